"""Step statistics: per step name, the attempts that started in a window, by outcome, with
the failure rate and the durations of the finished ones.

The window is one range of `ix_workflow_step_attempt_started_at` (migration 0017), which
holds everything the statistics need of an attempt but its record's slug, read from the
record's primary key: the cost grows with the attempts in the window, not with the table.
"""

from datetime import datetime
from typing import Any

from ..core.db import AsyncConn
from .reads import IN_PREFIX, WITH_LABELS, labels_params, prefix_params, prepared

# A slug names one run of a step in two shapes, whose statistics are the step name's:
# - a Celery task's slug (steprecord_client.celery), "<task name>:<task id, a UUID>";
# - a mapped task's slug (steprecord_client.airflow), "<task id>:<map index, digits>".
CELERY_TASK_ID = ":[0-9A-Fa-f]{8}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{12}$"
GROUPED_TAIL = (
    ":([0-9A-Fa-f]{8}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{12}|[0-9]+)$"
)
FINISHED = "a.status IN ('completed', 'failed')"


# The step name of a slug `{s}`, without a regular expression (one costs ~10 µs a slug, most
# of the statement's time over a large window): a slug ending in ":" and 36 characters that
# are a UUID (its hex digits mapped to "#", which no slug holds) is its task name; a slug
# whose part after its last ":" is one or more digits (`load:17`; the part found by
# reversing the slug) is what stands before that ":"; any other slug is itself.
# The same as `regexp_replace({s}, GROUPED_TAIL, '')` for every slug.
UUID_SHAPE = "########-####-####-####-############"
_TAIL = "right({s}, strpos(reverse({s}), ':') - 1)"
NAME_OF = (
    "CASE WHEN substr({s}, length({s}) - 36, 1) = ':'"
    " AND translate(right({s}, 36), '0123456789abcdefABCDEF', '######################')"
    " = '" + UUID_SHAPE + "' THEN left({s}, -37)"
    " WHEN strpos({s}, ':') > 0 AND " + _TAIL + " <> ''"
    " AND translate(" + _TAIL + ", '0123456789', '') = ''"
    " THEN left({s}, -strpos(reverse({s}), ':')) ELSE {s} END"
)


def _within(*, prefix: bool, labels: bool) -> str:
    """The attempts' instances: those of a key prefix, holding labels, or both."""
    where = [*([IN_PREFIX] if prefix else []), *([WITH_LABELS] if labels else [])]
    if not where:
        return ""
    return (
        f" AND a.instance_id IN (SELECT p.id FROM process_instance p WHERE {' AND '.join(where)})"
    )


def step_stats_query(*, prefix: bool, labels: bool = False) -> str:
    """The window's attempts from the covering index, each with its record's step name read
    by primary key in a subquery (never a join the planner could turn into a scan of every
    record: a hash join over the whole table was its choice from a day's window up)."""
    within = _within(prefix=prefix, labels=labels)
    return f"""
SELECT a.name,
       count(*) FILTER (WHERE a.status = 'completed') AS completed,
       count(*) FILTER (WHERE a.status = 'failed') AS failed,
       count(*) FILTER (WHERE a.status = 'superseded') AS superseded,
       count(*) FILTER (WHERE a.status = 'running') AS running,
       percentile_cont(0.5) WITHIN GROUP (ORDER BY a.ms) FILTER (WHERE {FINISHED}) AS p50,
       percentile_cont(0.95) WITHIN GROUP (ORDER BY a.ms) FILTER (WHERE {FINISHED}) AS p95,
       max(a.ms) FILTER (WHERE {FINISHED}) AS max
FROM (
    SELECT a.status,
           extract(epoch FROM a.completed_at - a.started_at)::float8 * 1000 AS ms,
           (SELECT {NAME_OF.format(s="r.step_slug")} FROM workflow_step_record r
            WHERE r.instance_id = a.instance_id AND r.id = a.record_id) AS name
    FROM workflow_step_attempt a
    WHERE a.started_at >= %(since)s AND a.started_at < %(until)s{within}
) a
GROUP BY 1
ORDER BY count(*) DESC, 1
LIMIT %(limit)s
"""


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


async def step_stats(
    conn: AsyncConn,
    *,
    since: datetime,
    until: datetime,
    prefix: str | None,
    limit: int,
    labels: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """One item per step name, most attempts first (see the module's docstring); `labels`:
    only the attempts of instances holding every one of them."""
    params: dict[str, Any] = {"since": since, "until": until, "limit": limit}
    if prefix:
        params |= prefix_params(prefix)
    params |= labels_params(labels)
    query = step_stats_query(prefix=bool(prefix), labels=bool(labels))
    cur = await conn.execute(query, params, prepare=prepared(labels))
    items = []
    for row in await cur.fetchall():
        done = row["completed"] + row["failed"]
        items.append(
            {
                "name": row["name"],
                "attempts": {
                    key: row[key] for key in ("completed", "failed", "superseded", "running")
                },
                "failure_rate": None if done == 0 else round(row["failed"] / done, 4),
                "duration_ms": {key: _ms(row[key]) for key in ("p50", "p95", "max")},
            }
        )
    return items


# The window's failed attempts counted by hour first, then laid over every hour: on Citus
# the count runs on each shard and the coordinator adds them up, whereas attempts joined to
# the hours in the join's condition, with a key prefix's subquery there, is a correlated
# subquery that Citus refuses.
FAILURES_PER_HOUR = """
SELECT h.hour, coalesce(f.failed, 0) AS failed
FROM generate_series(date_trunc('hour', %(since)s::timestamptz),
                     date_trunc('hour', %(until)s::timestamptz), interval '1 hour') h(hour)
LEFT JOIN (
    SELECT date_trunc('hour', a.started_at) AS hour, count(*) AS failed
    FROM workflow_step_attempt a
    WHERE a.status = 'failed'
      AND a.started_at >= %(since)s AND a.started_at < %(until)s{within}
    GROUP BY 1
) f ON f.hour = h.hour
ORDER BY h.hour
"""


async def failures_per_hour(
    conn: AsyncConn,
    *,
    since: datetime,
    until: datetime,
    prefix: str | None,
    labels: dict[str, str] | None = None,
) -> list[tuple[datetime, int]]:
    """Failed attempts per hour (by the hour they started) from `since` to `until`, every
    hour listed, from the same index as the statistics."""
    within = _within(prefix=bool(prefix), labels=bool(labels))
    params: dict[str, Any] = {"since": since, "until": until}
    if prefix:
        params |= prefix_params(prefix)
    params |= labels_params(labels)
    query = FAILURES_PER_HOUR.format(within=within)
    cur = await conn.execute(query, params, prepare=prepared(labels))
    return [(row["hour"], row["failed"]) for row in await cur.fetchall()]


# The same, of one step name's attempts only (Failing now filtered by step): each failed
# attempt's step name read from its record by primary key, as in the statistics.
FAILURES_PER_HOUR_OF_STEP = FAILURES_PER_HOUR.replace(
    "{within}",
    "{within} AND (SELECT "
    + NAME_OF.format(s="r.step_slug").replace("{", "{{").replace("}", "}}")
    + " FROM workflow_step_record r"
    " WHERE r.instance_id = a.instance_id AND r.id = a.record_id) = %(name)s",
)


async def failures_per_hour_of_step(
    conn: AsyncConn,
    name: str,
    *,
    since: datetime,
    until: datetime,
    prefix: str | None,
    labels: dict[str, str] | None = None,
) -> list[tuple[datetime, int]]:
    """`failures_per_hour` of the attempts of step `name` only, as `/v1/stats/steps` names
    steps (a Celery task over every task id, a mapped task over every map index)."""
    within = _within(prefix=bool(prefix), labels=bool(labels))
    params: dict[str, Any] = {"since": since, "until": until, "name": name}
    if prefix:
        params |= prefix_params(prefix)
    params |= labels_params(labels)
    query = FAILURES_PER_HOUR_OF_STEP.format(within=within)
    cur = await conn.execute(query, params, prepare=prepared(labels))
    return [(row["hour"], row["failed"]) for row in await cur.fetchall()]
