"""The convergence guarantee of contract §3, as a property.

For any set of events of one step in which every event carries `attempt` and its timestamps,
with at most one terminal content per attempt and identical duplicates, every arrival order
and every concurrent interleaving ends in the same record, and every response is 2xx or 409
`stale_attempt`.
"""

import asyncio
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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
    return {field: record[field] for field in COMPARED}


async def apply_concurrently(base_url: str, key: str, events: list[Event]) -> None:
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
def test_every_order_and_interleaving_ends_in_the_same_record(
    shared_client: httpx.Client, server_url: str, data: st.DataObject, events: list[Event]
) -> None:
    reference = apply_in_order(shared_client, f"ref-{uuid.uuid4().hex}", events)
    shuffled = data.draw(st.permutations(events))
    assert apply_in_order(shared_client, f"perm-{uuid.uuid4().hex}", shuffled) == reference
    key = f"conc-{uuid.uuid4().hex}"
    asyncio.run(apply_concurrently(server_url, key, shuffled))
    assert final(shared_client, key) == reference
