-- Revision 0024_repairs, upgrade: the files of app/sql/ that changed since revision
-- 0023, whole.
-- Made by `python -m app.sql freeze 0024_repairs`. Never edit it: the source is app/sql/;
-- change it there and freeze a new revision.

-- ===== app/sql/record_guard.sql =====
-- The record's transition guard: what no UPDATE of workflow_step_record may do, whoever
-- sends it (the judge, the sweeper, a racing retry, a hand-written repair). The one repair
-- it lets through is the operator's reopen, and only from steprecord_reopen (reopen.sql).
--
-- The named CHECK constraints (migration 0001) hold each row's own truth: the closed status
-- set, the content each status allows, the timing, the sizes. This trigger holds what only
-- a comparison of the old and the new row can: the order of events. It raises
-- check_violation naming tr_workflow_step_record_transition, so a refused update reads like
-- a refused CHECK (the service answers 422 constraint_violation with the name).
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
    -- A finished attempt is a fact: within the same attempt its status, times, output and
    -- error never change. Only a higher attempt reopens the record.
    -- Back to pending at a higher attempt: only an operator's reopen of a finished record
    -- (steprecord_reopen, reopen.sql, which sets steprecord.writer = 'repair' for its call
    -- and logs the repair). Every event starts the next attempt running or finished.
    ELSIF NEW.status = 'pending' AND NEW.attempt_count > OLD.attempt_count
          AND NOT (OLD.status IN ('completed', 'failed')
                   AND NEW.attempt_count = OLD.attempt_count + 1
                   AND current_setting('steprecord.writer', true) IS NOT DISTINCT FROM 'repair')
          THEN
        why := 'only steprecord_reopen takes a record back to pending, from finished, at'
               ' the next attempt';
    ELSIF OLD.status IN ('completed', 'failed') AND NEW.attempt_count = OLD.attempt_count
          AND (NEW.status, NEW.started_at, NEW.completed_at, NEW.output,
               NEW.external_output_url, NEW.error_code, NEW.error_message)
              IS DISTINCT FROM
              (OLD.status, OLD.started_at, OLD.completed_at, OLD.output,
               OLD.external_output_url, OLD.error_code, OLD.error_message) THEN
        why := 'a finished attempt never changes; only a higher attempt reopens it';
    END IF;
    IF why IS NOT NULL THEN
        RAISE EXCEPTION 'workflow_step_record %: %', OLD.id, why
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

-- ===== app/sql/reopen.sql =====
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
-- the CLI's writer name).
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
-- steprecord.writer = 'repair' for the call only (restored when it returns): the record's
-- guard (record_guard.sql) lets a finished record go back to pending at the next attempt,
-- and the repair log's guard lets a row in, only then.
CREATE OR REPLACE FUNCTION steprecord_reopen(
    p_instance_id bigint, p_instance_key text, p_step_slug text, p_attempt int,
    p_reason text, p_by text
) RETURNS TABLE (
    outcome text,
    id bigint, step_slug text, ordinal integer, status text, attempt_count integer,
    output text, external_output_url text, started_at timestamptz, completed_at timestamptz,
    lease_expires_at timestamptz, error_code text, error_message text,
    created_at timestamptz, updated_at timestamptz,
    repair_id bigint, repair_at timestamptz
)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
AS $fn$
#variable_conflict use_column
DECLARE
    -- The call's clock reading, a value: Citus runs only IMMUTABLE functions inside a write
    -- of a distributed table, so the statements below never call a clock.
    v_now timestamptz := clock_timestamp();
    v_outcome text;
    -- The record as it stands (a `record`, not workflow_step_record%ROWTYPE: on Citus the
    -- function is made on the workers before the tables are, and a row type would not resolve).
    r record;
    v_repair_id bigint;
BEGIN
    PERFORM set_config('steprecord.writer', 'repair', true);
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
            NULL::bigint, NULL::timestamptz;
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
            r.created_at, r.updated_at, NULL::bigint, NULL::timestamptz;
        RETURN;
    END IF;

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
        updated_at = v_now
    WHERE rec.instance_id = p_instance_id AND rec.id = r.id
    RETURNING rec.* INTO r;

    INSERT INTO workflow_step_repair AS rep (
        instance_id, record_id, step_slug, action, attempt, reason, repaired_by, at)
    VALUES (p_instance_id, r.id, r.step_slug, 'reopen', r.attempt_count - 1, p_reason, p_by,
            v_now)
    RETURNING rep.id INTO v_repair_id;

    RETURN QUERY SELECT 'reopened'::text, r.id, r.step_slug, r.ordinal, r.status,
        r.attempt_count, r.output::text, r.external_output_url, r.started_at,
        r.completed_at, r.lease_expires_at, r.error_code, r.error_message,
        r.created_at, r.updated_at, v_repair_id, v_now;
END
$fn$;

-- ===== app/sql/repair_log.sql =====
-- The repair log's guard (workflow_step_repair, made by migration 0024): an append-only
-- record of every repair, which hand-written SQL can neither forge, change nor delete.
--
--   * INSERT only from steprecord_reopen (reopen.sql), which sets steprecord.writer =
--     'repair' for its call, and only for a record it has just reopened: pending at the
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
               OR NOT EXISTS (SELECT 1 FROM workflow_step_record r
                              WHERE r.instance_id = NEW.instance_id AND r.id = NEW.record_id
                                AND r.status = 'pending'
                                AND r.attempt_count = NEW.attempt + 1)) THEN
        why := 'the repair log is written only by steprecord_reopen';
    END IF;
    IF why IS NOT NULL THEN
        RAISE EXCEPTION 'workflow_step_repair: %', why
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
