"""Keep every attempt (`workflow_step_attempt`) and give running steps a lease.

The record keeps the latest attempt; a retry used to erase the truth about the one before it.
This revision adds the history, kept by the database itself, and leases that let the service
find and close steps whose worker died.

Why each statement is here:

1. `workflow_step_record.lease_expires_at`, with `ck_workflow_step_record_lease_only_running`:
   a running attempt may hold a lease (the database clock + `lease_seconds` of its start,
   extended by heartbeats); no other state may, so terminal events must clear it.
2. `uq_workflow_step_record_instance_id_id`: the target of the history's foreign key. The key
   carries the owner, so both tables can later be partitioned or distributed by instance.
3. `ix_workflow_step_record_status_updated_at_id` serves `GET /v1/steps` (newest `updated_at`
   first, across instances): one backward range per status, merged, so no filter sorts.
4. `ix_workflow_step_record_leased_updated_at_id`, a partial index of running records that
   hold a lease (few rows: only steps in flight), serves `GET /v1/steps?lease_expired=true` in
   `updated_at` order with no sort, and lets the sweeper find expired leases without reading
   the table. (A second index on `lease_expires_at` would let the planner trade the first for
   a sort, and costs every heartbeat one more index write.)
5. `workflow_step_attempt`: one row per attempt of a record, `UNIQUE (record_id, attempt)`,
   owned through `(instance_id, record_id)` with `ON DELETE CASCADE`. Its named CHECKs mirror
   the record's, plus `superseded` (a running attempt overtaken by a higher one: started, no
   output, no error, `completed_at` = when the next attempt took over). `lease_expires_at`
   keeps the last lease the attempt held, also once it ended.
6. The backfill: every record that is not pending gets its current attempt as history, with
   the record's own status and content and `created_at` = the record's `updated_at` (the best
   known time of that attempt's last change). Earlier attempts cannot be recovered: the record
   never kept them, so a record at attempt 3 starts its history at attempt 3.
7. `tr_workflow_step_attempt_guard` (row trigger, after the backfill): history is written only
   by the record's triggers (`pg_trigger_depth() > 1`), so a hand-written write to the history
   cannot make it disagree with the record; a finished or superseded attempt never changes;
   identities never change. It raises `check_violation` naming the trigger, like a CHECK.
8. `tr_workflow_step_record_history_insert` / `_update` (statement triggers with transition
   tables): every write to the record — the merge statement, a batch, the sweeper, a
   hand-written `UPDATE` — writes the history in the same statement, set-based: a running
   attempt overtaken by a higher attempt becomes `superseded`, and the record's current
   attempt (unless pending) is inserted or brought up to date. A write that changes nothing
   the history shows (a replay writes nothing at all) leaves the history untouched.

Downgrade drops all of it in reverse order; the leases and the history are lost with it.
It refuses, unless forced, while any attempt is recorded, saying how many would be lost
(`app/data/migrating.py`).

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-03
"""

from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

LOST = """
SELECT count(*) || ' attempts of history (workflow_step_attempt), and the leases of '
       || (SELECT count(*) FROM workflow_step_record WHERE lease_expires_at IS NOT NULL)
       || ' running steps, would be dropped'
FROM workflow_step_attempt HAVING count(*) > 0
"""

NAME = "'^[A-Za-z0-9][A-Za-z0-9._:-]{0,199}$'"
LEASED = "status = 'running' AND lease_expires_at IS NOT NULL"
# A running attempt mirrors the record's lease; a finished one keeps the last lease it held.
LEASE = (
    "CASE WHEN EXCLUDED.status = 'running' THEN EXCLUDED.lease_expires_at"
    " ELSE a.lease_expires_at END"
)

# The history's columns that mirror the record's, in the order both triggers use.
CONTENT = "status, started_at, completed_at, output, external_output_url, error_code, error_message"


def upgrade() -> None:
    op.execute("ALTER TABLE workflow_step_record ADD COLUMN lease_expires_at timestamptz")
    op.execute("""
        ALTER TABLE workflow_step_record ADD CONSTRAINT ck_workflow_step_record_lease_only_running
            CHECK (lease_expires_at IS NULL OR status = 'running')
    """)
    op.execute("""
        ALTER TABLE workflow_step_record ADD CONSTRAINT uq_workflow_step_record_instance_id_id
            UNIQUE (instance_id, id)
    """)
    op.execute(
        "CREATE INDEX ix_workflow_step_record_status_updated_at_id"
        " ON workflow_step_record (status, updated_at, id)"
    )
    op.execute(
        "CREATE INDEX ix_workflow_step_record_leased_updated_at_id"
        f" ON workflow_step_record (updated_at, id) WHERE {LEASED}"
    )
    op.execute(f"""
        CREATE TABLE workflow_step_attempt (
            id bigint GENERATED ALWAYS AS IDENTITY,
            instance_id bigint NOT NULL,
            record_id bigint NOT NULL,
            attempt integer NOT NULL,
            status text NOT NULL,
            started_at timestamptz,
            completed_at timestamptz,
            output jsonb,
            external_output_url text,
            error_code text,
            error_message text,
            lease_expires_at timestamptz,
            created_at timestamptz NOT NULL DEFAULT now(),
            updated_at timestamptz NOT NULL DEFAULT now(),
            CONSTRAINT pk_workflow_step_attempt PRIMARY KEY (id),
            CONSTRAINT fk_workflow_step_attempt_instance_id_workflow_step_record
                FOREIGN KEY (instance_id, record_id)
                REFERENCES workflow_step_record (instance_id, id) ON DELETE CASCADE,
            CONSTRAINT uq_workflow_step_attempt_record_id_attempt UNIQUE (record_id, attempt),
            CONSTRAINT ck_workflow_step_attempt_status_known
                CHECK (status IN ('running', 'completed', 'failed', 'superseded')),
            CONSTRAINT ck_workflow_step_attempt_attempt_positive CHECK (attempt >= 1),
            CONSTRAINT ck_workflow_step_attempt_output_inline_xor_external
                CHECK (output IS NULL OR external_output_url IS NULL),
            CONSTRAINT ck_workflow_step_attempt_output_size
                CHECK (octet_length(output::text) <= 1048576),
            CONSTRAINT ck_workflow_step_attempt_external_output_url_format
                CHECK (external_output_url ~ '^[A-Za-z][A-Za-z0-9+.-]*://'
                       AND char_length(external_output_url) <= 2048),
            CONSTRAINT ck_workflow_step_attempt_error_code_format CHECK (error_code ~ {NAME}),
            CONSTRAINT ck_workflow_step_attempt_error_message_size
                CHECK (octet_length(error_message) <= 65536),
            CONSTRAINT ck_workflow_step_attempt_timing CHECK (started_at <= completed_at),
            CONSTRAINT ck_workflow_step_attempt_running_content CHECK (
                status <> 'running' OR (
                    started_at IS NOT NULL AND completed_at IS NULL
                    AND output IS NULL AND external_output_url IS NULL
                    AND error_code IS NULL AND error_message IS NULL)),
            CONSTRAINT ck_workflow_step_attempt_completed_content CHECK (
                status <> 'completed' OR (
                    started_at IS NOT NULL AND completed_at IS NOT NULL
                    AND error_code IS NULL AND error_message IS NULL)),
            CONSTRAINT ck_workflow_step_attempt_failed_content CHECK (
                status <> 'failed' OR (
                    started_at IS NOT NULL AND completed_at IS NOT NULL
                    AND error_code IS NOT NULL
                    AND output IS NULL AND external_output_url IS NULL)),
            CONSTRAINT ck_workflow_step_attempt_superseded_content CHECK (
                status <> 'superseded' OR (
                    started_at IS NOT NULL AND completed_at IS NOT NULL
                    AND output IS NULL AND external_output_url IS NULL
                    AND error_code IS NULL AND error_message IS NULL))
        )
    """)
    op.execute(f"""
        INSERT INTO workflow_step_attempt (
            instance_id, record_id, attempt, {CONTENT}, created_at, updated_at)
        SELECT instance_id, id, attempt_count, {CONTENT}, updated_at, updated_at
        FROM workflow_step_record
        WHERE status <> 'pending'
    """)
    op.execute("""
        CREATE FUNCTION workflow_step_attempt_guard() RETURNS trigger
        LANGUAGE plpgsql AS $$
        DECLARE
            why text;
        BEGIN
            IF pg_trigger_depth() < 2 THEN
                why := 'the history is written only through workflow_step_record';
            ELSIF TG_OP = 'UPDATE' AND OLD.status <> 'running' THEN
                why := 'a finished or superseded attempt never changes';
            ELSIF TG_OP = 'UPDATE'
                  AND (NEW.id, NEW.instance_id, NEW.record_id, NEW.attempt, NEW.created_at)
                      IS DISTINCT FROM
                      (OLD.id, OLD.instance_id, OLD.record_id, OLD.attempt, OLD.created_at) THEN
                why := 'id, instance_id, record_id, attempt and created_at never change';
            END IF;
            IF why IS NOT NULL THEN
                RAISE EXCEPTION 'workflow_step_attempt: %', why
                    USING ERRCODE = 'check_violation',
                          CONSTRAINT = 'tr_workflow_step_attempt_guard',
                          TABLE = 'workflow_step_attempt';
            END IF;
            RETURN CASE TG_OP WHEN 'DELETE' THEN OLD ELSE NEW END;
        END
        $$
    """)
    op.execute("""
        CREATE TRIGGER tr_workflow_step_attempt_guard
        BEFORE INSERT OR UPDATE OR DELETE ON workflow_step_attempt
        FOR EACH ROW EXECUTE FUNCTION workflow_step_attempt_guard()
    """)
    # The record's current attempt, inserted or brought up to date; shared by both triggers.
    upsert_current = f"""
            INSERT INTO workflow_step_attempt AS a (
                instance_id, record_id, attempt, {CONTENT}, lease_expires_at,
                created_at, updated_at)
            SELECT n.instance_id, n.id, n.attempt_count, n.status, n.started_at,
                   n.completed_at, n.output, n.external_output_url, n.error_code,
                   n.error_message, n.lease_expires_at, n.updated_at, n.updated_at
            FROM new_rows n
            WHERE n.status <> 'pending'
            ON CONFLICT ON CONSTRAINT uq_workflow_step_attempt_record_id_attempt DO UPDATE SET
                status = EXCLUDED.status,
                started_at = EXCLUDED.started_at,
                completed_at = EXCLUDED.completed_at,
                output = EXCLUDED.output,
                external_output_url = EXCLUDED.external_output_url,
                error_code = EXCLUDED.error_code,
                error_message = EXCLUDED.error_message,
                lease_expires_at = {LEASE},
                updated_at = EXCLUDED.updated_at
            WHERE ({", ".join(f"a.{c}" for c in CONTENT.split(", "))}, a.lease_expires_at)
                  IS DISTINCT FROM
                  ({", ".join(f"EXCLUDED.{c}" for c in CONTENT.split(", "))},
                   {LEASE});
    """
    op.execute(f"""
        CREATE FUNCTION workflow_step_record_history_insert() RETURNS trigger
        LANGUAGE plpgsql AS $$
        BEGIN
            {upsert_current}
            RETURN NULL;
        END
        $$
    """)
    op.execute(f"""
        CREATE FUNCTION workflow_step_record_history_update() RETURNS trigger
        LANGUAGE plpgsql AS $$
        BEGIN
            UPDATE workflow_step_attempt a SET
                status = 'superseded',
                completed_at = GREATEST(a.started_at, COALESCE(n.started_at, n.updated_at)),
                updated_at = n.updated_at
            FROM old_rows o JOIN new_rows n ON n.id = o.id
            WHERE o.status = 'running' AND n.attempt_count > o.attempt_count
              AND a.record_id = o.id AND a.attempt = o.attempt_count AND a.status = 'running';
            {upsert_current}
            RETURN NULL;
        END
        $$
    """)
    op.execute("""
        CREATE TRIGGER tr_workflow_step_record_history_insert
        AFTER INSERT ON workflow_step_record
        REFERENCING NEW TABLE AS new_rows
        FOR EACH STATEMENT EXECUTE FUNCTION workflow_step_record_history_insert()
    """)
    op.execute("""
        CREATE TRIGGER tr_workflow_step_record_history_update
        AFTER UPDATE ON workflow_step_record
        REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
        FOR EACH STATEMENT EXECUTE FUNCTION workflow_step_record_history_update()
    """)


def downgrade() -> None:
    op.refuse_losing("0003", op.found(LOST))
    op.execute("DROP TRIGGER tr_workflow_step_record_history_update ON workflow_step_record")
    op.execute("DROP TRIGGER tr_workflow_step_record_history_insert ON workflow_step_record")
    op.execute("DROP FUNCTION workflow_step_record_history_update()")
    op.execute("DROP FUNCTION workflow_step_record_history_insert()")
    op.execute("DROP TABLE workflow_step_attempt")
    op.execute("DROP FUNCTION workflow_step_attempt_guard()")
    op.execute("DROP INDEX ix_workflow_step_record_leased_updated_at_id")
    op.execute("DROP INDEX ix_workflow_step_record_status_updated_at_id")
    op.execute(
        "ALTER TABLE workflow_step_record DROP CONSTRAINT uq_workflow_step_record_instance_id_id"
    )
    op.execute(
        "ALTER TABLE workflow_step_record"
        " DROP CONSTRAINT ck_workflow_step_record_lease_only_running"
    )
    op.execute("ALTER TABLE workflow_step_record DROP COLUMN lease_expires_at")
