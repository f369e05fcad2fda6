"""What a live stream reads: an instance's records changed after a position, and the LISTEN
session that wakes it."""

from dataclasses import dataclass
from typing import Any

import psycopg

from ..core.db import AsyncConn
from ..core.domain import InstanceNotFound, InstanceNotReplayed
from . import placement
from .common import RECORD, with_key
from .replication import replay_position

# The channel the record's triggers notify on commit, with the instance's id as payload.
CHANNEL = "steprecord_changes"
STREAM_PAGE = 500
# A read stops once its records hold this many bytes of long values (outputs as text, error
# messages, URLs), counted in the database: a stream holds about this much of an instance's
# records at a time, however large they are, and reads on from where it stopped.
STREAM_READ_BYTES = 4 * 1024 * 1024

# A stream's read: the records of an instance changed after a position `(changed_xid, id)`,
# up to the horizon (app/sql/live_updates.sql says what that is). Its first argument is the
# instance's id, derived from the key in the statement itself: on Citus the coordinator sends
# the whole call to the worker holding the instance, whose transaction ids the positions are.
# The position after a read is (horizon, 0), so a change is never sent twice and never
# skipped, whichever server each read goes to (a position from the primary may be ahead of a
# lagging standby's horizon: the read then finds nothing new and the position stays). The
# function answers at least one row, with the instance's id when it exists.
STREAM_CHANGES = f"""
SELECT s.standby, s.instance_id, s.horizon::text AS horizon, s.since_xid::text AS since_xid,
       s.since_id, s.behind, s.cut, s.changed_xid::text AS changed_xid, {RECORD.format(r="s")}
FROM steprecord_stream_changes(steprecord_instance_id(%(instance_key)s::text),
    %(instance_key)s::text, %(after_xid)s::text::xid8, %(after_id)s::bigint,
    %(limit)s::integer, %(max_bytes)s::bigint) s
"""
HEAD = ("standby", "instance_id", "horizon", "since_xid", "since_id", "behind", "cut")

Position = tuple[int, int]  # (changed_xid, id) of the last change sent


@dataclass(frozen=True, slots=True)
class Changes:
    instance_id: int
    records: list[dict[str, Any]]  # each with its `changed_xid` (an int)
    position: Position  # where the next read starts
    since: Position  # where it read from: the position asked for, or (0, 0) (another node's)
    more: bool  # a full page (of records, or of bytes): read on at once
    behind: bool  # a change waits (for an older transaction, or for replay): read again shortly
    caught_up: bool  # the read saw every commit up to `target` (always, on the primary)


async def stream_changes(
    conn: AsyncConn,
    instance_key: str,
    after: Position,
    limit: int = STREAM_PAGE,
    *,
    target: int = 0,
    max_bytes: int = STREAM_READ_BYTES,
) -> Changes:
    """The instance's records changed after `after`, up to the horizon (see above): at most
    `limit` of them, stopping once they hold `max_bytes` of long values.

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
        "max_bytes": max_bytes,
    }
    cur = await conn.execute(STREAM_CHANGES, params)
    rows = await cur.fetchall()
    first, cut = rows[0], rows[-1]["cut"]
    standby, instance_id, horizon = first["standby"], first["instance_id"], first["horizon"]
    behind, since = first["behind"], (int(first["since_xid"]), first["since_id"])
    if instance_id is None:
        raise (InstanceNotReplayed if standby else InstanceNotFound)(instance_key)
    lagging = replayed is not None and replayed < target
    records = []
    for row in rows:
        if row["id"] is None:
            continue
        for key in HEAD:
            del row[key]
        row["changed_xid"] = int(row["changed_xid"])
        records.append(with_key(row, instance_key))
    if len(records) == limit or cut:
        last = records[-1]
        position = (last["changed_xid"], last["id"])
        return Changes(instance_id, records, position, since, True, True, not lagging)
    position = max(since, (int(horizon), 0))
    return Changes(instance_id, records, position, since, False, behind or lagging, not lagging)


# A Citus cluster's workers but the node asked (a server without Citus has no node list):
# the coordinator's, or a worker's others when the service is pointed at a worker.
WORKERS = """
SELECT nodename, nodeport FROM pg_dist_node
WHERE noderole = 'primary' AND groupid <> 0 AND isactive
  AND groupid <> (SELECT groupid FROM pg_dist_local_group)
ORDER BY nodeid
"""


async def citus_workers(conn: psycopg.AsyncConnection[Any]) -> list[tuple[str, int]]:
    """The other workers whose shards notify, on a Citus node; none on a server without it."""
    row = await (await conn.execute(placement.HAS_CITUS)).fetchone()
    if not (row and row[0]):
        return []
    return [(str(host), int(port)) for host, port in await (await conn.execute(WORKERS)).fetchall()]


async def listen(conn: psycopg.AsyncConnection[Any]) -> None:
    await conn.execute(f"LISTEN {CHANNEL}")


async def ping(conn: psycopg.AsyncConnection[Any]) -> None:
    await conn.execute("SELECT 1")
