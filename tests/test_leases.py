"""Leases, heartbeats, the sweeper and the reads across instances, through the HTTP stack.

The shared server sweeps every 0.2 s, so an expired lease is closed about a second after a
1-second lease ends (docs/api.md, "Leases and the sweeper").
"""

import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import psycopg
import pytest

from app.data import leases
from tests.support.databases import migrated_database
from tests.support.http import T1, T2, attempts, history, post, problem, record
from tests.support.metrics import counter
from tests.support.servers import start_server, stop
from tests.support.waits import eventually, wait_for


def parse(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def test_start_with_a_lease_holds_it_from_the_database_clock(client: httpx.Client) -> None:
    before = datetime.now(UTC)
    body = post(client, "start", {"attempt": 1, "started_at": T1, "lease_seconds": 60}).json()
    after = datetime.now(UTC)
    lease = parse(body["lease_expires_at"])
    assert before + timedelta(seconds=59) <= lease <= after + timedelta(seconds=61)
    assert attempts(client)[0]["lease_expires_at"] == body["lease_expires_at"]


def test_start_without_a_lease_has_none(client: httpx.Client) -> None:
    assert post(client, "start").json()["lease_expires_at"] is None
    assert attempts(client)[0]["lease_expires_at"] is None


def test_heartbeat_extends_the_lease_and_changes_nothing_else(client: httpx.Client) -> None:
    started = post(client, "start", {"attempt": 1, "started_at": T1, "lease_seconds": 5}).json()
    beat = post(client, "heartbeat", {"attempt": 1, "lease_seconds": 600})
    assert beat.status_code == 200
    body = beat.json()
    assert parse(body["lease_expires_at"]) > parse(started["lease_expires_at"]) + timedelta(
        seconds=500
    )
    unchanged = ("status", "attempt_count", "started_at", "completed_at", "ordinal", "id")
    assert {k: body[k] for k in unchanged} == {k: started[k] for k in unchanged}
    assert body["updated_at"] > started["updated_at"]
    (only,) = attempts(client)
    assert (only["status"], only["lease_expires_at"]) == ("running", body["lease_expires_at"])


@pytest.mark.parametrize(
    "terminal",
    [
        ("complete", {"attempt": 1, "output": 1}),
        ("fail", {"attempt": 1, "error_code": "Boom"}),
    ],
)
def test_terminal_events_clear_the_lease(
    client: httpx.Client, terminal: tuple[str, dict[str, Any]]
) -> None:
    leased = post(client, "start", {"attempt": 1, "lease_seconds": 60}).json()
    kind, body = terminal
    assert post(client, kind, body).json()["lease_expires_at"] is None
    (only,) = attempts(client)
    assert only["lease_expires_at"] == leased["lease_expires_at"]  # the lease it last held


def test_a_new_attempt_without_lease_seconds_holds_no_lease(client: httpx.Client) -> None:
    post(client, "start", {"attempt": 1, "lease_seconds": 60})
    body = post(client, "start", {"attempt": 2}).json()
    assert body["lease_expires_at"] is None
    assert history(client) == [(1, "superseded"), (2, "running")]


def test_heartbeat_of_a_lower_attempt_is_stale(client: httpx.Client) -> None:
    post(client, "start", {"attempt": 2, "started_at": T2, "lease_seconds": 60})
    body = problem(
        post(client, "heartbeat", {"attempt": 1, "lease_seconds": 60}), 409, "stale_attempt"
    )
    assert body["current"]["attempt_count"] == 2


@pytest.mark.parametrize(
    ("setup", "attempt"),
    [
        ([("start", {"attempt": 1}), ("complete", {"attempt": 1})], 1),
        ([("start", {"attempt": 1}), ("fail", {"attempt": 1, "error_code": "E"})], 1),
        ([("start", {"attempt": 1})], 2),
    ],
    ids=["completed", "failed", "higher-attempt"],
)
def test_heartbeat_of_an_attempt_that_is_not_running_is_refused(
    client: httpx.Client, setup: list[tuple[str, dict[str, Any]]], attempt: int
) -> None:
    for kind, body in setup:
        post(client, kind, body)
    before = record(client)
    answer = problem(
        post(client, "heartbeat", {"attempt": attempt, "lease_seconds": 60}), 409, "not_running"
    )
    assert answer["current"] == before
    assert record(client) == before


def test_heartbeat_without_a_start_is_not_started_and_creates_nothing(
    client: httpx.Client,
) -> None:
    problem(post(client, "heartbeat", {"attempt": 1, "lease_seconds": 60}), 409, "not_started")
    problem(client.get("/v1/instances/order-1"), 404, "instance_not_found")
    post(client, "declare")
    body = problem(
        post(client, "heartbeat", {"attempt": 1, "lease_seconds": 60}), 409, "not_started"
    )
    assert body["current"]["status"] == "pending"


@pytest.mark.parametrize(
    "body",
    [
        None,
        {"attempt": 1},
        {"lease_seconds": 5},
        {"attempt": 1, "lease_seconds": 0},
        {"attempt": 1, "lease_seconds": 86401},
        {"attempt": 1, "lease_seconds": "5"},
        {"attempt": 1, "lease_seconds": 5.0},
        {"attempt": 1, "lease_seconds": 5, "lease": 5},
    ],
)
def test_heartbeat_bodies_are_validated(client: httpx.Client, body: Any) -> None:
    post(client, "start", {"attempt": 1, "lease_seconds": 60})
    problem(post(client, "heartbeat", body), 422, "validation_error")


@pytest.mark.parametrize("lease", [0, 86401, True, "60", 1.5])
def test_start_refuses_a_bad_lease(client: httpx.Client, lease: Any) -> None:
    problem(post(client, "start", {"lease_seconds": lease}), 422, "validation_error")
    problem(client.get("/v1/instances/order-1"), 404, "instance_not_found")


def test_lease_seconds_belongs_to_start_only(client: httpx.Client) -> None:
    post(client, "start", {"attempt": 1})
    for kind in ("declare", "complete", "fail"):
        body = {"lease_seconds": 5, **({"error_code": "E"} if kind == "fail" else {})}
        problem(post(client, kind, body), 422, "validation_error")


def test_batch_takes_heartbeats_in_order(client: httpx.Client) -> None:
    def event(kind: str, step: str, **fields: Any) -> dict[str, Any]:
        return {"instance_key": "order-1", "step_slug": step, "kind": kind, **fields}

    results = client.post(
        "/v1/events",
        json={
            "events": [
                event("start", "a", attempt=1, lease_seconds=5),
                event("heartbeat", "a", attempt=1, lease_seconds=600),
                event("heartbeat", "b", attempt=1, lease_seconds=600),
                event("heartbeat", "a", attempt=1),
                event("complete", "a", attempt=1),
                event("heartbeat", "a", attempt=1, lease_seconds=600),
            ]
        },
    ).json()["results"]
    assert [r["status"] for r in results] == [201, 200, 409, 422, 200, 409]
    assert parse(results[1]["record"]["lease_expires_at"]) > parse(
        results[0]["record"]["lease_expires_at"]
    ) + timedelta(seconds=500)
    assert results[2]["problem"]["code"] == "not_started"
    assert results[5]["problem"]["code"] == "not_running"
    assert results[4]["record"]["lease_expires_at"] is None


# --- the sweeper ------------------------------------------------------------------------


def test_an_expired_lease_is_swept_as_a_failure_at_its_expiry(client: httpx.Client) -> None:
    before = client.get("/metrics").text
    started = post(client, "start", {"attempt": 1, "started_at": T1, "lease_seconds": 1}).json()
    swept = wait_for("the sweep", lambda: (r := record(client))["status"] == "failed" and r)
    assert swept["error_code"] == "lease_expired"
    assert swept["completed_at"] == started["lease_expires_at"]
    assert swept["lease_expires_at"] is None
    assert swept["attempt_count"] == 1
    (only,) = attempts(client)
    assert (only["status"], only["error_code"], only["completed_at"]) == (
        "failed",
        "lease_expired",
        started["lease_expires_at"],
    )
    after = client.get("/metrics").text
    labels = {"kind": "fail", "outcome": "swept"}
    assert counter(after, "steprecord_events_total", **labels) >= (
        counter(before, "steprecord_events_total", **labels) + 1
    )
    late = problem(post(client, "complete", {"attempt": 1, "output": 1}), 409, "conflict")
    assert late["current"]["error_code"] == "lease_expired"
    assert post(client, "start", {"attempt": 2}).status_code == 200
    assert history(client) == [(1, "failed"), (2, "running")]


def test_heartbeats_keep_a_step_past_its_first_lease(client: httpx.Client) -> None:
    post(client, "start", {"attempt": 1, "lease_seconds": 1})
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        assert post(client, "heartbeat", {"attempt": 1, "lease_seconds": 1}).status_code == 200
        time.sleep(0.25)
    assert record(client)["status"] == "running"
    eventually(lambda: record(client)["status"] == "failed")


def test_a_step_without_a_lease_is_never_swept(client: httpx.Client) -> None:
    post(client, "start", {"attempt": 1}, step="free")
    post(client, "start", {"attempt": 1, "lease_seconds": 1}, step="leased")
    eventually(lambda: record(client, step="leased")["status"] == "failed")
    assert record(client, step="free")["status"] == "running"


# --- reads across instances -------------------------------------------------------------


def recent(client: httpx.Client, **params: Any) -> list[dict[str, Any]]:
    response = client.get("/v1/steps", params=params)
    assert response.status_code == 200, response.text
    items: list[dict[str, Any]] = response.json()["items"]
    return items


def test_steps_across_instances_are_newest_first_with_their_instance(
    client: httpx.Client,
) -> None:
    post(client, "start", instance="run-a", step="one")
    post(client, "fail", {"started_at": T1, "error_code": "E"}, instance="run-b", step="two")
    post(client, "declare", instance="run-a", step="three")
    post(client, "complete", {"output": 1}, instance="run-a", step="one")
    items = recent(client)
    assert [(i["instance_key"], i["step_slug"]) for i in items] == [
        ("run-a", "one"),
        ("run-a", "three"),
        ("run-b", "two"),
    ]
    assert [i["updated_at"] for i in items] == sorted(
        (i["updated_at"] for i in items), reverse=True
    )
    assert [i["step_slug"] for i in recent(client, status="failed,pending")] == ["three", "two"]
    cut = items[1]["updated_at"]
    assert [i["step_slug"] for i in recent(client, updated_after=cut)] == ["one"]
    assert "output" not in recent(client, fields="summary")[0]


def test_paging_across_instances_sees_each_record_once(client: httpx.Client) -> None:
    for i in range(7):
        post(client, "start", instance=f"run-{i % 3}", step=f"s{i}")
    seen: list[str] = []
    cursor = None
    while True:
        params: dict[str, Any] = {"limit": 2, **({"cursor": cursor} if cursor else {})}
        page = client.get("/v1/steps", params=params).json()
        seen += [item["step_slug"] for item in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == [f"s{i}" for i in reversed(range(7))]


@pytest.mark.parametrize(
    "params",
    [
        {"lease_expired": "false"},
        {"lease_expired": "yes"},
        {"updated_after": "2026-12-02T10:00:00"},
        {"updated_after": "yesterday"},
        {"status": "done"},
        {"cursor": "garbage"},
        {"limit": 0},
    ],
)
def test_bad_filters_across_instances_are_refused(
    client: httpx.Client, params: dict[str, Any]
) -> None:
    problem(client.get("/v1/steps", params=params), 422, "validation_error")


def test_a_cursor_of_another_listing_is_refused(client: httpx.Client) -> None:
    for step in ("a", "b"):
        post(client, "start", step=step)
    cursor = client.get("/v1/instances/order-1/steps", params={"limit": 1}).json()["next_cursor"]
    problem(client.get("/v1/steps", params={"cursor": cursor}), 422, "validation_error")


@pytest.fixture(scope="module")
def quiet_database(server_dsn: str) -> Iterator[str]:
    """A database of this module's own: no sweeper but the one these tests control."""
    with migrated_database(server_dsn, "steprecord_leases_") as url:
        yield url


@pytest.fixture(scope="module")
def unswept(quiet_database: str) -> Iterator[httpx.Client]:
    """A server with the sweeper off, so expired leases stay put."""
    url, proc = start_server(quiet_database, env={"STEPRECORD_SWEEP_SECONDS": "0"})
    try:
        with httpx.Client(base_url=url, timeout=30) as c:
            yield c
    finally:
        stop(proc)


def expire(database_url: str, step: str) -> None:
    """Move a lease into the past by hand (the database refuses nothing here), each instance's
    in a transaction of its own: on Citus a transaction that writes on two workers commits in
    two phases, which PostgreSQL refuses once the record's trigger has notified."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        instances = conn.execute(
            "SELECT DISTINCT instance_id FROM workflow_step_record WHERE step_slug = %s", (step,)
        ).fetchall()
        assert instances, step
        for (instance_id,) in instances:
            conn.execute(
                "UPDATE workflow_step_record SET lease_expires_at = now() - interval '1 minute'"
                " WHERE instance_id = %s AND step_slug = %s",
                (instance_id, step),
            )


def test_expired_leases_are_listed_until_swept(unswept: httpx.Client, quiet_database: str) -> None:
    key = "run-" + uuid.uuid4().hex[:8]
    for step in ("stuck", "alive", "free"):
        post(unswept, "start", {"lease_seconds": 600} if step != "free" else {}, key, step)
    expire(quiet_database, "stuck")
    assert [i["step_slug"] for i in recent(unswept, lease_expired="true")] == ["stuck"]
    assert recent(unswept, lease_expired="true", status="failed") == []
    assert (
        post(unswept, "heartbeat", {"attempt": 1, "lease_seconds": 600}, key, "stuck").status_code
        == 200
    )
    assert recent(unswept, lease_expired="true") == []


def test_a_sweep_skips_a_record_held_by_a_heartbeat_in_flight(
    unswept: httpx.Client, quiet_database: str
) -> None:
    """A sweep never waits for, or writes, a record another transaction holds (SKIP LOCKED);
    once the heartbeat commits, its renewed lease keeps the attempt alive."""
    key = "run-" + uuid.uuid4().hex[:8]
    post(unswept, "start", {"attempt": 1, "lease_seconds": 600}, key, "racing")
    expire(quiet_database, "racing")
    with (
        psycopg.connect(quiet_database) as holder,
        psycopg.connect(quiet_database, autocommit=True) as sweeper,
    ):
        row = sweeper.execute("SELECT steprecord_instance_id(%s)", (key,)).fetchone()
        assert row is not None
        holder.execute(  # the instance's id: on Citus, a transaction on its worker alone
            "UPDATE workflow_step_record SET lease_expires_at = now() + interval '10 minutes',"
            " updated_at = now() WHERE instance_id = %s AND step_slug = 'racing'",
            (row[0],),
        )
        sweep = (leases.SWEEP_INSTANCE, {"instance_id": row[0]})
        assert sweeper.execute(*sweep).fetchone() == (0,)
        holder.commit()
        assert sweeper.execute(*sweep).fetchone() == (0,)
    assert record(unswept, key, "racing")["status"] == "running"
