"""Reads from a streaming replica (README, "Scaling"): a primary of the test's own, a replica
made from it with `pg_basebackup -R`, and a service whose reads go to the replica while it is
healthy and to the primary otherwise, never failing because of the replica."""

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from app.cli import migrate
from app.embedded import EmbeddedPostgres
from app.replica import check_interval
from tests.conftest import start_server, stop
from tests.helpers import make_replica
from tests.test_operations import metric

MAX_LAG = 1.0
# The bound plus two checks, and a second for a busy machine.
BYPASS_WITHIN = MAX_LAG + 2 * check_interval(MAX_LAG) + 1.0


@dataclass
class Replicated:
    primary: EmbeddedPostgres
    replica: EmbeddedPostgres
    url: str
    banner: Path


@pytest.fixture
def replicated(tmp_path: Path) -> Iterator[Replicated]:
    primary = EmbeddedPostgres(tmp_path / "primary")
    primary.start()
    try:
        migrate(primary.url)
        replica = make_replica(primary, tmp_path / "replica")
        try:
            banner = tmp_path / "stderr.txt"
            env = {
                # The password is there to be hidden (the servers trust local connections).
                "STEPRECORD_READ_DATABASE_URL": make_conninfo(replica.url, password="s3cret"),
                "STEPRECORD_READ_MAX_LAG_SECONDS": str(MAX_LAG),
                "STEPRECORD_SWEEP_SECONDS": "0",
            }
            with banner.open("wb") as err:
                url, proc = start_server(primary.url, env=env, stderr=err)
            try:
                yield Replicated(primary, replica, url, banner)
            finally:
                stop(proc)
        finally:
            replica.stop()
    finally:
        primary.stop()


def reads(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {
        pool: metric(text, "steprecord_reads_total", pool=pool) for pool in ("replica", "primary")
    }


def served_by(client: httpx.Client, path: str = "/v1/instances") -> str:
    """Which database served one read (the server has one worker and nobody else reads)."""
    before = reads(str(client.base_url))
    response = client.get(path)
    assert response.status_code == 200, response.text
    after = reads(str(client.base_url))
    (pool,) = [name for name in after if after[name] > before[name]]
    return pool


def eventually(check: Callable[[], bool], seconds: float = 15) -> float:
    """Seconds it took until `check()` held."""
    began = time.monotonic()
    while not check():
        assert time.monotonic() - began < seconds, "did not happen in time"
        time.sleep(0.05)
    return time.monotonic() - began


def start(client: httpx.Client, instance: str, step: str) -> None:
    response = client.post(f"/v1/instances/{instance}/steps/{step}/start", json={"attempt": 1})
    assert response.status_code == 201, response.text


def test_reads_are_served_by_the_replica(replicated: Replicated) -> None:
    with httpx.Client(base_url=replicated.url, timeout=10) as client:
        start(client, "order-1", "charge")
        eventually(lambda: served_by(client) == "replica")
        eventually(lambda: client.get("/v1/instances/order-1/steps/charge").status_code == 200)
        before = reads(replicated.url)
        paths = [
            "/v1/instances",
            "/v1/instances/order-1",
            "/v1/instances/order-1/steps",
            "/v1/instances/order-1/steps/charge",
            "/v1/instances/order-1/steps/charge/attempts",
            "/v1/steps?status=running",
        ]
        for path in paths:
            response = client.get(path)
            assert response.status_code == 200, response.text
        after = reads(replicated.url)
        assert after["replica"] - before["replica"] == len(paths)
        assert after["primary"] == before["primary"]
        # The dashboard's pages too.
        for page in ("/ui", "/ui/instances/order-1", "/ui/instances/order-1/steps/charge"):
            assert served_by(client, page) == "replica"
        # An idle primary does not make the replica look behind: nothing is left to replay.
        time.sleep(2 * MAX_LAG)
        assert served_by(client) == "replica"
        assert metric_value(replicated.url, "steprecord_read_replica_lag_seconds") < MAX_LAG
        # Writes and the schema check still use the primary.
        assert client.get("/readyz").status_code == 200
        start(client, "order-1", "ship")
    with psycopg.connect(replicated.primary.url) as conn:
        assert conn.execute("SELECT count(*) FROM workflow_step_record").fetchone() == (2,)
    banner = replicated.banner.read_text()
    assert "reads from replica" in banner
    assert "password=***" in banner
    assert "s3cret" not in banner


def test_a_replica_stopped_mid_load_costs_no_failed_read(replicated: Replicated) -> None:
    statuses: list[int] = []
    done = threading.Event()

    def keep_reading() -> None:
        with httpx.Client(base_url=replicated.url, timeout=10) as reader:
            while not done.is_set():
                statuses.append(reader.get("/v1/instances/order-1/steps/charge").status_code)

    with httpx.Client(base_url=replicated.url, timeout=10) as client:
        start(client, "order-1", "charge")
        eventually(lambda: served_by(client) == "replica")
        eventually(lambda: client.get("/v1/instances/order-1/steps/charge").status_code == 200)
        readers = [threading.Thread(target=keep_reading) for _ in range(4)]
        for reader in readers:
            reader.start()
        try:
            before = reads(replicated.url)
            eventually(lambda: reads(replicated.url)["replica"] > before["replica"] + 50)
            replicated.replica.stop()
            stopped = reads(replicated.url)
            eventually(lambda: reads(replicated.url)["primary"] > stopped["primary"] + 100)
        finally:
            done.set()
            for reader in readers:
                reader.join()
        assert len(statuses) > 150
        assert set(statuses) == {200}
        # Back in use once it runs again.
        replicated.replica.start()
        eventually(lambda: served_by(client) == "replica")


def test_a_paused_replay_is_bypassed_within_the_lag_bound_and_used_again_after(
    replicated: Replicated,
) -> None:
    done = threading.Event()
    failures: list[str] = []

    def keep_writing() -> None:
        with httpx.Client(base_url=replicated.url, timeout=10) as writer:
            while not done.is_set():
                step = uuid.uuid4().hex[:12]
                response = writer.post(f"/v1/instances/load/steps/{step}/start")
                if response.status_code != 201:
                    failures.append(response.text)
                time.sleep(0.01)

    with (
        httpx.Client(base_url=replicated.url, timeout=10) as client,
        psycopg.connect(replicated.replica.url, autocommit=True) as standby,
    ):
        eventually(lambda: served_by(client) == "replica")
        writer = threading.Thread(target=keep_writing)
        writer.start()
        try:
            time.sleep(MAX_LAG)  # the replica keeps up with the writes meanwhile
            assert served_by(client) == "replica"
            standby.execute("SELECT pg_wal_replay_pause()")
            bypassed_after = eventually(lambda: served_by(client) == "primary")
            assert bypassed_after < BYPASS_WITHIN
            # Served by the primary, a write is readable at once.
            start(client, "fresh", "a")
            assert client.get("/v1/instances/fresh/steps/a").status_code == 200
            lag = metric_value(replicated.url, "steprecord_read_replica_lag_seconds")
            assert lag > MAX_LAG
            standby.execute("SELECT pg_wal_replay_resume()")
            eventually(lambda: served_by(client) == "replica")
            assert client.get("/v1/instances/fresh/steps/a").status_code == 200
        finally:
            done.set()
            writer.join()
    assert failures == []


def metric_value(url: str, name: str) -> float:
    """A metric without labels."""
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no {name} in the metrics")
