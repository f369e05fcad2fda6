"""The convergence guarantee (docs/api.md, "Events"), as a property, for the record and its history.

For any set of events of one step in which every event carries `attempt` and its timestamps,
with at most one terminal content per attempt and identical duplicates, every arrival order
and every concurrent interleaving ends in the same record, and every response is 2xx or 409
`stale_attempt`.

The history converges too. When each attempt's events arrive before any higher attempt's (in
any order, or concurrently, within the attempt), the history is always the same. In any order
at all, the current attempt's history is the same, and every earlier attempt that reported an
end holds its own terminal report, however late it came (a late report is refused for the
record but kept in the history). An earlier attempt that never reported an end is
`superseded`, or absent when even its start came after a higher attempt's (a late start
writes nothing).
"""

import asyncio
import threading
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import psycopg
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.data.judge import APPLY_EVENT
from tests.support.databases import lock_waits
from tests.support.http import attempts, post, problem
from tests.support.waits import wait_for

Event = tuple[str, dict[str, Any]]
BASE = datetime(2026, 12, 2, 10, 0, tzinfo=UTC)
COMPARED = (
    "status",
    "attempt_count",
    "ordinal",
    "output",
    "external_output_url",
    "started_at",
    "completed_at",
    "error_code",
    "error_message",
)


def ts(seconds: int) -> str:
    return (BASE + timedelta(seconds=seconds)).isoformat().replace("+00:00", "Z")


@st.composite
def step_events(draw: st.DrawFn) -> list[Event]:
    events: list[Event] = []
    if draw(st.booleans()):
        events.append(("declare", {}))
    for attempt in range(1, draw(st.integers(1, 3)) + 1):
        started = attempt * 100 + draw(st.integers(0, 9))
        if draw(st.booleans()):
            events.append(("start", {"attempt": attempt, "started_at": ts(started)}))
        terminal = draw(st.sampled_from(["none", "complete", "complete_url", "fail"]))
        finished = {
            "attempt": attempt,
            "started_at": ts(started),
            "completed_at": ts(started + draw(st.integers(0, 50))),
        }
        if terminal == "complete":
            output = draw(
                st.one_of(
                    st.none(),
                    st.integers(),
                    st.dictionaries(st.sampled_from("abc"), st.integers(0, 3), max_size=3),
                )
            )
            events.append(("complete", {**finished, "output": output}))
        elif terminal == "complete_url":
            events.append(("complete", {**finished, "external_output_url": f"s3://b/{attempt}"}))
        elif terminal == "fail":
            events.append(
                (
                    "fail",
                    {
                        **finished,
                        "error_code": "Boom",
                        "error_message": draw(st.sampled_from([None, "x", "y"])),
                    },
                )
            )
    if not events:
        events.append(("start", {"attempt": 1, "started_at": ts(1)}))
    duplicates = draw(st.lists(st.sampled_from(events), max_size=3))
    return events + duplicates


HISTORY = (
    "attempt",
    "status",
    "started_at",
    "completed_at",
    "output",
    "external_output_url",
    "error_code",
    "error_message",
)
TERMINAL = {"complete": "completed", "fail": "failed"}


def attempt_of(event: Event) -> int:
    attempt: int = event[1].get("attempt", 0)  # a declare has none: it comes first
    return attempt


def by_attempt(events: list[Event]) -> list[Event]:
    """The same events, each attempt's after every lower attempt's (stable within one)."""
    return sorted(events, key=attempt_of)


def acceptable(response: httpx.Response) -> bool:
    if response.is_success:
        return True
    return response.status_code == 409 and response.json()["code"] == "stale_attempt"


def apply_in_order(client: httpx.Client, key: str, events: list[Event]) -> dict[str, Any]:
    for kind, body in events:
        response = client.post(f"/v1/instances/{key}/steps/s/{kind}", json=body)
        assert acceptable(response), (kind, body, response.text)
        assert client.get(f"/v1/instances/{key}/steps/s").status_code == 200
    return final(client, key)


def final(client: httpx.Client, key: str) -> dict[str, Any]:
    record = client.get(f"/v1/instances/{key}/steps/s").json()
    attempts = client.get(f"/v1/instances/{key}/steps/s/attempts").json()["items"]
    return {
        **{field: record[field] for field in COMPARED},
        "history": [{field: a[field] for field in HISTORY} for a in attempts],
    }


def assert_truthful(result: dict[str, Any], reference: dict[str, Any], events: list[Event]) -> None:
    """The record and the current attempt as in the reference; earlier attempts as they were."""
    assert {k: v for k, v in result.items() if k != "history"} == {
        k: v for k, v in reference.items() if k != "history"
    }
    rows: list[dict[str, Any]] = result["history"]
    assert rows[-1:] == reference["history"][-1:]
    ended = {body["attempt"] for kind, body in events if kind in TERMINAL}
    earlier = {row["attempt"] for row in rows[:-1]}
    assert {a for a in ended if a < result["attempt_count"]} <= earlier, (ended, rows)
    for row in rows[:-1]:
        own = [body for kind, body in events if body.get("attempt") == row["attempt"]]
        assert own, row
        assert row["started_at"] == own[0]["started_at"]
        terminals = {
            TERMINAL[kind]: body
            for kind, body in events
            if kind in TERMINAL and body.get("attempt") == row["attempt"]
        }
        if row["status"] == "superseded":
            assert row["attempt"] not in ended, row  # its own end was kept, whenever it came
            assert row["completed_at"] >= row["started_at"]
            continue
        assert row["status"] in terminals, row
        body = terminals[row["status"]]
        assert row["completed_at"] == body["completed_at"]
        for field in ("output", "external_output_url", "error_code", "error_message"):
            assert row[field] == body.get(field), (field, row, body)


async def apply_concurrently(base_url: str, key: str, events: list[Event]) -> None:
    await apply_groups_concurrently(base_url, key, [events])


async def apply_groups_concurrently(base_url: str, key: str, groups: list[list[Event]]) -> None:
    """Each group's events at once, one group after another."""
    for group in groups:
        await _concurrently(base_url, key, group)


async def _concurrently(base_url: str, key: str, events: list[Event]) -> None:
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        responses = await asyncio.gather(
            *(
                client.post(f"/v1/instances/{key}/steps/s/{kind}", json=body)
                for kind, body in events
            )
        )
    for (kind, body), response in zip(events, responses, strict=True):
        assert acceptable(response), (kind, body, response.text)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data(), events=step_events())
def test_every_order_and_interleaving_ends_in_the_same_record_and_history(
    shared_client: httpx.Client, server_url: str, data: st.DataObject, events: list[Event]
) -> None:
    reference = apply_in_order(shared_client, f"ref-{uuid.uuid4().hex}", by_attempt(events))
    shuffled = data.draw(st.permutations(events))
    grouped = by_attempt(shuffled)
    assert apply_in_order(shared_client, f"grp-{uuid.uuid4().hex}", grouped) == reference
    key = f"cgrp-{uuid.uuid4().hex}"
    groups = [
        [e for e in grouped if attempt_of(e) == a] for a in sorted(set(map(attempt_of, grouped)))
    ]
    asyncio.run(apply_groups_concurrently(server_url, key, groups))
    assert final(shared_client, key) == reference
    assert_truthful(
        apply_in_order(shared_client, f"perm-{uuid.uuid4().hex}", shuffled), reference, events
    )
    key = f"conc-{uuid.uuid4().hex}"
    asyncio.run(apply_concurrently(server_url, key, shuffled))
    assert_truthful(final(shared_client, key), reference, events)


def test_a_late_report_whose_statement_began_before_a_higher_attempt_took_over_is_kept(
    client: httpx.Client, database_url: str
) -> None:
    """The general statement (a batch) reads the history as its snapshot saw it, which may be
    older than the record it then locks: a higher attempt that took the record over meanwhile
    superseded the late attempt's entry in its own transaction. The report still ends it."""
    key = f"late-{uuid.uuid4().hex}"
    assert post(client, "start", {"attempt": 1, "started_at": ts(100)}, key, "s").status_code == 201
    late = {"attempt": 1, "started_at": ts(100), "completed_at": ts(110), "output": {"n": 1}}
    batch = {"events": [{"instance_key": key, "step_slug": "s", "kind": "complete", **late}]}
    answers: list[httpx.Response] = []
    with (
        psycopg.connect(database_url, autocommit=True) as watcher,
        psycopg.connect(database_url) as holder,
        psycopg.RawCursor(holder) as cur,
    ):
        # Attempt 3 takes the record over and supersedes attempt 1's entry, not committed yet.
        cur.execute(APPLY_EVENT, [0, key, "s", "start", 3, ts(300), *([None] * 8), "ci", None])
        assert cur.fetchone() is not None
        sender = threading.Thread(
            target=lambda: answers.append(client.post("/v1/events", json=batch))
        )
        sender.start()
        try:
            wait_for("the late report blocked on the record", lambda: lock_waits(watcher) >= 1)
            holder.commit()
        finally:
            sender.join()
    (result,) = answers[0].json()["results"]
    assert result["status"] == 409, result
    assert result["problem"]["code"] == "stale_attempt"
    assert result["problem"]["recorded"] is True
    items = attempts(client, key, "s")
    assert [(a["attempt"], a["status"]) for a in items] == [(1, "completed"), (3, "running")]
    assert items[0]["output"] == {"n": 1}
    assert problem(post(client, "complete", late, key, "s"), 409, "stale_attempt")["recorded"]
