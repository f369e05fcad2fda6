-- Revision 0021_live_on_citus, downgrade: the same files as of revision 0020.
-- Made by `python -m app.sql freeze 0021_live_on_citus`. Never edit it: the source is app/sql/;
-- change it there and freeze a new revision.

-- Functions this revision created or declared otherwise:
DROP FUNCTION steprecord_stream_changes(p_instance_id bigint, p_instance_key text, p_after_xid xid8, p_after_id bigint, p_limit integer);

-- ===== app/sql/live_updates.sql as of revision 0020 =====
-- Live updates: what the stream (GET /v1/instances/{key}/stream) reads and listens to.
--
-- A change's position is (changed_xid, id) of the record it left: the stream sends every
-- record written by a transaction below its horizon, in that order, and resumes after a
-- reconnect exactly there. There is no change-log table.

-- Every write of a record stamps it with the writing transaction's id, whoever writes (the
-- judge, a batch, a heartbeat, the sweeper, a hand-written UPDATE; a value written by hand
-- is overwritten), so no writer can forget it or forge it.
CREATE OR REPLACE FUNCTION workflow_step_record_set_changed_xid() RETURNS trigger
LANGUAGE plpgsql AS $fn$
BEGIN
    NEW.changed_xid := pg_current_xact_id();
    RETURN NEW;
END
$fn$;

CREATE OR REPLACE TRIGGER tr_workflow_step_record_changed_xid
BEFORE INSERT OR UPDATE ON workflow_step_record
FOR EACH ROW EXECUTE FUNCTION workflow_step_record_set_changed_xid();

-- One notification per instance a statement wrote, with the instance's id as payload.
-- PostgreSQL delivers it only when the transaction commits (never for a rollback) and
-- drops duplicates within a transaction, so listeners hear each committed write once per
-- instance; a replay or a refused event writes nothing and so notifies nothing.
CREATE OR REPLACE FUNCTION workflow_step_record_notify() RETURNS trigger
LANGUAGE plpgsql AS $fn$
BEGIN
    PERFORM pg_notify('steprecord_changes', w.instance_id::text)
    FROM (SELECT DISTINCT instance_id FROM new_rows) w;
    RETURN NULL;
END
$fn$;

CREATE OR REPLACE TRIGGER tr_workflow_step_record_notify_insert
AFTER INSERT ON workflow_step_record
REFERENCING NEW TABLE AS new_rows
FOR EACH STATEMENT EXECUTE FUNCTION workflow_step_record_notify();

CREATE OR REPLACE TRIGGER tr_workflow_step_record_notify_update
AFTER UPDATE ON workflow_step_record
REFERENCING NEW TABLE AS new_rows
FOR EACH STATEMENT EXECUTE FUNCTION workflow_step_record_notify();
