"""The API's reads: one record, a page of an instance's records, an instance, the instances,
a step's attempts, and records across instances."""

import json
from collections.abc import Sequence
from datetime import datetime
from itertools import repeat
from typing import Any, Literal

import psycopg
from psycopg.rows import tuple_row

from ..core.db import AsyncConn
from ..core.domain import InstanceNotFound, Order, Page, StepNotFound
from ..core.serialize import MAX_PAGE_BYTES, RECORD_KEYS
from .common import RECORD, with_key

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


# An instance's step counts and summary, from one pass over its records (`r`, those of
# `p`): first start, last finish, and the most recently failed step (by its completed_at).
STEP_COUNTS = """
    SELECT count(*) FILTER (WHERE r.status = 'pending') AS pending,
           count(*) FILTER (WHERE r.status = 'running') AS running,
           count(*) FILTER (WHERE r.status = 'completed') AS completed,
           count(*) FILTER (WHERE r.status = 'failed') AS failed,
           min(r.started_at) AS first_started_at,
           max(r.completed_at) AS last_finished_at,
           (array_agg(r.step_slug ORDER BY r.completed_at DESC, r.id DESC)
               FILTER (WHERE r.status = 'failed'))[1] AS failing_step
    FROM workflow_step_record r WHERE r.instance_id = p.id
"""
# The summary's status and duration from those: running while a step runs, else failed when
# one failed, else completed when every one completed, else pending; the duration from the
# first start to the last finish, to now while running (milliseconds).
SUMMARY = """
       CASE WHEN c.running > 0 THEN 'running' WHEN c.failed > 0 THEN 'failed'
            WHEN c.pending = 0 AND c.completed > 0 THEN 'completed' ELSE 'pending' END
           AS summary_status,
       round((extract(epoch FROM CASE WHEN c.running > 0 THEN statement_timestamp()
                                      ELSE c.last_finished_at END - c.first_started_at)
              * 1000)::numeric, 3)::float8 AS duration_ms
"""
COUNTED = ("pending", "running", "completed", "failed")
SUMMARY_KEYS = ("first_started_at", "last_finished_at", "duration_ms", "failing_step")

# One instance: its records joined by its id, so that on Citus the statement goes to the one
# shard that holds it (a LATERAL subquery of its records went to every shard).
GET_INSTANCE = f"""
SELECT c.*, {SUMMARY}
FROM (
    SELECT p.id, p.instance_key, p.created_at, p.labels,
           count(r.id) FILTER (WHERE r.status = 'pending') AS pending,
           count(r.id) FILTER (WHERE r.status = 'running') AS running,
           count(r.id) FILTER (WHERE r.status = 'completed') AS completed,
           count(r.id) FILTER (WHERE r.status = 'failed') AS failed,
           min(r.started_at) AS first_started_at,
           max(r.completed_at) AS last_finished_at,
           (array_agg(r.step_slug ORDER BY r.completed_at DESC, r.id DESC)
               FILTER (WHERE r.status = 'failed'))[1] AS failing_step
    FROM process_instance p
    LEFT JOIN workflow_step_record r ON r.instance_id = p.id
    WHERE {THE_INSTANCE}
    GROUP BY p.id
) c
"""


def shaped_instance(row: dict[str, Any]) -> dict[str, Any]:
    """An instance as the API shows it: its step counts and its summary apart."""
    counts = {status: row.pop(status) for status in COUNTED}
    summary = {"status": row.pop("summary_status")}
    summary |= {key: row.pop(key) for key in SUMMARY_KEYS}
    return {**row, "step_counts": counts, "summary": summary}


async def get_instance(conn: AsyncConn, instance_key: str) -> dict[str, Any]:
    cur = await conn.execute(GET_INSTANCE, {"instance_key": instance_key})
    row = await cur.fetchone()
    if row is None:
        raise InstanceNotFound(instance_key)
    return shaped_instance(row)


# In the order the list's status filter names them (app/api/routes/instances.py): typing keeps
# one of two equal Literals, and the OpenAPI document writes the enum in its order.
Trouble = Literal["running", "failed"]

# Keys starting with a prefix: the range is what the index `ix_process_instance_instance_key_
# prefix` reads (text_pattern_ops: byte order, in which a prefix is a range), in any plan;
# LIKE lets the planner estimate how many keys match from the column's statistics.
IN_PREFIX = (
    "p.instance_key ~>=~ %(prefix_low)s AND p.instance_key ~<~ %(prefix_high)s"
    " AND p.instance_key LIKE %(prefix_like)s"
)
# Instances holding every label asked for: the GIN index `ix_process_instance_labels` reads it.
WITH_LABELS = "p.labels @> %(labels)s::jsonb"


def prefix_params(prefix: str) -> dict[str, str]:
    """The parameters of `IN_PREFIX`. Keys are ASCII, so incrementing the last character of
    the prefix gives the first key past them; `_` is a wildcard of LIKE, hence escaped."""
    like = prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
    high = prefix[:-1] + chr(ord(prefix[-1]) + 1)
    return {"prefix_low": prefix, "prefix_high": high, "prefix_like": like}


def labels_params(labels: dict[str, str] | None) -> dict[str, str]:
    """The parameter of `WITH_LABELS`: the labels as a JSON object."""
    return {} if not labels else {"labels": json.dumps(labels)}


def prepared(labels: dict[str, str] | None) -> bool | None:
    """`prepare=` of a statement filtered by `labels`: False, planned with its labels on every
    call, never by a prepared statement's generic plan. The plan for a label that 100
    instances hold (read them from the labels' index, then sort) is not the plan for one that
    a third hold (read the newest first, keep those that match), and a generic plan cannot
    tell them apart: the second plan, given a label that nothing holds, reads every row."""
    return False if labels else None


def list_instances_query(
    *, prefix: bool, has: Trouble | None, labels: bool = False, created_after: bool = False
) -> str:
    """Instances newest first (their step counts and summaries: `PAGE_SUMMARIES`); a key
    prefix reads the prefix index, labels the labels' index, and a status filter probes the
    partial index of running and failed records per instance."""
    where = ["(p.created_at, p.id) < (%(before_created_at)s, %(before_id)s)"]
    if prefix:
        where.append(IN_PREFIX)
    if labels:
        where.append(WITH_LABELS)
    if created_after:
        where.append("p.created_at > %(created_after)s")
    if has is not None:
        where.append(
            "EXISTS (SELECT FROM workflow_step_record f"
            f" WHERE f.instance_id = p.id AND f.status = '{has}')"
        )
    return f"""
SELECT p.id, p.instance_key, p.created_at, p.labels
FROM process_instance p
WHERE {" AND ".join(where)}
ORDER BY p.created_at DESC, p.id DESC
LIMIT %(limit)s
"""


# The step counts and summaries of a page of instances, by their ids: read after the page, so
# that they are computed for its instances alone (joined into the page's statement, they
# were computed for every instance a label matched before the sort kept a page of them).
PAGE_SUMMARIES = f"""
SELECT p.id, c.*, {SUMMARY}
FROM process_instance p
CROSS JOIN LATERAL ({STEP_COUNTS}) c
WHERE p.id = ANY(%(ids)s)
"""


async def list_instances(
    conn: AsyncConn,
    *,
    prefix: str | None = None,
    has: Trouble | None = None,
    labels: dict[str, str] | None = None,
    created_after: datetime | None = None,
    before: Sequence[Any] | None,
    limit: int,
) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """Instances newest first, each with its `step_counts`, `labels` and `summary`; only
    those whose key starts with `prefix`, holding every label of `labels`, created after
    `created_after`, and with a step in status `has` (for `failed`: and none running), when
    given. `before` is `(created_at, id)` of the last one seen."""
    created_at, last_id = before if before else ("infinity", 0)
    params: dict[str, Any] = {
        "before_created_at": created_at,
        "before_id": last_id,
        "created_after": created_after,
        "limit": limit + 1,
    }
    if prefix:
        params |= prefix_params(prefix)
    params |= labels_params(labels)
    query = list_instances_query(
        prefix=bool(prefix), has=has, labels=bool(labels), created_after=bool(created_after)
    )
    cur = await conn.execute(query, params, prepare=prepared(labels))
    rows = await cur.fetchall()
    if rows:
        cur = await conn.execute(PAGE_SUMMARIES, {"ids": [row["id"] for row in rows[:limit]]})
        found = {row.pop("id"): row for row in await cur.fetchall()}
        rows = [shaped_instance({**row, **found[row["id"]]}) for row in rows[:limit]] + rows[limit:]
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


def _recent_branch(
    status: str, *, updated_after: bool, lease_expired: bool, labels: bool = False
) -> str:
    """Records of one status, newest `updated_at` first, read backwards from an index; with
    `labels`, of the instances holding them."""
    where = [f"r.status = '{status}'", "(r.updated_at, r.id) < (%(before)s, %(before_id)s)"]
    if labels:
        where.append(WITH_LABELS)
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
    statuses: Sequence[str],
    *,
    updated_after: bool,
    lease_expired: bool,
    prefix: bool = False,
    labels: bool = False,
) -> str:
    """Records of the given statuses across instances, newest `updated_at` first.

    One branch per status, each a backward scan of `(status, updated_at, id)` (or of the
    partial index of leased records) merged in order by a Merge Append, so no filter sorts.
    One status is its branch alone, a statement of its own: on Citus its ORDER BY and LIMIT
    then go to every shard in one distributed statement (as a subquery it was a subplan
    whose result the coordinator stored, then read back). Within a key prefix, the prefix's
    instances are read first instead (`_in_prefix_query`). With `labels`, only the records
    of instances holding them (the planner reads the labels' index first when few match).
    """
    if prefix:
        return _in_prefix_query(
            statuses, updated_after=updated_after, lease_expired=lease_expired, labels=labels
        )
    branches = [
        _recent_branch(s, updated_after=updated_after, lease_expired=lease_expired, labels=labels)
        for s in statuses
    ]
    if len(branches) == 1:
        return branches[0]
    merged = " UNION ALL ".join(branches)
    return f"SELECT s.* FROM ({merged} ORDER BY updated_at DESC, id DESC LIMIT %(limit)s) s"


def _in_prefix_query(
    statuses: Sequence[str], *, updated_after: bool, lease_expired: bool, labels: bool = False
) -> str:
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
    within = f" AND {WITH_LABELS}" if labels else ""
    return f"""
WITH p AS MATERIALIZED (
    SELECT p.id, p.instance_key FROM process_instance p WHERE {IN_PREFIX}{within}
)
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
    labels: dict[str, str] | None = None,
    statuses: Sequence[str],
    updated_after: datetime | None,
    lease_expired: bool,
    before: Sequence[Any] | None,
    limit: int,
) -> Page:
    """Records across instances, newest `updated_at` first; `before` is `(updated_at, id)`
    of the last one seen. `lease_expired` keeps running records whose lease has expired;
    `prefix` only the records of instances whose key starts with it; `labels` only those of
    instances holding every one of them."""
    if lease_expired:
        statuses = [s for s in statuses if s == "running"]
    if not statuses:
        return Page([], None)
    query = list_recent_query(
        statuses,
        updated_after=updated_after is not None,
        lease_expired=lease_expired,
        prefix=bool(prefix),
        labels=bool(labels),
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
    params |= labels_params(labels)
    cur = await conn.execute(query, params, prepare=prepared(labels))
    rows = await cur.fetchall()
    for row in rows:
        del row["instance_id"]
    if len(rows) > limit:
        return Page(rows[:limit], rows[limit - 1])
    return Page(rows, None)
