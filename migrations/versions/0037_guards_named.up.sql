-- Revision 0037_guards_named, upgrade: the files of app/sql/ that changed since revision
-- 0036, whole.
-- Made by `python -m app.sql freeze 0037_guards_named`. Never edit it: the source is app/sql/;
-- change it there and freeze a new revision.

-- ===== app/sql/attempt_history.sql =====
-- The attempt history (workflow_step_attempt): one row per attempt of a record, written by
-- the database itself in the same statement as the record, whoever writes the record.
--
-- Three functions, three triggers:
--   * workflow_step_record_history_insert / _update (row triggers, AFTER each inserted or
--     updated row of workflow_step_record): every write to a record — the judge, a batch,
--     the sweeper, a hand-written UPDATE — brings its history up to date. Row triggers, not
--     statement triggers with transition tables: on Citus a trigger runs on the shard, where
--     no transition table can be found; a row trigger writes the history's row on the shard
--     beside its record's (co-located by instance_id: every statement below names the
--     instance id as a value, so Citus routes it to that one shard). The entry's id is
--     taken from its sequence before the upsert and passed as a value: a statement with
--     no volatile function in it is one whose plan Citus keeps for the shard (planned once
--     per connection and shard); with the identity's default in it, Citus planned the
--     upsert again for every row, about 80 µs a record written on a worker;
--   * workflow_step_attempt_guard (row trigger on workflow_step_attempt): the history is
--     written only by those triggers, and a finished attempt never changes.

-- After a record is inserted: its attempt, unless it is pending (a pending record has no
-- attempt yet: the trigger's WHEN skips it). _update below repeats this upsert word for word
-- (a trigger function calling a shared one would cost a second call per row; a change of one
-- is a change of both): an attempt row exists from the moment its attempt starts and is brought up to date by every
-- write of its record; the WHERE skips writes that change nothing the history shows. A
-- running attempt mirrors the record's lease; a finished one keeps the last lease it held.
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

-- ===== app/sql/record_guard.sql =====
-- The record's transition guard: what no UPDATE of workflow_step_record may do, whoever
-- sends it (the judge, the sweeper, a racing retry, a hand-written repair). The one repair
-- it lets through is the operator's reopen, and only from steprecord_reopen (reopen.sql).
--
-- The named CHECK constraints (migration 0001) hold each row's own truth: the closed status
-- set, the content each status allows, the timing, the sizes. This trigger holds what only
-- a comparison of the old and the new row can: the order of events. It raises
-- check_violation naming tr_workflow_step_record_transition, in the error's constraint field
-- and in its message as a CHECK's does (Citus relays a worker's SQLSTATE and message, not
-- the constraint field), so a refused update reads like a refused CHECK on one node and on a
-- cluster (the service answers 422 constraint_violation with the name).
CREATE OR REPLACE FUNCTION workflow_step_record_guard_transition() RETURNS trigger
LANGUAGE plpgsql AS $fn$
DECLARE
    -- A record's rank within its attempt (judge_rules.sql): pending 0, running 1, finished 2.
    old_rank int := judge_status_rank(OLD.status);
    new_rank int := judge_status_rank(NEW.status);
    why text;
BEGIN
    -- Identities: the record stays the same step of the same instance, at its ordinal.
    IF (NEW.id, NEW.instance_id, NEW.step_slug, NEW.ordinal, NEW.created_at)
       IS DISTINCT FROM
       (OLD.id, OLD.instance_id, OLD.step_slug, OLD.ordinal, OLD.created_at) THEN
        why := 'id, instance_id, step_slug, ordinal and created_at never change';
    -- Progress: (attempt_count, rank) never decreases, so a late start cannot reopen a
    -- finished attempt and a racing retry cannot go back to an older attempt.
    ELSIF (NEW.attempt_count, new_rank) < (OLD.attempt_count, old_rank) THEN
        why := format('(attempt_count, rank) may not go back from (%s, %s) to (%s, %s)',
                      OLD.attempt_count, old_rank, NEW.attempt_count, new_rank);
    -- Back to pending at a higher attempt: only an operator's reopen of a finished record
    -- (steprecord_reopen, reopen.sql, which sets steprecord.writer = 'repair' for its
    -- transaction and logs the repair). Every event starts the next attempt running or finished.
    ELSIF NEW.status = 'pending' AND NEW.attempt_count > OLD.attempt_count
          AND NOT (OLD.status IN ('completed', 'failed')
                   AND NEW.attempt_count = OLD.attempt_count + 1
                   AND current_setting('steprecord.writer', true) IS NOT DISTINCT FROM 'repair'
                   AND steprecord_by_owner())
          THEN
        why := 'only steprecord_reopen takes a record back to pending, from finished, at'
               ' the next attempt';
    -- A finished attempt is a fact: within the same attempt its status, times, output,
    -- error, and who wrote it (updated_by) never change. Only a higher attempt reopens the
    -- record. (The judge never writes a finished record within its attempt: a replay writes
    -- nothing, a late report writes the history alone.)
    ELSIF OLD.status IN ('completed', 'failed') AND NEW.attempt_count = OLD.attempt_count
          AND (NEW.status, NEW.started_at, NEW.completed_at, NEW.output,
               NEW.external_output_url, NEW.error_code, NEW.error_message, NEW.updated_by)
              IS DISTINCT FROM
              (OLD.status, OLD.started_at, OLD.completed_at, OLD.output,
               OLD.external_output_url, OLD.error_code, OLD.error_message,
               OLD.updated_by) THEN
        why := 'a finished attempt never changes; only a higher attempt reopens it';
    END IF;
    IF why IS NOT NULL THEN
        RAISE EXCEPTION 'workflow_step_record % violates constraint "%": %',
                        OLD.id, 'tr_workflow_step_record_transition', why
            USING ERRCODE = 'check_violation',
                  CONSTRAINT = 'tr_workflow_step_record_transition',
                  TABLE = 'workflow_step_record';
    END IF;
    RETURN NEW;
END
$fn$;

CREATE OR REPLACE TRIGGER tr_workflow_step_record_transition
BEFORE UPDATE ON workflow_step_record
FOR EACH ROW EXECUTE FUNCTION workflow_step_record_guard_transition();

-- ===== app/sql/repair_log.sql =====
-- The repair log's guard (workflow_step_repair, made by migration 0024): an append-only
-- record of every repair, which hand-written SQL can neither forge, change nor delete.
--
--   * INSERT only from steprecord_reopen (reopen.sql), which sets steprecord.writer =
--     'repair' for its transaction, and only for a record it has just reopened: pending at the
--     entry's attempt + 1;
--   * UPDATE never;
--   * DELETE only as the cascade of its instance's (or record's) deletion, which runs as a
--     trigger (trigger depth 2 and more; the history's guard, attempt_history.sql, tells a
--     cascade apart the same way).
-- It raises check_violation naming tr_workflow_step_repair_guard, like a CHECK.
CREATE OR REPLACE FUNCTION workflow_step_repair_guard() RETURNS trigger
LANGUAGE plpgsql AS $fn$
DECLARE
    why text;
BEGIN
    IF TG_OP = 'UPDATE' THEN
        why := 'the repair log is append-only: an entry never changes';
    ELSIF TG_OP = 'DELETE' AND pg_trigger_depth() < 2 THEN
        why := 'the repair log is append-only: an entry goes only with its instance';
    ELSIF TG_OP = 'INSERT'
          AND (pg_trigger_depth() >= 2
               OR current_setting('steprecord.writer', true) IS DISTINCT FROM 'repair'
               OR NOT steprecord_by_owner()
               OR NOT EXISTS (SELECT 1 FROM workflow_step_record r
                              WHERE r.instance_id = NEW.instance_id AND r.id = NEW.record_id
                                AND r.status = 'pending'
                                AND r.attempt_count = NEW.attempt + 1)) THEN
        why := 'the repair log is written only by steprecord_reopen';
    END IF;
    IF why IS NOT NULL THEN
        -- The guard's name in the message too, as a CHECK's: Citus relays a worker's
        -- SQLSTATE and message, not the constraint field.
        RAISE EXCEPTION 'workflow_step_repair violates constraint "%": %',
                        'tr_workflow_step_repair_guard', why
            USING ERRCODE = 'check_violation',
                  CONSTRAINT = 'tr_workflow_step_repair_guard',
                  TABLE = 'workflow_step_repair';
    END IF;
    RETURN CASE TG_OP WHEN 'DELETE' THEN OLD ELSE NEW END;
END
$fn$;

CREATE OR REPLACE TRIGGER tr_workflow_step_repair_guard
BEFORE INSERT OR UPDATE OR DELETE ON workflow_step_repair
FOR EACH ROW EXECUTE FUNCTION workflow_step_repair_guard();
