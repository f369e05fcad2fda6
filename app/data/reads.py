"""The API's reads: one record, a page of an instance's records, an instance, the instances,
a step's attempts, and records across instances."""

from collections.abc import Sequence
from datetime import datetime
from itertools import repeat
from typing import Any

import psycopg
from psycopg.rows import tuple_row

from app.data.common import RECORD, with_key
from app.db import AsyncConn
from app.domain import InstanceNotFound, Order, Page, StepNotFound
from app.serialize import RECORD_KEYS

GET_STEP = f"""
SELECT p.id AS instance_id, {RECORD.format(r="r")}
FROM process_instance p
LEFT JOIN workflow_step_record r ON r.instance_id = p.id AND r.step_slug = %(step_slug)s
WHERE p.instance_key = %(instance_key)s
"""


async def get_step(conn: AsyncConn, instance_key: str, step_slug: str) -> dict[str, Any]:
    cur = await conn.execute(GET_STEP, {"instance_key": instance_key, "step_slug": step_slug})
    row = await cur.fetchone()
    if row is None:
        raise InstanceNotFound(instance_key)
    if row["id"] is None:
        raise StepNotFound(step_slug)
    del row["instance_id"]
    return with_key(row, instance_key)


# A page of an instance's records (app/sql/list_page.sql says how it reads):
# planned once per connection, where the statement it runs cost more to plan than to run on
# every call. Its columns are `PAGE_COLUMNS`, the record as the API shows it, in that order.
LIST_PAGE = (
    "SELECT * FROM steprecord_list_page($1::text, $2::text, $3::integer, $4::timestamptz,"
    " $5::bigint, $6::text[], $7::integer)"
)
# The function answers the record's columns in the API's order (a test checks them).
PAGE_COLUMNS = RECORD_KEYS


async def list_steps(
    conn: AsyncConn,
    instance_key: str,
    *,
    order: Order,
    after: Sequence[Any] | None,
    statuses: Sequence[str] | None,
    limit: int,
) -> Page:
    """One page of an instance's records, each with the keys of `PAGE_COLUMNS` in that order;
    `after` is the keyset position of the last one seen.

    For `ordinal` it is `(ordinal,)`; for `started_at` it is `(started_at or None, id)`.
    The rows come in binary and as tuples: a page of 100 is 1,500 values, and this is the
    service's most frequent read.
    """
    after_ordinal, after_started_at, after_id = -1, "-infinity", 0
    if after and order == "ordinal":
        (after_ordinal,) = after
    elif after:
        after_started_at, after_id = after
    params = [instance_key, order, after_ordinal, after_started_at, after_id]
    params += [list(statuses) if statuses else None, limit + 1]
    async with psycopg.AsyncRawCursor(conn, row_factory=tuple_row) as cur:
        await cur.execute(LIST_PAGE, params, binary=True)
        rows = await cur.fetchall()
    if not rows:
        raise InstanceNotFound(instance_key)
    if rows[0][0] is None:  # the instance has no such record
        return Page([], None)
    # map() over zip: a third cheaper than a comprehension calling zip(..., strict=False).
    items = list(map(dict, map(zip, repeat(PAGE_COLUMNS), rows[:limit])))
    last = items[-1] if len(rows) > limit else None
    return Page(items, last)


GET_INSTANCE = """
SELECT p.id, p.instance_key, p.created_at,
       count(r.id) FILTER (WHERE r.status = 'pending') AS pending,
       count(r.id) FILTER (WHERE r.status = 'running') AS running,
       count(r.id) FILTER (WHERE r.status = 'completed') AS completed,
       count(r.id) FILTER (WHERE r.status = 'failed') AS failed
FROM process_instance p
LEFT JOIN workflow_step_record r ON r.instance_id = p.id
WHERE p.instance_key = %(instance_key)s
GROUP BY p.id
"""


async def get_instance(conn: AsyncConn, instance_key: str) -> dict[str, Any]:
    cur = await conn.execute(GET_INSTANCE, {"instance_key": instance_key})
    row = await cur.fetchone()
    if row is None:
        raise InstanceNotFound(instance_key)
    counts = {s: row.pop(s) for s in ("pending", "running", "completed", "failed")}
    return {**row, "step_counts": counts}


LIST_INSTANCES = """
SELECT id, instance_key, created_at FROM process_instance
WHERE (created_at, id) < (%(before_created_at)s, %(before_id)s)
ORDER BY created_at DESC, id DESC
LIMIT %(limit)s
"""


async def list_instances(
    conn: AsyncConn, *, before: Sequence[Any] | None, limit: int
) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """Instances newest first; `before` is `(created_at, id)` of the last one seen."""
    created_at, last_id = before if before else ("infinity", 0)
    cur = await conn.execute(
        LIST_INSTANCES,
        {"before_created_at": created_at, "before_id": last_id, "limit": limit + 1},
    )
    rows = await cur.fetchall()
    if len(rows) > limit:
        return rows[:limit], rows[limit - 1]
    return rows, None


ATTEMPT = (
    "a.attempt, a.status, a.started_at, a.completed_at, a.output::text AS output,"
    " a.external_output_url, a.error_code, a.error_message, a.lease_expires_at,"
    " a.created_at, a.updated_at"
)

LIST_ATTEMPTS = f"""
SELECT r.id AS record_id, a.*
FROM process_instance p
LEFT JOIN workflow_step_record r ON r.instance_id = p.id AND r.step_slug = %(step_slug)s
LEFT JOIN LATERAL (
    SELECT {ATTEMPT} FROM workflow_step_attempt a
    WHERE a.record_id = r.id AND a.attempt > %(after_attempt)s
    ORDER BY a.attempt
    LIMIT %(limit)s
) a ON true
WHERE p.instance_key = %(instance_key)s
"""


async def list_attempts(
    conn: AsyncConn, instance_key: str, step_slug: str, *, after: int | None, limit: int
) -> Page:
    """One page of a step's attempts in attempt order; `after` is the last attempt seen."""
    cur = await conn.execute(
        LIST_ATTEMPTS,
        {
            "instance_key": instance_key,
            "step_slug": step_slug,
            "after_attempt": 0 if after is None else after,
            "limit": limit + 1,
        },
    )
    rows = await cur.fetchall()
    if not rows:
        raise InstanceNotFound(instance_key)
    if rows[0]["record_id"] is None:
        raise StepNotFound(step_slug)
    items = [row for row in rows if row["attempt"] is not None]
    for item in items:
        del item["record_id"]
    if len(items) > limit:
        return Page(items[:limit], items[limit - 1])
    return Page(items, None)


def _recent_branch(status: str, *, updated_after: bool, lease_expired: bool) -> str:
    """Records of one status, newest `updated_at` first, read backwards from an index."""
    where = [f"r.status = '{status}'", "(r.updated_at, r.id) < (%(before)s, %(before_id)s)"]
    if updated_after:
        where.append("r.updated_at > %(updated_after)s")
    if lease_expired:
        where += ["r.lease_expires_at IS NOT NULL", "r.lease_expires_at < clock_timestamp()"]
    return (
        f"(SELECT r.instance_id, {RECORD.format(r='r')} FROM workflow_step_record r"
        f" WHERE {' AND '.join(where)}"
        " ORDER BY r.updated_at DESC, r.id DESC LIMIT %(limit)s)"
    )


def list_recent_query(statuses: Sequence[str], *, updated_after: bool, lease_expired: bool) -> str:
    """Records of the given statuses across instances, newest `updated_at` first.

    One branch per status, each a backward scan of `(status, updated_at, id)` (or of the
    partial index of leased records) merged in order by a Merge Append, so no filter sorts.
    """
    branches = [
        _recent_branch(s, updated_after=updated_after, lease_expired=lease_expired)
        for s in statuses
    ]
    merged = " UNION ALL ".join(branches)
    if len(branches) > 1:
        merged += " ORDER BY updated_at DESC, id DESC LIMIT %(limit)s"
    return f"""
SELECT (SELECT p.instance_key FROM process_instance p WHERE p.id = s.instance_id)
           AS instance_key, s.*
FROM ({merged}) s
"""


async def list_recent(
    conn: AsyncConn,
    *,
    statuses: Sequence[str],
    updated_after: datetime | None,
    lease_expired: bool,
    before: Sequence[Any] | None,
    limit: int,
) -> Page:
    """Records across instances, newest `updated_at` first; `before` is `(updated_at, id)`
    of the last one seen. `lease_expired` keeps running records whose lease has expired."""
    if lease_expired:
        statuses = [s for s in statuses if s == "running"]
    if not statuses:
        return Page([], None)
    query = list_recent_query(
        statuses, updated_after=updated_after is not None, lease_expired=lease_expired
    )
    before_at, before_id = before if before else ("infinity", 0)
    cur = await conn.execute(
        query,
        {
            "before": before_at,
            "before_id": before_id if before else 0,
            "updated_after": updated_after,
            "limit": limit + 1,
        },
    )
    rows = await cur.fetchall()
    for row in rows:
        del row["instance_id"]
    if len(rows) > limit:
        return Page(rows[:limit], rows[limit - 1])
    return Page(rows, None)
