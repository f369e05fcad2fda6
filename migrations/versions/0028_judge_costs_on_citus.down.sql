-- Revision 0028_judge_costs_on_citus, downgrade: the same files as of revision 0027.
-- Made by `python -m app.sql freeze 0028_judge_costs_on_citus`. Never edit it: the source is app/sql/;
-- change it there and freeze a new revision.

-- ===== app/sql/apply_events_on_shard.sql as of revision 0027 =====
-- steprecord_apply_events_on_shard: the general statement (steprecord_apply_events) for events
-- whose instances live on one node, run there, one statement per shard group.
--
-- Arguments: p_instance_id, the id of one of the events' instances (on Citus the function's
-- distribution argument: the coordinator sends the whole call to the worker that holds it),
-- then the arguments of steprecord_apply_events, the same names in the same order. Answer:
-- the answer of steprecord_apply_events for those events.
--
-- Without Citus it is steprecord_apply_events itself. On Citus the general statement cannot
-- run through the coordinator's planner as one statement: Citus plans a statement whose
-- WITH holds an INSERT part by part (only SELECT, UPDATE and DELETE parts are routed to one
-- shard), and then refuses its row locks (FOR UPDATE) across shards. So the statement runs
-- here, on the worker, on each shard group's own shards (the tables `<table>_<shard id>`
-- beside this call), as PostgreSQL plans it on one node: one statement per group, in the
-- order of the groups' shard ids, all in this call's transaction, their locks and writes on
-- this node, the shards' triggers (the record's guard, history and
-- notification) firing as on one node. The events are of distinct steps (as
-- steprecord_apply_events requires), so no group's events see another's. Its text is
-- steprecord_apply_events's own, read from the catalog, with each table named by its shard
-- and each variable by a parameter: one statement, stated once.
-- Rewriting that text and planning it cost more than running it, so each connection does both
-- once per shard group: the statement is a prepared statement of the connection (Citus keeps
-- its connections to a worker open between calls), named by its shard group and by the
-- version of steprecord_apply_events it was read from (the catalog row's xmin: a migration
-- that replaces the function makes a new name), with one generic plan; a call binds its
-- values as literals of the parameters' types (an EXECUTE of a prepared statement takes no
-- parameters of its own), which read back as the same values in the same connection.
-- A call that Citus ran on a node without a group's shards is refused: an event whose
-- instance lives on another worker (the caller groups a batch's events by worker:
-- app/data/judge.py), or a call inside a transaction block, which Citus does not delegate
-- (call it alone).
CREATE OR REPLACE FUNCTION steprecord_apply_events_on_shard(
    p_instance_id bigint, p_i int[], p_instance_key text[], p_step_slug text[], p_kind text[],
    p_attempt bigint[], p_started_at timestamptz[], p_completed_at timestamptz[],
    p_output text[], p_external_output_url text[], p_error_code text[],
    p_error_message text[], p_ordinal bigint[], p_lease_seconds int[],
    p_trace_id text DEFAULT NULL, p_reported_by text DEFAULT NULL
) RETURNS TABLE (
    i integer, outcome text, recorded boolean,
    id bigint, step_slug text, ordinal integer, status text, attempt_count integer,
    output text, external_output_url text, started_at timestamptz, completed_at timestamptz,
    lease_expires_at timestamptz, error_code text, error_message text,
    created_at timestamptz, updated_at timestamptz, updated_by text
)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
AS $fn$
#variable_conflict use_column
DECLARE
    v_now timestamptz := clock_timestamp();
    v_ids bigint[];
    v_shard bigint;
    v_statement text;
    v_table text;
    v_shard_table text;
    v_name text;
    v_version text;
    v_pos int[];
BEGIN
    PERFORM set_config('steprecord.writer', 'judge', true);
    IF to_regprocedure('get_shard_id_for_distribution_column(regclass,"any")') IS NULL THEN
        RETURN QUERY SELECT * FROM steprecord_apply_events(
            p_i, p_instance_key, p_step_slug, p_kind, p_attempt, p_started_at, p_completed_at,
            p_output, p_external_output_url, p_error_code, p_error_message, p_ordinal,
            p_lease_seconds, p_trace_id, p_reported_by);
        RETURN;
    END IF;
    PERFORM set_config('steprecord.trace_id', coalesce(p_trace_id, ''), true);
    SELECT p.xmin::text INTO v_version
    FROM pg_proc p WHERE p.oid = 'steprecord_apply_events(int[], text[], text[], text[],
        bigint[], timestamptz[], timestamptz[], text[], text[], text[], text[], bigint[], int[],
        text, text)'::regprocedure;

    -- Each shard group's events (their positions n, ascending), the groups in the order of
    -- their shard ids: every call on this node locks its groups' rows in that one order, as
    -- the statement locks each group's rows by id, so two calls wait for each other instead
    -- of deadlocking (in the order the groups first appear among the events, two batches
    -- that reached the same groups in turn locked them in opposite orders). The answer is
    -- the same in any order: the events are of distinct steps, each judged as if alone.
    FOR v_shard, v_pos IN
        SELECT g.shard, array_agg(g.n ORDER BY g.n)
        FROM (SELECT n, get_shard_id_for_distribution_column(
                            'process_instance', steprecord_instance_id(p_instance_key[n])) AS shard
              FROM generate_subscripts(p_instance_key, 1) AS n) g
        GROUP BY g.shard
        ORDER BY g.shard
    LOOP
        v_ids := ARRAY(SELECT DISTINCT steprecord_instance_id(p_instance_key[n])
                       FROM unnest(v_pos) AS n);
        v_name := format('steprecord_apply_events_%s_%s', v_shard, v_version);
        IF NOT EXISTS (SELECT 1 FROM pg_prepared_statements s WHERE s.name = v_name) THEN
            -- The general statement: the text between RETURN QUERY and the END of its body.
            SELECT substring(p.prosrc FROM 'RETURN QUERY(.*);\s*END\s*$') INTO v_statement
            FROM pg_proc p
            WHERE p.oid = 'steprecord_apply_events(int[], text[], text[], text[], bigint[],
                           timestamptz[], timestamptz[], text[], text[], text[], text[],
                           bigint[], int[], text, text)'::regprocedure;
            FOREACH v_table IN ARRAY ARRAY['process_instance', 'workflow_step_record',
                                           'workflow_step_attempt'] LOOP
                v_shard_table := shard_name(
                    v_table::regclass, get_shard_id_for_distribution_column(v_table, v_ids[1]));
                IF to_regclass(v_shard_table) IS NULL THEN
                    RAISE EXCEPTION 'steprecord_apply_events_on_shard: shard % is not on this node', v_shard_table
                        USING ERRCODE = 'object_not_in_prerequisite_state',
                              HINT = 'Call the function alone, outside a transaction block, with events whose instances live on one worker, so that Citus sends it to that worker.';
                END IF;
                v_statement := regexp_replace(v_statement, '\m' || v_table || '\M',
                                              v_shard_table, 'g');
                -- A unique key named in ON CONFLICT carries its shard's id on the shard.
                v_statement := regexp_replace(v_statement, '\m(uq_' || v_table || '_\w+)\M',
                                              '\1' || substring(v_shard_table FROM '_[0-9]+$'),
                                              'g');
            END LOOP;
            v_statement := regexp_replace(v_statement, '\mv_now\M', '$14', 'g');
            v_statement := regexp_replace(v_statement, '\mv_ids\M', '$15', 'g');
            v_statement := regexp_replace(v_statement, '\mp_reported_by\M', '$16', 'g');
            FOR n IN 1..13 LOOP
                v_statement := regexp_replace(
                    v_statement,
                    '\m' || (ARRAY['p_i', 'p_instance_key', 'p_step_slug', 'p_kind', 'p_attempt',
                                   'p_started_at', 'p_completed_at', 'p_output',
                                   'p_external_output_url', 'p_error_code', 'p_error_message',
                                   'p_ordinal', 'p_lease_seconds'])[n] || '\M',
                    '$' || n, 'g');
            END LOOP;
            EXECUTE format('PREPARE %I (int[], text[], text[], text[], bigint[], timestamptz[],'
                           ' timestamptz[], text[], text[], text[], text[], bigint[], int[],'
                           ' timestamptz, bigint[], text) AS %s', v_name, v_statement);
        END IF;

        RETURN QUERY EXECUTE format(
            'EXECUTE %I(%L, %L, %L, %L, %L, %L, %L, %L, %L, %L, %L, %L, %L, %L, %L, %L)', v_name,
            ARRAY(SELECT p_i[n] FROM unnest(v_pos) AS n ORDER BY n),
            ARRAY(SELECT p_instance_key[n] FROM unnest(v_pos) AS n ORDER BY n),
            ARRAY(SELECT p_step_slug[n] FROM unnest(v_pos) AS n ORDER BY n),
            ARRAY(SELECT p_kind[n] FROM unnest(v_pos) AS n ORDER BY n),
            ARRAY(SELECT p_attempt[n] FROM unnest(v_pos) AS n ORDER BY n),
            ARRAY(SELECT p_started_at[n] FROM unnest(v_pos) AS n ORDER BY n),
            ARRAY(SELECT p_completed_at[n] FROM unnest(v_pos) AS n ORDER BY n),
            ARRAY(SELECT p_output[n] FROM unnest(v_pos) AS n ORDER BY n),
            ARRAY(SELECT p_external_output_url[n] FROM unnest(v_pos) AS n ORDER BY n),
            ARRAY(SELECT p_error_code[n] FROM unnest(v_pos) AS n ORDER BY n),
            ARRAY(SELECT p_error_message[n] FROM unnest(v_pos) AS n ORDER BY n),
            ARRAY(SELECT p_ordinal[n] FROM unnest(v_pos) AS n ORDER BY n),
            ARRAY(SELECT p_lease_seconds[n] FROM unnest(v_pos) AS n ORDER BY n),
            v_now, v_ids, p_reported_by);
    END LOOP;
END
$fn$;


-- ===== app/sql/attempt_history.sql as of revision 0027 =====
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
--     instance id as a value, so Citus routes it to that one shard);
--   * workflow_step_attempt_guard (row trigger on workflow_step_attempt): the history is
--     written only by those triggers, and a finished attempt never changes.

-- After a record is inserted: its attempt, unless it is pending (a pending record has no
-- attempt yet: the trigger's WHEN skips it). The upsert is shared with _update below: an
-- attempt row exists from the moment its attempt starts and is brought up to date by every
-- write of its record; the WHERE skips writes that change nothing the history shows. A
-- running attempt mirrors the record's lease; a finished one keeps the last lease it held.
-- An entry written names its record's writer (reported_by = the record's updated_by):
-- whoever last wrote the record last wrote the entry.
CREATE OR REPLACE FUNCTION workflow_step_record_history_insert() RETURNS trigger
LANGUAGE plpgsql AS $fn$
BEGIN
    INSERT INTO workflow_step_attempt AS a (
        instance_id, record_id, attempt, status, started_at, completed_at, output,
        external_output_url, error_code, error_message, lease_expires_at,
        created_at, updated_at, reported_by)
    VALUES (NEW.instance_id, NEW.id, NEW.attempt_count, NEW.status, NEW.started_at,
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
    INSERT INTO workflow_step_attempt AS a (
        instance_id, record_id, attempt, status, started_at, completed_at, output,
        external_output_url, error_code, error_message, lease_expires_at,
        created_at, updated_at, reported_by)
    VALUES (NEW.instance_id, NEW.id, NEW.attempt_count, NEW.status, NEW.started_at,
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
--     the judge's functions for their call only): it may insert an attempt's terminal
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
        RAISE EXCEPTION 'workflow_step_attempt: %', why
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
