"""The dashboard's own reads: instances with their step counts, and an instance's steps with
every attempt, for the timeline."""

from collections.abc import Sequence
from typing import Any, Literal

from app.db import AsyncConn

STEP_COUNTS = """
    SELECT count(*) FILTER (WHERE r.status = 'pending') AS pending,
           count(*) FILTER (WHERE r.status = 'running') AS running,
           count(*) FILTER (WHERE r.status = 'completed') AS completed,
           count(*) FILTER (WHERE r.status = 'failed') AS failed
    FROM workflow_step_record r WHERE r.instance_id = p.id
"""
Trouble = Literal["failed", "running"]


def prefix_range(prefix: str) -> tuple[str, str]:
    """The byte-wise range of keys starting with `prefix`: keys are ASCII, so incrementing the
    last character of the prefix gives the first key past them."""
    return prefix, prefix[:-1] + chr(ord(prefix[-1]) + 1)


def prefix_pattern(prefix: str) -> str:
    """A LIKE pattern matching the keys that start with `prefix` (`_` is a wildcard there)."""
    return prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"


def list_instances_query(*, prefix: bool, has: Trouble | None) -> str:
    """Instances newest first with their step counts; a key prefix reads the prefix index, a
    status filter probes the partial index of running and failed records per instance."""
    where = ["(p.created_at, p.id) < (%(before_created_at)s, %(before_id)s)"]
    if prefix:
        # The range is what the index reads (in any plan); LIKE lets the planner estimate
        # how many keys match from the column's statistics.
        where.append(
            "p.instance_key ~>=~ %(prefix_low)s AND p.instance_key ~<~ %(prefix_high)s"
            " AND p.instance_key LIKE %(prefix_like)s"
        )
    if has is not None:
        where.append(
            "EXISTS (SELECT FROM workflow_step_record f"
            f" WHERE f.instance_id = p.id AND f.status = '{has}')"
        )
    return f"""
SELECT p.id, p.instance_key, p.created_at, c.*
FROM process_instance p
CROSS JOIN LATERAL ({STEP_COUNTS}) c
WHERE {" AND ".join(where)}
ORDER BY p.created_at DESC, p.id DESC
LIMIT %(limit)s
"""


async def list_instances_with_counts(
    conn: AsyncConn,
    *,
    prefix: str | None,
    has: Trouble | None,
    before: Sequence[Any] | None,
    limit: int,
) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """Instances newest first with their step counts, optionally only those whose key starts
    with `prefix` and those with a step in status `has`; `before` is `(created_at, id)`."""
    created_at, last_id = before if before else ("infinity", 0)
    params: dict[str, Any] = {
        "before_created_at": created_at,
        "before_id": last_id,
        "limit": limit + 1,
    }
    if prefix:
        params["prefix_low"], params["prefix_high"] = prefix_range(prefix)
        params["prefix_like"] = prefix_pattern(prefix)
    query = list_instances_query(prefix=bool(prefix), has=has)
    cur = await conn.execute(query, params)
    rows = await cur.fetchall()
    if len(rows) > limit:
        return rows[:limit], rows[limit - 1]
    return rows, None


# Everything the instance page shows of its steps, without outputs and messages (the step
# page shows those): one statement for the records, one for every attempt of the instance.
INSTANCE_STEPS = """
SELECT r.id, r.step_slug, r.ordinal, r.status, r.attempt_count, r.started_at, r.completed_at,
       r.error_code, r.lease_expires_at, r.updated_at
FROM workflow_step_record r
WHERE r.instance_id = %(instance_id)s
ORDER BY r.ordinal
LIMIT %(limit)s
"""
INSTANCE_ATTEMPTS = """
SELECT a.record_id, a.attempt, a.status, a.started_at, a.completed_at, a.error_code
FROM workflow_step_record r
JOIN workflow_step_attempt a ON a.record_id = r.id
WHERE r.instance_id = %(instance_id)s AND r.ordinal <= %(last_ordinal)s
ORDER BY a.record_id, a.attempt
"""


async def instance_steps(
    conn: AsyncConn, instance_id: int, *, limit: int
) -> tuple[list[dict[str, Any]], bool]:
    """The first `limit` records of an instance in ordinal order, each with `attempts` (every
    attempt, oldest first); True when the instance has more."""
    cur = await conn.execute(INSTANCE_STEPS, {"instance_id": instance_id, "limit": limit + 1})
    records = await cur.fetchall()
    more = len(records) > limit
    records = records[:limit]
    if not records:
        return [], more
    by_id: dict[int, dict[str, Any]] = {}
    for record in records:
        record["attempts"] = []
        by_id[record["id"]] = record
    cur = await conn.execute(
        INSTANCE_ATTEMPTS,
        {"instance_id": instance_id, "last_ordinal": records[-1]["ordinal"]},
    )
    for attempt in await cur.fetchall():
        owner = by_id.get(attempt.pop("record_id"))
        if owner is not None:
            owner["attempts"].append(attempt)
    return records, more
