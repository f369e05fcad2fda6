"""What the judge costs a Citus worker: per record written, and per shard group of a batch.

- The history's triggers take each entry's id from its sequence as a value. The record's
  row triggers upsert the attempt's history entry (`app/sql/attempt_history.sql`). On Citus
  they run on the record's shard and reach the history through the distributed table, which
  Citus routes to the co-located shard on the same node. Citus keeps a plan for such a
  statement per connection and shard only when it holds no volatile function, and the
  identity's default (`nextval`) is one: every record written on a worker was planned
  again, about 80 µs of the worker's time each. Now each trigger takes the id from
  `workflow_step_attempt_id_seq` first, as the identity would, and inserts it with
  OVERRIDING SYSTEM VALUE: ids come from the same sequence as before, one per upsert.
- `steprecord_apply_events_on_shard` builds every group's arguments in the one query that
  groups the events (it ran sixteen subqueries per group), and remembers the statements it
  prepared in a setting of the session, read instead of `pg_prepared_statements` (which
  copies the text of every statement prepared, for every group of every call).

Answers, writes and locks are unchanged; without Citus nothing changes but the history's
ids, taken from the same sequence as before.

Frozen in `0028_judge_costs_on_citus.up.sql` by
`python -m app.sql freeze 0028_judge_costs_on_citus`; the downgrade restores the previous
text (`.down.sql`).

Revision ID: 0028
Revises: 0027
Create Date: 2026-12-06
"""

from pathlib import Path

from alembic import op

revision = "0028"
down_revision = "0027"
branch_labels = None
depends_on = None

# The frozen text this revision installs, and the text its downgrade restores, beside this
# file and read by it alone.
UP = Path(__file__).with_suffix(".up.sql")
DOWN = Path(__file__).with_suffix(".down.sql")


def upgrade() -> None:
    op.run_script(UP.read_text())


def downgrade() -> None:
    op.run_script(DOWN.read_text())
