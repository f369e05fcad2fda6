"""Faults on a Citus cluster of the test's own (`own_citus`): a worker stopped and started again.

The instances and their pending steps are written with plain SQL through the coordinator and
the record's triggers with a transition table are off (Citus refuses them on a shard, as of
this revision); the service then writes each step with a single event.
"""

import uuid
from collections.abc import Iterator

import httpx
import psycopg
import pytest

from app.cli import migrate
from tests.helpers import (
    CitusCluster,
    create_database,
    drop_database,
    eventually,
    one_key_per_worker,
    post,
    problem,
    record,
    start_server,
    stop,
    without_transition_table_triggers,
)

STEPS = [f"s{n}" for n in range(4)]
NEW_INSTANCE = """
INSERT INTO process_instance (id, instance_key) VALUES (steprecord_instance_id(%(key)s), %(key)s)
"""
NEW_STEP = """
INSERT INTO workflow_step_record (instance_id, step_slug, ordinal, status, attempt_count)
VALUES (steprecord_instance_id(%(key)s), %(step)s, %(ordinal)s, 'pending', 1)
"""


@pytest.fixture
def cluster_service(own_citus: CitusCluster) -> Iterator[tuple[CitusCluster, str, list[str]]]:
    """The cluster, a database on it migrated by `steprecord migrate` alone with a pending
    step per STEPS in an instance on each worker, and a service on it."""
    name = f"steprecord_faults_{uuid.uuid4().hex[:8]}"
    url = create_database(own_citus.url, name)
    try:
        migrate(url)
        keys = one_key_per_worker(url, own_citus)
        with psycopg.connect(url, autocommit=True) as conn:
            without_transition_table_triggers(conn)
            for key in keys:
                conn.execute(NEW_INSTANCE, {"key": key})
                for ordinal, step in enumerate(STEPS):
                    conn.execute(NEW_STEP, {"key": key, "step": step, "ordinal": ordinal})
        base, proc = start_server(url)
        try:
            yield own_citus, base, keys
        finally:
            stop(proc)
    finally:
        for worker in own_citus.workers:
            worker.start()  # running again, whatever the test left stopped
        drop_database(own_citus.url, name)


def test_a_stopped_worker_answers_503_for_its_instances_the_other_keeps_working_nothing_lost(
    cluster_service: tuple[CitusCluster, str, list[str]],
) -> None:
    cluster, base, (down, up) = cluster_service
    stopped = cluster.workers[0]
    accepted: list[tuple[str, str]] = []  # every (instance, step) whose start got a 2xx
    with httpx.Client(base_url=base, timeout=30) as client:
        first, *during = STEPS
        for key in (down, up):
            assert post(client, "start", instance=key, step=first).status_code == 200
            accepted.append((key, first))
        stopped.stop()
        try:
            for step in during:
                response = post(client, "start", instance=down, step=step)
                body = problem(response, 503, "unavailable")
                assert response.headers["Retry-After"].isdigit()
                assert "retry" in body["detail"]
                for secret in (str(stopped.port), "127.0.0.1", "localhost"):
                    assert secret not in response.text
                # The other worker's instance is written and read meanwhile.
                written = post(client, "start", instance=up, step=step)
                assert written.status_code == 200, written.text
                accepted.append((up, step))
                assert record(client, up, step)["status"] == "running"
        finally:
            stopped.start()

        def retried(step: str) -> bool:
            response = post(client, "start", instance=down, step=step)
            assert response.status_code in (200, 503), response.text
            return response.status_code == 200

        for step in during:
            eventually(lambda step=step: retried(step), 30, 0.2, f"{step} after the restart")
            accepted.append((down, step))
        for key in (down, up):
            for step in STEPS:
                want = "running" if (key, step) in accepted else "pending"
                assert record(client, key, step)["status"] == want, (key, step)
    assert len(accepted) == 2 * len(STEPS)
