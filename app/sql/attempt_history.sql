-- The attempt history (workflow_step_attempt): one row per attempt of a record, written by
-- the database itself in the same statement as the record, whoever writes the record.
--
-- Three functions, three triggers:
--   * workflow_step_record_history_insert / _update (row triggers, AFTER each inserted or
--     updated row of workflow_step_record): every write to a record — the judge, a batch,
--     the sweeper, a hand-written UPDATE — brings its history up to date. On Citus a trigger
--     runs on the shard, and writes the history's row on the shard beside its record's
--     (co-located by instance_id: every statement below names the instance id as a value,
--     so Citus routes it to that one shard). The entry's id is taken from its sequence
--     before the upsert and passed as a value: Citus keeps the plan of a statement routed to
--     one shard of its own node (planned once per connection and shard) only when the
--     statement holds no volatile function, such as the identity's default;
--   * workflow_step_attempt_guard (row trigger on workflow_step_attempt): the history is
--     written only by those triggers, and a finished attempt never changes.

-- After a record is inserted: its attempt, unless it is pending (a pending record has no
-- attempt yet: the trigger's WHEN skips it). _update below repeats this upsert word for word,
-- and tests/test_sql_source.py holds the two equal: a shared function that both called would
-- add a PL/pgSQL call per row written, and one function serving both triggers would be a new
-- function, which a revision can install only by dropping both triggers first (DROP TRIGGER
-- locks the records ACCESS EXCLUSIVE, reads too, until the migration commits; CREATE OR
-- REPLACE TRIGGER, SHARE ROW EXCLUSIVE). An attempt row exists from the moment its attempt
-- starts and is brought up to date by every write of its record; the WHERE skips writes that
-- change nothing the history shows. A running attempt mirrors the record's lease; a
-- finished one keeps the last lease it held.
-- An entry written names its record's writer (reported_by = the record's updated_by):
-- whoever last wrote the record last wrote the entry.
CREATE OR REPLACE FUNCTION workflow_step_record_history_insert() RETURNS trigger
LANGUAGE plpgsql AS $fn$
DECLARE
    v_id bigint;
BEGIN
    v_id := nextval('workflow_step_attempt_id_seq');
    INSERT INTO workflow_step_attempt AS a (
        id, instance_id, record_id, attempt, status, started_at, completed_at, output,
        external_output_url, error_code, error_message, lease_expires_at,
        created_at, updated_at, reported_by)
    OVERRIDING SYSTEM VALUE
    VALUES (v_id, NEW.instance_id, NEW.id, NEW.attempt_count, NEW.status, NEW.started_at,
            NEW.completed_at, NEW.output, NEW.external_output_url, NEW.error_code,
            NEW.error_message, NEW.lease_expires_at, NEW.updated_at, NEW.updated_at,
            NEW.updated_by)
    ON CONFLICT ON CONSTRAINT uq_workflow_step_attempt_instance_id_record_id_attempt
    DO UPDATE SET
        status = EXCLUDED.status,
        started_at = EXCLUDED.started_at,
        completed_at = EXCLUDED.completed_at,
        output = EXCLUDED.output,
        external_output_url = EXCLUDED.external_output_url,
        error_code = EXCLUDED.error_code,
        error_message = EXCLUDED.error_message,
        lease_expires_at = CASE WHEN EXCLUDED.status = 'running'
                                THEN EXCLUDED.lease_expires_at ELSE a.lease_expires_at END,
        updated_at = EXCLUDED.updated_at,
        reported_by = EXCLUDED.reported_by
    WHERE (a.status, a.started_at, a.completed_at, a.output, a.external_output_url,
           a.error_code, a.error_message, a.lease_expires_at)
          IS DISTINCT FROM
          (EXCLUDED.status, EXCLUDED.started_at, EXCLUDED.completed_at, EXCLUDED.output,
           EXCLUDED.external_output_url, EXCLUDED.error_code, EXCLUDED.error_message,
           CASE WHEN EXCLUDED.status = 'running'
                THEN EXCLUDED.lease_expires_at ELSE a.lease_expires_at END);
    RETURN NULL;
END
$fn$;

-- After a record is updated: first, a running attempt overtaken by a higher attempt
-- becomes `superseded` (it started and never reported an end; completed_at = when the next
-- attempt took over, never before its own start). The superseded entry names the writer of
-- the record's update that took it over, its last writer. Then the record's current attempt,
-- unless the record is pending, is inserted or brought up to date, as after an insert.
CREATE OR REPLACE FUNCTION workflow_step_record_history_update() RETURNS trigger
LANGUAGE plpgsql AS $fn$
DECLARE
    v_id bigint;
BEGIN
    IF OLD.status = 'running' AND NEW.attempt_count > OLD.attempt_count THEN
        UPDATE workflow_step_attempt a SET
            status = 'superseded',
            completed_at = GREATEST(a.started_at, COALESCE(NEW.started_at, NEW.updated_at)),
            updated_at = NEW.updated_at,
            reported_by = NEW.updated_by
        WHERE a.instance_id = OLD.instance_id AND a.record_id = OLD.id
          AND a.attempt = OLD.attempt_count AND a.status = 'running';
    END IF;
    IF NEW.status = 'pending' THEN
        RETURN NULL;
    END IF;
    v_id := nextval('workflow_step_attempt_id_seq');
    INSERT INTO workflow_step_attempt AS a (
        id, instance_id, record_id, attempt, status, started_at, completed_at, output,
        external_output_url, error_code, error_message, lease_expires_at,
        created_at, updated_at, reported_by)
    OVERRIDING SYSTEM VALUE
    VALUES (v_id, NEW.instance_id, NEW.id, NEW.attempt_count, NEW.status, NEW.started_at,
            NEW.completed_at, NEW.output, NEW.external_output_url, NEW.error_code,
            NEW.error_message, NEW.lease_expires_at, NEW.updated_at, NEW.updated_at,
            NEW.updated_by)
    ON CONFLICT ON CONSTRAINT uq_workflow_step_attempt_instance_id_record_id_attempt
    DO UPDATE SET
        status = EXCLUDED.status,
        started_at = EXCLUDED.started_at,
        completed_at = EXCLUDED.completed_at,
        output = EXCLUDED.output,
        external_output_url = EXCLUDED.external_output_url,
        error_code = EXCLUDED.error_code,
        error_message = EXCLUDED.error_message,
        lease_expires_at = CASE WHEN EXCLUDED.status = 'running'
                                THEN EXCLUDED.lease_expires_at ELSE a.lease_expires_at END,
        updated_at = EXCLUDED.updated_at,
        reported_by = EXCLUDED.reported_by
    WHERE (a.status, a.started_at, a.completed_at, a.output, a.external_output_url,
           a.error_code, a.error_message, a.lease_expires_at)
          IS DISTINCT FROM
          (EXCLUDED.status, EXCLUDED.started_at, EXCLUDED.completed_at, EXCLUDED.output,
           EXCLUDED.external_output_url, EXCLUDED.error_code, EXCLUDED.error_message,
           CASE WHEN EXCLUDED.status = 'running'
                THEN EXCLUDED.lease_expires_at ELSE a.lease_expires_at END);
    RETURN NULL;
END
$fn$;

CREATE OR REPLACE TRIGGER tr_workflow_step_record_history_insert
AFTER INSERT ON workflow_step_record
FOR EACH ROW WHEN (NEW.status <> 'pending')
EXECUTE FUNCTION workflow_step_record_history_insert();

CREATE OR REPLACE TRIGGER tr_workflow_step_record_history_update
AFTER UPDATE ON workflow_step_record
FOR EACH ROW EXECUTE FUNCTION workflow_step_record_history_update();

-- The history's guard, so that it cannot disagree with the record:
--   * it is written only by the record's triggers (trigger depth 2 and more): a
--     hand-written INSERT, UPDATE or DELETE of the history is refused (deleting a record's
--     instance still cascades: the cascade runs as a trigger too);
--   * one exception, the judge's late report of an older attempt (apply_events.sql, its
--     `late` steps), written while the judge runs (steprecord.writer = 'judge', set by
--     the judge's functions for the rest of their transaction): it may insert an attempt's terminal
--     entry where there was none, or turn a `superseded` entry into its own terminal
--     report, and nothing else;
--   * a finished attempt never changes, and a superseded one only by that late report;
--   * identities never change.
-- It raises check_violation naming tr_workflow_step_attempt_guard, like a CHECK.
CREATE OR REPLACE FUNCTION workflow_step_attempt_guard() RETURNS trigger
LANGUAGE plpgsql AS $fn$
DECLARE
    why text;
    late_report boolean := pg_trigger_depth() < 2
        AND current_setting('steprecord.writer', true) = 'judge'
        AND steprecord_by_owner()
        AND TG_OP IN ('INSERT', 'UPDATE') AND NEW.status IN ('completed', 'failed');
BEGIN
    IF late_report THEN
        IF TG_OP = 'UPDATE'
           AND (NEW.id, NEW.instance_id, NEW.record_id, NEW.attempt, NEW.created_at)
               IS DISTINCT FROM
               (OLD.id, OLD.instance_id, OLD.record_id, OLD.attempt, OLD.created_at) THEN
            why := 'id, instance_id, record_id, attempt and created_at never change';
        ELSIF TG_OP = 'UPDATE' AND OLD.status <> 'superseded' THEN
            why := 'a late report ends only a superseded attempt; a finished one never changes';
        ELSE
            -- The record, one table by its distribution column and no subquery: on Citus a
            -- "fast path" statement, which the judge's generic plans can route.
            PERFORM FROM workflow_step_record r
            WHERE r.instance_id = NEW.instance_id AND r.id = NEW.record_id
              AND r.attempt_count > NEW.attempt;
            IF NOT FOUND THEN
                why := 'a late report is of an attempt older than its record''s';
            END IF;
        END IF;
    ELSIF pg_trigger_depth() < 2 THEN
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
        -- The guard's name in the message too, as a CHECK's: Citus relays a worker's
        -- SQLSTATE and message, not the constraint field.
        RAISE EXCEPTION 'workflow_step_attempt violates constraint "%": %',
                        'tr_workflow_step_attempt_guard', why
            USING ERRCODE = 'check_violation',
                  CONSTRAINT = 'tr_workflow_step_attempt_guard',
                  TABLE = 'workflow_step_attempt';
    END IF;
    RETURN CASE TG_OP WHEN 'DELETE' THEN OLD ELSE NEW END;
END
$fn$;

CREATE OR REPLACE TRIGGER tr_workflow_step_attempt_guard
BEFORE INSERT OR UPDATE OR DELETE ON workflow_step_attempt
FOR EACH ROW EXECUTE FUNCTION workflow_step_attempt_guard();
