-- The repair log's guard (workflow_step_repair, made by migration 0024): an append-only
-- record of every repair, which hand-written SQL can neither forge, change nor delete.
--
--   * INSERT only from steprecord_reopen (reopen.sql), which sets steprecord.writer =
--     'repair' for its transaction, and only for a record it has just reopened: pending at the
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
               OR NOT steprecord_by_owner()
               OR NOT EXISTS (SELECT 1 FROM workflow_step_record r
                              WHERE r.instance_id = NEW.instance_id AND r.id = NEW.record_id
                                AND r.status = 'pending'
                                AND r.attempt_count = NEW.attempt + 1)) THEN
        why := 'the repair log is written only by steprecord_reopen';
    END IF;
    IF why IS NOT NULL THEN
        -- The guard's name in the message too, as a CHECK's: Citus relays a worker's
        -- SQLSTATE and message, not the constraint field.
        RAISE EXCEPTION 'workflow_step_repair violates constraint "%": %',
                        'tr_workflow_step_repair_guard', why
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
