-- Revision 0040_shard_judges, downgrade: the same files as of revision 0039.
-- Made by `python -m app.sql freeze 0040_shard_judges`. Never edit it: the source is app/sql/;
-- change it there and freeze a new revision.

-- Functions this revision created or declared otherwise:
DROP FUNCTION steprecord_apply_event_text(p_suffix text, p_records text, p_instances text, p_attempts text, p_first text);
DROP FUNCTION steprecord_shard_judge(p_shard bigint);
DROP FUNCTION steprecord_drop_shard_judges();

-- ===== app/sql/apply_event.sql as of revision 0039 =====
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
CREATE OR REPLACE FUNCTION steprecord_apply_event(
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
    PERFORM set_config('steprecord.trace_id', coalesce(p_trace_id, ''), true);
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
        FROM workflow_step_record r
        WHERE r.instance_id = v_id AND r.step_slug = p_step_slug
        FOR UPDATE;
        EXIT WHEN FOUND OR v_locked;

        -- 5. No record. The instance that holds the id, as it stands.
        SELECT p.instance_key INTO v_key FROM process_instance p WHERE p.id = v_id;
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
            INSERT INTO process_instance (id, instance_key, next_ordinal, labels)
            VALUES (v_id, p_instance_key, 0, coalesce(p_labels, '{}'))
            ON CONFLICT DO NOTHING;
        END IF;
        SELECT p.instance_key, p.next_ordinal INTO v_key, v_next
        FROM process_instance p WHERE p.id = v_id
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
        PERFORM FROM process_instance p WHERE p.id = v_id AND p.instance_key = p_instance_key;
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
        UPDATE workflow_step_record r SET
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
            FROM workflow_step_attempt h
            WHERE h.instance_id = v_id AND h.record_id = judged.id
              AND h.attempt = judged.new_attempt;
            v_completed_at := judge_event_completed_at(
                p_kind, p_completed_at, v_now, COALESCE(p_started_at, v_entry.started_at));
            v_started_at := COALESCE(p_started_at, v_entry.started_at, v_completed_at);
            IF (v_entry.status IS NULL OR v_entry.status IN ('running', 'superseded'))
               AND v_started_at <= v_completed_at THEN
                PERFORM set_config('steprecord.writer', 'judge', true);
                INSERT INTO workflow_step_attempt AS a (
                    id, instance_id, record_id, attempt, status, started_at, completed_at,
                    output, external_output_url, error_code, error_message, created_at,
                    updated_at, reported_by)
                OVERRIDING SYSTEM VALUE
                VALUES (nextval('workflow_step_attempt_id_seq'), v_id, judged.id,
                        judged.new_attempt, v_status, v_started_at, v_completed_at,
                        p_output::jsonb, p_external_output_url, p_error_code, p_error_message,
                        v_now, v_now, p_reported_by)
                ON CONFLICT ON CONSTRAINT uq_workflow_step_attempt_instance_id_record_id_attempt
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
            UPDATE process_instance p
            SET next_ordinal = CASE WHEN p_ordinal IS NULL THEN v_next + 1
                                    ELSE GREATEST(v_next, p_ordinal + 1) END
            WHERE p.id = v_id;
            -- A declare creates attempt 1, pending; a start or a terminal event creates its
            -- own attempt (the one it names, else 1). A client ordinal that another step
            -- holds fails uq_workflow_step_record_instance_id_ordinal.
            v_outcome := 'created';
            RETURN QUERY
            INSERT INTO workflow_step_record AS r (
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
        UPDATE process_instance p SET labels = p.labels || p_labels
        WHERE p.id = v_id AND NOT p.labels @> p_labels;
    END IF;
    PERFORM set_config('steprecord.trace_id', coalesce(v_trace, ''), true);
END
$fn$;

-- Called by the owner and the roles it granted (owner_rights.sql).
REVOKE ALL ON FUNCTION steprecord_apply_event FROM PUBLIC;


-- ===== app/sql/owner_rights.sql as of revision 0039 =====
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
--   (an instance's labels).
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
