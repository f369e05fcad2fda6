"""Leases: the sweeper's statement, which fails the running attempts whose lease expired."""

from app.db import AsyncConn

# The sweeper: fail every running attempt whose lease expired, as a `fail` event of that attempt
# would (error `lease_expired`, `completed_at` = the expiry), in one statement. SKIP LOCKED
# lets several sweepers (workers, service instances) run at once without ever writing the same
# record twice, and FOR UPDATE re-checks the lease on the newest row version, so a heartbeat
# that committed first keeps its attempt alive.
SWEEP = """
WITH due AS (
    SELECT r.instance_id, r.id FROM workflow_step_record r
    WHERE r.status = 'running' AND r.lease_expires_at IS NOT NULL
      AND r.lease_expires_at < clock_timestamp()
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
UPDATE workflow_step_record r SET
    status = 'failed',
    completed_at = GREATEST(r.lease_expires_at, r.started_at),
    error_code = 'lease_expired',
    error_message = 'no heartbeat, complete or fail arrived before the lease expired',
    lease_expires_at = NULL,
    updated_at = clock_timestamp()
FROM due
WHERE r.instance_id = due.instance_id AND r.id = due.id
RETURNING r.id
"""
SWEEP_BATCH = 500


async def sweep_expired(conn: AsyncConn) -> int:
    """Fail the running attempts whose lease expired; the number of records swept."""
    swept = 0
    while True:
        cur = await conn.execute(SWEEP, {"limit": SWEEP_BATCH})
        swept += cur.rowcount
        if cur.rowcount < SWEEP_BATCH:
            return swept
