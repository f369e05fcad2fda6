"""Instance labels: finding runs by what they are about.

An instance had only its key, so "the runs of customer 42" or "the prod runs of dag
`etl_daily` that failed" could be found only by encoding everything into key prefixes. Now
an instance has labels: string keys and values that write events merge in (`labels` in an
event's body, in a batch too) and `PATCH /v1/instances/{instance_key}` sets and removes, and
`?label=KEY=VALUE` filters every list across instances by.

Why each statement is here:

1. `ADD COLUMN process_instance.labels jsonb NOT NULL DEFAULT '{}'`: one JSON object per
   instance, on the row the judge already locks to create a step (a constant default
   rewrites nothing, so the upgrade is quick on a large table; the instances that exist
   have no labels).
2. Four named CHECKs (`ck_process_instance_labels_object`, `_count`, `_key_format`,
   `_value_format`), each in an ALTER TABLE of its own (Citus adds a constraint to a
   distributed table only so): an object of at most 32 labels, keys 1-63 characters of
   `[A-Za-z0-9._/-]`, values strings of at most 200 characters. The service checks the
   same first, for a precise 422; a hand-written UPDATE is refused like a bad call.
3. `ix_process_instance_labels`, a GIN index (`jsonb_path_ops`) that a filter
   `labels @> '{"env": "prod"}'` reads: the filter's cost grows with the instances that
   match, not with the table.
   `SET STATISTICS 1000` on the column: the planner estimates how many instances a label
   matches from a sample of the labels (the histogram), and chooses between reading the
   labels' index then sorting (a label few instances hold) and reading the newest instances
   first, keeping those that match (one most hold). With the default 100 entries a label
   that 100 of 10^6 instances hold was estimated at 1% once in a while, and its page read
   every instance (408 ms instead of 2 ms, tests/bench/labels.py); 1000 entries tell a
   label under 0.1% from one at 1%. Not on a table Citus has distributed, which refuses the
   statement (docs/operations.md says what to set on the workers instead).
4. The judge's functions (frozen in `0035_instance_labels.up.sql` by
   `python -m app.sql freeze 0035_instance_labels`): `steprecord_apply_event` takes
   `p_labels jsonb DEFAULT NULL` and `steprecord_apply_events` `p_labels jsonb[] DEFAULT
   NULL` as a last argument, and merge the labels of every event they answer 2xx into its
   instance's, in the event's own statement. Their arguments change, so they are dropped
   and created (app/distribution.py delegates the new `steprecord_apply_event` on Citus at
   the next migrate, as it did the old one).
5. `steprecord_patch_labels` (`app/sql/labels.sql`): a PATCH's merge, one UPDATE of the
   instance's row, as a function so that the service writes the row only through the
   database's own functions.

Downgrade restores the functions as the revision before left them (`.down.sql`) and drops
the index, the CHECKs and the column: the labels kept meanwhile are lost, so it refuses,
unless forced, while any instance has a label, saying how many (`app/data/migrating.py`).

The judge's two functions take a new argument, so they are dropped and created; a runtime
role (`steprecord grant`) is granted them again by the migrate that runs this revision
(app/data/roles.py, `keep_grants`).

Revision ID: 0035
Revises: 0034
Create Date: 2026-12-07
"""

from pathlib import Path

from alembic import op

revision = "0035"
down_revision = "0034"
branch_labels = None
depends_on = None

LABEL_KEY_PATTERN = "^[A-Za-z0-9._/-]{1,63}$"
MAX_LABELS = 32

COLUMN = f"""
ALTER TABLE process_instance ADD COLUMN labels jsonb NOT NULL DEFAULT '{{}}'::jsonb;
ALTER TABLE process_instance ADD CONSTRAINT ck_process_instance_labels_object
    CHECK (jsonb_typeof(labels) = 'object');
ALTER TABLE process_instance ADD CONSTRAINT ck_process_instance_labels_count
    CHECK (jsonb_array_length(jsonb_path_query_array(labels, '$.*')) <= {MAX_LABELS});
ALTER TABLE process_instance ADD CONSTRAINT ck_process_instance_labels_key_format
    CHECK (NOT jsonb_path_exists(labels,
        'strict $.keyvalue() ? (!(@.key like_regex "{LABEL_KEY_PATTERN}"))', '{{}}', true));
ALTER TABLE process_instance ADD CONSTRAINT ck_process_instance_labels_value_format
    CHECK (NOT jsonb_path_exists(labels,
        'strict $.* ? (@.type() != "string" || !(@ like_regex "^.{{0,200}}$" flag "s"))',
        '{{}}', true));
CREATE INDEX ix_process_instance_labels ON process_instance USING gin (labels jsonb_path_ops);
"""
STATISTICS = "ALTER TABLE process_instance ALTER COLUMN labels SET STATISTICS 1000"
# Citus refuses SET STATISTICS on a distributed table (and its shards would not take it).
CITUS = "SELECT 'citus' WHERE to_regclass('pg_catalog.pg_dist_partition') IS NOT NULL"
DISTRIBUTED = """
SELECT 'distributed' FROM pg_catalog.pg_dist_partition
WHERE logicalrelid = 'process_instance'::regclass
"""
DROP_COLUMN = """
DROP INDEX ix_process_instance_labels;
ALTER TABLE process_instance DROP COLUMN labels;
"""

# One count, one statement over every shard on Citus.
LOST = """
SELECT count(*) || ' instances'' labels would be dropped'
FROM process_instance WHERE labels <> '{}'::jsonb
HAVING count(*) > 0
"""

# The frozen text this revision installs, and the text its downgrade restores, beside this
# file and read by it alone.
UP = Path(__file__).with_suffix(".up.sql")
DOWN = Path(__file__).with_suffix(".down.sql")


def upgrade() -> None:
    op.run_script(COLUMN)
    if op.found(CITUS) is None or op.found(DISTRIBUTED) is None:
        op.run_script(STATISTICS)
    op.run_script(UP.read_text())


def downgrade() -> None:
    op.refuse_losing("0035", op.found(LOST))
    op.run_script(DOWN.read_text())
    op.run_script(DROP_COLUMN)
