"""Step statistics, long-running steps and far-future timestamps (docs/operations.md,
"Long-running steps and step statistics")."""

from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import psycopg
import pytest

from app.core.cursors import long_running_cursor
from app.data import stats as stats_data
from tests.support.http import T0, ago, post, problem
from tests.support.metrics import metric, metrics

STATS = "/v1/stats/steps"
WINDOW = {"since": "2026-12-02T00:00:00Z", "until": "2026-12-03T00:00:00Z"}
TASK_ID = "0f4c5b1e-9d1a-4c53-8d1e-1a2b3c4d5e6f"


def at(seconds: float) -> str:
    return (datetime(2026, 12, 2, 10, tzinfo=UTC) + timedelta(seconds=seconds)).isoformat()


def run(client: httpx.Client, instance: str, step: str, attempts: list[tuple[str, float]]) -> None:
    """Attempts 1.. of a step, each started a minute after the last, lasting its seconds."""
    for number, (outcome, seconds) in enumerate(attempts, 1):
        start = 60 * number
        body: dict[str, Any] = {"attempt": number, "started_at": at(start)}
        if outcome == "running":
            assert post(client, "start", body, instance, step).status_code in (200, 201)
            continue
        body["completed_at"] = at(start + seconds)
        if outcome == "failed":
            body["error_code"] = "Boom"
        kind = "fail" if outcome == "failed" else "complete"
        response = post(client, kind, body, instance, step)
        assert response.status_code in (200, 201), response.text


def stats(client: httpx.Client, **params: str) -> dict[str, Any]:
    response = client.get(STATS, params={**WINDOW, **params})
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def test_stats_count_attempts_by_outcome_with_failure_rate_and_durations(
    client: httpx.Client,
) -> None:
    run(client, "order-1", "charge", [("failed", 1), ("failed", 3), ("completed", 2)])
    run(client, "order-2", "charge", [("completed", 4)])
    run(client, "order-3", "charge", [("running", 0)])  # running: counted, no duration
    run(client, "order-1", "ship", [("completed", 0.05)])
    body = stats(client)
    assert (body["since"], body["until"]) == ("2026-12-02T00:00:00Z", "2026-12-03T00:00:00Z")
    charge, ship = body["items"]  # most attempts first
    assert charge == {
        "name": "charge",
        "attempts": {"completed": 2, "failed": 2, "superseded": 0, "running": 1},
        "failure_rate": 0.5,
        "duration_ms": {"p50": 2500.0, "p95": 3850.0, "max": 4000.0},
    }
    assert ship["name"] == "ship"
    assert ship["failure_rate"] == 0.0
    assert ship["duration_ms"] == {"p50": 50.0, "p95": 50.0, "max": 50.0}


def test_superseded_attempts_are_counted_without_durations(client: httpx.Client) -> None:
    post(client, "start", {"attempt": 1, "started_at": at(0)})
    post(client, "start", {"attempt": 2, "started_at": at(10)})
    (item,) = stats(client)["items"]
    assert item["attempts"] == {"completed": 0, "failed": 0, "superseded": 1, "running": 1}
    assert item["failure_rate"] is None
    assert item["duration_ms"] == {"p50": None, "p95": None, "max": None}


def test_celery_slugs_are_grouped_by_task_name(client: httpx.Client) -> None:
    run(client, "chain-1", f"shop.charge:{TASK_ID}", [("completed", 1)])
    run(client, "chain-2", f"shop.charge:{TASK_ID[:-1]}7", [("failed", 1)])
    run(client, "chain-2", "shop.charge:not-a-uuid", [("completed", 1)])
    names = {i["name"]: i["attempts"]["completed"] for i in stats(client)["items"]}
    assert names == {"shop.charge": 1, "shop.charge:not-a-uuid": 1}
    (grouped,) = [i for i in stats(client)["items"] if i["name"] == "shop.charge"]
    assert grouped["failure_rate"] == 0.5


def test_mapped_slugs_are_grouped_by_task_id(client: httpx.Client) -> None:
    """An Airflow mapped task's slugs (`load:0` ... `load:39`) are one step, `load`; a slug
    whose part after the last colon is not all digits stays itself."""
    for index in range(40):
        outcome = "failed" if index % 10 == 0 else "completed"
        run(client, "etl:scheduled__2026-12-02T00:00:00+00:00", f"load:{index}", [(outcome, 1)])
    run(client, "etl:scheduled__2026-12-02T00:00:00+00:00", "load:3a", [("completed", 1)])
    run(client, "etl:manual__2026-12-02T00:00:00+00:00", "load", [("completed", 1)])
    items = {i["name"]: i for i in stats(client)["items"]}
    assert set(items) == {"load", "load:3a"}
    assert items["load"]["attempts"] == {
        "completed": 37,
        "failed": 4,
        "superseded": 0,
        "running": 0,
    }
    assert items["load"]["failure_rate"] == round(4 / 41, 4)
    # A prefix with a `+` (an Airflow run id) narrows them like any other.
    within = stats(client, prefix="etl:scheduled__2026-12-02T00:00:00+00")["items"]
    assert {i["name"]: i["attempts"]["completed"] for i in within} == {"load": 36, "load:3a": 1}


def test_only_attempts_started_in_the_window_count(client: httpx.Client) -> None:
    run(client, "order-1", "charge", [("completed", 1), ("completed", 1)])  # at +60 s, +120 s
    assert stats(client, since=at(61), until=at(120))["items"] == []
    (item,) = stats(client, since=at(60), until=at(121))["items"]
    assert item["attempts"]["completed"] == 2


def test_the_window_defaults_to_the_last_24_hours(client: httpx.Client) -> None:
    now = datetime.now(UTC)
    post(client, "start", {"started_at": (now - timedelta(hours=1)).isoformat()}, step="new")
    post(client, "start", {"started_at": (now - timedelta(hours=25)).isoformat()}, step="old")
    response = client.get(STATS)
    assert response.status_code == 200, response.text
    body = response.json()
    assert [i["name"] for i in body["items"]] == ["new"]
    since, until = (datetime.fromisoformat(body[k]) for k in ("since", "until"))
    assert until - since == timedelta(hours=24)


def test_a_prefix_narrows_the_statistics(client: httpx.Client) -> None:
    run(client, "acme-1", "charge", [("completed", 1)])
    run(client, "other-1", "charge", [("failed", 1)])
    (item,) = stats(client, prefix="acme-")["items"]
    assert item["attempts"]["completed"] == 1
    assert item["attempts"]["failed"] == 0
    assert stats(client, prefix="nobody-")["items"] == []


def test_limit_keeps_the_steps_with_most_attempts(client: httpx.Client) -> None:
    run(client, "order-1", "a", [("failed", 1), ("completed", 1)])
    run(client, "order-1", "b", [("completed", 1)])
    assert [i["name"] for i in stats(client, limit="1")["items"]] == ["a"]


@pytest.mark.parametrize(
    ("params", "field", "words"),
    [
        ({"since": "2026-12-02"}, "since", "RFC 3339"),
        ({"until": "2026-12-02T10:00:00"}, "until", "RFC 3339"),
        ({"since": "2026-12-03T00:00:00Z", "until": "2026-12-02T00:00:00Z"}, "since", "before"),
        ({"until": "0001-01-01T00:00:00Z"}, "since", "before"),
        ({"prefix": "bad prefix"}, "prefix", ""),
        ({"limit": "0"}, "limit", ""),
    ],
)
def test_bad_windows_are_refused(
    client: httpx.Client, params: dict[str, str], field: str, words: str
) -> None:
    found = problem(client.get(STATS, params=params), 422, "validation_error")
    assert found["errors"][0]["field"] == field, found
    assert words in found["errors"][0]["message"], found


def test_a_window_near_the_earliest_time_starts_there(client: httpx.Client) -> None:
    response = client.get(STATS, params={"until": "0001-01-01T12:00:00Z"})
    assert response.status_code == 200, response.text
    body = response.json()
    assert (body["since"], body["until"]) == ("0001-01-01T00:00:00Z", "0001-01-01T12:00:00Z")
    assert body["items"] == []


# --- long-running steps ----------------------------------------------------------------


def test_running_longer_than_lists_the_longest_running_first(client: httpx.Client) -> None:
    post(client, "start", {"started_at": ago(hours=3)}, step="oldest")
    post(client, "start", {"started_at": ago(hours=2)}, step="older")
    post(client, "start", {"started_at": ago(minutes=1)}, step="recent")
    post(client, "fail", {"started_at": ago(hours=5), "error_code": "E"}, step="finished")
    post(client, "start", {"started_at": ago(hours=4), "lease_seconds": 3600}, step="leased")
    response = client.get("/v1/steps", params={"running_longer_than": 3600})
    assert response.status_code == 200, response.text
    body = response.json()
    assert [r["step_slug"] for r in body["items"]] == ["leased", "oldest", "older"]
    assert {r["instance_key"] for r in body["items"]} == {"order-1"}
    assert body["next_cursor"] is None


def test_running_longer_than_pages_by_keyset(client: httpx.Client) -> None:
    for n in range(5):
        post(client, "start", {"started_at": ago(hours=10 - n)}, step=f"s{n}")
    seen, cursor = [], None
    while True:
        params: dict[str, Any] = {"running_longer_than": 60, "limit": 2}
        if cursor:
            params["cursor"] = cursor
        body = client.get("/v1/steps", params=params).json()
        seen += [r["step_slug"] for r in body["items"]]
        cursor = body["next_cursor"]
        if cursor is None:
            break
    assert seen == ["s0", "s1", "s2", "s3", "s4"]


def test_running_longer_than_refuses_other_listings_cursors_and_filters(
    client: httpx.Client,
) -> None:
    refused: list[dict[str, str]] = [
        {"running_longer_than": "60", "status": "failed"},
        {"running_longer_than": "60", "lease_expired": "true"},
        {"running_longer_than": "60", "updated_after": T0},
        {"running_longer_than": "-1"},
    ]
    for params in refused:
        problem(client.get("/v1/steps", params=params), 422, "validation_error")
    other = long_running_cursor({"started_at": datetime.now(UTC), "id": 1})
    found = problem(client.get("/v1/steps", params={"cursor": other}), 422, "validation_error")
    assert "running_longer_than" in found["errors"][0]["message"]


def test_metrics_count_long_running_steps_without_a_lease(
    client: httpx.Client, server_url: str
) -> None:
    post(client, "start", {"started_at": ago(hours=2)}, step="forgotten")
    post(client, "start", {"started_at": ago(hours=2), "lease_seconds": 3600}, step="leased")
    post(client, "start", {"started_at": ago(minutes=5)}, step="young")
    assert metric(metrics(server_url), "steprecord_long_running_steps") == 1


# --- far-future timestamps -----------------------------------------------------------


def test_a_timestamp_a_day_ahead_is_refused_with_the_limit(client: httpx.Client) -> None:
    ahead = (datetime.now(UTC) + timedelta(hours=25)).isoformat()
    found = problem(post(client, "start", {"started_at": ahead}), 422, "validation_error")
    assert found["errors"][0]["field"] == "started_at"
    assert "24 hours ahead of the server's clock" in found["detail"], found
    for year in ("2206", "9999"):
        body = {"started_at": T0, "completed_at": f"{year}-01-01T00:00:00Z"}
        found = problem(post(client, "complete", body), 422, "validation_error")
        assert found["errors"][0]["field"] == "completed_at"
    assert client.get("/v1/instances/order-1").status_code == 404  # nothing written


def test_a_clock_a_little_ahead_is_accepted(client: httpx.Client) -> None:
    ahead = (datetime.now(UTC) + timedelta(hours=23)).isoformat()
    assert post(client, "start", {"started_at": ahead}).status_code == 201


def test_a_batch_event_with_a_far_future_timestamp_is_refused(client: httpx.Client) -> None:
    events = [
        {"instance_key": "order-1", "step_slug": "a", "kind": "start", "started_at": T0},
        {
            "instance_key": "order-1",
            "step_slug": "b",
            "kind": "start",
            "started_at": "9999-12-31T00:00:00Z",
        },
    ]
    response = client.post("/v1/events", json={"events": events})
    assert response.status_code == 200, response.text
    good, bad = response.json()["results"]
    assert good["status"] == 201
    assert bad["status"] == 422
    assert bad["problem"]["code"] == "validation_error"
    assert "24 hours ahead of the server's clock" in bad["problem"]["detail"], bad
    assert client.get("/v1/instances/order-1/steps/b").status_code == 404


@pytest.mark.parametrize(
    "slug",
    [
        "charge",
        "shop.tasks.charge:5f0c7d6e-2b1a-4c3d-9e8f-0a1b2c3d4e5f",
        "shop.tasks.charge:5F0C7D6E-2B1A-4C3D-9E8F-0A1B2C3D4E5F",
        "a:5f0c7d6e-2b1a-4c3d-9e8f-0a1b2c3d4e5f:5f0c7d6e-2b1a-4c3d-9e8f-0a1b2c3d4e5f",
        "a:5f0c7d6e-2b1a-4c3d-9e8f-0a1b2c3d4e5g",
        "a-5f0c7d6e-2b1a-4c3d-9e8f-0a1b2c3d4e5f",
        "5f0c7d6e-2b1a-4c3d-9e8f-0a1b2c3d4e5f",
        "a:5f0c7d6e-2b1a-4c3d-9e8f:0a1b2c3d4e5f",
        "a:5f0c7d6e-2b1a-4c3d-9e8f-0a1b2c3d4e5f0",
        "a:5f0c7d6e-2b1a-4c3d-9e8f-0a1b2c3d4e5",
        "x",
        "load:0",
        "load:39",
        "etl.load:1234567",
        "load:",
        "load:3a",
        "load:-3",
        "a::12",
        "a:12:5f0c7d6e-2b1a-4c3d-9e8f-0a1b2c3d4e5f",
        "a:5f0c7d6e-2b1a-4c3d-9e8f-0a1b2c3d4e5f:7",
        "12",
        "3:4",
    ],
)
def test_the_step_name_without_a_regular_expression_is_the_regular_expressions(
    db: psycopg.Connection[tuple[object, ...]], slug: str
) -> None:
    row = db.execute(
        f"SELECT {stats_data.NAME_OF.format(s='%(slug)s::text')},"
        f" regexp_replace(%(slug)s, '{stats_data.GROUPED_TAIL}', '')",
        {"slug": slug},
    ).fetchone()
    assert row is not None
    assert row[0] == row[1]
