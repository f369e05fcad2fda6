"""Leases: the sweeper's statements, which fail the running attempts whose lease expired."""

from app.db import AsyncConn

# The instances that hold a running attempt whose lease expired (at most `limit` of them).
DUE_INSTANCES = """
SELECT DISTINCT r.instance_id FROM workflow_step_record r
WHERE r.status = 'running' AND r.lease_expires_at IS NOT NULL AND r.lease_expires_at < now()
LIMIT %(limit)s
"""

# The sweep of one instance: fail each of its running attempts whose lease expired, as a
# `fail` event of that attempt would (error `lease_expired`, `completed_at` = the expiry), in
# one statement, its own transaction. One instance's rows live together (on Citus, on one
# worker), so the statement writes one node: a transaction that wrote two Citus workers would
# commit in two phases, which PostgreSQL refuses to a transaction that notified, as every
# write of a record does. SKIP LOCKED lets several sweepers (workers, service instances) run
# at once without ever writing the same record twice, and FOR UPDATE re-checks the lease on
# the newest row version, so a heartbeat that committed first keeps its attempt alive. The
# clock is the statement's `now()`: Citus refuses volatile functions in a distributed write.
# The writer is `sweeper` (the record's updated_by, and the failed attempt's reported_by).
SWEEP_INSTANCE = """
WITH due AS (
    SELECT r.id FROM workflow_step_record r
    WHERE r.instance_id = %(instance_id)s AND r.status = 'running'
      AND r.lease_expires_at IS NOT NULL AND r.lease_expires_at < now()
    FOR UPDATE SKIP LOCKED
)
UPDATE workflow_step_record r SET
    status = 'failed',
    completed_at = GREATEST(r.lease_expires_at, r.started_at),
    error_code = 'lease_expired',
    error_message = 'no heartbeat, complete or fail arrived before the lease expired',
    lease_expires_at = NULL,
    updated_at = now(),
    updated_by = 'sweeper'
FROM due
WHERE r.instance_id = %(instance_id)s AND r.id = due.id
RETURNING r.id
"""
SWEEP_BATCH = 500


async def sweep_expired(conn: AsyncConn) -> int:
    """Fail the running attempts whose lease expired, one instance per transaction (`conn`
    is in autocommit); the number of records swept."""
    swept = 0
    while True:
        cur = await conn.execute(DUE_INSTANCES, {"limit": SWEEP_BATCH})
        due = [row["instance_id"] for row in await cur.fetchall()]
        this_round = 0
        for instance_id in due:
            cur = await conn.execute(SWEEP_INSTANCE, {"instance_id": instance_id})
            this_round += cur.rowcount
        swept += this_round
        # Fewer instances than a batch: none left; nothing swept: the rest is another
        # sweeper's (locked), which sweeps it.
        if len(due) < SWEEP_BATCH or not this_round:
            return swept
