"""The judge's calls: every event and heartbeat goes to a database function (`app/sql/`).

The database decides, under the record's row lock, whether an event is newer than the
record, a replay, a conflict or stale, and writes only when it is newer: one statement per
event (or per set of events of distinct steps), nothing decided in Python.
"""

from collections.abc import Callable, Sequence
from typing import Any
from weakref import WeakKeyDictionary

import psycopg

from ..core.db import AsyncConn, DatabaseUnavailable, public_reason
from ..core.domain import (
    ConstraintViolation,
    Contention,
    Event,
    InvalidData,
    OutputTooLarge,
    Result,
)
from . import placement
from .common import RECORD, constraint_name, violation, with_key

# The judge is a function in the database (app/sql/apply_events.sql says how it judges):
# PostgreSQL plans it once per connection, through any pooler, where the statement it runs
# cost several times its execution time to plan on every call (a one-event call: 3 ms planned
# each time, 0.6 ms with the kept plan, on PostgreSQL 15). It takes $1 the events' indexes,
# then one array per field of `PARAMS`, in order, then the request's trace id (NULL for
# none: the attempts the events start keep it), then the writer (the request's token's name,
# or `anonymous`: every record written takes it as `updated_by`), then each event's labels
# (JSON text or NULL: those of the events answered 2xx merge into their instances'), and
# answers one row per
# event (index, outcome, record) with events of distinct steps applied in one statement, each
# judged as if alone. It runs on a raw cursor: the text is sent as is, never parsed for
# placeholders.
APPLY_EVENTS = (
    "SELECT * FROM steprecord_apply_events($1::int[], $2::text[], $3::text[], $4::text[],"
    " $5::bigint[], $6::timestamptz[], $7::timestamptz[], $8::text[], $9::text[], $10::text[],"
    " $11::text[], $12::bigint[], $13::int[], $14::text, $15::text, $16::jsonb[])"
)

# One event (not a heartbeat) with scalars for arrays (app/sql/apply_event.sql): the same
# answer, by the same rules (app/sql/judge_rules.sql), in statements of one table each by the
# instance's id. Its first argument is that id, derived from the key in the statement itself
# (app/sql/instance_id.sql): on Citus the coordinator sends the call to the worker holding it.
APPLY_EVENT_WITH = (
    "SELECT * FROM {}(steprecord_instance_id($2::text), $1::int, $2::text,"
    " $3::text, $4::text, $5::bigint, $6::timestamptz, $7::timestamptz, $8::text, $9::text,"
    " $10::text, $11::text, $12::bigint, $13::int, $14::text, $15::text, $16::jsonb)"
)
APPLY_EVENT = APPLY_EVENT_WITH.format("steprecord_apply_event")

# On Citus, the same call of the judge's copy for the instance's shard, on the node that
# holds it (app/sql/shard_judge.sql): the same statements on the shard's own tables, without
# Citus's planner and executor in each. The node makes the copy and names it
# (`steprecord_shard_judge`, NULL when the shard is not there: the call is then the
# distributed judge's); asked once per connection and shard. A copy's name changes with its
# text: one gone (undefined_function, a revision made the template anew) is asked again.
SHARD_JUDGE = "SELECT steprecord_shard_judge(%s) AS name"
_COPIES: WeakKeyDictionary[AsyncConn, dict[int, str]] = WeakKeyDictionary()


# An event with no row in the answer lost a race with a concurrent creator of its instance (the
# statement's snapshot could not see the new row); a collision on the step's unique key (a
# concurrent creator of the step) aborts the whole statement, so nothing was written. In both
# cases the next try sees the new row. A deadlock between two batches is retried the same way.
MAX_TRIES = 5
# A collision on the step's unique key, or a record whose instance was deleted meanwhile
# (`DELETE /v1/instances/...`): the next try creates the record, or a new instance.
RACE_KEYS = frozenset(
    {
        "uq_workflow_step_record_instance_id_step_slug",
        "fk_workflow_step_record_instance_id_process_instance",
    }
)
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
# it never changes status, times or attempt_count (app/sql/heartbeat.sql). Parameters: the
# events' indexes, then one array per field of `HEARTBEAT_PARAMS`, then the writer (a
# heartbeat writes the record: its lease, updated_at and updated_by).
HEARTBEAT = (
    "SELECT * FROM steprecord_heartbeat($1::int[], $2::text[], $3::text[], $4::bigint[],"
    " $5::int[], $6::text)"
)
HEARTBEAT_PARAMS = ("instance_key", "step_slug", "attempt", "lease_seconds")

Outcomes = list[Result | Exception]


async def apply_event(
    conn: AsyncConn,
    event: Event,
    *,
    writer: str,
    trace_id: str | None = None,
    shard: int | None = None,
) -> Result:
    """Apply one event; raise what the database refused.

    It goes to `steprecord_apply_event`, which judges it and writes only when the event
    applies; on Citus, with the instance's `shard` known, to that shard's copy on the node
    `conn` is to. An attempt the event starts keeps `trace_id` (the request's W3C trace id,
    32 lowercase hex digits); a record it writes keeps `writer` (the request's token's name,
    or `anonymous`).
    """
    if event.kind == "heartbeat":
        (result,) = await apply_events(conn, [event], writer=writer)
    else:
        outcomes: list[Result | Exception | None] = [None]
        await _apply_one(conn, [event], 0, outcomes, _scalars(trace_id, writer), shard)
        result = await _final(conn, event, outcomes[0])
    if isinstance(result, Exception):
        raise result
    return result


async def apply_events(
    conn: AsyncConn,
    events: Sequence[Event],
    *,
    writer: str,
    trace_id: str | None = None,
    shards: Sequence[int | None] | None = None,
) -> Outcomes:
    """Apply events in order, each judged as if alone; one result (or refusal) per event.

    Consecutive events of distinct steps go in one statement; a step seen again starts the
    next statement, so later events of a step see the effects of earlier ones. The events
    share one request, so the attempts they start all keep its `trace_id`, and the records
    they write its `writer`.

    On Citus each event is a call of its own, in order (`_apply_one_by_one`): the statement
    above joins the instances of many workers, which Citus would run as one distributed
    transaction. Each event's instance's shard, where known (`shards`), picks the shard's
    copy of the judge, as `apply_event` does.
    """
    outcomes: list[Result | Exception | None] = [None] * len(events)
    if await placement.is_citus(conn):
        known = [None] * len(events) if shards is None else shards
        await _apply_one_by_one(conn, events, outcomes, trace_id, writer, known)
        return [await _final(conn, events[i], o) for i, o in enumerate(outcomes)]
    segment: list[int] = []
    seen: set[tuple[str, str]] = set()
    for index, event in enumerate(events):
        key = (event.instance_key, event.step_slug)
        if key in seen:
            await _apply_segment(conn, events, segment, outcomes, trace_id, writer)
            segment, seen = [], set()
        segment.append(index)
        seen.add(key)
    if segment:
        await _apply_segment(conn, events, segment, outcomes, trace_id, writer)
    return [await _final(conn, events[i], o) for i, o in enumerate(outcomes)]


async def _apply_one_by_one(
    conn: AsyncConn,
    events: Sequence[Event],
    outcomes: list[Result | Exception | None],
    trace_id: str | None,
    writer: str,
    shards: Sequence[int | None],
) -> None:
    """Each event as its own endpoint judges it, in order: an event as `apply_event` sends it
    (its instance's worker runs it), a heartbeat as a one-element call (Citus routes its
    statement to the instance's shard). A worker that cannot be reached answers its events
    503 (`DatabaseUnavailable`), and the others commit."""
    for index, event in enumerate(events):
        try:
            if event.kind == "heartbeat":
                params = _columns_and(writer)
                await _apply_statement(
                    conn, HEARTBEAT, HEARTBEAT_PARAMS, events, [index], outcomes, params
                )
            else:
                params = _scalars(trace_id, writer)
                await _apply_one(conn, events, index, outcomes, params, shards[index])
        except psycopg.OperationalError as exc:
            if conn.closed:  # the coordinator itself is gone: the whole request is refused
                raise
            outcomes[index] = DatabaseUnavailable(str(exc), public_reason(exc))


async def _final(
    conn: AsyncConn, event: Event, outcome: Result | Exception | None
) -> Result | Exception:
    return Contention("not applied") if outcome is None else await _explained(conn, event, outcome)


async def _apply_segment(
    conn: AsyncConn,
    events: Sequence[Event],
    indexes: list[int],
    outcomes: list[Result | Exception | None],
    trace_id: str | None,
    writer: str,
) -> None:
    """Apply events of distinct steps: they cannot affect each other, so heartbeats and the
    other events go in one statement each (a heartbeat starts no attempt: no trace id)."""
    beats = [index for index in indexes if events[index].kind == "heartbeat"]
    others = [index for index in indexes if events[index].kind != "heartbeat"]
    if beats:
        params = _columns_and(writer)
        await _apply_statement(conn, HEARTBEAT, HEARTBEAT_PARAMS, events, beats, outcomes, params)
    if others:
        params = _with_labels(trace_id, writer)
        await _apply_statement(conn, APPLY_EVENTS, PARAMS, events, others, outcomes, params)


# A statement's parameters: the events' indexes, then one array per field (`_columns`), or
# for one event its index and its fields (`_scalars`); the judge's functions then take the
# request's trace id (not a heartbeat), its writer, and the events' labels (not a heartbeat).
Params = Callable[[Sequence[Event], list[int], Sequence[str]], list[Any]]


def _columns(events: Sequence[Event], indexes: list[int], names: Sequence[str]) -> list[Any]:
    return [indexes] + [[getattr(events[i], name) for i in indexes] for name in names]


def _columns_and(*scalars: str | None) -> Params:
    def params(events: Sequence[Event], indexes: list[int], names: Sequence[str]) -> list[Any]:
        return [*_columns(events, indexes, names), *scalars]

    return params


def _with_labels(trace_id: str | None, writer: str) -> Params:
    def params(events: Sequence[Event], indexes: list[int], names: Sequence[str]) -> list[Any]:
        labels = [events[i].labels for i in indexes]
        return [*_columns(events, indexes, names), trace_id, writer, labels]

    return params


def _scalars(trace_id: str | None, writer: str) -> Params:
    def params(events: Sequence[Event], indexes: list[int], names: Sequence[str]) -> list[Any]:
        (index,) = indexes
        fields = (getattr(events[index], name) for name in names)
        return [index, *fields, trace_id, writer, events[index].labels]

    return params


async def _apply_one(
    conn: AsyncConn,
    events: Sequence[Event],
    index: int,
    outcomes: list[Result | Exception | None],
    params: Params,
    shard: int | None,
) -> None:
    """One event (not a heartbeat): to its shard's copy of the judge when there is one on
    this node, else to `steprecord_apply_event`."""
    if shard is not None and (name := await _copy(conn, shard)) is not None:
        statement = APPLY_EVENT_WITH.format(name)
        try:
            await _apply_statement(conn, statement, PARAMS, events, [index], outcomes, params)
            return
        except psycopg.errors.UndefinedFunction:  # the copy was made anew: ask next time
            _COPIES[conn].pop(shard, None)
    await _apply_statement(conn, APPLY_EVENT, PARAMS, events, [index], outcomes, params)


async def _copy(conn: AsyncConn, shard: int) -> str | None:
    """The name of the judge's copy for `shard` on this connection's node (None: no copy,
    the shard is not there)."""
    copies = _COPIES.setdefault(conn, {})
    name = copies.get(shard)
    if name is None:
        row = await (await conn.execute(SHARD_JUDGE, (shard,))).fetchone()
        if row is None or row["name"] is None:
            return None
        name = copies[shard] = str(row["name"])
    return name


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
                constraint_name(exc) in RACE_KEYS
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
            record = None if row["id"] is None else with_key(row, instance_key)
            recorded = bool(row.pop("recorded", False))  # heartbeats answer no such column
            outcomes[index] = Result(outcome, record, recorded)
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
        return violation(exc)
    return InvalidData(exc.diag.message_primary or str(exc))


ORDINAL_KEY = "uq_workflow_step_record_instance_id_ordinal"
OUTPUT_SIZE = "ck_workflow_step_record_output_size"

# The record holding the event's ordinal or, for a server-assigned one, the highest ordinal.
ORDINAL_HOLDER = f"""
SELECT {RECORD.format(r="r")}
FROM process_instance p JOIN workflow_step_record r ON r.instance_id = p.id
WHERE p.id = steprecord_instance_id(%(instance_key)s) AND p.instance_key = %(instance_key)s
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
        return Result("ordinal_taken", None if row is None else with_key(row, event.instance_key))
    if isinstance(outcome, ConstraintViolation) and outcome.constraint == OUTPUT_SIZE:
        cur = await conn.execute("SELECT octet_length(%s::jsonb::text) AS size", (event.output,))
        row = await cur.fetchone()
        assert row is not None
        return OutputTooLarge(row["size"])
    return outcome
