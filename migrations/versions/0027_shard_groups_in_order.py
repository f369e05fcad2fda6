"""A batch's shard groups on a Citus worker, judged in the order of their shard ids.

`steprecord_apply_events_on_shard` runs the general statement once per shard group of the
events it was sent, all in one transaction on the worker. It took the groups in the order
they first appear among the events, so two batches that reached the same groups in turn
could lock them in opposite orders, and the second to wait deadlocked: PostgreSQL found it
after `deadlock_timeout` (a second by default), aborted one call, and the service sent it
again. Under a load of concurrent batches over the same instances that was most of a batch's
time. Now every call takes its groups in the order of their shard ids, as the statement
takes each group's rows by id, so two calls wait for each other instead. The answer is
unchanged: the events are of distinct steps, each judged as if alone, answered by index.
Nothing changes without Citus, where the function is `steprecord_apply_events` itself.

Frozen in `0027_shard_groups_in_order.up.sql` by
`python -m app.sql freeze 0027_shard_groups_in_order`; the downgrade restores the previous
text (`.down.sql`).

Revision ID: 0027
Revises: 0026
Create Date: 2026-12-06
"""

from pathlib import Path

from alembic import op

revision = "0027"
down_revision = "0026"
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
