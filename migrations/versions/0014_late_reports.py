"""Keep late reports of superseded attempts in the history.

A `complete` or `fail` of an attempt older than the record's was answered 409 `stale_attempt`
and wrote nothing, so the history lost true news: a shuffled soak of 4,800 duplicated events
on 400 steps (attempt 1 fails, attempt 2 completes) ended with every record right, but only
130 of the 400 histories showed attempt 1's failure. Such a report is still refused for the
record, and now becomes its attempt's history entry when that entry is missing or
`superseded`; a terminal entry never changes.

Why each statement is here:

1. `DROP FUNCTION` of `steprecord_apply_events` and `steprecord_apply_event`, then their new
   text from `app/sql/` (frozen in `0014_late_reports.up.sql`): each answers a new column,
   `recorded` (true when a late report is in the history), and a function's result type is
   changed only by dropping and creating it. Their `late` steps write the entry under the
   record's row lock; they run with `steprecord.writer = 'judge'` for the call only.
2. `CREATE OR REPLACE FUNCTION workflow_step_attempt_guard()`: the history's guard allows that
   write, and only it: the judge may insert a terminal entry for a missing attempt older
   than the record's, or turn a `superseded` entry into a terminal one, once. Hand-written
   SQL is still refused, and a terminal entry still never changes.

Downgrade restores revision 0013's functions (frozen in `0014_late_reports.down.sql`); late
reports written meanwhile stay in the history, where the old guard leaves them untouched.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-04
"""

from pathlib import Path

from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

# The frozen text this revision installs, and the text its downgrade restores, beside this
# file and read by it alone.
UP = Path(__file__).with_suffix(".up.sql")
DOWN = Path(__file__).with_suffix(".down.sql")


def upgrade() -> None:
    op.execute(UP.read_text())


def downgrade() -> None:
    op.execute(DOWN.read_text())
