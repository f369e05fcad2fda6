"""Who wrote it: each record keeps `updated_by`, each attempt entry `reported_by`.

An operator repairing a process needs to know which caller wrote what. The writer is the
name of the token whose request last wrote the row: `anonymous` for a request let in
without tokens, `sweeper` for a lease the service's sweeper closed.

Why each statement is here:

1. `ADD COLUMN workflow_step_record.updated_by text` and `workflow_step_attempt.reported_by
   text`, nullable and without a default: the rows that exist were written before
   steprecord recorded writers, and nobody knows who wrote them, so they stay NULL, which
   the API shows as `null` and docs/database.md explains (adding a column without a
   default rewrites nothing, so the upgrade is quick on a large table).
2. `ck_workflow_step_record_updated_by_format`, `ck_workflow_step_attempt_reported_by_format`:
   a writer is a token's name, `anonymous` or `sweeper`, all in the names' alphabet
   (1-200 characters of `[A-Za-z0-9._:-]`, the first a letter or a digit), so a garbled
   value is refused like every other malformed field.
3. The functions of `app/sql/` that changed (frozen in `0025_writers.up.sql`):
   `steprecord_apply_event`, `steprecord_apply_events`, `steprecord_apply_events_on_shard`
   (which passes it on, and on Citus binds it in the general statement it runs on a shard
   group) and `steprecord_heartbeat` take the writer as a last argument
   `p_reported_by text DEFAULT NULL` and write it into every record they write (and a late
   report's entry); `steprecord_reopen` writes its operator (`p_by`, also the repair log's
   `repaired_by`) as the reopened record's writer. They, `steprecord_list_page` and
   `steprecord_stream_changes` answer `updated_by` with the record. Their arguments or
   results change, so they are dropped and created (app/distribution.py distributes the
   new signatures on Citus at the next migrate). The history's row triggers copy the
   record's `updated_by` into the entry they write (and into the entry a new attempt
   supersedes); the record's guard keeps a finished attempt's `updated_by` as it is, like
   the rest of a finished attempt.

Downgrade restores the functions as revision 0024 left them (`0025_writers.down.sql`) and
drops the columns with their CHECKs: the writers kept meanwhile are lost, so it refuses,
unless forced, while any row names one, saying how many (`app/data/migrating.py`).

Revision ID: 0025
Revises: 0024
Create Date: 2026-12-06
"""

from pathlib import Path

from alembic import op

revision = "0025"
down_revision = "0024"
branch_labels = None
depends_on = None

NAME_PATTERN = "^[A-Za-z0-9][A-Za-z0-9._:-]{0,199}$"

# A column and its CHECK in two statements: Citus adds a constraint to a distributed table
# only in an ALTER TABLE of its own.
COLUMNS = f"""
ALTER TABLE workflow_step_record ADD COLUMN updated_by text;
ALTER TABLE workflow_step_record ADD CONSTRAINT ck_workflow_step_record_updated_by_format
    CHECK (updated_by ~ '{NAME_PATTERN}');
ALTER TABLE workflow_step_attempt ADD COLUMN reported_by text;
ALTER TABLE workflow_step_attempt ADD CONSTRAINT ck_workflow_step_attempt_reported_by_format
    CHECK (reported_by ~ '{NAME_PATTERN}');
"""
DROP_COLUMNS = """
ALTER TABLE workflow_step_attempt DROP COLUMN reported_by;
ALTER TABLE workflow_step_record DROP COLUMN updated_by;
"""

# Two counts joined, each one statement over every shard on Citus (which cannot plan an
# EXISTS subquery of a distributed table in a WHERE without a FROM).
LOST = """
SELECT r.n || ' records'' and ' || a.n
       || ' attempts'' writers (updated_by, reported_by) would be dropped'
FROM (SELECT count(*) AS n FROM workflow_step_record WHERE updated_by IS NOT NULL) r,
     (SELECT count(*) AS n FROM workflow_step_attempt WHERE reported_by IS NOT NULL) a
WHERE r.n > 0 OR a.n > 0
"""

# The frozen text this revision installs, and the text its downgrade restores, beside this
# file and read by it alone.
UP = Path(__file__).with_suffix(".up.sql")
DOWN = Path(__file__).with_suffix(".down.sql")


def upgrade() -> None:
    op.run_script(COLUMNS)
    op.run_script(UP.read_text())


def downgrade() -> None:
    op.refuse_losing("0025", op.found(LOST))
    op.run_script(DOWN.read_text())
    op.run_script(DROP_COLUMNS)
