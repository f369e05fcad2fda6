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
-- steprecord.writer = 'judge' and the trace id for the call only, set first by set_config
-- and restored at the end, as apply_events.sql does and says why.
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
    v_group record;
    v_statement text;
    v_table text;
    v_shard_table text;
    v_name text;
    v_version text;
    v_writer text := current_setting('steprecord.writer', true);  -- restored at the end
    v_trace text := current_setting('steprecord.trace_id', true);
BEGIN
    IF to_regprocedure('get_shard_id_for_distribution_column(regclass,"any")') IS NULL THEN
        RETURN QUERY SELECT * FROM steprecord_apply_events(
            p_i, p_instance_key, p_step_slug, p_kind, p_attempt, p_started_at, p_completed_at,
            p_output, p_external_output_url, p_error_code, p_error_message, p_ordinal,
            p_lease_seconds, p_trace_id, p_reported_by);
        RETURN;
    END IF;
    PERFORM set_config('steprecord.writer', 'judge', true);
    PERFORM set_config('steprecord.trace_id', coalesce(p_trace_id, ''), true);
    SELECT p.xmin::text INTO v_version
    FROM pg_proc p WHERE p.oid = 'steprecord_apply_events(int[], text[], text[], text[],
        bigint[], timestamptz[], timestamptz[], text[], text[], text[], text[], bigint[], int[],
        text, text)'::regprocedure;

    -- Each shard group's events, in the order they were given (by n), as the arguments of
    -- its statement, and the group's instance ids; the groups in the order of their shard
    -- ids: every call on this node locks its groups' rows in that one order, as the
    -- statement locks each group's rows by id, so two calls wait for each other instead of
    -- deadlocking (in the order the groups first appear among the events, two batches that
    -- reached the same groups in turn locked them in opposite orders). The answer is the
    -- same in any order: the events are of distinct steps, each judged as if alone.
    FOR v_group IN
        SELECT g.shard, array_agg(DISTINCT g.instance_id) AS ids,
               array_agg(p_i[g.n] ORDER BY g.n) AS i,
               array_agg(p_instance_key[g.n] ORDER BY g.n) AS instance_key,
               array_agg(p_step_slug[g.n] ORDER BY g.n) AS step_slug,
               array_agg(p_kind[g.n] ORDER BY g.n) AS kind,
               array_agg(p_attempt[g.n] ORDER BY g.n) AS attempt,
               array_agg(p_started_at[g.n] ORDER BY g.n) AS started_at,
               array_agg(p_completed_at[g.n] ORDER BY g.n) AS completed_at,
               array_agg(p_output[g.n] ORDER BY g.n) AS output,
               array_agg(p_external_output_url[g.n] ORDER BY g.n) AS external_output_url,
               array_agg(p_error_code[g.n] ORDER BY g.n) AS error_code,
               array_agg(p_error_message[g.n] ORDER BY g.n) AS error_message,
               array_agg(p_ordinal[g.n] ORDER BY g.n) AS ordinal,
               array_agg(p_lease_seconds[g.n] ORDER BY g.n) AS lease_seconds
        FROM (SELECT k.n, k.instance_id,
                     get_shard_id_for_distribution_column('process_instance', k.instance_id)
                         AS shard
              FROM (SELECT n, steprecord_instance_id(p_instance_key[n]) AS instance_id
                    FROM generate_subscripts(p_instance_key, 1) AS n) k) g
        GROUP BY g.shard
        ORDER BY g.shard
    LOOP
        v_name := format('steprecord_apply_events_%s_%s', v_group.shard, v_version);
        -- Prepared in this connection already: a setting of the session says so, cheaper
        -- to read than pg_prepared_statements (which copies every statement's text). A
        -- call that failed rolled the setting back but not the PREPARE (which is not
        -- transactional): the catalog is asked then, and the setting written again.
        IF current_setting('steprecord.' || v_name, true) IS DISTINCT FROM 'prepared' THEN
            IF NOT EXISTS (SELECT 1 FROM pg_prepared_statements s WHERE s.name = v_name) THEN
                -- The general statement: the text between RETURN QUERY and the first
                -- statement after it, the restore of the writer.
                SELECT substring(p.prosrc FROM 'RETURN QUERY(.*?);\s*PERFORM set_config\(''steprecord.writer''')
                INTO v_statement
                FROM pg_proc p
                WHERE p.oid = 'steprecord_apply_events(int[], text[], text[], text[], bigint[],
                               timestamptz[], timestamptz[], text[], text[], text[], text[],
                               bigint[], int[], text, text)'::regprocedure;
                FOREACH v_table IN ARRAY ARRAY['process_instance', 'workflow_step_record',
                                               'workflow_step_attempt'] LOOP
                    v_shard_table := shard_name(
                        v_table::regclass, get_shard_id_for_distribution_column(v_table, v_group.ids[1]));
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
            PERFORM set_config('steprecord.' || v_name, 'prepared', false);
        END IF;

        RETURN QUERY EXECUTE format(
            'EXECUTE %I(%L, %L, %L, %L, %L, %L, %L, %L, %L, %L, %L, %L, %L, %L, %L, %L)', v_name,
            v_group.i, v_group.instance_key, v_group.step_slug, v_group.kind, v_group.attempt,
            v_group.started_at, v_group.completed_at, v_group.output,
            v_group.external_output_url, v_group.error_code, v_group.error_message,
            v_group.ordinal, v_group.lease_seconds, v_now, v_group.ids, p_reported_by);
    END LOOP;
    PERFORM set_config('steprecord.writer', coalesce(v_writer, ''), true);
    PERFORM set_config('steprecord.trace_id', coalesce(v_trace, ''), true);
END
$fn$;
