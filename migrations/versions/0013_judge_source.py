"""Install the database functions from their commented source in `app/sql/`.

Until this revision the judge existed only as text that migrations 0008, 0010 and 0011 spliced
out of older migrations at import time: nobody could read the SQL the service runs without
executing Python, and editing an old migration changed what a fresh database got from a newer
one. The functions now have one current source each, a commented `.sql` file under `app/sql/`
that a person can read and change; this revision installs a frozen copy of those files
(`0013_judge_source.up.sql`), and a test proves that a database at head holds exactly them.

It changes no behaviour. The new function bodies differ from revision 0012's only in comments
and layout: with comments removed and whitespace collapsed, each body is token for token the
one it replaces, and every signature, result type, setting and trigger is unchanged.

Why each statement is here:

1. `DROP FUNCTION steprecord_list_steps(...)`: the page read of revision 0009, which renders
   JSON in the database. The service stopped calling it in revision 0012, which kept it for
   instances of the previous release during a rolling deploy; nothing calls it now.
2. `CREATE OR REPLACE FUNCTION` of every function and `CREATE OR REPLACE TRIGGER` of every
   trigger, from `app/sql/` (the triggers are unchanged; they are in the files so that each
   file is the whole of its concern).

Downgrade restores revision 0012's functions from their frozen text
(`0013_judge_source.down.sql`), `steprecord_list_steps` included.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-04
"""

from pathlib import Path

from alembic import op

revision = "0013"
down_revision = "0012"
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
