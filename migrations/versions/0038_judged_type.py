"""The judge's answer row declared once: the composite type `steprecord_judged`.

`steprecord_apply_event` and `steprecord_apply_events` answered the same 18 columns (the
event's index, its outcome, whether a late report was recorded, and the record's columns),
each in a `RETURNS TABLE` of its own, held equal by tests/test_record_shape.py. Now the row
is one type, and both functions return a set of it; a test still holds the type to the
record's one definition (app/record.py).

Why each statement is here (frozen in `0038_judged_type.up.sql` by
`python -m app.sql freeze 0038_judged_type`):

1. `DROP FUNCTION` of the two judge functions: PostgreSQL changes a function's result type
   only by dropping and creating it.
2. `CREATE TYPE steprecord_judged` (app/sql/answers.sql): the same columns, names, types and
   order as the two `RETURNS TABLE` had. A caller's `SELECT * FROM steprecord_apply_event(...)`
   reads the same columns, so a statement a running instance prepared before this revision is
   planned again on its next call, not refused (`cached plan must not change result type` is
   raised only when the columns differ; tests/test_sql_source.py runs such a statement across
   the upgrade): the release needs no restart of running instances (docs/operations.md).
3. The two functions created again, `RETURNS SETOF steprecord_judged`, their bodies as they
   were. A runtime role (`steprecord grant`) is granted them again by the migrate that runs
   this revision (app/data/roles.py, `keep_grants`); on Citus, `steprecord_apply_event` is
   delegated again and `steprecord_apply_events` plans with its values again by the same
   migrate (app/distribution.py); Citus creates the type on the workers before a function
   that names it.
4. Comments of app/sql/ that stated a fact about PostgreSQL or Citus, each checked, and
   corrected where it was wrong or unproven (docs/database.md, "What the comments claim"):
   Citus does run a statement trigger with a transition table on a shard (the comments of
   the history's and the notification's row triggers said it did not); Citus refuses a
   VOLATILE function in an UPDATE of a distributed table and all but IMMUTABLE ones in an
   upsert's DO UPDATE SET (the comments said it "runs only IMMUTABLE functions in a write");
   a statement's new snapshot holds for a VOLATILE function at READ COMMITTED; a cost no
   test re-measures went. The functions of those files are created again as they were (CREATE
   OR REPLACE), and the triggers of attempt_history.sql and live_updates.sql too, which locks
   the records SHARE ROW EXCLUSIVE (writes wait, reads do not) until the migration commits,
   as every revision that changed those files did.

Downgrade: the two functions dropped, then the type, and the files as revision 0037 left
them run again (`.down.sql`); keep_grants and distribution re-grant and re-delegate at that
migrate as at this one.

Revision ID: 0038
Revises: 0037
Create Date: 2026-12-07
"""

from pathlib import Path

from alembic import op

revision = "0038"
down_revision = "0037"
branch_labels = None
depends_on = None

UP = Path(__file__).with_suffix(".up.sql")
DOWN = Path(__file__).with_suffix(".down.sql")


def upgrade() -> None:
    op.run_script(UP.read_text())


def downgrade() -> None:
    op.run_script(DOWN.read_text())
