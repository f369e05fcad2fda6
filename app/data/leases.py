"""Leases: the sweeper's statements, which fail the running attempts whose lease expired."""

from ..core.db import AsyncConn

# The instances that hold a running attempt whose lease expired (at most `limit` of them).
DUE_INSTANCES = """
SELECT DISTINCT r.instance_id FROM workflow_step_record r
WHERE r.status = 'running' AND r.lease_expires_at IS NOT NULL AND r.lease_expires_at < now()
LIMIT %(limit)s
"""

# The sweep of one instance, its own transaction: `steprecord_sweep_instance` (app/sql/
# sweeper.sql) fails its running attempts whose lease expired; on Citus the call goes to the
# worker that holds the instance.
SWEEP_INSTANCE = "SELECT steprecord_sweep_instance(%(instance_id)s) AS swept"
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
            row = await cur.fetchone()
            this_round += row["swept"] if row is not None else 0
        swept += this_round
        # Fewer instances than a batch: none left; nothing swept: the rest is another
        # sweeper's (locked), which sweeps it.
        if len(due) < SWEEP_BATCH or not this_round:
            return swept
