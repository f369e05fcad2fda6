"""The dashboard's own reads: an instance's steps with every attempt, for the timeline, and
the failed records of one step name, for Failing now (its other lists are the API's)."""

from typing import Any

from ..core.db import AsyncConn
from .common import RECORD
from .reads import IN_PREFIX, WITH_LABELS, labels_params, prefix_params, prepared
from .stats import NAME_OF

# How a Python traceback starts.
TRACEBACK = "Traceback (most recent call last):"

# An error message's line that says why (the step page shows it whole), cut to 300
# characters: for a Python traceback its last line that is not blank, the exception (its
# first line is only "Traceback (most recent call last):"), else its first line. Read from the
# end by `reverse`, in linear time, so it costs little even for a message of 64 KiB.
ERROR_LINE = f"""left(CASE WHEN strpos({{m}}, '{TRACEBACK}') > 0
    THEN btrim(reverse(split_part(reverse(rtrim({{m}}, E' \\t\\r\\n')), E'\\n', 1)))
    ELSE split_part({{m}}, E'\\n', 1) END, 300) AS error_line"""

# Everything the instance page shows of its steps, without outputs and with only the first
# line of an error message (the step page shows both whole): one statement for the records,
# one for every attempt of the instance.
INSTANCE_STEPS = f"""
SELECT r.id, r.step_slug, r.ordinal, r.status, r.attempt_count, r.started_at, r.completed_at,
       r.error_code, {ERROR_LINE.format(m="r.error_message")}, r.lease_expires_at, r.updated_at
FROM workflow_step_record r
WHERE r.instance_id = %(instance_id)s
ORDER BY r.ordinal
LIMIT %(limit)s
"""
# The newest attempts of each step, oldest first: at most `LANE_ATTEMPTS`, and fewer when the
# page has many steps, so that it draws at most about `BARS` bars (a step retried without end
# does not make the page read every attempt it ever had, nor 1,000 such steps 50,000 bars).
LANE_ATTEMPTS = 50
BARS = 5000
INSTANCE_ATTEMPTS = f"""
SELECT r.id AS record_id, a.*
FROM workflow_step_record r
CROSS JOIN LATERAL (
    SELECT a.attempt, a.status, a.started_at, a.completed_at, a.error_code,
           {ERROR_LINE.format(m="a.error_message")}
    FROM workflow_step_attempt a
    WHERE a.instance_id = %(instance_id)s AND a.record_id = r.id
    ORDER BY a.attempt DESC
    LIMIT %(lane)s
) a
WHERE r.instance_id = %(instance_id)s AND r.ordinal <= %(last_ordinal)s
ORDER BY r.id, a.attempt
"""


COUNT_STEPS = "SELECT count(*) AS steps FROM workflow_step_record WHERE instance_id = %s"


def lane_attempts(steps: int) -> int:
    """How many of each step's newest attempts a page of `steps` steps draws."""
    return max(1, min(LANE_ATTEMPTS, BARS // max(steps, 1)))


async def instance_steps(
    conn: AsyncConn, instance_id: int, *, limit: int
) -> tuple[list[dict[str, Any]], int, int]:
    """The first `limit` records of an instance in ordinal order, each with `attempts` (its
    newest `lane_attempts(...)`, oldest first); how many records the instance has in all; and
    how many attempts a lane holds at most."""
    cur = await conn.execute(INSTANCE_STEPS, {"instance_id": instance_id, "limit": limit + 1})
    records = await cur.fetchall()
    total = len(records)
    if total > limit:
        cur = await conn.execute(COUNT_STEPS, (instance_id,))
        counted = await cur.fetchone()
        total = max(int(counted["steps"]) if counted else 0, total)
    records = records[:limit]
    lane = lane_attempts(len(records))
    if not records:
        return [], total, lane
    by_id: dict[int, dict[str, Any]] = {}
    for record in records:
        record["attempts"] = []
        by_id[record["id"]] = record
    cur = await conn.execute(
        INSTANCE_ATTEMPTS,
        {"instance_id": instance_id, "last_ordinal": records[-1]["ordinal"], "lane": lane},
    )
    for attempt in await cur.fetchall():
        owner = by_id.get(attempt.pop("record_id"))
        if owner is not None:
            owner["attempts"].append(attempt)
    return records, total, lane


# The step page: an output's first `OUTPUT_HEAD` bytes (the API has it whole), and attempts
# newest first until what they show (outputs so cut, error messages) passes `ATTEMPTS_BUDGET`
# bytes, always the newest; each with `total`, how many attempts the step has in all.
OUTPUT_HEAD = 64 * 1024
ATTEMPTS_BUDGET = 4 * 1024 * 1024
STEP_ATTEMPTS = f"""
SELECT a.attempt, a.status, a.started_at, a.completed_at, a.lease_expires_at, a.error_code,
       a.error_message, a.external_output_url, a.trace_id, a.reported_by,
       left(a.output::text, {OUTPUT_HEAD}) AS output,
       octet_length(a.output::text) AS output_bytes, a.total
FROM (
    SELECT a.*, count(*) OVER () AS total,
           sum(least(coalesce(octet_length(a.output::text), 0), {OUTPUT_HEAD})
               + coalesce(octet_length(a.error_message), 0))
               OVER (ORDER BY a.attempt DESC) AS shown_bytes,
           row_number() OVER (ORDER BY a.attempt DESC) AS newest
    FROM workflow_step_attempt a
    WHERE a.instance_id = steprecord_instance_id(%(instance_key)s) AND a.record_id = %(record_id)s
) a
WHERE a.newest = 1 OR a.shown_bytes <= {ATTEMPTS_BUDGET}
ORDER BY a.attempt DESC
LIMIT %(limit)s
"""


async def step_attempts(
    conn: AsyncConn, instance_key: str, record_id: int, *, limit: int
) -> tuple[list[dict[str, Any]], int]:
    """A step's newest attempts within `ATTEMPTS_BUDGET` (at most `limit`), newest first,
    each output cut to its first `OUTPUT_HEAD` characters with its size in `output_bytes`;
    and how many attempts it has in all."""
    params = {"instance_key": instance_key, "record_id": record_id, "limit": limit}
    cur = await conn.execute(STEP_ATTEMPTS, params)
    attempts = await cur.fetchall()
    total = int(attempts[0].pop("total")) if attempts else 0
    for attempt in attempts[1:]:
        del attempt["total"]
    return attempts, total


def failed_of_step_query(*, prefix: bool, labels: bool = False) -> str:
    """Failed records of one step name (a slug; a Celery task name, whose slugs are the name, a
    colon and a task id; a mapped task's name, whose slugs are the name, a colon and a map
    index), newest `updated_at` first: a backward scan of the failed records by
    `(status, updated_at, id)` that stops at `limit` matches."""
    where = [*([IN_PREFIX] if prefix else []), *([WITH_LABELS] if labels else [])]
    within = (
        f" AND r.instance_id IN (SELECT p.id FROM process_instance p WHERE {' AND '.join(where)})"
        if where
        else ""
    )
    return f"""
SELECT (SELECT p.instance_key FROM process_instance p WHERE p.id = r.instance_id)
           AS instance_key, {RECORD.format(r="r")}
FROM workflow_step_record r
WHERE r.status = 'failed'
  AND (r.step_slug = %(name)s
       OR (r.step_slug LIKE %(grouped_like)s
           AND {NAME_OF.format(s="r.step_slug")} = %(name)s)){within}
ORDER BY r.updated_at DESC, r.id DESC
LIMIT %(limit)s
"""


async def failed_of_step(
    conn: AsyncConn,
    name: str,
    *,
    prefix: str | None,
    limit: int,
    labels: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """The failed records of step `name` as `/v1/stats/steps` names steps (see
    `failed_of_step_query`), only of instances whose key starts with `prefix` when given."""
    escaped = name.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    params: dict[str, Any] = {"name": name, "grouped_like": escaped + ":%", "limit": limit}
    if prefix:
        params |= prefix_params(prefix)
    params |= labels_params(labels)
    query = failed_of_step_query(prefix=bool(prefix), labels=bool(labels))
    cur = await conn.execute(query, params, prepare=prepared(labels))
    return await cur.fetchall()


# For the instances a list page shows (at most a page of them): when each last changed, its
# first start and last end, whether a step runs, and its first failed step by ordinal. One
# statement reading those instances' records by `instance_id`, never the whole table.
INSTANCE_SUMMARIES = """
SELECT r.instance_id,
       max(r.updated_at) AS last_activity,
       min(r.started_at) AS first_start,
       max(r.completed_at) AS last_end,
       bool_or(r.status = 'running') AS running,
       (array_agg(r.step_slug ORDER BY r.ordinal) FILTER (WHERE r.status = 'failed'))[1]
           AS failing_step
FROM workflow_step_record r
WHERE r.instance_id = ANY(%(ids)s)
GROUP BY r.instance_id
"""


async def instance_summaries(conn: AsyncConn, ids: list[int]) -> dict[int, dict[str, Any]]:
    """Per instance id (see `INSTANCE_SUMMARIES`); an instance without records is absent."""
    if not ids:
        return {}
    cur = await conn.execute(INSTANCE_SUMMARIES, {"ids": ids})
    return {row.pop("instance_id"): row for row in await cur.fetchall()}
