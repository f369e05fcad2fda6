"""What a live stream reads: an instance's records changed after a position, and the LISTEN
session that wakes it."""

from dataclasses import dataclass
from typing import Any

import psycopg

from app.data.common import RECORD, with_key
from app.data.replication import replay_position
from app.db import AsyncConn
from app.domain import InstanceNotFound, InstanceNotReplayed

# The channel the record's triggers notify on commit, with the instance's id as payload.
CHANNEL = "steprecord_changes"
STREAM_PAGE = 500

# A stream's read: the records of an instance after a position `(changed_xid, id)`, in that
# order, but only those written by transactions below the horizon, before which every
# transaction that could write this database has ended, so no record can still appear there
# later. On the primary the horizon is the oldest transaction still running at this very
# statement's snapshot, skipping those that the activity view shows working in another
# database (a cluster's other databases never write here; one that already ended by the time
# the view is read counts as ours, to be safe), or the snapshot's xmax when none is left. The
# activity view is read only when some transaction is running, and then once. On a standby
# the snapshot lists no running transaction (in recovery PostgreSQL keeps the primary's
# transactions among the snapshot's subtransactions) and the activity view knows none of
# them, but the snapshot's xmin is the oldest of them still running as far as replay got: the
# horizon there, other databases' transactions included. The position after a read is
# (horizon, 0), so a change is never sent twice and never skipped, whichever server each read
# goes to (a position from the primary may be ahead of a lagging standby's horizon: the read
# then finds nothing new and the position stays). `behind` says whether a visible record
# beyond the position, at or above the horizon, waits for an older transaction still in
# flight; the stream then reads again shortly. An unknown instance still yields one row
# (without an instance id), which says whether a standby answered.
STREAM_CHANGES = f"""
WITH now AS MATERIALIZED (
    SELECT pg_current_snapshot() AS snapshot, pg_is_in_recovery() AS standby
),
elsewhere AS MATERIALIZED (
    SELECT a.backend_xid FROM pg_stat_activity a
    WHERE a.backend_xid IS NOT NULL AND a.datname <> current_database()
),
w AS MATERIALIZED (
    SELECT now.standby, CASE WHEN now.standby THEN pg_snapshot_xmin(now.snapshot)
        ELSE least(pg_snapshot_xmax(now.snapshot), (
            SELECT x FROM pg_snapshot_xip(now.snapshot) AS x
            WHERE x::xid NOT IN (SELECT backend_xid FROM elsewhere)
            ORDER BY x LIMIT 1)) END AS horizon
    FROM now
)
SELECT w.standby, p.id AS instance_id, w.horizon::text AS horizon,
       EXISTS (SELECT FROM workflow_step_record l
               WHERE l.instance_id = p.id AND l.changed_xid >= w.horizon
                 AND (l.changed_xid, l.id) > (%(after_xid)s::text::xid8, %(after_id)s::bigint)
       ) AS behind,
       s.*
FROM w LEFT JOIN process_instance p ON p.instance_key = %(instance_key)s
LEFT JOIN LATERAL (
    SELECT r.changed_xid::text AS changed_xid, {RECORD.format(r="r")}
    FROM workflow_step_record r
    WHERE r.instance_id = p.id
      AND (r.changed_xid, r.id) > (%(after_xid)s::text::xid8, %(after_id)s::bigint)
      AND r.changed_xid < w.horizon
    ORDER BY r.changed_xid, r.id
    LIMIT %(limit)s
) s ON true
"""

Position = tuple[int, int]  # (changed_xid, id) of the last change sent


@dataclass(frozen=True, slots=True)
class Changes:
    instance_id: int
    records: list[dict[str, Any]]  # each with its `changed_xid` (an int)
    position: Position  # where the next read starts
    more: bool  # a full page: read on at once
    behind: bool  # a change waits (for an older transaction, or for replay): read again shortly
    caught_up: bool  # the read saw every commit up to `target` (always, on the primary)


async def stream_changes(
    conn: AsyncConn,
    instance_key: str,
    after: Position,
    limit: int = STREAM_PAGE,
    *,
    target: int = 0,
) -> Changes:
    """The instance's records changed after `after`, up to the horizon (see above).

    `target`: a primary WAL position (`wal_position`) whose commits the read must see. A
    standby that has not replayed that far yet answers `behind`, not `caught_up`. Its replay
    position is read in a statement of its own before the read, whose snapshot then has all it
    had replayed: read in the same statement, it could have moved on after that statement's
    snapshot.
    """
    replayed = await replay_position(conn) if target else None
    params = {
        "instance_key": instance_key,
        "after_xid": str(after[0]),
        "after_id": after[1],
        "limit": limit,
    }
    cur = await conn.execute(STREAM_CHANGES, params)
    rows = await cur.fetchall()
    first = rows[0]
    standby, instance_id, horizon = first["standby"], first["instance_id"], first["horizon"]
    behind = first["behind"]
    if instance_id is None:
        raise (InstanceNotReplayed if standby else InstanceNotFound)(instance_key)
    lagging = replayed is not None and replayed < target
    records = []
    for row in rows:
        if row["id"] is None:
            continue
        for key in ("standby", "instance_id", "horizon", "behind"):
            del row[key]
        row["changed_xid"] = int(row["changed_xid"])
        records.append(with_key(row, instance_key))
    if len(records) == limit:
        last = records[-1]
        position = (last["changed_xid"], last["id"])
        return Changes(instance_id, records, position, True, True, not lagging)
    position = max(after, (int(horizon), 0))
    return Changes(instance_id, records, position, False, behind or lagging, not lagging)


async def listen(conn: psycopg.AsyncConnection[Any]) -> None:
    await conn.execute(f"LISTEN {CHANNEL}")


async def ping(conn: psycopg.AsyncConnection[Any]) -> None:
    await conn.execute("SELECT 1")
