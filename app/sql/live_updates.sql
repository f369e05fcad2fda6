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

-- One notification per record written, with the instance's id as payload. PostgreSQL
-- delivers it only when the transaction commits (never for a rollback) and drops duplicates
-- within a transaction, so listeners hear each committed write once per instance; a replay
-- or a refused event writes nothing and so notifies nothing. On Citus the trigger runs on
-- the worker's shard, and the notification comes from that worker (the service listens on
-- every worker; see app/live.py).
CREATE OR REPLACE FUNCTION workflow_step_record_notify() RETURNS trigger
LANGUAGE plpgsql AS $fn$
BEGIN
    PERFORM pg_notify('steprecord_changes', NEW.instance_id::text);
    RETURN NULL;
END
$fn$;

CREATE OR REPLACE TRIGGER tr_workflow_step_record_notify_insert
AFTER INSERT ON workflow_step_record
FOR EACH ROW EXECUTE FUNCTION workflow_step_record_notify();

CREATE OR REPLACE TRIGGER tr_workflow_step_record_notify_update
AFTER UPDATE ON workflow_step_record
FOR EACH ROW EXECUTE FUNCTION workflow_step_record_notify();

-- A stream's read (app/data/stream.py): the records of an instance after a position
-- `(changed_xid, id)`, in that order, but only those written by transactions below the
-- horizon, before which every transaction that could write this database has ended, so no
-- record can still appear there later. On the primary the horizon is the oldest transaction
-- still running at this call's snapshot, skipping those that the activity view shows working
-- in another database (a cluster's other databases never write here; one that already ended
-- by the time the view is read counts as ours, to be safe), or the snapshot's xmax when none
-- is left. The activity view is read only when some transaction is running, and then once.
-- On a standby the snapshot lists no running transaction (in recovery PostgreSQL keeps the
-- primary's transactions among the snapshot's subtransactions) and the activity view knows
-- none of them, but the snapshot's xmin is the oldest of them still running as far as replay
-- got: the horizon there, other databases' transactions included.
--
-- `behind` says whether a visible record beyond the position, at or above the horizon, waits
-- for an older transaction still in flight. An unknown instance still yields one row (without
-- an instance id), which says whether a standby answered. `since` is the position the read
-- started from: the caller's, or (0, 0) when the caller's is beyond anything this server has
-- assigned (above its next transaction id: a position from another server, e.g. before the
-- instance's shard moved to another Citus worker), so the stream sends the whole instance
-- again rather than wait for this server's ids to get there. A standby may lag behind a
-- position the primary gave: it never resets.
--
-- At most p_limit records, and no more once the records answered hold p_max_bytes of long
-- values (output as text, error message, output URL) or more: `cut` is true on the last row
-- when the read stopped there for its bytes, and the stream reads on from that record. The
-- rows are read one by one and counted as they come, so a stream's first read of an instance
-- of large outputs stops reading at the bound.
--
-- PL/pgSQL, with the instance's id first: on Citus it is a distributed function by that
-- argument, so the whole call runs on the worker that holds the instance, and the snapshot,
-- the transaction ids and the activity view are that worker's, the ones the records'
-- `changed_xid` stamps come from.
CREATE OR REPLACE FUNCTION steprecord_stream_changes(
    p_instance_id bigint, p_instance_key text, p_after_xid xid8, p_after_id bigint,
    p_limit integer, p_max_bytes bigint
)
RETURNS TABLE (
    standby boolean, instance_id bigint, horizon xid8, since_xid xid8, since_id bigint,
    behind boolean, changed_xid xid8,
    id bigint, step_slug text, ordinal integer, status text, attempt_count integer,
    output text, external_output_url text, started_at timestamptz, completed_at timestamptz,
    lease_expires_at timestamptz, error_code text, error_message text,
    created_at timestamptz, updated_at timestamptz, updated_by text, cut boolean
)
LANGUAGE plpgsql STABLE
SET plan_cache_mode = force_custom_plan
AS $fn$
#variable_conflict use_column
DECLARE
    v_snapshot pg_snapshot := pg_current_snapshot();
    v_standby boolean := pg_is_in_recovery();
    v_horizon xid8;
    v_after_xid xid8 := p_after_xid;
    v_after_id bigint := p_after_id;
    v_bytes bigint := 0;
BEGIN
    IF v_standby THEN
        v_horizon := pg_snapshot_xmin(v_snapshot);
    ELSE
        v_horizon := least(pg_snapshot_xmax(v_snapshot), (
            SELECT x FROM pg_snapshot_xip(v_snapshot) AS x
            WHERE x::xid NOT IN (
                SELECT a.backend_xid FROM pg_stat_activity a
                WHERE a.backend_xid IS NOT NULL AND a.datname <> current_database())
            ORDER BY x LIMIT 1));
        IF v_after_xid > pg_snapshot_xmax(v_snapshot) THEN
            v_after_xid := '0'::xid8;
            v_after_id := 0;
        END IF;
    END IF;
    cut := false;
    FOR standby, instance_id, horizon, since_xid, since_id, behind, changed_xid, id, step_slug,
        ordinal, status, attempt_count, output, external_output_url, started_at, completed_at,
        lease_expires_at, error_code, error_message, created_at, updated_at, updated_by IN
    SELECT v_standby, p.id, v_horizon, v_after_xid, v_after_id,
           EXISTS (SELECT FROM workflow_step_record l
                   WHERE l.instance_id = p_instance_id AND l.changed_xid >= v_horizon
                     AND (l.changed_xid, l.id) > (v_after_xid, v_after_id)),
           s.changed_xid,
           s.id, s.step_slug, s.ordinal, s.status, s.attempt_count, s.output,
           s.external_output_url, s.started_at, s.completed_at, s.lease_expires_at,
           s.error_code, s.error_message, s.created_at, s.updated_at, s.updated_by
    FROM (SELECT) one
    LEFT JOIN process_instance p
        ON p.id = p_instance_id AND p.instance_key = p_instance_key
    LEFT JOIN LATERAL (
        SELECT r.changed_xid, r.id, r.step_slug, r.ordinal, r.status, r.attempt_count,
               r.output::text AS output, r.external_output_url, r.started_at,
               r.completed_at, r.lease_expires_at, r.error_code, r.error_message,
               r.created_at, r.updated_at, r.updated_by
        FROM workflow_step_record r
        WHERE r.instance_id = p_instance_id AND p.id IS NOT NULL
          AND (r.changed_xid, r.id) > (v_after_xid, v_after_id)
          AND r.changed_xid < v_horizon
        ORDER BY r.changed_xid, r.id
        LIMIT p_limit
    ) s ON true
    LOOP
        v_bytes := v_bytes + coalesce(octet_length(output), 0)
            + coalesce(octet_length(error_message), 0)
            + coalesce(octet_length(external_output_url), 0);
        cut := v_bytes >= p_max_bytes;
        RETURN NEXT;
        EXIT WHEN cut;
    END LOOP;
END
$fn$;
