"""The judge on Citus without planning on every call.

On a Citus worker the one-event judge spent about ten times one node's CPU on an existing
record, and a new record five times: each call planned its statements again (the join of an
instance and its record could be routed to its shard only with the values in the plan) and
rewrote the general statement's text for the shard group before planning it again. Now:

- `steprecord_apply_event` reads and writes one table per statement, each by its
  distribution column named once: the record (locked), then its instance's key, then the
  update. Citus keeps one generic plan of such a statement per connection, and on the worker
  its plan on the local shard, as one node keeps its plans. The behaviour is unchanged: a
  record counts only when its instance is the key's, as the join said, and the update
  answers what the update in a WITH answered.
- `steprecord_apply_events_on_shard` rewrites and prepares the general statement once per
  connection and shard group (a prepared statement named by the group's shard and the
  function's catalog version), planned once (`force_generic_plan`), and binds each call's
  values as literals; on one node it is unchanged.

- The history's guard (`workflow_step_attempt_guard`) checks a late report against its
  record with one statement on the record's table instead of an EXISTS subquery, which Citus
  cannot route under a generic plan (the judge's setting holds for the triggers its writes
  fire).

- The general statement (`steprecord_apply_events`) keeps a late report that raced a higher
  attempt. It read the late attempt's history entry with its snapshot, which may be older
  than the record's row lock it then waited for: when a higher attempt took the record over
  meanwhile, its transaction superseded the entry after that snapshot, so the statement saw
  the entry `running` (or missing, seen as such), wrote nothing, and answered
  `stale_attempt` with `recorded` false, leaving the entry `superseded` although its end was
  reported. Now only a terminal entry (which never changes) is skipped, and the upsert,
  which sees the entry's newest version, decides. A batch hits it on one node too; on Citus
  the one-event judge's new records and late reports go through this statement as well.

app/distribution.py no longer sets `force_custom_plan` on `steprecord_apply_event`: its
statements need no values to be routed.

Frozen in `0026_judge_plans_on_citus.up.sql` by
`python -m app.sql freeze 0026_judge_plans_on_citus`; the downgrade restores the previous
text (`.down.sql`). On Citus, 0025's one-event judge needs `force_custom_plan` (its join is
routed only when planned with its values): 0025's own code sets it at its next `migrate`
(its app/distribution.py), as it did before; the downgrade leaves what an upgrade to 0025 by
this code leaves, which tests/test_sql_source.py compares.

Revision ID: 0026
Revises: 0025
Create Date: 2026-12-06
"""

from pathlib import Path

from alembic import op

revision = "0026"
down_revision = "0025"
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
