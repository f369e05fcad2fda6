"""All SQL of the service: the event merge and the reads.

Every event is one statement (`apply_event`): the database decides, under the record's row
lock, whether the event is newer than the record, a replay, a conflict or stale, and writes
only when it is newer. Nothing here imports the web framework.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from itertools import repeat
from typing import Any, Literal

import psycopg
from psycopg.rows import tuple_row

from app.db import AsyncConn

Kind = Literal["declare", "start", "complete", "fail", "heartbeat"]
Outcome = Literal[
    "created",
    "applied",
    "replay",
    "conflict",
    "stale_attempt",
    "not_started",
    "not_running",
    "ordinal_taken",
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
    lease_seconds: int | None = None


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


class OutputTooLarge(Exception):
    """The database refused an inline output over its cap; `size` is what it measured."""

    def __init__(self, size: int) -> None:
        super().__init__(f"the output is {size} bytes")
        self.size = size


RECORD = (
    "{r}.id, {r}.step_slug, {r}.ordinal, {r}.status, {r}.attempt_count,"
    " {r}.output::text AS output, {r}.external_output_url, {r}.started_at, {r}.completed_at,"
    " {r}.error_code, {r}.error_message, {r}.created_at, {r}.updated_at, {r}.lease_expires_at"
)
# The merge is a function in the database (migration 0007 says how it judges; 0008 holds its
# current SQL): PostgreSQL plans it once per connection, through any pooler, where the statement
# it runs cost twice its execution time to plan on every call. It takes $1 the events' indexes,
# then one array per field of `PARAMS`, in order, and answers one row per event (index,
# outcome, record) with events of distinct steps applied in one statement, each judged as if
# alone. It runs on a raw cursor: the text is sent as is, never parsed for placeholders.
APPLY_EVENTS = (
    "SELECT * FROM steprecord_apply_events($1::int[], $2::text[], $3::text[], $4::text[],"
    " $5::bigint[], $6::timestamptz[], $7::timestamptz[], $8::text[], $9::text[], $10::text[],"
    " $11::text[], $12::bigint[], $13::int[])"
)

# One event (not a heartbeat) with scalars for arrays (migration 0010): the same answer, from
# the half of the general statement the event needs: the record judged and, only when the
# event applies, updated; or, when there is none, created.
APPLY_EVENT = (
    "SELECT * FROM steprecord_apply_event($1::int, $2::text, $3::text, $4::text, $5::bigint,"
    " $6::timestamptz, $7::timestamptz, $8::text, $9::text, $10::text, $11::text, $12::bigint,"
    " $13::int)"
)

# An event with no row in the answer lost a race with a concurrent creator of its instance (the
# statement's snapshot could not see the new row); a collision on the step's unique key (a
# concurrent creator of the step) aborts the whole statement, so nothing was written. In both
# cases the next try sees the new row. A deadlock between two batches is retried the same way.
MAX_TRIES = 5
RACE_KEY = "uq_workflow_step_record_instance_id_step_slug"
PARAMS = (
    "instance_key",
    "step_slug",
    "kind",
    "attempt",
    "started_at",
    "completed_at",
    "output",
    "external_output_url",
    "error_code",
    "error_message",
    "ordinal",
    "lease_seconds",
)

# A heartbeat extends the lease of the running attempt it names, under the record's row lock;
# it never changes status, times or attempt_count (a function of migration 0007, like the
# merge). Parameters: the events' indexes, then one array per field of `HEARTBEAT_PARAMS`.
HEARTBEAT = (
    "SELECT * FROM steprecord_heartbeat($1::int[], $2::text[], $3::text[], $4::bigint[], $5::int[])"
)
HEARTBEAT_PARAMS = ("instance_key", "step_slug", "attempt", "lease_seconds")

Outcomes = list[Result | Exception]


async def apply_event(conn: AsyncConn, event: Event) -> Result:
    """Apply one event; raise what the database refused.

    It goes to `steprecord_apply_event`, which runs only the half of the general statement
    the event needs (and writes an existing record only when the event applies).
    """
    if event.kind == "heartbeat":
        (result,) = await apply_events(conn, [event])
    else:
        outcomes: list[Result | Exception | None] = [None]
        await _apply_statement(conn, APPLY_EVENT, PARAMS, [event], [0], outcomes, _scalars)
        result = await _final(conn, event, outcomes[0])
    if isinstance(result, Exception):
        raise result
    return result


async def apply_events(conn: AsyncConn, events: Sequence[Event]) -> Outcomes:
    """Apply events in order, each judged as if alone; one result (or refusal) per event.

    Consecutive events of distinct steps go in one statement; a step seen again starts the
    next statement, so later events of a step see the effects of earlier ones.
    """
    outcomes: list[Result | Exception | None] = [None] * len(events)
    segment: list[int] = []
    seen: set[tuple[str, str]] = set()
    for index, event in enumerate(events):
        key = (event.instance_key, event.step_slug)
        if key in seen:
            await _apply_segment(conn, events, segment, outcomes)
            segment, seen = [], set()
        segment.append(index)
        seen.add(key)
    if segment:
        await _apply_segment(conn, events, segment, outcomes)
    return [await _final(conn, events[i], o) for i, o in enumerate(outcomes)]


async def _final(
    conn: AsyncConn, event: Event, outcome: Result | Exception | None
) -> Result | Exception:
    return Contention("not applied") if outcome is None else await _explained(conn, event, outcome)


async def _apply_segment(
    conn: AsyncConn,
    events: Sequence[Event],
    indexes: list[int],
    outcomes: list[Result | Exception | None],
) -> None:
    """Apply events of distinct steps: they cannot affect each other, so heartbeats and the
    other events go in one statement each."""
    beats = [index for index in indexes if events[index].kind == "heartbeat"]
    others = [index for index in indexes if events[index].kind != "heartbeat"]
    if beats:
        await _apply_statement(conn, HEARTBEAT, HEARTBEAT_PARAMS, events, beats, outcomes)
    if others:
        await _apply_statement(conn, APPLY_EVENTS, PARAMS, events, others, outcomes)


# A statement's parameters: the events' indexes, then one array per field (`_columns`), or
# for one event its index and its fields (`_scalars`).
Params = Callable[[Sequence[Event], list[int], Sequence[str]], list[Any]]


def _columns(events: Sequence[Event], indexes: list[int], names: Sequence[str]) -> list[Any]:
    return [indexes] + [[getattr(events[i], name) for i in indexes] for name in names]


def _scalars(events: Sequence[Event], indexes: list[int], names: Sequence[str]) -> list[Any]:
    (index,) = indexes
    return [index] + [getattr(events[index], name) for name in names]


async def _apply_statement(
    conn: AsyncConn,
    statement: str,
    names: Sequence[str],
    events: Sequence[Event],
    indexes: list[int],
    outcomes: list[Result | Exception | None],
    params: Params = _columns,
) -> None:
    pending = indexes
    for _ in range(MAX_TRIES):
        try:
            rows = await _run(conn, statement, params(events, pending, names))
        except (psycopg.errors.DeadlockDetected, psycopg.errors.SerializationFailure):
            continue
        except (psycopg.errors.IntegrityError, psycopg.errors.DataError) as exc:
            if isinstance(exc, psycopg.errors.IntegrityError) and (
                exc.diag.constraint_name == RACE_KEY
            ):
                continue
            if len(pending) > 1:  # find which event was refused: one statement each
                for index in pending:
                    await _apply_statement(
                        conn, statement, names, events, [index], outcomes, params
                    )
                return
            outcomes[pending[0]] = _refusal(exc)
            return
        for row in rows:
            index = row.pop("i")
            outcome = row.pop("outcome")
            instance_key = events[index].instance_key
            record = None if row["id"] is None else _record(row, instance_key)
            outcomes[index] = Result(outcome, record)
        pending = [index for index in pending if outcomes[index] is None]
        if not pending:
            return
    for index in pending:
        event = events[index]
        outcomes[index] = Contention(
            f"{event.instance_key}/{event.step_slug}: gave up after {MAX_TRIES} races"
        )


async def _run(conn: AsyncConn, statement: str, params: list[Any]) -> list[dict[str, Any]]:
    async with psycopg.AsyncRawCursor(conn) as cur:
        await cur.execute(statement, params)
        return await cur.fetchall()


def _refusal(exc: psycopg.Error) -> Exception:
    if isinstance(exc, psycopg.errors.IntegrityError):
        return _violation(exc)
    return InvalidData(exc.diag.message_primary or str(exc))


def _violation(exc: psycopg.errors.IntegrityError) -> ConstraintViolation:
    name = exc.diag.constraint_name or "unknown"
    unique = isinstance(exc, psycopg.errors.UniqueViolation)
    return ConstraintViolation(name, unique, exc.diag.message_primary or str(exc))


ORDINAL_KEY = "uq_workflow_step_record_instance_id_ordinal"
OUTPUT_SIZE = "ck_workflow_step_record_output_size"

# The record holding the event's ordinal or, for a server-assigned one, the highest ordinal.
ORDINAL_HOLDER = f"""
SELECT {RECORD.format(r="r")}
FROM process_instance p JOIN workflow_step_record r ON r.instance_id = p.id
WHERE p.instance_key = %(instance_key)s
  AND (%(ordinal)s::int IS NULL OR r.ordinal = %(ordinal)s::int)
ORDER BY r.ordinal DESC
LIMIT 1
"""


async def _explained(
    conn: AsyncConn, event: Event, outcome: Result | Exception
) -> Result | Exception:
    """A refusal with what the client needs to act on it, read after the fact (rare path).

    A taken ordinal comes with the record that holds it; an oversized output with its size
    as the database measures it (jsonb's text, which differs from the JSON sent).
    """
    if (isinstance(outcome, Result) and outcome.outcome == "ordinal_taken") or (
        isinstance(outcome, ConstraintViolation) and outcome.constraint == ORDINAL_KEY
    ):
        params = {"instance_key": event.instance_key, "ordinal": event.ordinal}
        cur = await conn.execute(ORDINAL_HOLDER, params)
        row = await cur.fetchone()
        return Result("ordinal_taken", None if row is None else _record(row, event.instance_key))
    if isinstance(outcome, ConstraintViolation) and outcome.constraint == OUTPUT_SIZE:
        cur = await conn.execute("SELECT octet_length(%s::jsonb::text) AS size", (event.output,))
        row = await cur.fetchone()
        assert row is not None
        return OutputTooLarge(row["size"])
    return outcome


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


def _list_queries(columns: str) -> tuple[str, str, str]:
    """The three list queries (by ordinal, by started_at, inside the never-started part),
    each selecting `columns` of the records `r` of one page of an instance `p`."""
    started = f"""
    (SELECT {columns} FROM workflow_step_record r
     WHERE r.instance_id = p.id
       AND (r.started_at, r.id) > (%(after_started_at)s, %(after_id)s) {STATUS_FILTER}
     ORDER BY r.started_at, r.id
     LIMIT %(limit)s)
"""
    unstarted = f"""
    (SELECT {columns} FROM workflow_step_record r
     WHERE r.instance_id = p.id AND r.started_at IS NULL
       AND r.id > %(after_id)s {STATUS_FILTER}
     ORDER BY r.started_at, r.id
     LIMIT %(limit)s)
"""
    by_ordinal = f"""
SELECT p.id AS instance_id, s.*
FROM process_instance p
LEFT JOIN LATERAL (
    SELECT {columns} FROM workflow_step_record r
    WHERE r.instance_id = p.id AND r.ordinal > %(after_ordinal)s {STATUS_FILTER}
    ORDER BY r.ordinal
    LIMIT %(limit)s
) s ON true
WHERE p.instance_key = %(instance_key)s
"""
    # Started steps by (started_at, id), then never-started ones by id: two index range scans
    # appended, so neither needs a sort. A cursor inside the never-started part needs only
    # that one.
    by_started_at = f"""
SELECT p.id AS instance_id, s.*
FROM process_instance p
LEFT JOIN LATERAL (
    {started} UNION ALL {unstarted.replace("%(after_id)s", "0")} LIMIT %(limit)s
) s ON true
WHERE p.instance_key = %(instance_key)s
"""
    only_unstarted = f"""
SELECT p.id AS instance_id, s.*
FROM process_instance p
LEFT JOIN LATERAL {unstarted} s ON true
WHERE p.instance_key = %(instance_key)s
"""
    return by_ordinal, by_started_at, only_unstarted


# The pages as rows (the bench runs these through pgbench, the plan tests check them).
LIST_BY_ORDINAL, LIST_BY_STARTED_AT, LIST_UNSTARTED = _list_queries(RECORD.format(r="r"))


# A page of an instance's records (migration 0012 holds the function and says how it reads):
# planned once per connection, where the statement it runs cost more to plan than to run on
# every call. Its columns are `PAGE_COLUMNS`, the record as the API shows it, in that order.
LIST_PAGE = (
    "SELECT * FROM steprecord_list_page($1::text, $2::text, $3::integer, $4::timestamptz,"
    " $5::bigint, $6::text[], $7::integer)"
)
PAGE_COLUMNS = (
    "id",
    "instance_key",
    "step_slug",
    "ordinal",
    "status",
    "attempt_count",
    "output",
    "external_output_url",
    "started_at",
    "completed_at",
    "lease_expires_at",
    "error_code",
    "error_message",
    "created_at",
    "updated_at",
)


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


# --- the dashboard ---------------------------------------------------------------------

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


# --- live updates ---------------------------------------------------------------------

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


class InstanceNotReplayed(InstanceNotFound):
    """No such instance on a standby: the primary may have it, not replayed there yet."""


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
        records.append(_record(row, instance_key))
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


# The sweeper: fail every running attempt whose lease expired, as a `fail` event of that attempt
# would (error `lease_expired`, `completed_at` = the expiry), in one statement. SKIP LOCKED
# lets several sweepers (workers, service instances) run at once without ever writing the same
# record twice, and FOR UPDATE re-checks the lease on the newest row version, so a heartbeat
# that committed first keeps its attempt alive.
SWEEP = """
WITH due AS (
    SELECT r.id FROM workflow_step_record r
    WHERE r.status = 'running' AND r.lease_expires_at IS NOT NULL
      AND r.lease_expires_at < clock_timestamp()
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
UPDATE workflow_step_record r SET
    status = 'failed',
    completed_at = GREATEST(r.lease_expires_at, r.started_at),
    error_code = 'lease_expired',
    error_message = 'no heartbeat, complete or fail arrived before the lease expired',
    lease_expires_at = NULL,
    updated_at = clock_timestamp()
FROM due
WHERE r.id = due.id
RETURNING r.id
"""
SWEEP_BATCH = 500


async def sweep_expired(conn: AsyncConn) -> int:
    """Fail the running attempts whose lease expired; the number of records swept."""
    swept = 0
    while True:
        cur = await conn.execute(SWEEP, {"limit": SWEEP_BATCH})
        swept += cur.rowcount
        if cur.rowcount < SWEEP_BATCH:
            return swept


async def schema_revision(conn: AsyncConn) -> str | None:
    """The alembic revision the database is at, or None when it was never migrated."""
    try:
        cur = await conn.execute("SELECT version_num FROM alembic_version")
    except psycopg.errors.UndefinedTable:
        return None
    row = await cur.fetchone()
    return None if row is None else str(row["version_num"])


# Taken first in the migration transaction and held until it ends, so instances that start
# together migrate one after the other and the later ones find the schema at head. A
# transaction-level lock also holds and ends correctly through PgBouncer in transaction mode,
# where a session-level one would stay on whichever server connection took it.
MIGRATION_LOCK = "SELECT pg_advisory_xact_lock(hashtext('steprecord'), hashtext('migrate'))"


# --- tokens -----------------------------------------------------------------------------


async def create_token(conn: AsyncConn, name: str, scope: str, digest: bytes) -> None:
    try:
        await conn.execute(
            "INSERT INTO api_token (name, scope, token_sha256) VALUES (%s, %s, %s)",
            (name, scope, digest),
        )
    except psycopg.errors.IntegrityError as exc:
        raise _violation(exc) from exc


async def list_tokens(conn: AsyncConn) -> list[dict[str, Any]]:
    cur = await conn.execute(
        "SELECT name, scope, created_at, last_used_at FROM api_token ORDER BY name"
    )
    return await cur.fetchall()


REVOKE_TOKEN = """
WITH gone AS (DELETE FROM api_token WHERE name = %s RETURNING id)
SELECT count(*) AS removed, (SELECT count(*) FROM api_token) - count(*) AS remaining FROM gone
"""


async def revoke_token(conn: AsyncConn, name: str) -> int | None:
    """The number of tokens left after revoking `name`, or None when no token has that name."""
    cur = await conn.execute(REVOKE_TOKEN, (name,))
    row = await cur.fetchone()
    assert row is not None
    return None if row["removed"] == 0 else int(row["remaining"])


ALLOW_ANONYMOUS = """
INSERT INTO access_policy (tokens_required)
SELECT false WHERE NOT EXISTS (SELECT FROM api_token)
ON CONFLICT (id) DO UPDATE SET tokens_required = false, updated_at = now()
RETURNING id
"""


async def allow_anonymous(conn: AsyncConn) -> bool:
    """Record that no token is required while none exists; False (nothing done) if any does."""
    cur = await conn.execute(ALLOW_ANONYMOUS)
    return await cur.fetchone() is not None


async def anonymous_allowed(conn: AsyncConn) -> bool:
    """Whether having no token means anonymous access (never, once a token has existed)."""
    try:
        cur = await conn.execute("SELECT tokens_required FROM access_policy")
    except psycopg.errors.UndefinedTable as exc:
        raise SchemaMissing(str(exc)) from exc
    row = await cur.fetchone()
    return row is not None and not row["tokens_required"]


class SchemaMissing(Exception):
    """The database has not been migrated far enough for this query."""


async def active_tokens(conn: AsyncConn) -> list[dict[str, Any]]:
    try:
        cur = await conn.execute("SELECT id, scope, token_sha256 FROM api_token")
    except psycopg.errors.UndefinedTable as exc:
        raise SchemaMissing(str(exc)) from exc
    return await cur.fetchall()


async def touch_tokens(conn: AsyncConn, ids: Sequence[int]) -> None:
    await conn.execute("UPDATE api_token SET last_used_at = now() WHERE id = ANY(%s)", (list(ids),))


# --- replication positions (the read replica's lag) ------------------------------------


async def wal_position(conn: AsyncConn) -> int:
    """The primary's current WAL write position, in bytes: every commit acknowledged so far
    ends at or before it."""
    cur = await conn.execute("SELECT (pg_current_wal_lsn() - '0/0')::bigint AS lsn")
    row = await cur.fetchone()
    assert row is not None
    return int(row["lsn"])


async def replay_position(conn: AsyncConn) -> int | None:
    """How far a standby has replayed the primary's WAL, in bytes; None on a primary (also on
    a promoted one, where the last replayed position stands still)."""
    cur = await conn.execute(
        "SELECT CASE WHEN pg_is_in_recovery()"
        " THEN (pg_last_wal_replay_lsn() - '0/0')::bigint END AS replayed"
    )
    row = await cur.fetchone()
    assert row is not None
    return None if row["replayed"] is None else int(row["replayed"])


async def replay_state(conn: AsyncConn) -> dict[str, Any]:
    """A standby's replay: `in_recovery`, `replayed` (the WAL position replayed, in bytes),
    `caught_up` (it has replayed all it received) and `behind_seconds` (the age of the last
    replayed commit, on the standby's clock)."""
    cur = await conn.execute(
        "SELECT pg_is_in_recovery() AS in_recovery,"
        " (pg_last_wal_replay_lsn() - '0/0')::bigint AS replayed,"
        " pg_last_wal_replay_lsn() >= pg_last_wal_receive_lsn() AS caught_up,"
        " extract(epoch FROM now() - pg_last_xact_replay_timestamp())::float8"
        " AS behind_seconds"
    )
    row = await cur.fetchone()
    assert row is not None
    return row
