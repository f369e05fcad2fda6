"""Create new instances and new records in key order, so concurrent batches cannot deadlock.

`steprecord_apply_events` (migration 0007) inserted the new instances of a set of events in
the order its grouping produced them, which differs from call to call. Two concurrent calls
that both create instances K1 and K2 could insert them in opposite orders: each then waits
for the other's uncommitted key, a deadlock that PostgreSQL detects only after
`deadlock_timeout` (1 s by default) and ends by aborting one of them. The benchmark's batch
load (16 connections, 100 events per call over 5,000 instances) hit four or five a run, each
costing a batch a second and a retry. pgbench's own batch statement inserts in key order
and never deadlocks.

Why each statement is here:

1. `CREATE OR REPLACE FUNCTION steprecord_apply_events(...)`: the same function, judging
   exactly as before, with two orders added: new instances are inserted by `instance_key`
   and new records by `(instance_id, step_slug)`. Any two calls then take the keys they
   both insert in the same order, so one waits for the other instead of deadlocking.
   Existing rows were already locked in id order (`ORDER BY ... FOR UPDATE`).

The function's text (frozen in `0008_ordered_inserts.up.sql`) is revision 0007's with exactly
these two `ORDER BY` clauses added. Downgrade restores revision 0007's function, whose text
`0008_ordered_inserts.down.sql` keeps.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-03
"""

from pathlib import Path

from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

# The frozen text this revision installs, beside this file and read by it alone.
UP = Path(__file__).with_suffix(".up.sql")
# The text of the revision before, which the downgrade restores.
DOWN = Path(__file__).with_suffix(".down.sql")


def upgrade() -> None:
    op.execute(UP.read_text())


def downgrade() -> None:
    op.execute(DOWN.read_text())
