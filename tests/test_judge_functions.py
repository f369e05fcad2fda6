"""The judge's two database functions, called with raw SQL as `psql` or another client would.

`steprecord_apply_event` (one event, scalar arguments) must answer exactly as a one-element call
of `steprecord_apply_events` (docs/api.md, "Events"): the single endpoints use the first,
batches the second.
"""

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from app.data.judge import PARAMS
from tests.support.citus import on_citus

Conn = psycopg.Connection[tuple[object, ...]]

# Each call is a statement of its own, the function alone in it and its instance's id derived
# from the key in the statement: on Citus the coordinator then sends the whole call to the
# worker holding the instance (a call it does not send there cannot write a new record).
ONE = (
    "SELECT * FROM steprecord_apply_event(steprecord_instance_id(%s::text), %s::int, %s::text,"
    " %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"
)
ARRAYS = (
    "%s::int[], %s::text[], %s::text[], %s::text[], %s::bigint[], %s::timestamptz[],"
    " %s::timestamptz[], %s::text[], %s::text[], %s::text[], %s::text[], %s::bigint[],"
    " %s::int[]"
)
SET = f"SELECT * FROM steprecord_apply_events({ARRAYS})"
FIELDS = PARAMS[2:]  # the arguments after the instance key and the step slug
# Everything but the generated id and the clock's times (created_at, updated_at, a lease).
COMPARED = (
    *("i", "outcome", "recorded", "step_slug", "ordinal", "status", "attempt_count", "output"),
    *("external_output_url", "started_at", "completed_at", "error_code", "error_message"),
)

T1, T2, T3, T4 = (f"2026-12-04T10:00:0{n}Z" for n in range(1, 5))
# One step's events, in order, reaching every outcome: created, replay, applied, conflict,
# stale_attempt, not_started (a terminal event without a start on a new step), ordinal_taken,
# and the late reports of older attempts that the history keeps (`recorded`) or refuses.
EVENTS: list[tuple[str, dict[str, Any]]] = [
    ("a", {"kind": "declare"}),
    ("a", {"kind": "declare"}),
    ("a", {"kind": "start", "attempt": 1, "started_at": T1, "lease_seconds": 30}),
    ("a", {"kind": "start", "attempt": 1, "started_at": T1}),
    ("a", {"kind": "complete", "attempt": 1, "started_at": T1, "completed_at": T2, "output": "1"}),
    ("a", {"kind": "complete", "attempt": 1, "started_at": T1, "completed_at": T2, "output": "1"}),
    ("a", {"kind": "complete", "attempt": 1, "started_at": T1, "completed_at": T2, "output": "2"}),
    ("a", {"kind": "start", "attempt": 2, "started_at": T3}),
    ("a", {"kind": "fail", "attempt": 1, "started_at": T1, "completed_at": T2, "error_code": "E"}),
    (
        "a",
        {
            "kind": "fail",
            "attempt": 2,
            "started_at": T3,
            "completed_at": T4,
            "error_code": "E",
            "error_message": "boom",
        },
    ),
    ("a", {"kind": "start", "attempt": 3, "started_at": T4}),
    ("a", {"kind": "complete", "attempt": 3, "completed_at": T4, "external_output_url": "s3://x"}),
    # Late reports: attempt 1 superseded by attempt 2, then its own fail arrives (kept), again
    # (kept, as the first), then another content (refused), then its start (writes nothing).
    ("g", {"kind": "start", "attempt": 1, "started_at": T1}),
    ("g", {"kind": "start", "attempt": 2, "started_at": T3}),
    ("g", {"kind": "fail", "attempt": 1, "completed_at": T2, "error_code": "Late"}),
    ("g", {"kind": "fail", "attempt": 1, "completed_at": T2, "error_code": "Late"}),
    ("g", {"kind": "complete", "attempt": 1, "completed_at": T2, "output": "3"}),
    ("g", {"kind": "start", "attempt": 1, "started_at": T1}),
    # Attempt 3 starts first: attempt 2 has no entry and its report becomes one; attempt 1's
    # report ends before it starts, so it writes nothing.
    ("h", {"kind": "start", "attempt": 3, "started_at": T4}),
    ("h", {"kind": "complete", "attempt": 2, "completed_at": T3, "output": "[2]"}),
    ("h", {"kind": "fail", "attempt": 1, "started_at": T3, "completed_at": T2, "error_code": "E"}),
    ("b", {"kind": "complete", "attempt": 1, "completed_at": T2}),
    ("c", {"kind": "start", "ordinal": 7, "started_at": T1}),
    ("e", {"kind": "start", "started_at": T1}),
    ("f", {"kind": "start", "ordinal": 2**31, "started_at": T1}),  # past the last ordinal
]
HISTORY = """
SELECT r.step_slug, a.attempt, a.status, a.started_at, a.completed_at, a.output::text,
       a.external_output_url, a.error_code, a.error_message
FROM workflow_step_attempt a
JOIN workflow_step_record r ON r.instance_id = a.instance_id AND r.id = a.record_id
JOIN process_instance p ON p.id = r.instance_id
WHERE p.instance_key = %s
ORDER BY r.step_slug, a.attempt
"""


@pytest.fixture
def conn(database_url: str) -> Iterator[Conn]:
    """A connection in autocommit, as the service calls the judge: each call is its own
    transaction (the tables are emptied before each test)."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        yield conn


def one(db: Conn, instance_key: str, slug: str, event: dict[str, Any]) -> list[tuple[Any, ...]]:
    args = [instance_key, 5, instance_key, slug, *(event.get(field) for field in FIELDS)]
    return _compared(db.execute(ONE, args))


def general(db: Conn, instance_key: str, slug: str, event: dict[str, Any]) -> list[tuple[Any, ...]]:
    """The event as one node judges it in a batch. On Citus the service judges every event
    with the one-event function (the batch statement is one node's): the event is sent there,
    and the test below compares the answers and the history with the constants it states."""
    args = [[5], [instance_key], [slug], *([event.get(field)] for field in FIELDS)]
    if on_citus(db):
        return one(db, instance_key, slug, event)
    return _compared(db.execute(SET, args))


def _compared(cur: psycopg.Cursor[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    assert cur.description is not None
    names = [column.name for column in cur.description]
    return [tuple(row[names.index(name)] for name in COMPARED) for row in cur.fetchall()]


def test_one_event_function_answers_as_the_general_function(conn: Conn) -> None:
    outcomes, answers = [], []
    for slug, event in EVENTS:
        by_one = one(conn, "judged-alone", slug, event)
        by_set = general(conn, "judged-in-a-set", slug, event)
        assert by_one == by_set, (slug, event)
        outcomes.append(by_one[0][1] if by_one else None)
        answers.append(by_one[0])
    assert outcomes == [
        "created",
        "replay",
        "applied",
        "replay",
        "applied",
        "replay",
        "conflict",
        "applied",
        "stale_attempt",
        "applied",
        "applied",
        "applied",
        *("created", "applied", "stale_attempt", "stale_attempt", "stale_attempt"),
        *("stale_attempt", "created", "stale_attempt", "stale_attempt"),
        "not_started",
        "created",
        "created",
        "ordinal_taken",
    ]
    recorded = [(slug, by[2]) for (slug, _), by in zip(EVENTS, answers, strict=True) if by[2]]
    assert recorded == [("g", True), ("g", True), ("h", True)]
    alone = conn.execute(HISTORY, ("judged-alone",)).fetchall()
    assert alone == conn.execute(HISTORY, ("judged-in-a-set",)).fetchall()
    assert [row[:3] for row in alone if row[0] in ("g", "h")] == [
        ("g", 1, "failed"),
        ("g", 2, "running"),
        ("h", 2, "completed"),
        ("h", 3, "running"),
    ]


def test_one_event_function_writes_nothing_for_a_replay(conn: Conn) -> None:
    start = {"kind": "start", "attempt": 1, "started_at": T1}
    one(conn, "replayed", "a", start)
    version = (
        "SELECT r.ctid::text FROM workflow_step_record r JOIN process_instance p"
        " ON p.id = r.instance_id WHERE p.instance_key = 'replayed'"
    )
    before = conn.execute(version).fetchall()
    assert one(conn, "replayed", "a", start)[0][1] == "replay"
    assert conn.execute(version).fetchall() == before  # an update would make a new row version
    assert one(conn, "replayed", "a", {**start, "attempt": 2})[0][1] == "applied"
    assert conn.execute(version).fetchall() != before
