"""Update applied records from the judgement alone, without a second join to the events.

In `steprecord_apply_events` the `upd` step joined the judgements (`dec`) to the events (`e`)
again for the values to write. Planned generically, both look like one row, so PostgreSQL
joins them with a nested loop: every judged record scans every event of the call. For a batch
of 100 events completing 50 records, `EXPLAIN ANALYZE` showed the update at 3.1 ms of the
statement's 6.3 ms, 1.6 ms of it in that loop (50 x 100 rows); pgbench calling the function
with such batches, 8 clients, five alternating rounds: 106-160 calls/s before, 137-171 after.

Why each statement is here:

1. `CREATE OR REPLACE FUNCTION steprecord_apply_events(...)`: the same function, judging
   exactly as before. `dec` now carries the event's values that an update writes (target,
   kind, completion time, clock, output, URL, error, lease), and `upd` reads them from `dec`
   alone, so an update costs one lookup of its record whatever the size of the call.

The function's text (frozen in `0011_update_from_judgement.up.sql`) is revision 0008's with
exactly these two edits. Downgrade restores revision 0008's, whose text the `.down.sql` keeps.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-04
"""

from pathlib import Path

from alembic import op

revision = "0011"
down_revision = "0010"
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
