-- On Citus, the judge's copy for one shard of the instances, on the node that holds it: the
-- service calls it for the events of the instances it knows to be on that shard
-- (app/data/judge.py), on that shard's node (app/ops/nodes.py).
--
-- steprecord_apply_event's statements on the distributed tables each go through Citus's
-- planner and executor, and Citus plans every call of a distributed function with parameters
-- anew: a replayed event cost a worker 2.2 to 2.45 times what it costs one node. A copy is
-- made from the same template (apply_event.sql) on the shard's own tables (Citus names them,
-- with shard_name), on this node alone (not one of Citus's objects, so its calls are planned
-- once per connection, as on one node): 1.2 to 1.6 times (tests/bench/call_shapes.py and
-- tests/bench/growth.py, docs/scaling.md).
--
-- What Citus does for the statements it routes, a copy does first, on every call:
--   - it takes Citus's lock on the shard's metadata, shared (lock_shard_metadata, mode 5, as
--     Citus's own writes of a shard take it): a shard move or split takes it exclusively on
--     every node before it copies the shard and holds it until its transaction ends, so a
--     copy's write is before the move (and moved with the shard) or after it (and then sees
--     where the shard went);
--   - under that lock, it checks that the shard's placement is on this node and that the
--     event's instance is of this shard (Citus's own answer,
--     get_shard_id_for_distribution_column: a key whose shard the service knew wrong, after
--     the table was distributed again);
--   - when either is not so, it is the distributed judge's call instead: Citus routes its
--     statements to wherever the shard is now. A stale shard map in the service costs time,
--     never a write in a shard's table that is no longer the shard.
-- A copy's name is `steprecord_apply_event_<shard id>_<tag>`, the tag a digest of its text,
-- so a template changed by a revision makes copies of other names: a caller holding an old
-- name finds it gone (undefined_function) and asks for the copy again.

-- steprecord_shard_judge(p_shard): the name of this node's copy for the instances' shard
-- p_shard, made now when it is not there yet (the copies of that shard of other texts are
-- dropped then); NULL when the shard is not one of the instances' on this node (the caller
-- calls steprecord_apply_event). Made with Citus's DDL propagation off: on this node alone.
-- The roles that may call steprecord_apply_event may call the copy (owner_rights.sql): a
-- role granted or revoked since it was made is granted or revoked on it when any connection
-- next asks for it (to cut a role off at once, drop the copies:
-- steprecord_drop_shard_judges() on each node).
CREATE OR REPLACE FUNCTION steprecord_shard_judge(p_shard bigint) RETURNS text
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, public, pg_temp
AS $fn$
DECLARE
    v_records text;
    v_instances text;
    v_attempts text;
    v_first text;
    v_text text;
    v_suffix text;  -- `_<shard id>_<tag>`
    v_name text;
    v_grantee text;
    v_grant boolean;  -- granted the judge (else only the copy: revoked since)
    v_old regprocedure;
BEGIN
    -- The shard's tables, when the shard is the instances' and on this node: its co-located
    -- shards are those of the same hash range.
    SELECT shard_name('workflow_step_record'::regclass, r.shardid),
           shard_name('process_instance'::regclass, s.shardid),
           shard_name('workflow_step_attempt'::regclass, a.shardid)
    INTO v_records, v_instances, v_attempts
    FROM pg_dist_shard s
    JOIN pg_dist_placement p ON p.shardid = s.shardid
    JOIN pg_dist_shard r ON r.logicalrelid = 'workflow_step_record'::regclass
                        AND r.shardminvalue = s.shardminvalue
    JOIN pg_dist_shard a ON a.logicalrelid = 'workflow_step_attempt'::regclass
                        AND a.shardminvalue = s.shardminvalue
    WHERE s.shardid = p_shard AND s.logicalrelid = 'process_instance'::regclass
      AND p.groupid = (SELECT groupid FROM pg_dist_local_group);
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    v_first := format($first$
    PERFORM lock_shard_metadata(5, ARRAY[%1$s]::bigint[]);
    PERFORM FROM pg_dist_placement pl
    WHERE pl.shardid = %1$s AND pl.groupid = (SELECT l.groupid FROM pg_dist_local_group l)
      AND get_shard_id_for_distribution_column('process_instance', v_id) = %1$s;
    IF NOT FOUND THEN
        RETURN QUERY SELECT * FROM steprecord_apply_event(
            p_instance_id, p_i, p_instance_key, p_step_slug, p_kind, p_attempt, p_started_at,
            p_completed_at, p_output, p_external_output_url, p_error_code, p_error_message,
            p_ordinal, p_lease_seconds, p_trace_id, p_reported_by, p_labels);
        RETURN;
    END IF;
$first$, p_shard);
    v_text := steprecord_apply_event_text('_' || p_shard, v_records, v_instances, v_attempts,
                                          v_first);
    v_suffix := format('_%s_%s', p_shard, left(md5(v_text), 12));
    v_name := 'steprecord_apply_event' || v_suffix;
    -- One maker of a shard's copy at a time: two would collide in the catalog (making it, or
    -- granting it). Held until the call's transaction ends: a call per connection and shard.
    PERFORM pg_advisory_xact_lock(hashtextextended('steprecord_shard_judge ' || p_shard, 0));
    PERFORM set_config('citus.enable_ddl_propagation', 'off', true);
    IF to_regproc('public.' || v_name) IS NULL THEN
        FOR v_old IN
            SELECT p.oid::regprocedure FROM pg_proc p
            WHERE p.pronamespace = 'public'::regnamespace
              AND p.proname ~ ('^steprecord_apply_event_' || p_shard || '_[0-9a-f]+$')
        LOOP
            EXECUTE format('DROP FUNCTION %s', v_old);
        END LOOP;
        -- Made in the schema's own: the template names the function without its schema, and
        -- CREATE puts it in the first of the search path (this function's is restored on
        -- exit).
        PERFORM set_config('search_path', 'public, pg_catalog, pg_temp', true);
        EXECUTE steprecord_apply_event_text(v_suffix, v_records, v_instances, v_attempts,
                                            v_first);
        PERFORM set_config('search_path', 'pg_catalog, public, pg_temp', true);
        EXECUTE format('REVOKE ALL ON FUNCTION public.%s FROM PUBLIC', v_name);
    END IF;
    -- Whoever may call the judge may call the copy, and no one else: the roles granted or
    -- revoked since the copy was made too (`steprecord grant`), each time a copy is named.
    FOR v_grantee, v_grant IN
        SELECT coalesce(j.grantee, c.grantee)::regrole::text, j.grantee IS NOT NULL
        FROM (SELECT a.grantee FROM pg_proc f, aclexplode(f.proacl) a
              WHERE f.oid = 'steprecord_apply_event'::regproc
                AND a.privilege_type = 'EXECUTE' AND a.grantee NOT IN (0, f.proowner)) j
        FULL JOIN (SELECT a.grantee FROM pg_proc f, aclexplode(f.proacl) a
                   WHERE f.oid = to_regproc('public.' || v_name)
                     AND a.privilege_type = 'EXECUTE' AND a.grantee NOT IN (0, f.proowner)) c
            ON c.grantee = j.grantee
        WHERE j.grantee IS NULL OR c.grantee IS NULL
    LOOP
        EXECUTE format(CASE WHEN v_grant THEN 'GRANT EXECUTE ON FUNCTION public.%s TO %s'
                            ELSE 'REVOKE EXECUTE ON FUNCTION public.%s FROM %s' END,
                       v_name, v_grantee);
    END LOOP;
    RETURN v_name;
END
$fn$;

-- steprecord_drop_shard_judges(): drop this node's copies, all of them; the number dropped.
-- `steprecord migrate` calls it on every node of a Citus cluster before it changes the schema
-- (app/ops/distribution.py): a copy names the judge's answer type, which a revision may drop
-- and make again; the copies are made again on first use. With the caller's rights: the
-- owner's, who owns the copies (no runtime role needs it).
CREATE OR REPLACE FUNCTION steprecord_drop_shard_judges() RETURNS int
LANGUAGE plpgsql
SET search_path = pg_catalog, public, pg_temp
AS $fn$
DECLARE
    v_old regprocedure;
    v_count int := 0;
BEGIN
    PERFORM set_config('citus.enable_ddl_propagation', 'off', true);
    FOR v_old IN
        SELECT p.oid::regprocedure FROM pg_proc p
        WHERE p.pronamespace = 'public'::regnamespace
          AND p.proname ~ '^steprecord_apply_event_[0-9]+_[0-9a-f]+$'
    LOOP
        EXECUTE format('DROP FUNCTION %s', v_old);
        v_count := v_count + 1;
    END LOOP;
    RETURN v_count;
END
$fn$;

-- Called by the owner and the roles it granted (owner_rights.sql); the drop by the owner.
REVOKE ALL ON FUNCTION steprecord_shard_judge FROM PUBLIC;
REVOKE ALL ON FUNCTION steprecord_drop_shard_judges FROM PUBLIC;
