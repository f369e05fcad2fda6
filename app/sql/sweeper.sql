-- The sweeper's write (app/ops/sweeper.py, app/data/leases.py): fail each running attempt of one
-- instance whose lease expired, as a `fail` event of that attempt would (error
-- `lease_expired`, completed_at = the expiry), in one statement; the number of records it
-- failed. A definer function (owner_rights.sql): the service's role writes no record itself.
--
-- One instance's rows live together (on Citus, on one worker: p_instance_id is the
-- distribution argument, so the coordinator sends the whole call there), so the statement
-- writes one node: a transaction that wrote two Citus workers would commit in two phases,
-- which PostgreSQL refuses to a transaction that notified, as every write of a record does.
-- SKIP LOCKED lets several sweepers (workers, service instances) run at once without ever
-- writing the same record twice, and FOR UPDATE re-checks the lease on the newest row
-- version, so a heartbeat that committed first keeps its attempt alive. The clock is the
-- statement's `now()`. The writer is `sweeper` (the record's updated_by, and the failed
-- attempt's reported_by).
CREATE OR REPLACE FUNCTION steprecord_sweep_instance(p_instance_id bigint) RETURNS integer
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, public, pg_temp
AS $fn$
DECLARE
    v_swept integer;
BEGIN
    WITH due AS (
        SELECT r.id FROM workflow_step_record r
        WHERE r.instance_id = p_instance_id AND r.status = 'running'
          AND r.lease_expires_at IS NOT NULL AND r.lease_expires_at < now()
        FOR UPDATE SKIP LOCKED
    ),
    swept AS (
        UPDATE workflow_step_record r SET
            status = 'failed',
            completed_at = GREATEST(r.lease_expires_at, r.started_at),
            error_code = 'lease_expired',
            error_message = 'no heartbeat, complete or fail arrived before the lease expired',
            lease_expires_at = NULL,
            updated_at = now(),
            updated_by = 'sweeper'
        FROM due
        WHERE r.instance_id = p_instance_id AND r.id = due.id
        RETURNING r.id
    )
    SELECT count(*) INTO v_swept FROM swept;
    RETURN v_swept;
END
$fn$;

-- Called by the owner and the roles it granted (owner_rights.sql).
REVOKE ALL ON FUNCTION steprecord_sweep_instance FROM PUBLIC;
