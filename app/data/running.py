"""Long-running steps: running records that started long ago, longest-running first.

Read forwards from the partial index of running records by `(started_at, id)` (migration
0017); within a key prefix, the prefix's instances are read first, as for the other lists
across instances.
"""

from collections.abc import Sequence
from typing import Any

from ..core.db import AsyncConn
from ..core.domain import Page
from .common import RECORD
from .reads import IN_PREFIX, WITH_LABELS, labels_params, prefix_params, prepared

# Started more than `older_than` seconds ago by the database's clock, after the keyset position.
_RUNNING = (
    "r.status = 'running'"
    " AND r.started_at < clock_timestamp() - make_interval(secs => %(older_than)s)"
    " AND (r.started_at, r.id) > (%(after_started_at)s, %(after_id)s)"
)


def long_running_query(*, prefix: bool, no_lease: bool, labels: bool = False) -> str:
    """With a key prefix or labels, their instances are read first."""
    where = _RUNNING + (" AND r.lease_expires_at IS NULL" if no_lease else "")
    if prefix or labels:
        within = " AND ".join(
            [*([IN_PREFIX] if prefix else []), *([WITH_LABELS] if labels else [])]
        )
        return f"""
WITH p AS MATERIALIZED (SELECT p.id, p.instance_key FROM process_instance p WHERE {within})
SELECT p.instance_key, {RECORD.format(r="r")}
FROM p JOIN workflow_step_record r ON r.instance_id = p.id
WHERE {where}
ORDER BY r.started_at, r.id
LIMIT %(limit)s
"""
    return f"""
SELECT (SELECT p.instance_key FROM process_instance p WHERE p.id = r.instance_id)
           AS instance_key, {RECORD.format(r="r")}
FROM workflow_step_record r
WHERE {where}
ORDER BY r.started_at, r.id
LIMIT %(limit)s
"""


async def list_long_running(
    conn: AsyncConn,
    *,
    older_than: float,
    prefix: str | None = None,
    labels: dict[str, str] | None = None,
    no_lease: bool = False,
    after: Sequence[Any] | None,
    limit: int,
) -> Page:
    """Running records started more than `older_than` seconds ago, longest-running first;
    `after` is `(started_at, id)` of the last one seen; `no_lease` keeps those without a
    lease (which the sweeper never fails)."""
    after_started_at, after_id = after if after else ("-infinity", 0)
    params: dict[str, Any] = {
        "older_than": older_than,
        "after_started_at": after_started_at,
        "after_id": after_id,
        "limit": limit + 1,
    }
    if prefix:
        params |= prefix_params(prefix)
    params |= labels_params(labels)
    query = long_running_query(prefix=bool(prefix), no_lease=no_lease, labels=bool(labels))
    cur = await conn.execute(query, params, prepare=prepared(labels))
    rows = await cur.fetchall()
    if len(rows) > limit:
        return Page(rows[:limit], rows[limit - 1])
    return Page(rows, None)


COUNT_LONG_RUNNING = """
SELECT count(*) FROM workflow_step_record r
WHERE r.status = 'running' AND r.lease_expires_at IS NULL
  AND r.started_at < clock_timestamp() - make_interval(secs => %(older_than)s)
"""


async def count_long_running(conn: AsyncConn, older_than: float) -> int:
    """How many running records without a lease started more than `older_than` seconds ago."""
    cur = await conn.execute(COUNT_LONG_RUNNING, {"older_than": older_than})
    row = await cur.fetchone()
    assert row is not None
    return int(row["count"])
