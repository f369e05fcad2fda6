"""The owner of the database migrates it, with no other right.

On a managed PostgreSQL no one is superuser: the service's role owns its database and
nothing more. The judge's functions said who was writing (`steprecord.writer`) and which
trace an attempt keeps (`steprecord.trace_id`) by `SET` clauses of the functions themselves.
Those are settings that no extension defines (placeholders), and PostgreSQL lets only a
superuser, or a role granted `SET ON PARAMETER` by one, create a function with such a clause:
`steprecord migrate` stopped with "permission denied to set parameter".

Now each function sets them first thing in its body with `set_config(..., true)`, which any
role may do; they hold until the transaction ends (each call sets them again). The guards
read them as before: they say who is writing, while rights on the tables say who may write
(docs/operations.md, "Database roles").

The frozen copies of the revisions before this one (0014 to 0028) were changed the same way,
and in nothing else, so that an empty database reaches head without a superuser; a database
migrated before keeps their old text until this revision replaces it. The downgrade restores
the text of revision 0028 as it now stands (without the clauses).

Frozen in `0029_least_privilege.up.sql` by `python -m app.sql freeze 0029_least_privilege`;
the downgrade restores the previous text (`.down.sql`).

Revision ID: 0029
Revises: 0028
Create Date: 2026-12-07
"""

from pathlib import Path

from alembic import op

revision = "0029"
down_revision = "0028"
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
