-- steprecord_apply_event: the judge of one event (every POST .../declare, /start,
-- /complete, /fail), on the judge's own rules (judge_rules.sql) and, for everything but
-- the most common write, on steprecord_apply_events itself (apply_events.sql).
--
-- Arguments: p_instance_id, the instance's id (steprecord_instance_id(p_instance_key): the
-- service's statement computes it so), then the fields of steprecord_apply_events as
-- scalars, in the same order and with the same names (p_i, p_instance_key, ...
-- p_lease_seconds), then p_trace_id (default NULL): the request's trace id, which the
-- attempt this event starts keeps, then p_reported_by (default NULL): the writer, the name of
-- the token whose request sent the event (`anonymous` without tokens), which the record's
-- updated_by takes when the event writes it (NULL: the caller named none, as a hand-written
-- call may; the service always names one). On Citus p_instance_id is the function's distribution
-- argument: the coordinator sends the whole call to the worker that holds the instance.
-- An id that is not its key's finds no record, and the general statement (4) judges the
-- event by its key alone.
--
-- Answer: the row a one-element call of steprecord_apply_events answers. The general
-- statement holds every step any event may need, and its plan costs more to run than one
-- event on an existing record needs; so:
--   1. find the record, lock it, and judge the event (judge_outcome); the record counts only
--      when its instance is the key's;
--   2. when the record exists and the event writes nothing (a replay or a refusal), answer
--      the record as it stands;
--   3. when the event applies to the record, write it: the update of the general
--      statement's `upd`, each value from the same rule;
--   4. otherwise (no record yet, or a late complete/fail of an older attempt, which the
--      history may take), call the general statement with the event, on the instance's
--      shards (steprecord_apply_events_on_shard: on Citus, on this worker, in this call).
-- The record's row lock taken in 1 is held until the transaction ends, so the judgement of 1
-- still holds when 3 writes, and 4 judges the record 1 judged as 1 did.
--
-- Each statement of 1-3 reads or writes one table by its distribution column named once
-- (`instance_id = p_instance_id`, `id = p_instance_id`), never a join: on Citus such a
-- statement is a "fast path" one, which keeps one generic plan per connection, and on the
-- worker its plan on the local shard is kept too (plan_cache_mode = force_generic_plan, as
-- on one node), instead of being planned again, twice, on every call.
--
-- steprecord.trace_id for the call only, set first by set_config and restored at the end (as
-- in apply_events.sql, which says why not by a `SET` clause): the attempt an update of 3
-- starts keeps this call's trace id.
CREATE OR REPLACE FUNCTION steprecord_apply_event(
    p_instance_id bigint, p_i int, p_instance_key text, p_step_slug text, p_kind text, p_attempt bigint,
    p_started_at timestamptz, p_completed_at timestamptz, p_output text,
    p_external_output_url text, p_error_code text, p_error_message text, p_ordinal bigint,
    p_lease_seconds int, p_trace_id text DEFAULT NULL, p_reported_by text DEFAULT NULL
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
    -- The call's clock reading, a value: Citus runs only IMMUTABLE functions inside a write
    -- of a distributed table, so the statements below never call a clock.
    v_now timestamptz := clock_timestamp();
    judged record;
    v_trace text := current_setting('steprecord.trace_id', true);  -- restored at the end
BEGIN
    PERFORM set_config('steprecord.trace_id', coalesce(p_trace_id, ''), true);

    -- 1. The record, locked, and the event judged against its newest version, with the
    --    attempt and start time an update writes; then its instance's key, when there is a
    --    record (an id that is not its key's finds no record: 4 judges the event by its key).
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
           r.id, r.step_slug, r.ordinal, r.status, r.attempt_count, r.output::text AS output,
           r.external_output_url, r.started_at, r.completed_at, r.error_code, r.error_message,
           r.created_at, r.updated_at, r.updated_by, r.lease_expires_at
    INTO judged
    FROM workflow_step_record r
    WHERE r.instance_id = p_instance_id AND r.step_slug = p_step_slug
    FOR UPDATE;
    IF FOUND THEN
        PERFORM FROM process_instance p
        WHERE p.id = p_instance_id AND p.instance_key = p_instance_key;
    END IF;

    IF NOT FOUND OR (judged.outcome = 'stale_attempt' AND p_kind IN ('complete', 'fail')) THEN
        -- 4. The event as a one-element call of the general statement, on this instance's
        --    shards (apply_events_on_shard.sql: on Citus, here on the worker this call was
        --    sent to; on one node, steprecord_apply_events itself).
        RETURN QUERY SELECT * FROM steprecord_apply_events_on_shard(
            p_instance_id, ARRAY[p_i], ARRAY[p_instance_key], ARRAY[p_step_slug], ARRAY[p_kind],
            ARRAY[p_attempt], ARRAY[p_started_at], ARRAY[p_completed_at], ARRAY[p_output],
            ARRAY[p_external_output_url], ARRAY[p_error_code], ARRAY[p_error_message],
            ARRAY[p_ordinal], ARRAY[p_lease_seconds], p_trace_id, p_reported_by);
    ELSIF judged.outcome = 'applied' THEN
        -- 3. Applied: the event replaces the record's whole state, as `upd` does.
        RETURN QUERY
        UPDATE workflow_step_record r SET
            status = judge_event_status(p_kind),
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
        WHERE r.instance_id = p_instance_id AND r.id = judged.id
        RETURNING p_i, 'applied'::text, false,
                  r.id, r.step_slug, r.ordinal, r.status, r.attempt_count,
                  r.output::text, r.external_output_url, r.started_at,
                  r.completed_at, r.lease_expires_at, r.error_code,
                  r.error_message, r.created_at, r.updated_at, r.updated_by;
    ELSE
        -- 2. Judged without a write: the record as it stands.
        RETURN QUERY SELECT p_i, judged.outcome, false,
            judged.id, judged.step_slug, judged.ordinal, judged.status, judged.attempt_count,
            judged.output, judged.external_output_url, judged.started_at,
            judged.completed_at, judged.lease_expires_at, judged.error_code,
            judged.error_message, judged.created_at, judged.updated_at, judged.updated_by;
    END IF;
    PERFORM set_config('steprecord.trace_id', coalesce(v_trace, ''), true);
END
$fn$;
