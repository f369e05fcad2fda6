"""Create the owner (`process_instance`) and the fact (`workflow_step_record`).

Why each statement is here:

1. `process_instance` is the owner: a generated id, the orchestrator's own key (unique, in
   the same format as a step slug), and `next_ordinal`, the counter that hands out
   server-assigned ordinals. Updating that counter takes the instance row's lock, which is
   the per-instance lock that gives concurrent new steps distinct ordinals.
2. `ix_process_instance_created_at_id` serves `GET /v1/instances` newest first by keyset.
3. `workflow_step_record` is the fact, one row per (instance, step). Every invariant a
   client, a racing retry or a hand-written repair could break is a named CHECK, so the
   database refuses it atomically and the service can cite the name in its 4xx:
   closed status set, positive attempts, inline XOR external output, coherent timing,
   state-appropriate content per status, formats and size caps. Both UNIQUE keys are the
   scope of the idempotent upsert (`instance_id, step_slug`) and the owner/ordinal read
   (`instance_id, ordinal`), whose index serves `order=ordinal` with no sort.
4. `ix_workflow_step_record_instance_id_started_at_id` serves `order=started_at` (ties by
   id, never-started steps last: NULLs sort last in an ascending btree).
5. The `BEFORE UPDATE` trigger guards transitions, which no CHECK can see because they
   compare the old row with the new: the position `(attempt_count, rank)` never goes back;
   a terminal row keeps its status, times, output and error unless a higher attempt reopens
   it; the identity columns never change. It raises `check_violation` naming
   `tr_workflow_step_record_transition`, so callers handle it like any named constraint.

Downgrade drops everything in reverse order; nothing else depends on these objects. It
refuses, unless forced, while any instance exists, saying how many instances and records
would be deleted (`app/data/migrating.py`).

Revision ID: 0001
Revises:
Create Date: 2026-12-02
"""

from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

LOST = """
SELECT count(*) || ' instances with '
       || (SELECT count(*) FROM workflow_step_record) || ' step records would be deleted'
FROM process_instance HAVING count(*) > 0
"""

NAME = "'^[A-Za-z0-9][A-Za-z0-9._:-]{0,199}$'"


def upgrade() -> None:
    op.execute(f"""
        CREATE TABLE process_instance (
            id bigint GENERATED ALWAYS AS IDENTITY,
            instance_key text NOT NULL,
            next_ordinal bigint NOT NULL DEFAULT 0,
            created_at timestamptz NOT NULL DEFAULT now(),
            CONSTRAINT pk_process_instance PRIMARY KEY (id),
            CONSTRAINT uq_process_instance_instance_key UNIQUE (instance_key),
            CONSTRAINT ck_process_instance_instance_key_format CHECK (instance_key ~ {NAME}),
            CONSTRAINT ck_process_instance_next_ordinal_nonnegative CHECK (next_ordinal >= 0)
        )
    """)
    op.execute(
        "CREATE INDEX ix_process_instance_created_at_id ON process_instance (created_at, id)"
    )
    op.execute(f"""
        CREATE TABLE workflow_step_record (
            id bigint GENERATED ALWAYS AS IDENTITY,
            instance_id bigint NOT NULL,
            step_slug text NOT NULL,
            ordinal integer NOT NULL,
            status text NOT NULL,
            attempt_count integer NOT NULL,
            output jsonb,
            external_output_url text,
            started_at timestamptz,
            completed_at timestamptz,
            error_code text,
            error_message text,
            created_at timestamptz NOT NULL DEFAULT now(),
            updated_at timestamptz NOT NULL DEFAULT now(),
            CONSTRAINT pk_workflow_step_record PRIMARY KEY (id),
            CONSTRAINT fk_workflow_step_record_instance_id_process_instance
                FOREIGN KEY (instance_id) REFERENCES process_instance (id),
            CONSTRAINT uq_workflow_step_record_instance_id_step_slug
                UNIQUE (instance_id, step_slug),
            CONSTRAINT uq_workflow_step_record_instance_id_ordinal UNIQUE (instance_id, ordinal),
            CONSTRAINT ck_workflow_step_record_step_slug_format CHECK (step_slug ~ {NAME}),
            CONSTRAINT ck_workflow_step_record_ordinal_range
                CHECK (ordinal BETWEEN 0 AND 2147483647),
            CONSTRAINT ck_workflow_step_record_status_known
                CHECK (status IN ('pending', 'running', 'completed', 'failed')),
            CONSTRAINT ck_workflow_step_record_attempt_count_positive CHECK (attempt_count >= 1),
            CONSTRAINT ck_workflow_step_record_output_inline_xor_external
                CHECK (output IS NULL OR external_output_url IS NULL),
            CONSTRAINT ck_workflow_step_record_output_size
                CHECK (octet_length(output::text) <= 1048576),
            CONSTRAINT ck_workflow_step_record_external_output_url_format
                CHECK (external_output_url ~ '^[A-Za-z][A-Za-z0-9+.-]*://'
                       AND char_length(external_output_url) <= 2048),
            CONSTRAINT ck_workflow_step_record_error_code_format CHECK (error_code ~ {NAME}),
            CONSTRAINT ck_workflow_step_record_error_message_size
                CHECK (octet_length(error_message) <= 65536),
            CONSTRAINT ck_workflow_step_record_timing CHECK (started_at <= completed_at),
            CONSTRAINT ck_workflow_step_record_pending_content CHECK (
                status <> 'pending' OR (
                    started_at IS NULL AND completed_at IS NULL
                    AND output IS NULL AND external_output_url IS NULL
                    AND error_code IS NULL AND error_message IS NULL)),
            CONSTRAINT ck_workflow_step_record_running_content CHECK (
                status <> 'running' OR (
                    started_at IS NOT NULL AND completed_at IS NULL
                    AND output IS NULL AND external_output_url IS NULL
                    AND error_code IS NULL AND error_message IS NULL)),
            CONSTRAINT ck_workflow_step_record_completed_content CHECK (
                status <> 'completed' OR (
                    started_at IS NOT NULL AND completed_at IS NOT NULL
                    AND error_code IS NULL AND error_message IS NULL)),
            CONSTRAINT ck_workflow_step_record_failed_content CHECK (
                status <> 'failed' OR (
                    started_at IS NOT NULL AND completed_at IS NOT NULL
                    AND error_code IS NOT NULL
                    AND output IS NULL AND external_output_url IS NULL))
        )
    """)
    op.execute(
        "CREATE INDEX ix_workflow_step_record_instance_id_started_at_id"
        " ON workflow_step_record (instance_id, started_at, id)"
    )
    op.execute("""
        CREATE FUNCTION workflow_step_record_guard_transition() RETURNS trigger
        LANGUAGE plpgsql AS $$
        DECLARE
            old_rank int := CASE OLD.status WHEN 'pending' THEN 0 WHEN 'running' THEN 1 ELSE 2 END;
            new_rank int := CASE NEW.status WHEN 'pending' THEN 0 WHEN 'running' THEN 1 ELSE 2 END;
            why text;
        BEGIN
            IF (NEW.id, NEW.instance_id, NEW.step_slug, NEW.ordinal, NEW.created_at)
               IS DISTINCT FROM
               (OLD.id, OLD.instance_id, OLD.step_slug, OLD.ordinal, OLD.created_at) THEN
                why := 'id, instance_id, step_slug, ordinal and created_at never change';
            ELSIF (NEW.attempt_count, new_rank) < (OLD.attempt_count, old_rank) THEN
                why := format('(attempt_count, rank) may not go back from (%s, %s) to (%s, %s)',
                              OLD.attempt_count, old_rank, NEW.attempt_count, new_rank);
            ELSIF old_rank = 2 AND NEW.attempt_count = OLD.attempt_count
                  AND (NEW.status, NEW.started_at, NEW.completed_at, NEW.output,
                       NEW.external_output_url, NEW.error_code, NEW.error_message)
                      IS DISTINCT FROM
                      (OLD.status, OLD.started_at, OLD.completed_at, OLD.output,
                       OLD.external_output_url, OLD.error_code, OLD.error_message) THEN
                why := 'a finished attempt never changes; only a higher attempt reopens it';
            END IF;
            IF why IS NOT NULL THEN
                RAISE EXCEPTION 'workflow_step_record %: %', OLD.id, why
                    USING ERRCODE = 'check_violation',
                          CONSTRAINT = 'tr_workflow_step_record_transition',
                          TABLE = 'workflow_step_record';
            END IF;
            RETURN NEW;
        END
        $$
    """)
    op.execute("""
        CREATE TRIGGER tr_workflow_step_record_transition
        BEFORE UPDATE ON workflow_step_record
        FOR EACH ROW EXECUTE FUNCTION workflow_step_record_guard_transition()
    """)


def downgrade() -> None:
    op.refuse_losing("0001", op.found(LOST))
    op.execute("DROP TRIGGER tr_workflow_step_record_transition ON workflow_step_record")
    op.execute("DROP FUNCTION workflow_step_record_guard_transition()")
    op.execute("DROP TABLE workflow_step_record")
    op.execute("DROP TABLE process_instance")
