"""The judge on a Citus cluster (the `citus` fixture), through the service: a batch is judged
per worker, a statement per shard group, and answers as one node does, in request order; a
new record and a late report go through the delegated one-event judge; racing events
converge; and a refusal raised on a worker cites its constraint as on one node."""

import threading
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import psycopg
import pytest

from app.data.common import constraint_name
from app.data.judge import APPLY_EVENT, APPLY_EVENTS_ON_SHARD
from tests.helpers import (
    CitusCluster,
    attempts,
    lock_waits,
    migrated_database,
    node_of,
    one_key_per_worker,
    post,
    problem,
    record,
    rows_on_worker,
    start_server,
    stop,
    wait_for,
)

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


def on_node(node_url: str, database: str) -> str:
    return psycopg.conninfo.make_conninfo(node_url, dbname=database)


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
        params = [0, key, "s", "start", *([None] * 10), "ci"]
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


# The worker holding a key's shard group, and the group.
_PLACEMENT = """
SELECT pl.groupid, pl.shardid FROM pg_dist_placement pl
WHERE pl.shardid = get_shard_id_for_distribution_column(
    'process_instance', steprecord_instance_id(%s))
"""


def start_on_shard(conn: psycopg.Connection[Any], keys: list[str]) -> list[tuple[Any, ...]]:
    """The shard function called as the service calls it, with a `start` of attempt 1 of step
    `s` of each instance: each event's index and outcome."""
    n = len(keys)
    with psycopg.RawCursor(conn) as cur:
        # Alone at the top of its statement, as the service calls it (inside a subquery, Citus
        # 13.0 crashes the coordinator's backend on a distributed function: operations guide).
        cur.execute(
            APPLY_EVENTS_ON_SHARD,
            [
                *(list(range(n)), keys, ["s"] * n, ["start"] * n, [1] * n),
                *([[None] * n] * 8),
                None,  # no trace id
                "ci",  # the writer
            ],
        )
        return sorted(row[:2] for row in cur.fetchall())


def test_the_shard_function_judges_one_workers_shard_groups_and_refuses_another_workers(
    cluster_database: str,
) -> None:
    """A batch's call for one worker holds events of several of its shard groups: each group's
    statement runs on that worker, in the call's transaction. An event of another worker's
    instance is refused with what to do, and nothing of the call is written."""
    # Instance keys by worker, one per shard group, as many as 200 random keys find.
    keys: dict[int, dict[int, str]] = {}
    with psycopg.connect(cluster_database, autocommit=True) as conn:
        for n in range(200):
            key = f"grp-{uuid.uuid4().hex[:8]}-{n}"
            row = conn.execute(_PLACEMENT, (key,)).fetchone()
            assert row is not None
            keys.setdefault(int(row[0]), {}).setdefault(int(row[1]), key)
        first, second = (list(by_shard.values()) for _, by_shard in sorted(keys.items()))
        assert len(first) >= 4  # four shard groups of one worker

        def call(batch: list[str]) -> list[tuple[Any, ...]]:
            return start_on_shard(conn, batch)

        assert call(first[:3]) == [(0, "created"), (1, "created"), (2, "created")]
        assert call(first[:3]) == [(0, "replay"), (1, "replay"), (2, "replay")]
        with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState) as refused:
            call([first[3], second[0]])
        assert "is not on this node" in str(refused.value)
        assert "outside a transaction block" in str(refused.value.diag.message_hint)
        written = conn.execute(
            "SELECT count(*) FROM process_instance WHERE id = steprecord_instance_id(%s)"
            " OR id = steprecord_instance_id(%s)",
            (first[3], second[0]),
        ).fetchone()
        assert written == (0,)


def test_a_call_rolled_back_after_preparing_a_groups_statement_leaves_that_group_usable(
    cluster_database: str,
) -> None:
    """A worker prepares a shard group's statement once per connection and remembers it in a
    setting of the session. A call whose transaction is rolled back takes the setting back
    but not the PREPARE: the next call of that group in the session finds the statement
    anyway and uses it. (On the worker itself: there the function runs in the caller's
    session, also inside a transaction block.)"""
    key = f"again-{uuid.uuid4().hex[:8]}"
    with psycopg.connect(node_of(cluster_database, key), autocommit=True) as conn:
        with conn.transaction(force_rollback=True):
            assert start_on_shard(conn, [key]) == [(0, "created")]
        assert start_on_shard(conn, [key]) == [(0, "created")]
        assert start_on_shard(conn, [key]) == [(0, "replay")]


def test_two_calls_reaching_the_same_shard_groups_in_opposite_orders_wait_and_never_deadlock(
    cluster_database: str,
) -> None:
    """A call takes its shard groups in the order of their shard ids, whatever the order of
    its events. Two calls over the same two groups, sent in opposite orders while a session
    holds the lower group's record: when it lets go, the first takes both groups and the
    second waits for it; neither deadlocks (taken in the events' order, the second would hold
    the higher group's record while waiting for the lower, which the first holds)."""
    by_shard: dict[int, str] = {}
    with psycopg.connect(cluster_database, autocommit=True) as conn:
        worker: int | None = None
        for n in range(200):
            key = f"order-{uuid.uuid4().hex[:8]}-{n}"
            row = conn.execute(_PLACEMENT, (key,)).fetchone()
            assert row is not None
            worker = int(row[0]) if worker is None else worker
            if int(row[0]) == worker:
                by_shard.setdefault(int(row[1]), key)
        assert len(by_shard) >= 2  # two shard groups of one worker
        low, high = (by_shard[shard] for shard in sorted(by_shard)[:2])
        assert start_on_shard(conn, [low, high]) == [(0, "created"), (1, "created")]

        with psycopg.connect(cluster_database) as holder, psycopg.connect(cluster_database) as w:
            w.autocommit = True
            row = holder.execute("SELECT steprecord_instance_id(%s)", (low,)).fetchone()
            assert row is not None
            holder.execute(
                "SELECT 1 FROM workflow_step_record WHERE instance_id = %s AND step_slug = 's'"
                " FOR UPDATE",
                (row[0],),
            )
            answers: dict[str, list[tuple[Any, ...]] | BaseException] = {}

            def send(name: str, keys: list[str]) -> None:
                try:
                    with psycopg.connect(cluster_database, autocommit=True) as own:
                        answers[name] = start_on_shard(own, keys)
                except BaseException as exc:  # reported below, with the other call's answer
                    answers[name] = exc

            first = threading.Thread(target=send, args=("first", [low, high]))
            first.start()
            wait_for("the first call waits for the held record", lambda: lock_waits(w) >= 1)
            second = threading.Thread(target=send, args=("second", [high, low]))
            second.start()
            wait_for("the second call waits too", lambda: lock_waits(w) >= 2)
            holder.rollback()
            first.join(30)
            second.join(30)
    assert answers == {
        "first": [(0, "replay"), (1, "replay")],
        "second": [(0, "replay"), (1, "replay")],
    }
