"""`POST /v1/events` (docs/api.md, "Batch"): each event judged as its own endpoint would
judge it."""

import uuid
from typing import Any

import httpx
import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.http import T1, T2, T3, problem


def ev(kind: str, step: str = "s", instance: str = "order-1", **fields: Any) -> dict[str, Any]:
    return {"instance_key": instance, "step_slug": step, "kind": kind, **fields}


def batch(client: httpx.Client, events: list[Any]) -> list[dict[str, Any]]:
    response = client.post("/v1/events", json={"events": events})
    assert response.status_code == 200, response.text
    results: list[dict[str, Any]] = response.json()["results"]
    assert len(results) == len(events)
    return results


def counts(database_url: str) -> tuple[int, int]:
    with psycopg.connect(database_url) as conn:
        row = conn.execute(
            "SELECT (SELECT count(*) FROM process_instance),"
            " (SELECT count(*) FROM workflow_step_record)"
        ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def test_results_come_back_in_request_order(client: httpx.Client) -> None:
    results = batch(
        client,
        [
            ev("start", "a", attempt=1, started_at=T1),
            ev("declare", "b"),
            ev("complete", "a", attempt=1, completed_at=T2, output={"x": 1}),
            ev("complete", "c", output=1),
            ev("start", "a", attempt=1, started_at=T1),
        ],
    )
    assert [r["status"] for r in results] == [201, 201, 200, 409, 200]
    assert results[2]["record"]["status"] == "completed"
    assert results[2]["record"]["started_at"] == T1
    assert results[3]["problem"]["code"] == "not_started"
    assert results[4]["record"]["output"] == {"x": 1}


def test_events_of_one_step_see_each_other(client: httpx.Client) -> None:
    results = batch(client, [ev("start"), ev("start"), ev("complete", output="ok"), ev("start")])
    assert [r["record"]["attempt_count"] for r in results] == [1, 2, 2, 3]
    assert client.get("/v1/instances/order-1/steps/s").json()["status"] == "running"


def test_refused_events_write_nothing_and_do_not_stop_the_others(
    client: httpx.Client, database_url: str
) -> None:
    results = batch(
        client,
        [
            ev("start", "has space"),
            ev("start", "ok", atempt=1),
            "not an object",
            ev("complete", "x", instance="nobody"),
            ev("start", "a", ordinal=3),
            ev("start", "b", ordinal=3),
            ev("launch", "c"),
            ev("start", "d"),
        ],
    )
    codes = [r.get("problem", {}).get("code") or r["status"] for r in results]
    assert codes == [
        "validation_error",
        "validation_error",
        "validation_error",
        "not_started",
        201,
        "ordinal_taken",
        "validation_error",
        201,
    ]
    assert results[6]["status"] == 422
    assert results[7]["record"]["ordinal"] == 4
    assert counts(database_url) == (1, 2)


def test_ordinals_follow_event_order_with_client_ordinals_mixed_in(client: httpx.Client) -> None:
    results = batch(
        client,
        [
            ev("declare", "a"),
            ev("declare", "b", ordinal=10),
            ev("declare", "c"),
            ev("declare", "d", ordinal=5),
            ev("declare", "e"),
            ev("declare", "a", ordinal=99),
        ],
    )
    assert [r["record"]["ordinal"] for r in results] == [0, 10, 11, 5, 12, 0]
    assert client.post("/v1/instances/order-1/steps/f/declare").json()["ordinal"] == 13


@pytest.mark.parametrize(
    "body",
    [
        [],
        {"events": []},
        {"events": "x"},
        {"items": []},
        {"events": [ev("start")], "x": 1},
        {"events": [ev("start")] * 1001},
    ],
)
def test_malformed_envelope_is_refused_whole(
    client: httpx.Client, database_url: str, body: Any
) -> None:
    problem(client.post("/v1/events", json=body), 422, "validation_error")
    assert counts(database_url) == (0, 0)


def test_thousand_events_are_accepted(client: httpx.Client) -> None:
    results = batch(client, [ev("start", f"s{i}") for i in range(1000)])
    assert all(r["status"] == 201 for r in results)


def test_batch_body_over_sixteen_mebibytes_is_refused(client: httpx.Client) -> None:
    content = b'{"events": ["' + b"x" * (16 * 1024 * 1024) + b'"]}'
    problem(client.post("/v1/events", content=content), 413, "payload_too_large")


def test_batch_body_may_exceed_the_single_event_cap(client: httpx.Client) -> None:
    big = "x" * (1024 * 1024 - 10)
    results = batch(client, [ev("complete", f"s{i}", started_at=T1, output=big) for i in range(3)])
    assert [r["status"] for r in results] == [201, 201, 201]


def test_not_json_is_invalid_json(client: httpx.Client) -> None:
    problem(client.post("/v1/events", content=b"{"), 400, "invalid_json")


# --- the batch and the single endpoints agree ------------------------------------------

STEPS = ["a", "b", "c"]


@st.composite
def event_lists(draw: st.DrawFn) -> list[dict[str, Any]]:
    events = []
    for _ in range(draw(st.integers(1, 12))):
        kind = draw(st.sampled_from(["declare", "start", "complete", "fail"]))
        fields: dict[str, Any] = {
            "instance": draw(st.sampled_from(["i1", "i2"])),
            "step": draw(st.sampled_from(STEPS)),
        }
        if draw(st.booleans()):
            fields["attempt"] = draw(st.integers(1, 3))
        if draw(st.integers(0, 4)) == 0:
            fields["ordinal"] = draw(st.integers(0, 6))
        if kind in ("start", "complete", "fail") and draw(st.booleans()):
            fields["started_at"] = T1
        if kind in ("complete", "fail"):
            fields["completed_at"] = T3
        if kind == "complete" and draw(st.booleans()):
            fields["output"] = draw(st.sampled_from([1, "x", {"k": [1, 2]}]))
        if kind == "fail":
            fields["error_code"] = draw(st.sampled_from(["E1", "E2"]))
        events.append(ev(kind, **fields))
    return events


COMPARED = (
    "step_slug",
    "ordinal",
    "status",
    "attempt_count",
    "output",
    "external_output_url",
    "error_code",
    "error_message",
)


def summary(result: dict[str, Any]) -> Any:
    if "problem" in result:
        return result["status"], result["problem"]["code"]
    return result["status"], {k: result["record"][k] for k in COMPARED}


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(events=event_lists())
def test_batch_and_single_endpoints_give_identical_results(
    shared_client: httpx.Client, events: list[dict[str, Any]]
) -> None:
    run = uuid.uuid4().hex[:8]
    singles = []
    for event in events:
        body = {k: v for k, v in event.items() if k not in ("instance_key", "step_slug", "kind")}
        url = f"/v1/instances/single-{run}-{event['instance_key']}/steps/{event['step_slug']}"
        response = shared_client.post(f"{url}/{event['kind']}", json=body)
        result = response.json()
        singles.append(
            summary(
                {"status": response.status_code, "problem": result}
                if response.status_code >= 400
                else {"status": response.status_code, "record": result}
            )
        )
    batched = [{**e, "instance_key": f"batch-{run}-{e['instance_key']}"} for e in events]
    results = shared_client.post("/v1/events", json={"events": batched}).json()["results"]
    assert [summary(r) for r in results] == singles
    for key in ("i1", "i2"):
        a = shared_client.get(f"/v1/instances/single-{run}-{key}/steps")
        b = shared_client.get(f"/v1/instances/batch-{run}-{key}/steps")
        assert a.status_code == b.status_code
        if a.status_code == 200:
            records = [
                [{k: r[k] for k in COMPARED} for r in side.json()["items"]] for side in (a, b)
            ]
            assert records[0] == records[1]


def test_every_event_of_a_batch_is_counted_by_kind_and_outcome(client: httpx.Client) -> None:
    def count(text: str, kind: str, outcome: str) -> float:
        line = f'steprecord_events_total{{kind="{kind}",outcome="{outcome}"}} '
        found = [row for row in text.splitlines() if row.startswith(line)]
        return float(found[0].rsplit(" ", 1)[1]) if found else 0.0

    key = "counted-" + uuid.uuid4().hex[:8]
    before = client.get("/metrics").text
    batch(
        client,
        [
            *(ev("start", f"s{i}", key, attempt=1) for i in range(3)),
            ev("start", "s0", key, attempt=1),
            ev("complete", "s1", key, attempt=1, output=1),
            ev("start", "bad slug", key),
            {"kind": "nonsense"},
        ],
    )
    after = client.get("/metrics").text
    expected = {
        ("start", "created"): 3,
        ("start", "replay"): 1,
        ("complete", "applied"): 1,
        ("start", "refused"): 1,
        ("unknown", "refused"): 1,
    }
    for (kind, outcome), amount in expected.items():
        assert count(after, kind, outcome) - count(before, kind, outcome) == amount, (kind, outcome)
