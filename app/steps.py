"""All SQL of the service: the event merge and the reads.

Every event is one statement (`apply_event`): the database decides, under the record's row
lock, whether the event is newer than the record, a replay, a conflict or stale, and writes
only when it is newer. Nothing here imports the web framework.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

import psycopg

from app.db import AsyncConn

Kind = Literal["declare", "start", "complete", "fail"]
Outcome = Literal[
    "created", "applied", "replay", "conflict", "stale_attempt", "not_started", "ordinal_taken"
]
Order = Literal["ordinal", "started_at"]


@dataclass(frozen=True, slots=True)
class Event:
    instance_key: str
    step_slug: str
    kind: Kind
    attempt: int | None = None
    started_at: datetime | None = None
    completed_at: datetime | None = None
    output: str | None = None  # JSON text
    external_output_url: str | None = None
    error_code: str | None = None
    error_message: str | None = None
    ordinal: int | None = None


@dataclass(frozen=True, slots=True)
class Result:
    outcome: Outcome
    record: dict[str, Any] | None  # the record after the event, or as it stands when refused


class ConstraintViolation(Exception):
    """The database refused a write; `constraint` names the constraint or trigger."""

    def __init__(self, constraint: str, unique: bool, message: str) -> None:
        super().__init__(message)
        self.constraint = constraint
        self.unique = unique


class InvalidData(Exception):
    """The database could not take a value (out of range, untranslatable)."""


class Contention(Exception):
    """An event kept racing with concurrent creators; it wrote nothing."""


RECORD = (
    "{r}.id, {r}.step_slug, {r}.ordinal, {r}.status, {r}.attempt_count,"
    " {r}.output::text AS output, {r}.external_output_url, {r}.started_at, {r}.completed_at,"
    " {r}.error_code, {r}.error_message, {r}.created_at, {r}.updated_at"
)
NO_RECORD = ", ".join(["NULL"] * 13)

# Positions: a record sits at (attempt_count, rank), rank pending 0, running 1, finished 2;
# an event at (attempt, k), k declare 0, start 1, complete/fail 2. See the contract, §3.
APPLY_EVENT = f"""
WITH e AS MATERIALIZED (
    SELECT x.*,
           CASE x.kind WHEN 'declare' THEN 0 WHEN 'start' THEN 1 ELSE 2 END AS k,
           CASE x.kind WHEN 'declare' THEN 'pending' WHEN 'start' THEN 'running'
                       WHEN 'complete' THEN 'completed' ELSE 'failed' END AS target,
           (x.kind IN ('declare', 'start') OR x.started_at IS NOT NULL) AS can_create
    FROM (SELECT %(instance_key)s::text AS instance_key, %(step_slug)s::text AS step_slug,
                 %(kind)s::text AS kind, %(attempt)s::bigint AS attempt,
                 %(started_at)s::timestamptz AS started_at,
                 %(completed_at)s::timestamptz AS completed_at,
                 %(output)s::jsonb AS output, %(external_output_url)s::text AS url,
                 %(error_code)s::text AS error_code, %(error_message)s::text AS error_message,
                 %(ordinal)s::bigint AS ordinal, clock_timestamp() AS now) x
),
new_instance AS (
    INSERT INTO process_instance (instance_key, next_ordinal)
    SELECT e.instance_key, COALESCE(e.ordinal, 0) + 1 FROM e
    WHERE e.can_create
      AND NOT EXISTS (SELECT 1 FROM process_instance p WHERE p.instance_key = e.instance_key)
    ON CONFLICT ON CONSTRAINT uq_process_instance_instance_key DO NOTHING
    RETURNING id, next_ordinal - 1 AS ordinal
),
inst AS (
    SELECT id FROM new_instance
    UNION ALL
    SELECT p.id FROM process_instance p, e WHERE p.instance_key = e.instance_key
),
cur AS (
    SELECT r.* FROM workflow_step_record r, inst, e
    WHERE r.instance_id = inst.id AND r.step_slug = e.step_slug
    FOR UPDATE OF r
),
dec AS (
    SELECT cur.id, p.a_e, s.started_at,
        CASE
            WHEN (p.a_e, e.k) > (cur.attempt_count, p.rank) THEN
                CASE WHEN p.a_e > 2147483647 THEN 'conflict'
                     WHEN e.k = 2 AND s.started_at IS NULL THEN 'not_started'
                     ELSE 'applied' END
            WHEN (p.a_e, e.k) = (cur.attempt_count, p.rank) THEN
                CASE WHEN e.k < 2 THEN 'replay'
                     WHEN cur.status = e.target
                          AND cur.output IS NOT DISTINCT FROM e.output
                          AND cur.external_output_url IS NOT DISTINCT FROM e.url
                          AND cur.error_code IS NOT DISTINCT FROM e.error_code
                          AND cur.error_message IS NOT DISTINCT FROM e.error_message
                     THEN 'replay'
                     ELSE 'conflict' END
            WHEN p.a_e = cur.attempt_count THEN 'replay'
            ELSE 'stale_attempt'
        END AS outcome
    FROM cur, e,
        LATERAL (SELECT
            CASE WHEN e.k = 0 THEN cur.attempt_count
                 WHEN e.attempt IS NOT NULL THEN e.attempt
                 WHEN e.k = 1 THEN cur.attempt_count::bigint + (cur.status <> 'pending')::int
                 ELSE cur.attempt_count END AS a_e,
            CASE cur.status WHEN 'pending' THEN 0 WHEN 'running' THEN 1 ELSE 2 END AS rank
        ) p,
        LATERAL (SELECT COALESCE(
            e.started_at,
            CASE WHEN e.k = 1 THEN e.now
                 WHEN p.a_e = cur.attempt_count AND cur.status = 'running' THEN cur.started_at
            END) AS started_at
        ) s
),
upd AS (
    UPDATE workflow_step_record r SET
        status = e.target,
        attempt_count = d.a_e,
        started_at = d.started_at,
        completed_at = CASE WHEN e.k = 2
                            THEN COALESCE(e.completed_at, GREATEST(e.now, d.started_at)) END,
        output = e.output,
        external_output_url = e.url,
        error_code = e.error_code,
        error_message = e.error_message,
        updated_at = e.now
    FROM dec d, e
    WHERE r.id = d.id AND d.outcome = 'applied'
    RETURNING r.*
),
next_ordinal AS (
    UPDATE process_instance p
    SET next_ordinal = GREATEST(p.next_ordinal, COALESCE(e.ordinal, p.next_ordinal) + 1)
    FROM e
    WHERE p.instance_key = e.instance_key AND e.can_create
      AND NOT EXISTS (SELECT 1 FROM cur) AND NOT EXISTS (SELECT 1 FROM new_instance)
    RETURNING COALESCE(e.ordinal, p.next_ordinal - 1) AS ordinal
),
new_ordinal AS (
    SELECT ordinal FROM new_instance UNION ALL SELECT ordinal FROM next_ordinal
),
ins AS (
    INSERT INTO workflow_step_record AS r (
        instance_id, step_slug, ordinal, status, attempt_count, output, external_output_url,
        started_at, completed_at, error_code, error_message, created_at, updated_at)
    SELECT inst.id, e.step_slug, n.ordinal, e.target,
           CASE WHEN e.k = 0 THEN 1 ELSE COALESCE(e.attempt, 1) END,
           e.output, e.url,
           CASE WHEN e.k > 0 THEN COALESCE(e.started_at, e.now) END,
           CASE WHEN e.k = 2 THEN COALESCE(e.completed_at, GREATEST(e.now, e.started_at)) END,
           e.error_code, e.error_message, e.now, e.now
    FROM e, inst, new_ordinal n
    WHERE n.ordinal <= 2147483647
    RETURNING r.*
)
SELECT 'created' AS outcome, {RECORD.format(r="ins")} FROM ins
UNION ALL
SELECT 'applied', {RECORD.format(r="upd")} FROM upd
UNION ALL
SELECT d.outcome, {RECORD.format(r="cur")} FROM dec d JOIN cur ON cur.id = d.id
WHERE d.outcome <> 'applied'
UNION ALL
SELECT 'not_started', {NO_RECORD} FROM e WHERE NOT e.can_create AND NOT EXISTS (SELECT 1 FROM cur)
UNION ALL
SELECT 'ordinal_taken', {NO_RECORD} FROM new_ordinal WHERE ordinal > 2147483647
"""

# A statement that returns no row, or collides on the step's unique key, lost a race with a
# concurrent creator of the same instance or step: its snapshot could not see the new row.
# The collision aborts the whole statement (so no ordinal is spent) and the next try sees it.
MAX_TRIES = 5
RACE_KEY = "uq_workflow_step_record_instance_id_step_slug"


async def apply_event(conn: AsyncConn, event: Event) -> Result:
    params = {
        "instance_key": event.instance_key,
        "step_slug": event.step_slug,
        "kind": event.kind,
        "attempt": event.attempt,
        "started_at": event.started_at,
        "completed_at": event.completed_at,
        "output": event.output,
        "external_output_url": event.external_output_url,
        "error_code": event.error_code,
        "error_message": event.error_message,
        "ordinal": event.ordinal,
    }
    for _ in range(MAX_TRIES):
        try:
            cur = await conn.execute(APPLY_EVENT, params)
        except psycopg.errors.IntegrityError as exc:
            if exc.diag.constraint_name == RACE_KEY:
                continue
            raise _violation(exc) from exc
        except psycopg.errors.DataError as exc:
            raise InvalidData(exc.diag.message_primary or str(exc)) from exc
        row = await cur.fetchone()
        if row is None:
            continue
        outcome = row.pop("outcome")
        record = None if row["id"] is None else _record(row, event.instance_key)
        return Result(outcome, record)
    raise Contention(f"{event.instance_key}/{event.step_slug}: gave up after {MAX_TRIES} races")


def _violation(exc: psycopg.errors.IntegrityError) -> ConstraintViolation:
    name = exc.diag.constraint_name or "unknown"
    unique = isinstance(exc, psycopg.errors.UniqueViolation)
    return ConstraintViolation(name, unique, exc.diag.message_primary or str(exc))


def _record(row: dict[str, Any], instance_key: str) -> dict[str, Any]:
    row["instance_key"] = instance_key
    return row


# --- reads -----------------------------------------------------------------------------

GET_STEP = f"""
SELECT p.id AS instance_id, {RECORD.format(r="r")}
FROM process_instance p
LEFT JOIN workflow_step_record r ON r.instance_id = p.id AND r.step_slug = %(step_slug)s
WHERE p.instance_key = %(instance_key)s
"""


class InstanceNotFound(Exception):
    pass


class StepNotFound(Exception):
    pass


async def get_step(conn: AsyncConn, instance_key: str, step_slug: str) -> dict[str, Any]:
    cur = await conn.execute(GET_STEP, {"instance_key": instance_key, "step_slug": step_slug})
    row = await cur.fetchone()
    if row is None:
        raise InstanceNotFound(instance_key)
    if row["id"] is None:
        raise StepNotFound(step_slug)
    del row["instance_id"]
    return _record(row, instance_key)


STATUS_FILTER = "AND (%(statuses)s::text[] IS NULL OR r.status = ANY(%(statuses)s::text[]))"

LIST_BY_ORDINAL = f"""
SELECT p.id AS instance_id, s.*
FROM process_instance p
LEFT JOIN LATERAL (
    SELECT {RECORD.format(r="r")} FROM workflow_step_record r
    WHERE r.instance_id = p.id AND r.ordinal > %(after_ordinal)s {STATUS_FILTER}
    ORDER BY r.ordinal
    LIMIT %(limit)s
) s ON true
WHERE p.instance_key = %(instance_key)s
"""

_STARTED = f"""
    (SELECT {RECORD.format(r="r")} FROM workflow_step_record r
     WHERE r.instance_id = p.id
       AND (r.started_at, r.id) > (%(after_started_at)s, %(after_id)s) {STATUS_FILTER}
     ORDER BY r.started_at, r.id
     LIMIT %(limit)s)
"""
_UNSTARTED = f"""
    (SELECT {RECORD.format(r="r")} FROM workflow_step_record r
     WHERE r.instance_id = p.id AND r.started_at IS NULL
       AND r.id > %(after_id)s {STATUS_FILTER}
     ORDER BY r.started_at, r.id
     LIMIT %(limit)s)
"""
# Started steps by (started_at, id), then never-started ones by id: two index range scans
# appended, so neither needs a sort. A cursor inside the never-started part needs only that one.
LIST_BY_STARTED_AT = f"""
SELECT p.id AS instance_id, s.*
FROM process_instance p
LEFT JOIN LATERAL (
    {_STARTED} UNION ALL {_UNSTARTED.replace("%(after_id)s", "0")} LIMIT %(limit)s
) s ON true
WHERE p.instance_key = %(instance_key)s
"""
LIST_UNSTARTED = f"""
SELECT p.id AS instance_id, s.*
FROM process_instance p
LEFT JOIN LATERAL {_UNSTARTED} s ON true
WHERE p.instance_key = %(instance_key)s
"""


@dataclass(frozen=True, slots=True)
class Page:
    items: list[dict[str, Any]]
    last: dict[str, Any] | None  # the last item when another page follows


async def list_steps(
    conn: AsyncConn,
    instance_key: str,
    *,
    order: Order,
    after: Sequence[Any] | None,
    statuses: Sequence[str] | None,
    limit: int,
) -> Page:
    """One page of an instance's records; `after` is the keyset position of the last one seen.

    For `ordinal` it is `(ordinal,)`; for `started_at` it is `(started_at or None, id)`.
    """
    params: dict[str, Any] = {
        "instance_key": instance_key,
        "statuses": list(statuses) if statuses else None,
        "limit": limit + 1,
    }
    if order == "ordinal":
        params["after_ordinal"] = after[0] if after else -1
        query = LIST_BY_ORDINAL
    else:
        started_at, last_id = after if after else ("-infinity", 0)
        params["after_started_at"] = started_at
        params["after_id"] = last_id
        query = LIST_BY_STARTED_AT if started_at is not None else LIST_UNSTARTED
    cur = await conn.execute(query, params)
    rows = await cur.fetchall()
    if not rows:
        raise InstanceNotFound(instance_key)
    items = [_record(row, instance_key) for row in rows if row["id"] is not None]
    for item in items:
        del item["instance_id"]
    if len(items) > limit:
        return Page(items[:limit], items[limit - 1])
    return Page(items, None)


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


async def schema_revision(conn: AsyncConn) -> str | None:
    """The alembic revision the database is at, or None when it was never migrated."""
    try:
        cur = await conn.execute("SELECT version_num FROM alembic_version")
    except psycopg.errors.UndefinedTable:
        return None
    row = await cur.fetchone()
    return None if row is None else str(row["version_num"])
