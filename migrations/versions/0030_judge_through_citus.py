"""The judge on Citus through ordinary distributed statements: a rebalance is safe.

On Citus, a new record, a late report and every event of a batch went through
`steprecord_apply_events_on_shard`, which read `steprecord_apply_events`'s text from the
catalog, rewrote each table's name into its shard's (`<table>_<shard id>`) and ran it on the
worker. Those writes took none of the locks Citus takes on a shard's placement for the
statements it routes, so nothing ordered them against a shard move; a connection kept the
rewritten statement prepared, naming a shard that a move took away (every later call on it
failed until a restart); and the history's write, routed by Citus to the moved shard's new
node, was refused by the history's guard there (a valid event answered 422).

Now `steprecord_apply_event` judges every event of one instance itself, each statement on one
table by the instance's id: Citus routes it to the instance's shard, wherever that is now,
under its own locks. A batch on Citus is sent as one such call per event, in order
(app/data/judge.py); one node keeps the set-based `steprecord_apply_events` for batches.
`steprecord_apply_events_on_shard` is dropped.

Frozen in `0030_judge_through_citus.up.sql` by
`python -m app.sql freeze 0030_judge_through_citus`; the downgrade restores the previous text
(`.down.sql`), the dropped function with it.

Revision ID: 0030
Revises: 0029
Create Date: 2026-12-07
"""

from pathlib import Path

from alembic import op

revision = "0030"
down_revision = "0029"
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
