"""The judge's two database functions, called with raw SQL as `psql` or another client would.

`steprecord_apply_event` (one event, scalar arguments) must answer exactly as a one-element call
of `steprecord_apply_events` (README, "Events"): the single endpoints use the first, batches the
second.
"""

from typing import Any

import psycopg

from app.data.judge import PARAMS

Conn = psycopg.Connection[tuple[object, ...]]

ONE = "SELECT * FROM steprecord_apply_event(%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"
SET = (
    "SELECT * FROM steprecord_apply_events(%s::int[], %s::text[], %s::text[], %s::text[],"
    " %s::bigint[], %s::timestamptz[], %s::timestamptz[], %s::text[], %s::text[], %s::text[],"
    " %s::text[], %s::bigint[], %s::int[])"
)
FIELDS = PARAMS[2:]  # the arguments after the instance key and the step slug
# Everything but the generated id and the clock's times (created_at, updated_at, a lease).
COMPARED = (
    *("i", "outcome", "step_slug", "ordinal", "status", "attempt_count", "output"),
    *("external_output_url", "started_at", "completed_at", "error_code", "error_message"),
)

T1, T2, T3, T4 = (f"2026-12-04T10:00:0{n}Z" for n in range(1, 5))
# One step's events, in order, reaching every outcome: created, replay, applied, conflict,
# stale_attempt, not_started (a terminal event without a start on a new step), ordinal_taken.
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
    ("b", {"kind": "complete", "attempt": 1, "completed_at": T2}),
    ("c", {"kind": "start", "ordinal": 7, "started_at": T1}),
    ("e", {"kind": "start", "started_at": T1}),
    ("f", {"kind": "start", "ordinal": 2**31, "started_at": T1}),  # past the last ordinal
]


def one(db: Conn, instance_key: str, slug: str, event: dict[str, Any]) -> list[tuple[Any, ...]]:
    args = [5, instance_key, slug, *(event.get(field) for field in FIELDS)]
    return _compared(db.execute(ONE, args))


def general(db: Conn, instance_key: str, slug: str, event: dict[str, Any]) -> list[tuple[Any, ...]]:
    args = [[5], [instance_key], [slug], *([event.get(field)] for field in FIELDS)]
    return _compared(db.execute(SET, args))


def _compared(cur: psycopg.Cursor[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    assert cur.description is not None
    names = [column.name for column in cur.description]
    return [tuple(row[names.index(name)] for name in COMPARED) for row in cur.fetchall()]


def test_one_event_function_answers_as_the_general_function(db: Conn) -> None:
    outcomes = []
    for slug, event in EVENTS:
        by_one = one(db, "judged-alone", slug, event)
        by_set = general(db, "judged-in-a-set", slug, event)
        assert by_one == by_set, (slug, event)
        outcomes.append(by_one[0][1] if by_one else None)
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
        "not_started",
        "created",
        "created",
        "ordinal_taken",
    ]


def test_one_event_function_writes_nothing_for_a_replay(db: Conn) -> None:
    start = {"kind": "start", "attempt": 1, "started_at": T1}
    one(db, "replayed", "a", start)
    version = (
        "SELECT r.ctid::text FROM workflow_step_record r JOIN process_instance p"
        " ON p.id = r.instance_id WHERE p.instance_key = 'replayed'"
    )
    before = db.execute(version).fetchall()
    assert one(db, "replayed", "a", start)[0][1] == "replay"
    assert db.execute(version).fetchall() == before  # an update would make a new row version
    assert one(db, "replayed", "a", {**start, "attempt": 2})[0][1] == "applied"
    assert db.execute(version).fetchall() != before
