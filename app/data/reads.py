"""The API's reads: one record, a page of an instance's records, an instance, the instances,
a step's attempts, and records across instances."""

from collections.abc import Sequence
from datetime import datetime
from itertools import repeat
from typing import Any, Literal

import psycopg
from psycopg.rows import tuple_row

from app.data.common import RECORD, with_key
from app.db import AsyncConn
from app.domain import InstanceNotFound, Order, Page, StepNotFound
from app.serialize import MAX_PAGE_BYTES, RECORD_KEYS

# The instance of a key, by its id (derived from the key): on Citus the id names the shard, so
# a read of one instance goes to that shard alone (a filter on the key alone would ask every
# shard). The key too, for the one instance whose id and key both match.
THE_INSTANCE = (
    "p.id = steprecord_instance_id(%(instance_key)s) AND p.instance_key = %(instance_key)s"
)

GET_STEP = f"""
SELECT p.id AS instance_id, {RECORD.format(r="r")}
FROM process_instance p
LEFT JOIN workflow_step_record r ON r.instance_id = p.id AND r.step_slug = %(step_slug)s
WHERE {THE_INSTANCE}
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
    " $5::bigint, $6::text[], $7::integer, $8::bigint)"
)
# The function answers the record's columns in the API's order (a test checks them), then
# `cut`: whether the page stopped at that row for its bytes.
PAGE_COLUMNS = RECORD_KEYS
# A page stops once its records hold this many bytes of long values (outputs as text, error
# messages, URLs), counted in the database as it reads them: the service never holds more of
# them than about this much for one page, however many rows `limit` names. The rendered
# answer is bounded apart (`MAX_PAGE_BYTES`: JSON escapes may make it longer).
PAGE_READ_BYTES = MAX_PAGE_BYTES


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
    params += [list(statuses) if statuses else None, limit + 1, PAGE_READ_BYTES]
    async with psycopg.AsyncRawCursor(conn, row_factory=tuple_row) as cur:
        await cur.execute(LIST_PAGE, params, binary=True)
        rows = await cur.fetchall()
    if not rows:
        raise InstanceNotFound(instance_key)
    if rows[0][0] is None:  # the instance has no such record
        return Page([], None)
    # map() over zip: a third cheaper than a comprehension calling zip(..., strict=False);
    # zip leaves out `cut`, the column after the record's.
    items = list(map(dict, map(zip, repeat(PAGE_COLUMNS), rows[:limit])))
    last = items[-1] if len(rows) > limit or rows[-1][-1] else None
    return Page(items, last)


GET_INSTANCE = f"""
SELECT p.id, p.instance_key, p.created_at,
       count(r.id) FILTER (WHERE r.status = 'pending') AS pending,
       count(r.id) FILTER (WHERE r.status = 'running') AS running,
       count(r.id) FILTER (WHERE r.status = 'completed') AS completed,
       count(r.id) FILTER (WHERE r.status = 'failed') AS failed
FROM process_instance p
LEFT JOIN workflow_step_record r ON r.instance_id = p.id
WHERE {THE_INSTANCE}
GROUP BY p.id
"""


async def get_instance(conn: AsyncConn, instance_key: str) -> dict[str, Any]:
    cur = await conn.execute(GET_INSTANCE, {"instance_key": instance_key})
    row = await cur.fetchone()
    if row is None:
        raise InstanceNotFound(instance_key)
    counts = {status: row.pop(status) for status in COUNTED}
    return {**row, "step_counts": counts}


STEP_COUNTS = """
    SELECT count(*) FILTER (WHERE r.status = 'pending') AS pending,
           count(*) FILTER (WHERE r.status = 'running') AS running,
           count(*) FILTER (WHERE r.status = 'completed') AS completed,
           count(*) FILTER (WHERE r.status = 'failed') AS failed
    FROM workflow_step_record r WHERE r.instance_id = p.id
"""
COUNTED = ("pending", "running", "completed", "failed")
Trouble = Literal["failed", "running"]

# Keys starting with a prefix: the range is what the index `ix_process_instance_instance_key_
# prefix` reads (text_pattern_ops: byte order, in which a prefix is a range), in any plan;
# LIKE lets the planner estimate how many keys match from the column's statistics.
IN_PREFIX = (
    "p.instance_key ~>=~ %(prefix_low)s AND p.instance_key ~<~ %(prefix_high)s"
    " AND p.instance_key LIKE %(prefix_like)s"
)


def prefix_params(prefix: str) -> dict[str, str]:
    """The parameters of `IN_PREFIX`. Keys are ASCII, so incrementing the last character of
    the prefix gives the first key past them; `_` is a wildcard of LIKE, hence escaped."""
    like = prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
    high = prefix[:-1] + chr(ord(prefix[-1]) + 1)
    return {"prefix_low": prefix, "prefix_high": high, "prefix_like": like}


def list_instances_query(*, prefix: bool, has: Trouble | None) -> str:
    """Instances newest first with their step counts; a key prefix reads the prefix index, a
    status filter probes the partial index of running and failed records per instance."""
    where = ["(p.created_at, p.id) < (%(before_created_at)s, %(before_id)s)"]
    if prefix:
        where.append(IN_PREFIX)
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


async def list_instances(
    conn: AsyncConn,
    *,
    prefix: str | None = None,
    has: Trouble | None = None,
    before: Sequence[Any] | None,
    limit: int,
) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """Instances newest first, each with its `step_counts`; only those whose key starts with
    `prefix`, and only those with a step in status `has`, when given. `before` is
    `(created_at, id)` of the last one seen."""
    created_at, last_id = before if before else ("infinity", 0)
    params: dict[str, Any] = {
        "before_created_at": created_at,
        "before_id": last_id,
        "limit": limit + 1,
    }
    if prefix:
        params |= prefix_params(prefix)
    cur = await conn.execute(list_instances_query(prefix=bool(prefix), has=has), params)
    rows = await cur.fetchall()
    for row in rows:
        row["step_counts"] = {status: row.pop(status) for status in COUNTED}
    if len(rows) > limit:
        return rows[:limit], rows[limit - 1]
    return rows, None


ATTEMPT = (
    "a.attempt, a.status, a.started_at, a.completed_at, a.output::text AS output,"
    " a.external_output_url, a.error_code, a.error_message, a.lease_expires_at,"
    " a.created_at, a.updated_at, a.trace_id, a.reported_by"
)

LIST_ATTEMPTS = f"""
SELECT r.id AS record_id, a.*
FROM process_instance p
LEFT JOIN workflow_step_record r ON r.instance_id = p.id AND r.step_slug = %(step_slug)s
LEFT JOIN LATERAL (
    SELECT {ATTEMPT} FROM workflow_step_attempt a
    WHERE a.instance_id = steprecord_instance_id(%(instance_key)s) AND a.record_id = r.id
      AND a.attempt > %(after_attempt)s
    ORDER BY a.attempt
    LIMIT %(limit)s
) a ON true
WHERE {THE_INSTANCE}
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
        f"(SELECT p.instance_key, r.instance_id, {RECORD.format(r='r')}"
        " FROM workflow_step_record r JOIN process_instance p ON p.id = r.instance_id"
        f" WHERE {' AND '.join(where)}"
        " ORDER BY r.updated_at DESC, r.id DESC LIMIT %(limit)s)"
    )


def list_recent_query(
    statuses: Sequence[str], *, updated_after: bool, lease_expired: bool, prefix: bool = False
) -> str:
    """Records of the given statuses across instances, newest `updated_at` first.

    One branch per status, each a backward scan of `(status, updated_at, id)` (or of the
    partial index of leased records) merged in order by a Merge Append, so no filter sorts.
    One status is its branch alone, a statement of its own: on Citus its ORDER BY and LIMIT
    then go to every shard in one distributed statement (as a subquery it was a subplan
    whose result the coordinator stored, then read back). Within a key prefix, the prefix's
    instances are read first instead (`_in_prefix_query`).
    """
    if prefix:
        return _in_prefix_query(statuses, updated_after=updated_after, lease_expired=lease_expired)
    branches = [
        _recent_branch(s, updated_after=updated_after, lease_expired=lease_expired)
        for s in statuses
    ]
    if len(branches) == 1:
        return branches[0]
    merged = " UNION ALL ".join(branches)
    return f"SELECT s.* FROM ({merged} ORDER BY updated_at DESC, id DESC LIMIT %(limit)s) s"


def _in_prefix_query(statuses: Sequence[str], *, updated_after: bool, lease_expired: bool) -> str:
    """Records of the given statuses of the instances whose key starts with a prefix, newest
    `updated_at` first: the instances are read from the prefix's range of keys (materialized,
    so the plan never scans every record and filters by key afterwards), then their records
    by `instance_id`, sorted. Its cost grows with the prefix's records, not the table's."""
    where = [
        "r.status IN (" + ", ".join(f"'{s}'" for s in statuses) + ")",
        "(r.updated_at, r.id) < (%(before)s, %(before_id)s)",
    ]
    if updated_after:
        where.append("r.updated_at > %(updated_after)s")
    if lease_expired:
        where += ["r.lease_expires_at IS NOT NULL", "r.lease_expires_at < clock_timestamp()"]
    return f"""
WITH p AS MATERIALIZED (SELECT p.id, p.instance_key FROM process_instance p WHERE {IN_PREFIX})
SELECT p.instance_key, r.instance_id, {RECORD.format(r="r")}
FROM p JOIN workflow_step_record r ON r.instance_id = p.id
WHERE {" AND ".join(where)}
ORDER BY r.updated_at DESC, r.id DESC
LIMIT %(limit)s
"""


async def list_recent(
    conn: AsyncConn,
    *,
    prefix: str | None = None,
    statuses: Sequence[str],
    updated_after: datetime | None,
    lease_expired: bool,
    before: Sequence[Any] | None,
    limit: int,
) -> Page:
    """Records across instances, newest `updated_at` first; `before` is `(updated_at, id)`
    of the last one seen. `lease_expired` keeps running records whose lease has expired;
    `prefix` only the records of instances whose key starts with it."""
    if lease_expired:
        statuses = [s for s in statuses if s == "running"]
    if not statuses:
        return Page([], None)
    query = list_recent_query(
        statuses,
        updated_after=updated_after is not None,
        lease_expired=lease_expired,
        prefix=bool(prefix),
    )
    before_at, before_id = before if before else ("infinity", 0)
    params: dict[str, Any] = {
        "before": before_at,
        "before_id": before_id if before else 0,
        "updated_after": updated_after,
        "limit": limit + 1,
    }
    if prefix:
        params |= prefix_params(prefix)
    cur = await conn.execute(query, params)
    rows = await cur.fetchall()
    for row in rows:
        del row["instance_id"]
    if len(rows) > limit:
        return Page(rows[:limit], rows[limit - 1])
    return Page(rows, None)
