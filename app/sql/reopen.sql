-- steprecord_reopen: an operator's repair (POST .../steps/{step_slug}/reopen, `steprecord
-- repair reopen`): a finished record becomes pending at the next attempt, and the repair log
-- (workflow_step_repair, repair_log.sql) keeps who did it and why. One call is one event,
-- judged and written under the record's row lock, as the judge's own functions do.
--
-- Arguments: p_instance_id, the instance's id (steprecord_instance_id(p_instance_key): the
-- service's statement computes it so; on Citus it is the function's distribution argument,
-- and every statement below names it as a value, so the whole call runs on the worker that
-- holds the instance); the instance's key; the step's slug; p_attempt, the attempt the
-- operator saw (NULL: whichever is current); the reason (1-500 characters, held by
-- ck_workflow_step_repair_reason_length); p_by, who asks (the token's name, `anonymous`, or
-- the CLI's writer name): the repair log's repaired_by, and the reopened record's updated_by
-- (its last writer), as every judge's write names its writer.
--
-- Answer: one row, `outcome` and the record as it stands after the call, plus the repair
-- log entry (repair_id, repair_at) when one was written. Outcomes:
--   * instance_not_found, step_not_found: no record (the record's columns are NULL);
--   * stale_attempt: p_attempt is not the record's attempt_count (another operator, or a
--     new attempt, came first): nothing written;
--   * not_finished: the record is pending or running, nothing to reopen;
--   * no_attempt_left: the record is at the last attempt there is (2147483647);
--   * reopened: the record is pending at attempt_count + 1, its times, output, error and
--     lease cleared, and one repair log entry was written.
-- The history is left to the record's triggers (attempt_history.sql): a pending record has
-- no attempt, so attempt N's entry stays as it was, and the next start runs attempt N+1.
--
-- steprecord.writer = 'repair' for the call's two writes only, set by set_config and then
-- restored (not by a `SET` clause of the function: see apply_events.sql): the record's guard
-- (record_guard.sql) lets a finished record go back to pending at the next attempt, and the
-- repair log's guard lets a row in, only then.
CREATE OR REPLACE FUNCTION steprecord_reopen(
    p_instance_id bigint, p_instance_key text, p_step_slug text, p_attempt int,
    p_reason text, p_by text
) RETURNS TABLE (
    outcome text,
    id bigint, step_slug text, ordinal integer, status text, attempt_count integer,
    output text, external_output_url text, started_at timestamptz, completed_at timestamptz,
    lease_expires_at timestamptz, error_code text, error_message text,
    created_at timestamptz, updated_at timestamptz, updated_by text,
    repair_id bigint, repair_at timestamptz
)
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
    v_outcome text;
    -- The record as it stands (a `record`, not workflow_step_record%ROWTYPE: on Citus the
    -- function is made on the workers before the tables are, and a row type would not resolve).
    r record;
    v_repair_id bigint;
    -- The writer before this call, restored after its two writes.
    v_writer text := current_setting('steprecord.writer', true);
BEGIN
    -- The record, locked: a concurrent event or reopen of it waits until this call's
    -- transaction ends, and then judges the record this call left.
    SELECT rec.* INTO r
    FROM process_instance p
    JOIN workflow_step_record rec ON rec.instance_id = p.id AND rec.step_slug = p_step_slug
    WHERE p.id = p_instance_id AND p.instance_key = p_instance_key
    FOR UPDATE OF rec;

    IF NOT FOUND THEN
        IF EXISTS (SELECT 1 FROM process_instance p
                   WHERE p.id = p_instance_id AND p.instance_key = p_instance_key) THEN
            v_outcome := 'step_not_found';
        ELSE
            v_outcome := 'instance_not_found';
        END IF;
        RETURN QUERY SELECT v_outcome, NULL::bigint, NULL::text, NULL::int, NULL::text,
            NULL::int, NULL::text, NULL::text, NULL::timestamptz, NULL::timestamptz,
            NULL::timestamptz, NULL::text, NULL::text, NULL::timestamptz, NULL::timestamptz,
            NULL::text, NULL::bigint, NULL::timestamptz;
        RETURN;
    END IF;

    -- A named attempt first: an operator who saw attempt N finished and asks to reopen it
    -- learns that another one is current, even when that one is pending or running.
    IF p_attempt IS NOT NULL AND p_attempt <> r.attempt_count THEN
        v_outcome := 'stale_attempt';
    ELSIF r.status NOT IN ('completed', 'failed') THEN
        v_outcome := 'not_finished';
    ELSIF r.attempt_count >= 2147483647 THEN
        v_outcome := 'no_attempt_left';
    END IF;
    IF v_outcome IS NOT NULL THEN
        RETURN QUERY SELECT v_outcome, r.id, r.step_slug, r.ordinal, r.status,
            r.attempt_count, r.output::text, r.external_output_url, r.started_at,
            r.completed_at, r.lease_expires_at, r.error_code, r.error_message,
            r.created_at, r.updated_at, r.updated_by, NULL::bigint, NULL::timestamptz;
        RETURN;
    END IF;

    PERFORM set_config('steprecord.writer', 'repair', true);
    UPDATE workflow_step_record rec SET
        status = 'pending',
        attempt_count = r.attempt_count + 1,
        started_at = NULL,
        completed_at = NULL,
        output = NULL,
        external_output_url = NULL,
        error_code = NULL,
        error_message = NULL,
        lease_expires_at = NULL,
        updated_at = v_now,
        updated_by = p_by
    WHERE rec.instance_id = p_instance_id AND rec.id = r.id
    RETURNING rec.* INTO r;

    INSERT INTO workflow_step_repair AS rep (
        instance_id, record_id, step_slug, action, attempt, reason, repaired_by, at)
    VALUES (p_instance_id, r.id, r.step_slug, 'reopen', r.attempt_count - 1, p_reason, p_by,
            v_now)
    RETURNING rep.id INTO v_repair_id;
    PERFORM set_config('steprecord.writer', coalesce(v_writer, ''), true);

    RETURN QUERY SELECT 'reopened'::text, r.id, r.step_slug, r.ordinal, r.status,
        r.attempt_count, r.output::text, r.external_output_url, r.started_at,
        r.completed_at, r.lease_expires_at, r.error_code, r.error_message,
        r.created_at, r.updated_at, r.updated_by, v_repair_id, v_now;
END
$fn$;

-- Called by the owner and the roles it granted (owner_rights.sql).
REVOKE ALL ON FUNCTION steprecord_reopen FROM PUBLIC;
