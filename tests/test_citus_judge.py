"""The judge on a Citus cluster (the `citus` fixture), through the service: a batch is judged
event by event, each on its instance's worker, and answers as one node does, in request
order; a new record and a late report go through the delegated one-event judge; racing
events converge; and a refusal raised on a worker cites its constraint as on one node."""

import threading
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from app.data.common import constraint_name
from app.data.judge import APPLY_EVENT
from tests.support.citus import CitusCluster, on_node, one_key_per_worker, rows_on_worker
from tests.support.databases import create_database, drop_database, migrated_database
from tests.support.http import attempts, post, problem, record
from tests.support.servers import start_server, steprecord, stop
from tests.support.waits import eventually, wait_for

T1 = "2026-01-01T00:00:01Z"
T2 = "2026-01-01T00:00:02Z"


@pytest.fixture(scope="module")
def cluster_database(citus: CitusCluster) -> Iterator[str]:
    with migrated_database(citus.url, "steprecord_citus_judge_") as url:
        yield url


@pytest.fixture(scope="module")
def service(cluster_database: str) -> Iterator[str]:
    base, proc = start_server(cluster_database, env={"STEPRECORD_SWEEP_SECONDS": "0"})
    try:
        yield base
    finally:
        stop(proc)


@pytest.fixture
def client(service: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=service, timeout=30) as c:
        yield c


def test_a_batch_spanning_both_workers_answers_in_request_order_as_one_node_does(
    citus: CitusCluster, cluster_database: str, client: httpx.Client
) -> None:
    one, two = one_key_per_worker(cluster_database, citus)
    events: list[dict[str, Any]] = [
        {"instance_key": one, "step_slug": "a", "kind": "start", "attempt": 1},
        {"instance_key": two, "step_slug": "a", "kind": "declare"},
        {"instance_key": one, "step_slug": "b", "kind": "start", "ordinal": 5},
        {"instance_key": two, "step_slug": "b", "kind": "start", "lease_seconds": 60},
        # The same step again: it sees the effects of the events before it.
        {"instance_key": one, "step_slug": "a", "kind": "complete", "attempt": 1},
        {
            "instance_key": two,
            "step_slug": "b",
            "kind": "heartbeat",
            "attempt": 1,
            "lease_seconds": 120,
        },
        {"instance_key": one, "step_slug": "a", "kind": "complete", "attempt": 1},
        {"instance_key": two, "step_slug": "a", "kind": "start", "attempt": 2},
        # A late report of attempt 1, which the history never saw (it was only declared):
        # the report becomes its entry.
        {
            "instance_key": two,
            "step_slug": "a",
            "kind": "fail",
            "attempt": 1,
            "started_at": T1,
            "completed_at": T2,
            "error_code": "E",
            "error_message": "late",
        },
        {"instance_key": one, "step_slug": "c", "kind": "complete"},
    ]
    response = client.post("/v1/events", json={"events": events})
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    summary = [
        (r["status"], (r.get("record") or {}).get("status"), (r.get("record") or {}).get("ordinal"))
        for r in results
    ]
    assert summary == [
        (201, "running", 0),
        (201, "pending", 0),
        (201, "running", 5),
        (201, "running", 1),
        (200, "completed", 0),
        (200, "running", 1),
        (200, "completed", 0),  # a replay
        (200, "running", 0),
        (409, None, None),
        (409, None, None),
    ]
    assert results[8]["problem"]["code"] == "stale_attempt"
    assert results[8]["problem"]["recorded"] is True
    assert results[9]["problem"]["code"] == "not_started"
    assert [a["status"] for a in attempts(client, two, "a")] == ["failed", "running"]
    # The rows are on both workers, each instance's on its own.
    name = psycopg.conninfo.conninfo_to_dict(cluster_database)["dbname"]
    assert isinstance(name, str)
    for worker in citus.workers:
        assert rows_on_worker(on_node(worker.url, name), "workflow_step_record") >= 2


def test_a_new_record_and_a_late_report_go_through_the_delegated_one_event_judge(
    cluster_database: str, client: httpx.Client
) -> None:
    key = f"one-{uuid.uuid4().hex[:8]}"
    # The service's one-event statement is one task on one worker, the whole call sent there.
    with (
        psycopg.connect(cluster_database, autocommit=True) as conn,
        psycopg.RawCursor(conn) as cur,
    ):
        params = [0, key, "s", "start", *([None] * 10), "ci", None]
        cur.execute(f"EXPLAIN (VERBOSE) {APPLY_EVENT}", params)
        plan = "\n".join(str(row[0]) for row in cur.fetchall())
    assert "Task Count: 1" in plan
    assert "Function Call: steprecord_apply_event(" in plan

    assert post(client, "start", {"attempt": 1, "started_at": T1}, key, "s").status_code == 201
    assert post(client, "start", {"attempt": 2}, key, "s").status_code == 200
    late = {"attempt": 1, "completed_at": T2, "output": {"n": 1}}
    body = problem(post(client, "complete", late, key, "s"), 409, "stale_attempt")
    assert body["recorded"] is True
    assert record(client, key, "s")["attempt_count"] == 2
    items = attempts(client, key, "s")
    assert [(a["attempt"], a["status"]) for a in items] == [(1, "completed"), (2, "running")]


def test_racing_events_on_one_instance_converge(cluster_database: str, service: str) -> None:
    """Eight clients at once, each creating steps of one new instance and moving a shared
    step through its attempts: distinct ordinals, one record per step, the shared step at
    its newest attempt."""
    key = f"race-{uuid.uuid4().hex[:8]}"
    barrier = threading.Barrier(8)
    failures: list[BaseException] = []

    def worker(n: int) -> None:
        try:
            with httpx.Client(base_url=service, timeout=60) as c:
                barrier.wait(30)
                for m in range(3):
                    response = post(c, "start", None, key, f"own-{n}-{m}")
                    assert response.status_code == 201, response.text
                    response = post(c, "start", {"attempt": n + 1}, key, "shared")
                    assert response.status_code in (200, 201, 409), response.text
        except BaseException as exc:
            failures.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not failures, failures
    with httpx.Client(base_url=service, timeout=30) as c:
        page = c.get(f"/v1/instances/{key}/steps", params={"limit": 100}).json()["items"]
        shared = record(c, key, "shared")
    ordinals = sorted(r["ordinal"] for r in page)
    assert ordinals == list(range(25))
    assert shared["attempt_count"] == 8
    assert shared["status"] == "running"


def test_refusals_raised_on_a_worker_cite_their_constraint_as_on_one_node(
    cluster_database: str, client: httpx.Client
) -> None:
    key = f"refused-{uuid.uuid4().hex[:8]}"
    # Through the service: a taken ordinal (a unique key on the shard) and a timing CHECK.
    post(client, "start", {"ordinal": 3}, key, "a")
    body = problem(post(client, "start", {"ordinal": 3}, key, "b"), 409, "ordinal_taken")
    assert "ordinal 3 is held by step 'a'" in body["detail"]
    post(client, "start", {"attempt": 1, "started_at": T2}, key, "t")
    body = problem(
        post(client, "complete", {"attempt": 1, "completed_at": T1}, key, "t"),
        422,
        "invalid_timing",
    )
    assert body["constraint"] == "ck_workflow_step_record_timing"
    # Raw SQL through the coordinator: the guards' triggers and a unique key by their names.
    post(client, "complete", {"attempt": 1}, key, "a")
    where = f"instance_id = steprecord_instance_id('{key}') AND step_slug = 'a'"
    refused = {
        f"UPDATE workflow_step_record SET output = '2' WHERE {where}": (
            "tr_workflow_step_record_transition"
        ),
        f"DELETE FROM workflow_step_attempt WHERE instance_id = steprecord_instance_id('{key}')": (
            "tr_workflow_step_attempt_guard"
        ),
        "INSERT INTO workflow_step_record (instance_id, step_slug, ordinal, status,"
        f" attempt_count) VALUES (steprecord_instance_id('{key}'), 'a', 9, 'pending', 1)": (
            "uq_workflow_step_record_instance_id_step_slug"
        ),
    }
    with psycopg.connect(cluster_database, autocommit=True) as conn:
        for statement, name in refused.items():
            with pytest.raises(psycopg.errors.IntegrityError) as caught:
                conn.execute(statement)
            assert caught.value.diag.constraint_name is None  # as Citus forwards it
            assert constraint_name(caught.value) == name, statement


def test_a_batch_group_whose_worker_is_down_answers_503_and_the_other_groups_commit(
    citus: CitusCluster, cluster_database: str, client: httpx.Client
) -> None:
    up, down = one_key_per_worker(cluster_database, citus)
    events = [
        {"instance_key": down, "step_slug": "a", "kind": "start"},
        {"instance_key": up, "step_slug": "a", "kind": "start"},
        {"instance_key": down, "step_slug": "b", "kind": "declare"},
        {"instance_key": up, "step_slug": "b", "kind": "declare"},
    ]
    citus.workers[1].stop()
    try:
        response = client.post("/v1/events", json={"events": events})
    finally:
        citus.workers[1].start()
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    assert [r["status"] for r in results] == [503, 201, 503, 201]
    for result in (results[0], results[2]):
        assert result["problem"]["code"] == "unavailable"
        assert "retry after" in result["problem"]["detail"]
    assert [r["step_slug"] for r in client.get(f"/v1/instances/{up}/steps").json()["items"]] == [
        "a",
        "b",
    ]
    # Once the worker is back, the same events are judged there.
    again = wait_for(
        "the worker back",
        lambda: (
            r
            if (r := client.post("/v1/events", json={"events": events[::2]})).status_code == 200
            and all(x["status"] == 201 for x in r.json()["results"])
            else None
        ),
        seconds=60,
    )
    assert [x["record"]["ordinal"] for x in again.json()["results"]] == [0, 1]


# The sessions a node holds for the test's database under the application name the test gives
# its service (Citus's own connections name themselves `citus_internal …`).
SERVICE_SESSIONS = """
SELECT count(*) FROM pg_stat_activity
WHERE datname = current_database() AND application_name = 'steprecord-direct-test'
"""


def test_the_service_sends_each_instance_s_events_to_the_node_that_holds_it(
    citus: CitusCluster, cluster_database: str
) -> None:
    """With the shard map (`STEPRECORD_CITUS_DIRECT=true`), a service's events, heartbeats and
    reads of one instance reach each worker over connections of its own; with
    `STEPRECORD_CITUS_DIRECT=false` they all go through the coordinator, which delegates them
    (the workers see only Citus's connections)."""
    name = psycopg.conninfo.conninfo_to_dict(cluster_database)["dbname"]
    assert isinstance(name, str)
    workers = [on_node(worker.url, name) for worker in citus.workers]

    def sessions() -> list[int]:
        counts = []
        for url in workers:
            with psycopg.connect(url, autocommit=True) as conn:
                row = conn.execute(SERVICE_SESSIONS).fetchone()
                assert row is not None
                counts.append(int(row[0]))
        return counts

    for direct, expected in (("false", False), ("true", True)):
        base, proc = start_server(
            psycopg.conninfo.make_conninfo(
                cluster_database, application_name="steprecord-direct-test"
            ),
            env={"STEPRECORD_SWEEP_SECONDS": "0", "STEPRECORD_CITUS_DIRECT": direct},
        )
        try:
            keys = one_key_per_worker(cluster_database, citus)
            with httpx.Client(base_url=base, timeout=30) as client:
                for key in keys:
                    body = {"attempt": 1, "lease_seconds": 60}
                    assert post(client, "start", body, key, "s").status_code == 201
                    beat = post(client, "heartbeat", body, key, "s")
                    assert beat.status_code == 200, beat.text
                    assert record(client, key, "s")["status"] == "running"
                events = [{"instance_key": key, "step_slug": "b", "kind": "start"} for key in keys]
                answer = client.post("/v1/events", json={"events": events})
                assert [r["status"] for r in answer.json()["results"]] == [201, 201]
                assert [all(n > 0 for n in sessions())] == [expected]
        finally:
            stop(proc)
        eventually(lambda: sessions() == [0, 0], what="the service's sessions to end")


def test_a_service_pointed_at_a_worker_judges_and_reads_there_with_its_tokens_on_the_coordinator(
    citus: CitusCluster,
) -> None:
    """`serve` with a worker's URL migrates through the coordinator (where the schema's revision
    and the tokens live: Citus's metadata on the worker names it), then takes every call: the
    events of instances on both workers, a batch, reads of one instance and across instances,
    readiness; a token made with the worker's URL is kept on the coordinator and admits."""
    name = f"steprecord_citus_any_node_{uuid.uuid4().hex[:8]}"
    create_database(citus.url, name)
    worker_url = on_node(citus.workers[0].url, name)
    try:
        base, proc = start_server(
            make_conninfo(worker_url, application_name="steprecord-worker-test"),
            env={"STEPRECORD_SWEEP_SECONDS": "0"},
        )
        try:
            coordinator_url = on_node(citus.url, name)
            with psycopg.connect(coordinator_url) as conn:
                assert conn.execute("SELECT version_num FROM alembic_version").fetchone()
            token = steprecord(worker_url, "token", "create", "w", "--scope", "write")
            assert token.returncode == 0, token.stderr
            with psycopg.connect(coordinator_url) as conn:
                assert conn.execute("SELECT name FROM api_token").fetchall() == [("w",)]
            keys = one_key_per_worker(coordinator_url, citus)
            auth = {"Authorization": f"Bearer {token.stdout.strip()}"}
            with httpx.Client(base_url=base, timeout=30, headers=auth) as client:
                eventually(
                    lambda: client.get("/v1/steps").status_code == 200,
                    what="the service to load the token",
                )
                for key in keys:
                    assert post(client, "start", {"attempt": 1}, key, "s").status_code == 201
                    done = post(client, "complete", {"attempt": 1, "output": {"k": key}}, key, "s")
                    assert done.status_code == 200, done.text
                    assert record(client, key, "s")["output"] == {"k": key}
                events = [{"instance_key": key, "step_slug": "b", "kind": "start"} for key in keys]
                answer = client.post("/v1/events", json={"events": events})
                assert [r["status"] for r in answer.json()["results"]] == [201, 201]
                listed = client.get("/v1/steps", params={"status": "running"}).json()["items"]
                assert sorted(i["instance_key"] for i in listed) == sorted(keys)
                assert client.get("/readyz").status_code == 200
            with psycopg.connect(worker_url, autocommit=True) as conn:
                row = conn.execute(WORKER_TEST_SESSIONS).fetchone()
                assert row is not None
                assert row[0] > 0  # the service's own sessions there
        finally:
            stop(proc)
    finally:
        drop_database(citus.url, name)


WORKER_TEST_SESSIONS = """
SELECT count(*) FROM pg_stat_activity
WHERE datname = current_database() AND application_name = 'steprecord-worker-test'
"""
