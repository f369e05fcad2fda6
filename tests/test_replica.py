"""Reads from a streaming replica (docs/scaling.md): a primary of the test's own, a replica
made from it with `pg_basebackup -R`, and a service whose reads go to the replica while it is
healthy and to the primary otherwise, never failing because of the replica."""

import contextlib
import queue
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from app.cli.migrate import migrate
from app.live import MAX_BEHIND_SECONDS
from app.ops.embedded import EmbeddedPostgres
from app.ops.replica import check_interval
from tests.support.databases import make_replica, server_directory
from tests.support.metrics import counter, metric, metrics
from tests.support.servers import start_server, stop
from tests.support.streams import Event, Stream
from tests.support.waits import eventually

MAX_LAG = 1.0
# The bound plus two checks, and a second for a busy machine.
BYPASS_WITHIN = MAX_LAG + 2 * check_interval(MAX_LAG) + 1.0


@dataclass
class Replicated:
    primary: EmbeddedPostgres
    replica: EmbeddedPostgres
    url: str
    banner: Path


@contextlib.contextmanager
def replicated_service(**settings: str) -> Iterator[Replicated]:
    """A primary, its replica and a service reading from it (with `settings` on top)."""
    with server_directory() as directory:
        yield from _replicated(directory, settings)


def _replicated(tmp_path: Path, settings: dict[str, str]) -> Iterator[Replicated]:
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
                **settings,
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


@pytest.fixture
def replicated() -> Iterator[Replicated]:
    with replicated_service() as service:
        yield service


def reads(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {
        pool: counter(text, "steprecord_reads_total", pool=pool) for pool in ("replica", "primary")
    }


def served_by(client: httpx.Client, path: str = "/v1/instances") -> str:
    """Which database served one read (the server has one worker and nobody else reads)."""
    before = reads(str(client.base_url))
    response = client.get(path)
    assert response.status_code == 200, response.text
    after = reads(str(client.base_url))
    (pool,) = [name for name in after if after[name] > before[name]]
    return pool


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
        assert metric(metrics(replicated.url), "steprecord_read_replica_lag_seconds") < MAX_LAG
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
            lag = metric(metrics(replicated.url), "steprecord_read_replica_lag_seconds")
            assert lag > MAX_LAG
            standby.execute("SELECT pg_wal_replay_resume()")
            eventually(lambda: served_by(client) == "replica")
            assert client.get("/v1/instances/fresh/steps/a").status_code == 200
        finally:
            done.set()
            writer.join()
    assert failures == []


# --- the live-update stream through the replica -------------------------------------------


def replica_has(replicated: Replicated, step: str, instance: str = "order-1") -> bool:
    with psycopg.connect(replicated.replica.url, autocommit=True) as standby:
        row = standby.execute(
            "SELECT count(*) FROM workflow_step_record r JOIN process_instance p"
            " ON p.id = r.instance_id WHERE p.instance_key = %s AND r.step_slug = %s",
            (instance, step),
        ).fetchone()
    return row == (1,)


def no_event_for(stream: Stream, seconds: float) -> None:
    """Nothing but keepalives arrives for `seconds`."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        with contextlib.suppress(queue.Empty):
            item = stream.next_item(left)
            assert not isinstance(item, Event), f"unexpected {item}"


@contextlib.contextmanager
def streaming(url: str, instance: str = "order-1", **kwargs: Any) -> Iterator[Stream]:
    stream = Stream(f"{url}/v1/instances/{instance}/stream", **kwargs)
    try:
        yield stream
    finally:
        stream.close()


def test_a_stream_is_served_by_the_replica(replicated: Replicated) -> None:
    with httpx.Client(base_url=replicated.url, timeout=10) as client:
        start(client, "order-1", "charge")
        eventually(lambda: served_by(client) == "replica")
        eventually(lambda: replica_has(replicated, "charge"))
        before = reads(replicated.url)
        with streaming(replicated.url) as stream:
            assert stream.next_event().record["step_slug"] == "charge"
            start(client, "order-1", "ship")
            assert stream.next_event().record["step_slug"] == "ship"
            after = reads(replicated.url)
    # The snapshot, the read when the stream subscribed, the read the write woke.
    assert after["replica"] >= before["replica"] + 3
    assert after["primary"] == before["primary"]


def test_a_stream_on_the_replica_waits_for_an_older_open_transaction_of_the_primary(
    replicated: Replicated,
) -> None:
    """On a standby the snapshot lists no running transaction: the horizon is its xmin. A
    later write, committed and replayed first, is not sent past the older one's change."""
    with httpx.Client(base_url=replicated.url, timeout=10) as client:
        start(client, "order-1", "old")
        eventually(lambda: served_by(client) == "replica")
        eventually(lambda: replica_has(replicated, "old"))
        with streaming(replicated.url) as stream:
            assert stream.next_event().record["step_slug"] == "old"
            with psycopg.connect(replicated.primary.url) as older:
                older.execute(
                    "UPDATE workflow_step_record SET updated_at = now() WHERE step_slug = 'old'"
                )
                start(client, "order-1", "new")  # a later transaction, committed first
                eventually(lambda: replica_has(replicated, "new"))
                before = reads(replicated.url)
                no_event_for(stream, 1.0)
                waiting = reads(replicated.url)
                older.commit()
            got = stream.events(2)
            after = reads(replicated.url)
            resumed_after = got[-1].id
        with streaming(replicated.url, headers={"Last-Event-ID": resumed_after}) as resumed:
            no_event_for(resumed, 1.0)
    assert [event.record["step_slug"] for event in got] == ["old", "new"]
    xid_id = [tuple(int(part) for part in event.id.split("-")) for event in got]
    assert xid_id == sorted(xid_id)
    # Meanwhile the stream kept reading, on the replica only.
    assert waiting["replica"] > before["replica"]
    assert after["primary"] == before["primary"]


def test_a_write_reaches_a_stream_while_replay_is_paused_and_nothing_is_repeated(
    replicated: Replicated,
) -> None:
    with (
        httpx.Client(base_url=replicated.url, timeout=10) as client,
        psycopg.connect(replicated.replica.url, autocommit=True) as standby,
    ):
        start(client, "order-1", "a")
        eventually(lambda: served_by(client) == "replica")
        eventually(lambda: replica_has(replicated, "a"))
        with streaming(replicated.url) as stream:
            sent = [stream.next_event()]
            standby.execute("SELECT pg_wal_replay_pause()")
            eventually(
                lambda: (
                    standby.execute("SELECT pg_get_wal_replay_pause_state()").fetchone()
                    == ("paused",)
                )
            )
            # An instance the replica does not have yet is looked up on the primary: no 404.
            start(client, "fresh", "x")
            with streaming(replicated.url, "fresh") as fresh:
                assert fresh.next_event().record["step_slug"] == "x"
            began = time.monotonic()
            start(client, "order-1", "b")
            sent.append(stream.next_event())
            # The replica is bypassed within the bound, and the stream reads at least once a
            # second while its read is behind.
            assert time.monotonic() - began < BYPASS_WITHIN + MAX_BEHIND_SECONDS
            assert metric(metrics(replicated.url), "steprecord_read_replica_in_use") == 0
            start(client, "order-1", "c")
            sent.append(stream.next_event())
            standby.execute("SELECT pg_wal_replay_resume()")
            eventually(
                lambda: metric(metrics(replicated.url), "steprecord_read_replica_in_use") == 1
            )
            before = reads(replicated.url)
            start(client, "order-1", "d")
            sent.append(stream.next_event())
            assert reads(replicated.url)["replica"] > before["replica"]
            no_event_for(stream, 1.0)
        with streaming(replicated.url, headers={"Last-Event-ID": sent[1].id}) as resumed:
            missed = resumed.events(2)
            no_event_for(resumed, 1.0)
        with streaming(replicated.url) as fresh:
            snapshot = fresh.events(4)
    assert [event.record["step_slug"] for event in sent] == ["a", "b", "c", "d"]
    assert [event.id for event in missed] == [event.id for event in sent[2:]]
    assert [event.id for event in snapshot] == [event.id for event in sent]


def test_a_busy_replica_pool_sends_the_read_to_the_primary_and_stays_in_use() -> None:
    """One connection to each server; a read on the replica holds the one it has (waiting for
    a lock replayed from the primary): another read goes to the primary at once."""
    with (
        replicated_service(STEPRECORD_POOL_SIZE="1", STEPRECORD_DB_TIMEOUT="4") as replicated,
        httpx.Client(base_url=replicated.url, timeout=10) as client,
        psycopg.connect(replicated.replica.url, autocommit=True) as standby,
        psycopg.connect(replicated.primary.url) as locker,
    ):
        start(client, "order-1", "charge")
        eventually(lambda: served_by(client) == "replica")
        eventually(lambda: replica_has(replicated, "charge"))
        locker.execute("LOCK TABLE workflow_step_attempt IN ACCESS EXCLUSIVE MODE")
        # A commit flushes the WAL, the lock's record with it, to the replica.
        with psycopg.connect(replicated.primary.url, autocommit=True) as other:
            other.execute(
                "INSERT INTO process_instance (id, instance_key)"
                " VALUES (steprecord_instance_id('flush'), 'flush')"
            )
        eventually(
            lambda: (
                standby.execute(
                    "SELECT count(*) FROM pg_locks WHERE mode = 'AccessExclusiveLock'"
                    " AND relation = 'workflow_step_attempt'::regclass"
                ).fetchone()
                == (1,)
            )
        )
        blocked: list[httpx.Response] = []
        reader = threading.Thread(
            target=lambda: blocked.append(client.get("/v1/instances/order-1/steps/charge/attempts"))
        )
        reader.start()
        try:
            eventually(
                lambda: (
                    standby.execute(
                        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                    ).fetchone()
                    == (1,)
                )
            )
            before = reads(replicated.url)
            began = time.monotonic()
            response = client.get("/v1/instances")
            took = time.monotonic() - began
            after = reads(replicated.url)
            in_use = metric(metrics(replicated.url), "steprecord_read_replica_in_use")
        finally:
            locker.rollback()
            reader.join()
        assert response.status_code == 200, response.text
        assert after == {"replica": before["replica"], "primary": before["primary"] + 1}
        assert took < 2.0  # not after waiting for the replica's connection (4 s)
        assert in_use == 1
        assert [r.status_code for r in blocked] == [200]
        assert served_by(client) == "replica"
