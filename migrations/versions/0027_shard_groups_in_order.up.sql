-- Revision 0027_shard_groups_in_order, upgrade: the files of app/sql/ that changed since revision
-- 0026, whole.
-- Made by `python -m app.sql freeze 0027_shard_groups_in_order`. Never edit it: the source is app/sql/;
-- change it there and freeze a new revision.

-- ===== app/sql/apply_events_on_shard.sql =====
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
