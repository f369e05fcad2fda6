-- Revision 0040_shard_judges, upgrade: the files of app/sql/ that changed since revision
-- 0039, whole.
-- Made by `python -m app.sql freeze 0040_shard_judges`. Never edit it: the source is app/sql/;
-- change it there and freeze a new revision.

-- ===== app/sql/apply_event.sql =====
-- steprecord_apply_event: the judge of one event (every POST .../declare, /start,
-- /complete, /fail, and on Citus each event of a batch), on the judge's own rules
-- (judge_rules.sql), the same answers as a one-element call of steprecord_apply_events
-- (apply_events.sql), which one node uses for a batch.
--
-- Arguments: p_instance_id, the instance's id (steprecord_instance_id(p_instance_key): the
-- service's statement computes it so), then the fields of steprecord_apply_events as
-- scalars, in the same order and with the same names (p_i, p_instance_key, ...
-- p_lease_seconds), then p_trace_id (default NULL): the request's trace id, which the
-- attempt this event starts keeps, then p_reported_by (default NULL): the writer, the name of
-- the token whose request sent the event (`anonymous` without tokens), which the record's
-- updated_by takes when the event writes it (NULL: the caller named none, as a hand-written
-- call may; the service always names one). On Citus p_instance_id is the function's
-- distribution argument: the coordinator sends the whole call to the worker that holds the
-- instance. The statements use the id of the key itself (v_id), so a hand-written call with
-- another id is judged by its key, as steprecord_apply_events judges it.
-- Last, p_labels (default NULL): the event's labels, a JSON object of strings, which merge
-- into its instance's (6 below).
--
-- Every statement reads or writes one table, by its distribution column (`instance_id =
-- v_id`, `id = v_id`), never a join: on Citus an ordinary statement that Citus routes to the
-- instance's shard, takes Citus's locks on that shard's placement, and follows the shard
-- when it moves (on the worker the call was sent to it runs on the local shard; sent to a
-- node that no longer holds the shard, during or after a rebalance, Citus runs it where the
-- shard is). Citus keeps one generic plan per connection for such a "fast path" statement
-- (plan_cache_mode = force_generic_plan, as on one node).
--
-- The function is written once, as a template (steprecord_apply_event_text, below), and made
-- from it: on every database as steprecord_apply_event, on the tables themselves (the end of
-- this file); on a Citus node, for a shard of the instances that the node holds, as that
-- shard's copy on the shard's own tables (shard_judge.sql), which the service calls for the
-- instances it knows to be on that shard: the same statements, without Citus's planner and
-- executor in each (a replayed event cost a worker 2.2 to 2.45 times one node's CPU through
-- them, 1.2 to 1.6 times in a copy; docs/scaling.md).
--
-- The steps, under the record's row lock (taken in 1, held until the transaction ends, so
-- every later step judges the record 1 judged):
--   1. find the record, lock it, and judge the event (judge_outcome); a record counts only
--      when its instance is the key's (else the id is another key's: instance_key_collision);
--   2. the event applies: write it, each value from the same rule as the general statement's
--      `upd`;
--   3. a complete/fail of an attempt older than the record's (stale_attempt) is still news
--      of that attempt (a late report): it becomes the attempt's history entry when that is
--      missing or `superseded` (as the general statement's `late_write`);
--   4. otherwise an event that writes nothing: the record as it stands;
--   5. no record: an event that may create one (a declare, a start, or a complete/fail with
--      its started_at) locks its instance, creating it if needed, and looks for the record
--      again (a concurrent creator of the step held that lock and has committed); then takes
--      its ordinal (the client's, or the instance's next) and creates the record. Any other
--      event is not_started.
--   6. an event answered 2xx (created, applied, replay) merges its labels into its
--      instance's (`||`: a key it names takes its value, a key it omits stays); a refused
--      event writes nothing. The instance is written only when the labels change something
--      (`@>`), so an orchestrator that sends the same labels with every event writes them
--      once. Its row lock is taken after the record's, as a batch takes them
--      (apply_events.sql), and only then. A new instance is created with them (5).
-- Answer: one row, a steprecord_judged (answers.sql), as steprecord_apply_events answers.
-- An answer with no row: the instance went away between its creation and its lock (a
-- concurrent DELETE): the caller calls again.
--
-- steprecord.trace_id for the call only, set first by set_config and restored at the end (as
-- in apply_events.sql, which says why not by a `SET` clause): the attempt an update or a new
-- record starts keeps this call's trace id, and so does a late report's new entry.
-- steprecord.writer = 'judge' around the late report's write alone: the history's guard lets
-- the judge, and nothing else, write it (attempt_history.sql).

-- The template: the text of a CREATE FUNCTION statement, for format(), whose placeholders are
--   %1$s  what follows the function's name: nothing for steprecord_apply_event, or the
--         copy's `_<shard id>_<tag>` (shard_judge.sql);
--   %2$s  the step records' table (workflow_step_record, or its shard),
--   %3$s  the instances' table (process_instance, or its shard),
--   %4$s  the history's table (workflow_step_attempt, or its shard),
--   %5$s  statements run first (nothing, or a copy's check that its shard is here).
-- A `%` of the function's own would be written `%%`; it has none.
CREATE OR REPLACE FUNCTION steprecord_apply_event_text(
    p_suffix text, p_records text, p_instances text, p_attempts text, p_first text
) RETURNS text
LANGUAGE sql IMMUTABLE
AS $text$
SELECT format($judge$
CREATE OR REPLACE FUNCTION steprecord_apply_event%1$s(
    p_instance_id bigint, p_i int, p_instance_key text, p_step_slug text, p_kind text, p_attempt bigint,
    p_started_at timestamptz, p_completed_at timestamptz, p_output text,
    p_external_output_url text, p_error_code text, p_error_message text, p_ordinal bigint,
    p_lease_seconds int, p_trace_id text DEFAULT NULL, p_reported_by text DEFAULT NULL,
    p_labels jsonb DEFAULT NULL
) RETURNS SETOF steprecord_judged
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, public, pg_temp
SET plan_cache_mode = force_generic_plan
AS $fn$
#variable_conflict use_column
DECLARE
    -- The call's clock reading, a value: Citus refuses a VOLATILE function (clock_timestamp)
    -- in an UPDATE of a distributed table, and any but an IMMUTABLE one in an upsert's DO
    -- UPDATE SET, so the statements below never call a clock.
    v_now timestamptz := clock_timestamp();
    v_id bigint := steprecord_instance_id(p_instance_key);
    v_status text := judge_event_status(p_kind);
    judged record;
    v_key text;  -- the key of the instance that holds v_id
    v_next bigint;  -- that instance's next server-assigned ordinal
    v_locked boolean := false;  -- the instance is locked (5)
    v_ordinal bigint;
    v_entry record;  -- a late report's attempt in the history (3)
    v_completed_at timestamptz;
    v_started_at timestamptz;
    v_recorded boolean := false;
    v_outcome text;  -- the answer's outcome, for the labels (6)
    v_trace text := current_setting('steprecord.trace_id', true);  -- restored at the end
    v_writer text := current_setting('steprecord.writer', true);
BEGIN
%5$s    PERFORM set_config('steprecord.trace_id', coalesce(p_trace_id, ''), true);
    LOOP
        -- 1. The record, locked, and the event judged against its newest version, with the
        --    attempt and start time an update writes.
        SELECT judge_outcome(p_kind, p_attempt, p_started_at, v_now, p_output::jsonb,
                             p_external_output_url, p_error_code, p_error_message,
                             r.attempt_count, r.status, r.started_at, r.output,
                             r.external_output_url, r.error_code, r.error_message)
                   AS outcome,
               judge_event_attempt(p_kind, p_attempt, r.attempt_count, r.status)
                   AS new_attempt,
               judge_event_started_at(p_kind, p_attempt, p_started_at, v_now,
                                      r.attempt_count, r.status, r.started_at)
                   AS new_started_at,
               r.id, r.step_slug, r.ordinal, r.status, r.attempt_count,
               r.output::text AS output, r.external_output_url, r.started_at, r.completed_at,
               r.error_code, r.error_message, r.created_at, r.updated_at, r.updated_by,
               r.lease_expires_at
        INTO judged
        FROM %2$s r
        WHERE r.instance_id = v_id AND r.step_slug = p_step_slug
        FOR UPDATE;
        EXIT WHEN FOUND OR v_locked;

        -- 5. No record. The instance that holds the id, as it stands.
        SELECT p.instance_key INTO v_key FROM %3$s p WHERE p.id = v_id;
        IF FOUND AND v_key <> p_instance_key THEN
            RETURN QUERY SELECT p_i, 'instance_key_collision'::text, false,
                NULL::bigint, NULL::text, NULL::int, NULL::text, NULL::int, NULL::text, NULL::text,
                NULL::timestamptz, NULL::timestamptz, NULL::timestamptz, NULL::text, NULL::text,
                NULL::timestamptz, NULL::timestamptz, NULL::text;
            EXIT;
        END IF;
        IF NOT (p_kind IN ('declare', 'start') OR p_started_at IS NOT NULL) THEN
            RETURN QUERY SELECT p_i, 'not_started'::text, false,
                NULL::bigint, NULL::text, NULL::int, NULL::text, NULL::int, NULL::text, NULL::text,
                NULL::timestamptz, NULL::timestamptz, NULL::timestamptz, NULL::text, NULL::text,
                NULL::timestamptz, NULL::timestamptz, NULL::text;
            EXIT;
        END IF;
        -- The instance, created when missing (a concurrent creator's row, once it commits,
        -- makes this insert do nothing), then locked: creators of its steps take their
        -- ordinals one at a time. Its key is read again under the lock: a concurrent creator
        -- may have been another key with the same id.
        IF v_key IS NULL THEN
            INSERT INTO %3$s (id, instance_key, next_ordinal, labels)
            VALUES (v_id, p_instance_key, 0, coalesce(p_labels, '{}'))
            ON CONFLICT DO NOTHING;
        END IF;
        SELECT p.instance_key, p.next_ordinal INTO v_key, v_next
        FROM %3$s p WHERE p.id = v_id
        FOR UPDATE;
        IF NOT FOUND THEN
            EXIT;  -- deleted meanwhile: no answer, the caller calls again
        END IF;
        IF v_key <> p_instance_key THEN
            CONTINUE;  -- answered as a collision above, on the next round
        END IF;
        v_locked := true;
        -- and 1 again, under the instance's lock: a step created meanwhile is judged there.
    END LOOP;

    IF judged.id IS NOT NULL AND NOT v_locked THEN
        -- The record counts only when its instance is the key's.
        PERFORM FROM %3$s p WHERE p.id = v_id AND p.instance_key = p_instance_key;
        IF NOT FOUND THEN
            RETURN QUERY SELECT p_i, 'instance_key_collision'::text, false,
                NULL::bigint, NULL::text, NULL::int, NULL::text, NULL::int, NULL::text, NULL::text,
                NULL::timestamptz, NULL::timestamptz, NULL::timestamptz, NULL::text, NULL::text,
                NULL::timestamptz, NULL::timestamptz, NULL::text;
            judged := NULL;
        END IF;
    END IF;

    IF judged.id IS NOT NULL AND judged.outcome = 'applied' THEN
        -- 2. Applied: the event replaces the record's whole state, as `upd` does.
        v_outcome := 'applied';
        RETURN QUERY
        UPDATE %2$s r SET
            status = v_status,
            attempt_count = judged.new_attempt,
            started_at = judged.new_started_at,
            completed_at = judge_event_completed_at(p_kind, p_completed_at, v_now,
                                                    judged.new_started_at),
            output = p_output::jsonb,
            external_output_url = p_external_output_url,
            error_code = p_error_code,
            error_message = p_error_message,
            lease_expires_at = judge_lease_expires_at(v_now, p_lease_seconds),
            updated_at = v_now,
            updated_by = p_reported_by
        WHERE r.instance_id = v_id AND r.id = judged.id
        RETURNING p_i, 'applied'::text, false,
                  r.id, r.step_slug, r.ordinal, r.status, r.attempt_count,
                  r.output::text, r.external_output_url, r.started_at,
                  r.completed_at, r.lease_expires_at, r.error_code,
                  r.error_message, r.created_at, r.updated_at, r.updated_by;
    ELSIF judged.id IS NOT NULL THEN
        IF judged.outcome = 'stale_attempt' AND p_kind IN ('complete', 'fail') THEN
            -- 3. A late report: the attempt's entry, its times (the report's own completed_at,
            --    else the later of the clock and the start known; its own started_at, else the
            --    entry's, else its completed_at), and the entry written when it is missing or
            --    superseded and the times are in order. A terminal entry never changes (the
            --    upsert's WHERE decides on the entry's newest version).
            SELECT h.status, h.started_at, h.output, h.external_output_url, h.error_code,
                   h.error_message
            INTO v_entry
            FROM %4$s h
            WHERE h.instance_id = v_id AND h.record_id = judged.id
              AND h.attempt = judged.new_attempt;
            v_completed_at := judge_event_completed_at(
                p_kind, p_completed_at, v_now, COALESCE(p_started_at, v_entry.started_at));
            v_started_at := COALESCE(p_started_at, v_entry.started_at, v_completed_at);
            IF (v_entry.status IS NULL OR v_entry.status IN ('running', 'superseded'))
               AND v_started_at <= v_completed_at THEN
                PERFORM set_config('steprecord.writer', 'judge', true);
                INSERT INTO %4$s AS a (
                    id, instance_id, record_id, attempt, status, started_at, completed_at,
                    output, external_output_url, error_code, error_message, created_at,
                    updated_at, reported_by)
                OVERRIDING SYSTEM VALUE
                VALUES (nextval('workflow_step_attempt_id_seq'), v_id, judged.id,
                        judged.new_attempt, v_status, v_started_at, v_completed_at,
                        p_output::jsonb, p_external_output_url, p_error_code, p_error_message,
                        v_now, v_now, p_reported_by)
                ON CONFLICT (instance_id, record_id, attempt)
                DO UPDATE SET
                    status = EXCLUDED.status,
                    started_at = EXCLUDED.started_at,
                    completed_at = EXCLUDED.completed_at,
                    output = EXCLUDED.output,
                    external_output_url = EXCLUDED.external_output_url,
                    error_code = EXCLUDED.error_code,
                    error_message = EXCLUDED.error_message,
                    updated_at = EXCLUDED.updated_at,
                    reported_by = EXCLUDED.reported_by
                WHERE a.status = 'superseded'
                RETURNING true INTO v_recorded;
                PERFORM set_config('steprecord.writer', coalesce(v_writer, ''), true);
            END IF;
            -- Recorded: written now, or the entry already holds this very report.
            v_recorded := coalesce(v_recorded, false) OR coalesce(judge_same_report(
                v_entry.status, v_entry.output, v_entry.external_output_url,
                v_entry.error_code, v_entry.error_message,
                v_status, p_output::jsonb, p_external_output_url, p_error_code,
                p_error_message), false);
        END IF;
        -- 4. (and 3) Judged without a write of the record: the record as it stands.
        v_outcome := judged.outcome;
        RETURN QUERY SELECT p_i, judged.outcome, v_recorded,
            judged.id, judged.step_slug, judged.ordinal, judged.status, judged.attempt_count,
            judged.output, judged.external_output_url, judged.started_at,
            judged.completed_at, judged.lease_expires_at, judged.error_code,
            judged.error_message, judged.created_at, judged.updated_at, judged.updated_by;
    ELSIF v_locked THEN
        -- 5. A new record, under its instance's lock: the client's ordinal, or the
        --    instance's next one (and the counter after it: past the client's, or one more).
        v_ordinal := COALESCE(p_ordinal, v_next);
        IF v_ordinal > 2147483647 THEN
            RETURN QUERY SELECT p_i, 'ordinal_taken'::text, false,
                NULL::bigint, NULL::text, NULL::int, NULL::text, NULL::int, NULL::text, NULL::text,
                NULL::timestamptz, NULL::timestamptz, NULL::timestamptz, NULL::text, NULL::text,
                NULL::timestamptz, NULL::timestamptz, NULL::text;
        ELSE
            UPDATE %3$s p
            SET next_ordinal = CASE WHEN p_ordinal IS NULL THEN v_next + 1
                                    ELSE GREATEST(v_next, p_ordinal + 1) END
            WHERE p.id = v_id;
            -- A declare creates attempt 1, pending; a start or a terminal event creates its
            -- own attempt (the one it names, else 1). A client ordinal that another step
            -- holds fails uq_workflow_step_record_instance_id_ordinal.
            v_outcome := 'created';
            RETURN QUERY
            INSERT INTO %2$s AS r (
                id, instance_id, step_slug, ordinal, status, attempt_count, output,
                external_output_url, started_at, completed_at, error_code, error_message,
                lease_expires_at, created_at, updated_at, updated_by)
            OVERRIDING SYSTEM VALUE
            VALUES (nextval('workflow_step_record_id_seq'), v_id, p_step_slug, v_ordinal,
                    v_status, judge_event_attempt(p_kind, p_attempt, 1, 'pending'),
                    p_output::jsonb, p_external_output_url,
                    CASE WHEN p_kind <> 'declare' THEN COALESCE(p_started_at, v_now) END,
                    judge_event_completed_at(p_kind, p_completed_at, v_now, p_started_at),
                    p_error_code, p_error_message, judge_lease_expires_at(v_now, p_lease_seconds),
                    v_now, v_now, p_reported_by)
            RETURNING p_i, 'created'::text, false,
                      r.id, r.step_slug, r.ordinal, r.status, r.attempt_count,
                      r.output::text, r.external_output_url, r.started_at,
                      r.completed_at, r.lease_expires_at, r.error_code,
                      r.error_message, r.created_at, r.updated_at, r.updated_by;
        END IF;
    END IF;

    -- 6. The labels of an event answered 2xx, merged into its instance's when they change
    --    something (decided on the row's newest version: the UPDATE waits for its lock).
    IF p_labels IS NOT NULL AND v_outcome IN ('created', 'applied', 'replay') THEN
        UPDATE %3$s p SET labels = p.labels || p_labels
        WHERE p.id = v_id AND NOT p.labels @> p_labels;
    END IF;
    PERFORM set_config('steprecord.trace_id', coalesce(v_trace, ''), true);
END
$fn$
$judge$, p_suffix, p_records, p_instances, p_attempts, p_first)
$text$;

-- The judge itself, on the tables: on one node, and on Citus the distributed function that
-- migrate delegates to the instance's worker (app/ops/distribution.py).
DO $do$
BEGIN
    EXECUTE steprecord_apply_event_text(
        '', 'workflow_step_record', 'process_instance', 'workflow_step_attempt', '');
END
$do$;

-- Called by the owner and the roles it granted (owner_rights.sql).
REVOKE ALL ON FUNCTION steprecord_apply_event FROM PUBLIC;

-- ===== app/sql/owner_rights.sql =====
-- Who may write the records: the owner of the schema, and every other role only through the
-- judge's functions.
--
-- The fact tables (process_instance, workflow_step_record), the history
-- (workflow_step_attempt) and the repair log (workflow_step_repair) are written by their
-- owner, the role that migrates. The service may run as another role (`steprecord grant
-- ROLE`, docs/operations.md "Database roles") that holds SELECT on them and no write right
-- at all: it writes only by calling the functions below, which run with their owner's rights
-- (SECURITY DEFINER, with a fixed search_path so that no object of the caller's can stand in
-- for one of the schema's) and judge every write themselves:
--   steprecord_apply_event, steprecord_apply_events, steprecord_heartbeat (the judge),
--   steprecord_reopen (an operator's repair), steprecord_sweep_instance (the sweeper),
--   steprecord_delete_instance and steprecord_prune_* (deletion), steprecord_patch_labels
--   (an instance's labels), steprecord_shard_judge (on Citus, the judge's copy for a
--   shard, shard_judge.sql).
-- Each file revokes its functions from PUBLIC: only the owner, and the roles it granted
-- EXECUTE, call them.
--
-- The guards (record_guard.sql, attempt_history.sql, repair_log.sql) let the judge or a
-- repair write what no one else may (a late report's history entry, a reopen, a repair log
-- entry) when the transaction says so in `steprecord.writer`, a setting any session can
-- change. They trust it only from a role that holds the schema owner's rights (the owner, a
-- member of it, a superuser): the definer functions above, and the owner's own hand-written
-- repairs (audited as any other). A role granted write rights on a table later still cannot
-- pass for the judge.

-- Whether the current role (inside a definer function: the function's owner) holds the
-- rights of the schema's owner: the role that migrated it, which owns its functions, this one
-- among them, and its tables (on Citus their shards too). Asked of this function's owner, not
-- of a trigger's table: Citus hides a worker's shards from pg_class in a client's session, so
-- a guard running on a shard would not find its own table there.
CREATE OR REPLACE FUNCTION steprecord_by_owner() RETURNS boolean
LANGUAGE sql STABLE
AS $fn$
    SELECT coalesce((SELECT pg_has_role(current_user, p.proowner, 'USAGE')
                     FROM pg_catalog.pg_proc p
                     WHERE p.oid = 'public.steprecord_by_owner()'::pg_catalog.regprocedure),
                    false)
$fn$;

-- ===== app/sql/shard_judge.sql =====
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
