"""Two service instances on one database behave as one service (docs/scaling.md): a token
created or revoked once holds on both, a write through one is read through the other, and
each instance's metrics count its own requests. (The sweeper across instances: see
tests/test_sweeper.py.)"""

from collections.abc import Iterator

import httpx
import pytest

from tests.support.databases import migrated_database
from tests.support.metrics import counter
from tests.support.servers import start_server, steprecord, stop
from tests.support.tokens import REFRESH, bearer, create_token
from tests.support.waits import eventually


@pytest.fixture
def two_instances(server_dsn: str) -> Iterator[tuple[str, str, str]]:
    """Two `serve` processes on different ports, the first with two workers, and their
    database."""
    with migrated_database(server_dsn, "steprecord_instances_") as database_url:
        first, first_proc = start_server(database_url, "--workers", "2", env=REFRESH)
        try:
            second, second_proc = start_server(database_url, env=REFRESH)
            try:
                yield first, second, database_url
            finally:
                stop(second_proc)
        finally:
            stop(first_proc)


def everywhere(urls: tuple[str, ...], path: str, status: int, token: str | None = None) -> bool:
    """Every instance (and, over a few new connections, every worker) answers `status`."""
    headers = {} if token is None else bearer(token)
    return all(
        httpx.get(url + path, headers=headers).status_code == status
        for url in urls
        for _ in range(4)
    )


def test_tokens_and_revocation_hold_on_every_instance(
    two_instances: tuple[str, str, str],
) -> None:
    first, second, database_url = two_instances
    both = (first, second)
    assert everywhere(both, "/v1/instances", 200)
    writer = create_token(database_url, "writer", "write")
    reader = create_token(database_url, "reader", "read")
    eventually(lambda: everywhere(both, "/v1/instances", 401))
    eventually(lambda: everywhere(both, "/v1/instances", 200, reader))
    eventually(lambda: everywhere(both, "/v1/instances", 200, writer))
    started = httpx.post(
        first + "/v1/instances/run-1/steps/a/start", json={"attempt": 1}, headers=bearer(writer)
    )
    assert started.status_code == 201
    seen = httpx.get(second + "/v1/instances/run-1/steps/a", headers=bearer(reader))
    assert seen.json() == started.json()
    forbidden = httpx.post(second + "/v1/instances/run-1/steps/b/start", headers=bearer(reader))
    assert forbidden.status_code == 403
    done = steprecord(database_url, "token", "revoke", "reader")
    assert done.returncode == 0, done.stderr
    eventually(lambda: everywhere(both, "/v1/instances", 401, reader))
    assert everywhere(both, "/v1/instances", 200, writer)


def test_each_instance_counts_its_own_requests(two_instances: tuple[str, str, str]) -> None:
    first, second, _ = two_instances

    def created(url: str) -> float:
        text = httpx.get(url + "/metrics").text
        return counter(text, "steprecord_events_total", kind="start", outcome="created")

    for i in range(3):
        assert httpx.post(f"{first}/v1/instances/run-1/steps/a{i}/start").status_code == 201
    for i in range(2):
        assert httpx.post(f"{second}/v1/instances/run-1/steps/b{i}/start").status_code == 201
    # Each instance reports its own workers (summed); a scrape of every instance adds up.
    assert (created(first), created(second)) == (3, 2)
    listed = httpx.get(f"{second}/v1/instances/run-1/steps").json()["items"]
    assert [item["step_slug"] for item in listed] == ["a0", "a1", "a2", "b0", "b1"]
