-- The record's transition guard: what no UPDATE of workflow_step_record may do, whoever
-- sends it (the judge, the sweeper, a racing retry, a hand-written repair). The one repair
-- it lets through is the operator's reopen, and only from steprecord_reopen (reopen.sql).
--
-- The named CHECK constraints (migration 0001) hold each row's own truth: the closed status
-- set, the content each status allows, the timing, the sizes. This trigger holds what only
-- a comparison of the old and the new row can: the order of events. It raises
-- check_violation naming tr_workflow_step_record_transition, in the error's constraint field
-- and in its message as a CHECK's does (Citus relays a worker's SQLSTATE and message, not
-- the constraint field), so a refused update reads like a refused CHECK on one node and on a
-- cluster (the service answers 422 constraint_violation with the name).
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
    -- Back to pending at a higher attempt: only an operator's reopen of a finished record
    -- (steprecord_reopen, reopen.sql, which sets steprecord.writer = 'repair' for its
    -- transaction and logs the repair). Every event starts the next attempt running or finished.
    ELSIF NEW.status = 'pending' AND NEW.attempt_count > OLD.attempt_count
          AND NOT (OLD.status IN ('completed', 'failed')
                   AND NEW.attempt_count = OLD.attempt_count + 1
                   AND current_setting('steprecord.writer', true) IS NOT DISTINCT FROM 'repair'
                   AND steprecord_by_owner())
          THEN
        why := 'only steprecord_reopen takes a record back to pending, from finished, at'
               ' the next attempt';
    -- A finished attempt is a fact: within the same attempt its status, times, output,
    -- error, and who wrote it (updated_by) never change. Only a higher attempt reopens the
    -- record. (The judge never writes a finished record within its attempt: a replay writes
    -- nothing, a late report writes the history alone.)
    ELSIF OLD.status IN ('completed', 'failed') AND NEW.attempt_count = OLD.attempt_count
          AND (NEW.status, NEW.started_at, NEW.completed_at, NEW.output,
               NEW.external_output_url, NEW.error_code, NEW.error_message, NEW.updated_by)
              IS DISTINCT FROM
              (OLD.status, OLD.started_at, OLD.completed_at, OLD.output,
               OLD.external_output_url, OLD.error_code, OLD.error_message,
               OLD.updated_by) THEN
        why := 'a finished attempt never changes; only a higher attempt reopens it';
    END IF;
    IF why IS NOT NULL THEN
        RAISE EXCEPTION 'workflow_step_record % violates constraint "%": %',
                        OLD.id, 'tr_workflow_step_record_transition', why
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
