"""Faults on a Citus cluster of the test's own (`own_citus`): a worker stopped and started again."""

import uuid
from collections.abc import Iterator
from functools import partial

import httpx
import pytest

from app.cli.migrate import migrate
from tests.support.citus import CitusCluster, one_key_per_worker
from tests.support.databases import create_database, drop_database
from tests.support.http import post, problem, record
from tests.support.servers import start_server, stop
from tests.support.waits import eventually

STEPS = [f"s{n}" for n in range(4)]


@pytest.fixture
def cluster_service(own_citus: CitusCluster) -> Iterator[tuple[CitusCluster, str, list[str]]]:
    """The cluster, a database on it migrated by `steprecord migrate` alone, a service on it,
    and instance keys: one on the first worker, then one per STEPS on the second."""
    name = f"steprecord_faults_{uuid.uuid4().hex[:8]}"
    url = create_database(own_citus.url, name)
    try:
        migrate(url)
        keys = one_key_per_worker(url, own_citus)
        keys += [one_key_per_worker(url, own_citus)[1] for _ in STEPS[1:]]
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
    cluster, base, (down, up, *new) = cluster_service
    stopped = cluster.workers[0]
    accepted: list[tuple[str, str]] = []  # every (instance, step) whose start got a 2xx
    with httpx.Client(base_url=base, timeout=30) as client:
        first, *during = STEPS
        for key in (down, up):
            response = post(client, "start", instance=key, step=first)
            assert response.status_code == 201, response.text
            accepted.append((key, first))
        stopped.stop()
        try:
            for step, fresh in zip(during, new, strict=True):
                response = post(client, "start", instance=down, step=step)
                body = problem(response, 503, "unavailable")
                assert response.headers["Retry-After"].isdigit()
                assert "retry" in body["detail"]
                assert "a database node holding this data" in body["detail"]
                for secret in (str(stopped.port), "127.0.0.1", "localhost"):
                    assert secret not in response.text
                # The other worker's instance is written and read meanwhile, a new one made.
                for key in (up, fresh):
                    written = post(client, "start", instance=key, step=step)
                    assert written.status_code == 201, written.text
                    accepted.append((key, step))
                assert record(client, up, step)["status"] == "running"
            # A read over every shard needs every worker.
            listed = client.get("/v1/instances")
            problem(listed, 503, "unavailable")
            assert str(stopped.port) not in listed.text
        finally:
            stopped.start()

        def retried(step: str) -> bool:
            response = post(client, "start", instance=down, step=step)
            # 201 once the worker answers (200 had an earlier try reached it after all).
            assert response.status_code in (200, 201, 503), response.text
            return response.status_code != 503

        for step in during:
            eventually(partial(retried, step), 30, 0.2, f"{step} after the restart")
            accepted.append((down, step))
        for key, step in accepted:
            assert record(client, key, step)["status"] == "running", (key, step)
