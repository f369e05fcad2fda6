-- steprecord_heartbeat: extend the lease of the running attempt each heartbeat names.
--
-- Arguments, one array per field (element n is heartbeat n, all of distinct steps):
--   p_i (the index in the caller's list), p_instance_key, p_step_slug, p_attempt,
--   p_lease_seconds. Then p_reported_by (default NULL): the writer, the name of the token
--   whose request sent the heartbeats (`anonymous` without tokens; NULL: none named).
-- Answer: one row per heartbeat, its index, the outcome and the record (NULLs when there is
-- none), as steprecord_apply_events answers:
--   applied        the lease now ends at the database clock + lease_seconds;
--   stale_attempt  the heartbeat's attempt is older than the record's: a zombie worker
--                  learns that it was superseded;
--   not_started    no such record, or it is pending;
--   not_running    that attempt finished, or the heartbeat names an attempt that has not
--                  started.
-- A heartbeat never changes status, times or attempt_count, so it cannot move a record
-- backwards or reopen it; it is decided under the record's row lock, so it cannot extend
-- a lease that a concurrent terminal event or the sweeper has just closed. It does write the
-- record (its lease and updated_at), so it writes updated_by too, and the running attempt's
-- entry, whose lease the history copies, takes it as reported_by: the record names whoever
-- last wrote it, and a heartbeat is how a worker says the attempt is still its own.
CREATE OR REPLACE FUNCTION steprecord_heartbeat(
    p_i int[], p_instance_key text[], p_step_slug text[], p_attempt bigint[],
    p_lease_seconds int[], p_reported_by text DEFAULT NULL
)
RETURNS TABLE (
    i integer, outcome text,
    id bigint, step_slug text, ordinal integer, status text, attempt_count integer,
    output text, external_output_url text, started_at timestamptz, completed_at timestamptz,
    lease_expires_at timestamptz, error_code text, error_message text,
    created_at timestamptz, updated_at timestamptz, updated_by text
)
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, public, pg_temp
SET plan_cache_mode = force_generic_plan
AS $fn$
#variable_conflict use_column
DECLARE
    -- The call's clock reading, a value (no clock call inside a write: see apply_events.sql).
    v_now timestamptz := clock_timestamp();
    -- The heartbeats' instance ids, a value each read and write names (as in
    -- apply_events.sql): on Citus a call whose instances share one shard group is routed,
    -- whole, to the worker holding it (Citus locks rows only in a statement routed so).
    v_ids bigint[] := ARRAY(SELECT DISTINCT steprecord_instance_id(k) FROM unnest(p_instance_key) k);
BEGIN
    RETURN QUERY
    WITH e AS MATERIALIZED (
        SELECT x.*, steprecord_instance_id(x.instance_key) AS instance_id, v_now AS now,
               judge_lease_expires_at(v_now, x.lease_seconds) AS lease_expires_at
        FROM unnest(p_i, p_instance_key, p_step_slug, p_attempt, p_lease_seconds)
            AS x(i, instance_key, step_slug, attempt, lease_seconds)
    ),
    -- The records, locked in id order (no deadlock between two calls).
    cur AS (
        SELECT e.i, r.* FROM e
        JOIN process_instance p ON p.id = e.instance_id AND p.instance_key = e.instance_key
        JOIN workflow_step_record r ON r.instance_id = p.id AND r.step_slug = e.step_slug
        WHERE p.id = ANY (v_ids) AND r.instance_id = ANY (v_ids)
        ORDER BY r.id
        FOR UPDATE OF r
    ),
    dec AS (
        SELECT cur.i, cur.instance_id, cur.id,
            CASE WHEN e.attempt < cur.attempt_count THEN 'stale_attempt'
                 WHEN cur.status = 'pending' THEN 'not_started'
                 WHEN e.attempt > cur.attempt_count OR cur.status <> 'running' THEN 'not_running'
                 ELSE 'applied' END AS outcome
        FROM cur JOIN e ON e.i = cur.i
    ),
    -- Only the lease, updated_at and updated_by change (the history trigger copies the
    -- running attempt's new lease into its history entry). The lease is computed in `e`:
    -- Citus refuses a STABLE function over a column inside an UPDATE.
    upd AS (
        UPDATE workflow_step_record r SET
            lease_expires_at = e.lease_expires_at,
            updated_at = e.now,
            updated_by = p_reported_by
        FROM dec d JOIN e ON e.i = d.i
        WHERE r.instance_id = ANY (v_ids)
          AND r.instance_id = d.instance_id AND r.id = d.id AND d.outcome = 'applied'
        RETURNING d.i, r.*
    )
    SELECT upd.i, 'applied' AS outcome,
           upd.id, upd.step_slug, upd.ordinal, upd.status, upd.attempt_count,
           upd.output::text AS output, upd.external_output_url, upd.started_at,
           upd.completed_at, upd.lease_expires_at, upd.error_code,
           upd.error_message, upd.created_at, upd.updated_at, upd.updated_by
    FROM upd
    UNION ALL
    SELECT d.i, d.outcome,
           cur.id, cur.step_slug, cur.ordinal, cur.status, cur.attempt_count,
           cur.output::text AS output, cur.external_output_url, cur.started_at,
           cur.completed_at, cur.lease_expires_at, cur.error_code,
           cur.error_message, cur.created_at, cur.updated_at, cur.updated_by
    FROM dec d JOIN cur ON cur.i = d.i
    WHERE d.outcome <> 'applied'
    UNION ALL
    SELECT e.i, 'not_started',
           NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
           NULL
    FROM e
    WHERE NOT EXISTS (SELECT 1 FROM cur WHERE cur.i = e.i);
END
$fn$;

-- Called by the owner and the roles it granted (owner_rights.sql).
REVOKE ALL ON FUNCTION steprecord_heartbeat FROM PUBLIC;
