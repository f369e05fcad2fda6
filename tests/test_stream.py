"""Live updates (docs/api.md, "Live updates"): the stream of an instance's records over real
servers, resumption by event id, several workers and service instances, and the database's
part (the notification on commit, the transaction id of each write)."""

import asyncio
import contextlib
import json
import signal
import socket
import threading
from collections.abc import Callable, Iterator, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import psycopg
import pytest
from prometheus_client import REGISTRY

from app import live
from app.access.tokens import new_token
from app.core.config import Settings
from app.core.db import Pool
from app.core.limits import MAX_OUTPUT_BYTES
from app.data.stream import STREAM_READ_BYTES, Position
from app.live import LISTENER_NAME
from app.main import create_app
from app.ops.replica import ReadPool
from tests.support.citus import node_of
from tests.support.databases import migrated_database
from tests.support.http import T1, T2, T3, asgi_scope, post, problem, step_path
from tests.support.metrics import metric
from tests.support.servers import start_server, stop
from tests.support.streams import WAIT, Stream
from tests.support.waits import eventually


def as_read(client: httpx.Client, instance: str, step: str) -> str:
    response = client.get(step_path(instance, step))
    assert response.status_code == 200
    return response.text


def test_a_stream_sends_every_record_then_each_applied_write(
    client: httpx.Client, open_stream: Callable[..., Stream]
) -> None:
    post(client, "start", {"attempt": 1, "started_at": T1}, step="fetch")
    post(client, "declare", step="charge")
    stream = open_stream()
    assert stream.response_headers is not None
    assert stream.response_headers["content-type"].startswith("text/event-stream")
    assert stream.response_headers["cache-control"] == "no-cache"
    assert stream.response_headers["x-accel-buffering"] == "no"
    snapshot = stream.events(2)
    assert {e.record["step_slug"] for e in snapshot} == {"fetch", "charge"}
    for event in snapshot:  # exactly as the step's own read renders it
        assert event.data == as_read(client, "order-1", event.record["step_slug"])

    # Each write waits for its event: a record written twice before the stream reads it is
    # sent once, in its latest state (docs/api.md, "Live updates").
    live = []
    for kind, body, step in [
        ("complete", {"attempt": 1, "output": {"rows": 3}}, "fetch"),
        ("start", {"attempt": 1, "started_at": T2}, "charge"),
        ("fail", {"attempt": 1, "error_code": "CardDeclined"}, "charge"),
        ("start", {"attempt": 2, "started_at": T3}, "charge"),
    ]:
        post(client, kind, body, step=step)
        live.append(stream.next_event())
    assert [(e.record["step_slug"], e.record["status"]) for e in live] == [
        ("fetch", "completed"),
        ("charge", "running"),
        ("charge", "failed"),
        ("charge", "running"),
    ]
    assert live[0].record["output"] == {"rows": 3}
    assert live[3].data == as_read(client, "order-1", "charge")
    assert len({e.id for e in snapshot + live}) == 6
    stream.quiet()


def test_a_replay_or_a_refused_event_sends_nothing(
    client: httpx.Client, open_stream: Callable[..., Stream]
) -> None:
    post(client, "start", {"attempt": 2, "started_at": T1})
    stream = open_stream()
    stream.next_event()
    post(client, "start", {"attempt": 2, "started_at": T1})  # replay
    post(client, "declare")  # late declare: unchanged
    problem(post(client, "start", {"attempt": 1}), 409, "stale_attempt")
    problem(post(client, "complete", {"attempt": 2}, step="never"), 409, "not_started")
    problem(post(client, "start", {"attempt": 0}), 422, "validation_error")
    post(client, "complete", {"attempt": 2, "output": 1})
    event = stream.next_event()  # the first event after the refusals is the applied write
    assert (event.record["status"], event.record["output"]) == ("completed", 1)
    problem(post(client, "complete", {"attempt": 2, "output": 2}), 409, "conflict")
    post(client, "complete", {"attempt": 2, "output": 1})  # replay
    stream.quiet()


def test_writes_to_other_instances_are_not_sent(
    client: httpx.Client, open_stream: Callable[..., Stream]
) -> None:
    post(client, "declare", instance="order-1")
    stream = open_stream("order-1")
    stream.next_event()
    post(client, "declare", instance="order-2")
    post(client, "start", instance="order-1")
    assert stream.next_event().record["instance_key"] == "order-1"


def test_resuming_sends_exactly_the_changes_missed(
    client: httpx.Client, open_stream: Callable[..., Stream]
) -> None:
    for step in ("a", "b", "c"):
        post(client, "declare", step=step)
    first = open_stream()
    seen = first.events(3)
    post(client, "start", {"attempt": 1}, step="b")
    seen.append(first.next_event())
    first.close()

    post(client, "start", {"attempt": 1}, step="a")
    post(client, "complete", {"attempt": 1}, step="b")
    post(client, "declare", step="d")

    for resume in ({"headers": {"Last-Event-ID": seen[-1].id}}, {"last_event_id": seen[-1].id}):
        again = open_stream(**resume)
        missed = again.events(3)
        assert [(e.record["step_slug"], e.record["status"]) for e in missed] == [
            ("a", "running"),
            ("b", "completed"),
            ("d", "pending"),
        ]
        again.quiet()
        again.close()

    # A resumed stream goes on live from there.
    again = open_stream(headers={"Last-Event-ID": missed[-1].id})
    post(client, "start", {"attempt": 1}, step="c")
    assert again.next_event().record["step_slug"] == "c"
    again.quiet()


def test_the_header_wins_over_the_query_parameter(
    client: httpx.Client, open_stream: Callable[..., Stream]
) -> None:
    """EventSource reconnects to the URL it was given, with the newest id in the header."""
    post(client, "declare", step="a")
    old = open_stream().next_event().id
    post(client, "declare", step="b")
    newer = open_stream(headers={"Last-Event-ID": old}).next_event()
    post(client, "declare", step="c")
    resumed = open_stream(headers={"Last-Event-ID": newer.id}, last_event_id=old)
    assert resumed.next_event().record["step_slug"] == "c"
    resumed.quiet()


def test_a_write_overwritten_before_the_stream_reads_it_is_sent_once_in_its_latest_state(
    client: httpx.Client, open_stream: Callable[..., Stream]
) -> None:
    post(client, "declare", step="a")
    stream = open_stream()
    last = stream.next_event().id
    stream.close()
    post(client, "start", {"attempt": 1}, step="a")
    post(client, "complete", {"attempt": 1, "output": "done"}, step="a")
    resumed = open_stream(headers={"Last-Event-ID": last})
    assert resumed.next_event().record["output"] == "done"
    resumed.quiet()


def test_an_event_id_beyond_every_transaction_of_the_server_gets_the_instance_again(
    client: httpx.Client, open_stream: Callable[..., Stream]
) -> None:
    """An id from another server (on Citus, from before the instance's shard moved): the
    whole instance again, then each change, rather than silence until this server's
    transaction ids get there."""
    post(client, "declare", step="a")
    resumed = open_stream(headers={"Last-Event-ID": f"{2**40}-1"})
    assert resumed.next_event().record["step_slug"] == "a"
    post(client, "declare", step="b")
    assert resumed.next_event().record["step_slug"] == "b"
    resumed.quiet()


@pytest.mark.parametrize(
    "garbled",
    [
        "x",
        "12",
        "12-",
        "-3",
        "1-2-3",
        "1.5-2",
        "99999999999999999999999-1",
        "1-9223372036854775808",
    ],
)
def test_a_garbled_event_id_is_a_422(client: httpx.Client, garbled: str) -> None:
    post(client, "declare")
    path = "/v1/instances/order-1/stream"
    problem(client.get(path, headers={"Last-Event-ID": garbled}), 422, "validation_error")
    body = problem(client.get(path, params={"last_event_id": garbled}), 422, "validation_error")
    assert body["errors"][0]["field"] == "last_event_id"


def test_an_unknown_instance_is_a_404(client: httpx.Client) -> None:
    problem(client.get("/v1/instances/nobody/stream"), 404, "instance_not_found")


def test_an_unknown_query_parameter_is_refused(client: httpx.Client) -> None:
    post(client, "declare")
    problem(client.get("/v1/instances/order-1/stream?lastEventId=1-1"), 422, "validation_error")


def test_an_idle_stream_sends_keepalive_comments(
    client: httpx.Client, open_stream: Callable[..., Stream]
) -> None:
    post(client, "declare")
    stream = open_stream()
    stream.next_event()
    stream.quiet(keepalives=3)


def streams_open(client: httpx.Client) -> float:
    return metric(client.get("/metrics").text, "steprecord_streams_open")


def test_a_client_that_goes_away_is_unsubscribed_and_the_server_serves_on(
    client: httpx.Client, open_stream: Callable[..., Stream]
) -> None:
    post(client, "declare")
    eventually(lambda: streams_open(client) == 0)
    streams = [open_stream() for _ in range(3)]
    for stream in streams:
        stream.next_event()
    eventually(lambda: streams_open(client) == 3)
    for stream in streams:
        stream.close()
    eventually(lambda: streams_open(client) == 0)
    post(client, "start")
    assert open_stream().next_event().record["status"] == "running"


def test_a_worker_listens_only_while_it_has_a_stream_open(
    client: httpx.Client, open_stream: Callable[..., Stream], database_url: str
) -> None:
    """Without streams there is no listener session, so writes cost no worker a notification."""

    def listeners() -> int:
        with psycopg.connect(database_url) as conn:
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE datname = current_database() AND application_name = %s",
                (LISTENER_NAME,),
            ).fetchone()
        assert row is not None
        return int(row[0])

    post(client, "declare")
    eventually(lambda: streams_open(client) == 0 and listeners() == 0)
    stream = open_stream()
    stream.next_event()
    eventually(lambda: listeners() == 1)
    post(client, "start")
    assert stream.next_event().record["status"] == "running"
    stream.close()
    eventually(lambda: listeners() == 0)


def test_lease_heartbeats_and_the_sweeper_are_streamed(
    client: httpx.Client, open_stream: Callable[..., Stream]
) -> None:
    post(client, "start", {"attempt": 1, "lease_seconds": 1})
    stream = open_stream()
    started = stream.next_event().record
    beat = post(client, "heartbeat", {"attempt": 1, "lease_seconds": 1}).json()
    event = stream.next_event().record
    assert event == beat
    assert event["lease_expires_at"] > started["lease_expires_at"]
    swept = stream.next_event(timeout=WAIT).record  # the sweeper runs every 0.2 s here
    assert (swept["status"], swept["error_code"]) == ("failed", "lease_expired")


# --- across workers and service instances ------------------------------------------------


@pytest.fixture(scope="module")
def two_services(server_dsn: str) -> Iterator[tuple[str, str]]:
    """Two service instances on one database of their own: the first with two workers.

    Keepalives (each followed by a read) come only every minute here, so events arrive by
    notification or not at all within the tests' waits."""
    env = {"STEPRECORD_STREAM_HEARTBEAT_SECONDS": "60"}
    with migrated_database(server_dsn, "steprecord_stream_") as url:
        first, first_proc = start_server(url, "--workers", "2", env=env)
        try:
            second, second_proc = start_server(url, env=env)
            try:
                yield first, second
            finally:
                stop(second_proc)
        finally:
            stop(first_proc)


def test_a_write_taken_by_one_worker_or_service_is_streamed_by_every_other(
    two_services: tuple[str, str],
) -> None:
    first, second = two_services
    instance = "across-workers"
    streams: list[Stream] = []
    try:
        with httpx.Client(base_url=first, timeout=WAIT) as writer:
            post(writer, "declare", instance=instance, step="s0")
            # Several streams on the service with two workers: some land on each worker.
            for base in (first, first, first, first, second, second):
                streams.append(Stream(f"{base}/v1/instances/{instance}/stream"))
            for stream in streams:
                assert stream.next_event().record["step_slug"] == "s0"
            for i, base in enumerate((first, second, first, second), start=1):
                with httpx.Client(base_url=base, timeout=WAIT) as other:
                    post(other, "declare", instance=instance, step=f"s{i}")
            for stream in streams:
                got = [e.record["step_slug"] for e in stream.events(4)]
                assert got == ["s1", "s2", "s3", "s4"]
    finally:
        for stream in streams:
            stream.close()


def test_streams_open_on_two_workers_are_all_counted_and_all_released(
    two_services: tuple[str, str],
) -> None:
    first, _ = two_services
    with httpx.Client(base_url=first, timeout=WAIT) as client:
        post(client, "declare", instance="counted")
        streams = [Stream(f"{first}/v1/instances/counted/stream") for _ in range(4)]
        try:
            for stream in streams:
                stream.next_event()
            eventually(lambda: streams_open(client) == 4)
        finally:
            for stream in streams:
                stream.close()
        eventually(lambda: streams_open(client) == 0)


def test_sigterm_ends_open_streams_and_the_server_exits(server_dsn: str) -> None:
    """A stream never ends by itself: shutdown ends it rather than wait for it."""
    with migrated_database(server_dsn, "steprecord_stream_stop_") as url:
        base, proc = start_server(url, env={"STEPRECORD_STREAM_HEARTBEAT_SECONDS": "0.3"})
        try:
            httpx.post(f"{base}/v1/instances/stopping/steps/a/declare", timeout=WAIT)
            stream = Stream(f"{base}/v1/instances/stopping/stream")
            stream.next_event()
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(WAIT) == 0  # well before uvicorn's 30 s graceful timeout
            stream.close()
        finally:
            stop(proc)


def test_a_stream_needs_a_read_token_once_tokens_exist(server_dsn: str) -> None:
    with migrated_database(server_dsn, "steprecord_stream_auth_") as url:
        token, digest = new_token()
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(
                "INSERT INTO api_token (name, scope, token_sha256) VALUES ('r', 'read', %s)",
                (digest,),
            )
        base, proc = start_server(url, env={"STEPRECORD_STREAM_HEARTBEAT_SECONDS": "0.3"})
        try:
            path = f"{base}/v1/instances/x/stream"
            response = httpx.get(path, timeout=WAIT)
            problem(response, 401, "unauthorized")
            assert response.headers["www-authenticate"].startswith("Bearer")
            authorized = {"Authorization": f"Bearer {token}"}
            problem(httpx.get(path, headers=authorized, timeout=WAIT), 404, "instance_not_found")
        finally:
            stop(proc)


# --- the database's part ------------------------------------------------------------------

Conn = psycopg.Connection[tuple[Any, ...]]


def new_instance(conn: Conn, key: str) -> int:
    # The id as a value, not an INSERT ... SELECT: Citus routes such an INSERT to the
    # instance's worker alone, so the transaction writing the instance's records stays on it.
    row = conn.execute(
        "INSERT INTO process_instance (id, instance_key)"
        " VALUES (steprecord_instance_id(%s), %s) RETURNING id",
        (key, key),
    ).fetchone()
    assert row is not None
    return int(row[0])


def declare(conn: Conn, instance_id: int, slug: str, ordinal: int = 0) -> None:
    conn.execute(
        "INSERT INTO workflow_step_record (instance_id, step_slug, ordinal, status,"
        " attempt_count) VALUES (%s, %s, %s, 'pending', 1)",
        (instance_id, slug, ordinal),
    )


def test_the_notification_is_sent_on_commit_only(database_url: str) -> None:
    # The record's trigger notifies on the node holding the record: the server, or on Citus
    # the instance's worker. Both instances are on the same node, the one listened to.
    node = node_of(database_url, "committed")
    rolled_back = next(
        key for n in range(100) if node_of(database_url, key := f"rolled-back-{n}") == node
    )
    with (
        psycopg.connect(node, autocommit=True) as listener,
        psycopg.connect(database_url) as writer,
    ):
        listener.execute("LISTEN steprecord_changes")
        declare(writer, new_instance(writer, rolled_back), "a")
        writer.rollback()
        committed = new_instance(writer, "committed")
        declare(writer, committed, "a")
        declare(writer, committed, "b", 1)
        writer.execute(
            "UPDATE workflow_step_record SET updated_at = now() WHERE instance_id = %s",
            (committed,),
        )
        writer.commit()
        # Delivered in commit order: a notification of the rolled-back write would come first.
        got = [n.payload for n in listener.notifies(timeout=WAIT, stop_after=1)]
        assert got == [str(committed)]
        assert [n.payload for n in listener.notifies(timeout=0.3)] == []  # one per transaction


def test_the_database_sets_changed_xid_on_every_write_even_by_hand(db: Conn) -> None:
    instance_id = new_instance(db, "by-hand")
    declare(db, instance_id, "a")
    row = db.execute(
        "SELECT changed_xid = pg_current_xact_id() FROM workflow_step_record WHERE step_slug = 'a'"
    ).fetchone()
    assert row == (True,)
    db.execute("UPDATE workflow_step_record SET changed_xid = '5', updated_at = now()")
    row = db.execute(
        "SELECT changed_xid = pg_current_xact_id() FROM workflow_step_record WHERE step_slug = 'a'"
    ).fetchone()
    assert row == (True,)


def test_a_change_committed_behind_an_older_open_transaction_is_not_lost(
    client: httpx.Client, database_url: str, open_stream: Callable[..., Stream]
) -> None:
    """An older transaction that commits after a newer one: the stream waits for it instead
    of moving past its change, and a resumed stream repeats neither."""
    post(client, "declare", step="old")
    stream = open_stream()
    stream.next_event()
    with psycopg.connect(database_url) as older:
        older.execute(
            "UPDATE workflow_step_record SET updated_at = now()"
            " WHERE instance_id = steprecord_instance_id('order-1') AND step_slug = 'old'"
        )
        post(client, "declare", step="new")  # a later transaction, committed first
        older.commit()
    got = stream.events(2)
    assert sorted(e.record["step_slug"] for e in got) == ["new", "old"]
    stream.quiet()
    resumed = open_stream(headers={"Last-Event-ID": got[-1].id})
    resumed.quiet()


# --- streams of one instance share their reads ---------------------------------------------


@pytest.fixture(scope="module")
def sharing_database(server_dsn: str) -> Iterator[str]:
    """A database of this module's own for the in-process reads below: no server of the
    session writes to it."""
    with migrated_database(server_dsn, "steprecord_stream_share_") as url:
        yield url


def reads_served() -> float:
    """Reads this process's pools have served (`steprecord_reads_total`, the primary's)."""
    return REGISTRY.get_sample_value("steprecord_reads_total", {"pool": "primary"}) or 0.0


def seed_records(database_url: str, key: str, slugs: list[str]) -> int:
    with psycopg.connect(database_url) as conn:
        instance_id = new_instance(conn, key)
        for ordinal, slug in enumerate(slugs):
            declare(conn, instance_id, slug, ordinal)
    return instance_id


def slugs_of(update: live.Update) -> list[str]:
    """The step slugs of an update's events, in the order they would be sent."""
    return [
        json.loads(line.removeprefix("data: "))["step_slug"]
        for frame in update.frames
        for line in frame.decode().split("\n")
        if line.startswith("data: ")
    ]


class HeldPool:
    """A pool of one connection, and a way to keep that connection busy meanwhile."""

    def __init__(self, url: str) -> None:
        self.pool = Pool(url, size=1, timeout=10, statement_timeout=10, prepare_threshold=None)
        self.reads = ReadPool(self.pool)
        self._release = asyncio.Event()
        self._holder: asyncio.Task[None] | None = None

    async def hold(self) -> None:
        holding = asyncio.Event()

        async def held() -> None:
            async with self.pool.connection():
                holding.set()
                await self._release.wait()

        self._holder = asyncio.create_task(held())
        await holding.wait()

    async def release(self) -> None:
        self._release.set()
        assert self._holder is not None
        await self._holder


async def all_asking(
    reads: ReadPool, key: str, afters: list[Position]
) -> list[asyncio.Task[live.Update]]:
    """One stream read per position, each started; returns once every one has asked (read
    until it waits for the read it asked for)."""
    asked = asyncio.Event()
    count = [0]

    async def one(after: Position) -> live.Update:
        count[0] += 1
        if count[0] == len(afters):
            asked.set()
        return await live.read_changes(reads, key, after)  # asks before this task yields

    tasks = [asyncio.create_task(one(after)) for after in afters]
    await asked.wait()
    return tasks


def test_streams_of_an_instance_that_read_at_once_share_one_read_and_one_pool_slot(
    sharing_database: str,
) -> None:
    """A wall of dashboards opening together: with the pool's only connection busy, every
    stream that asks joins the one read about to run, which then serves them all."""
    slugs = [f"s{n}" for n in range(30)]
    seed_records(sharing_database, "wall", slugs)

    async def main() -> None:
        held = HeldPool(sharing_database)
        try:
            await held.hold()
            streams = await all_asking(held.reads, "wall", [(0, 0)] * 50)
            assert held.pool.waiting == 1  # one read waits for the connection, not fifty
            before = reads_served()
            await held.release()
            updates = await asyncio.gather(*streams)
            assert reads_served() - before == 1
            for update in updates:
                assert slugs_of(update) == slugs  # the whole snapshot, in order, once
                assert update.position == updates[0].position
                assert not update.more
        finally:
            await held.pool.close()

    asyncio.run(main())


def test_streams_at_different_positions_sharing_a_read_each_get_what_they_have_not_seen(
    sharing_database: str,
) -> None:
    instance_id = seed_records(sharing_database, "apart", ["a", "b"])

    async def main() -> None:
        held = HeldPool(sharing_database)
        try:
            first = await live.read_changes(held.reads, "apart", (0, 0))
            assert slugs_of(first) == ["a", "b"]
            with psycopg.connect(sharing_database) as conn:
                conn.execute(
                    "UPDATE workflow_step_record SET updated_at = now()"
                    " WHERE instance_id = %s AND step_slug = 'a'",
                    (instance_id,),
                )
                declare(conn, instance_id, "c", 2)
            await held.hold()
            fresh, resumed = await all_asking(held.reads, "apart", [(0, 0), first.position])
            before = reads_served()
            await held.release()
            assert slugs_of(await fresh) == ["b", "a", "c"]  # b's write, then the later one
            assert slugs_of(await resumed) == ["a", "c"]  # only what it has not seen
            assert reads_served() - before == 1
            assert (await fresh).position == (await resumed).position
            again = await live.read_changes(held.reads, "apart", (await resumed).position)
            assert slugs_of(again) == []
        finally:
            await held.pool.close()

    asyncio.run(main())


def test_many_streams_opened_at_once_on_one_pool_connection_all_get_everything(
    server_dsn: str,
) -> None:
    """Streams of one instance opened together on a server with a single pool connection:
    each gets the whole snapshot once, then every later write."""
    count, steps = 40, 25
    with migrated_database(server_dsn, "steprecord_stream_wall_") as url:
        env = {"STEPRECORD_POOL_SIZE": "1", "STEPRECORD_STREAM_HEARTBEAT_SECONDS": "60"}
        base, proc = start_server(url, env=env)
        streams: list[Stream] = []
        try:
            with httpx.Client(base_url=base, timeout=WAIT) as client:
                for n in range(steps):
                    post(client, "declare", instance="wall", step=f"s{n}")
                url_of = f"{base}/v1/instances/wall/stream"
                with ThreadPoolExecutor(count) as opening:
                    streams = list(opening.map(lambda _: Stream(url_of), range(count)))
                for stream in streams:
                    got = [e.record["step_slug"] for e in stream.events(steps)]
                    assert got == [f"s{n}" for n in range(steps)]
                post(client, "start", {"attempt": 1}, instance="wall", step="s3")
                for stream in streams:
                    event = stream.next_event().record
                    assert (event["step_slug"], event["status"]) == ("s3", "running")
        finally:
            for stream in streams:
                stream.close()
            stop(proc)


def test_streams_opened_while_writes_go_on_miss_and_repeat_nothing(
    client: httpx.Client, open_stream: Callable[..., Stream]
) -> None:
    """Streams open one after another while a writer starts and completes steps: each sends
    every step's latest state, and no state or event id twice."""
    steps = 20
    post(client, "declare", instance="busy", step="first")
    streams = [open_stream("busy")]
    writer_done = threading.Event()
    written: list[int] = []

    def write() -> None:
        try:
            with httpx.Client(base_url=str(client.base_url), timeout=WAIT) as writer:
                for n in range(steps):
                    step = f"s{n}"
                    post(writer, "start", {"attempt": 1}, instance="busy", step=step)
                    post(
                        writer, "complete", {"attempt": 1, "output": n}, instance="busy", step=step
                    )
                    written.append(n)
        finally:
            writer_done.set()

    thread = threading.Thread(target=write)
    thread.start()
    try:
        for n in range(1, 8):  # each stream opens after a few more steps were written

            def further(n: int = n) -> bool:
                return len(written) >= n * 2 or writer_done.is_set()

            eventually(further)
            streams.append(open_stream("busy"))
    finally:
        thread.join(WAIT * 3)
    assert len(written) == steps
    final = {(f"s{n}", "completed") for n in range(steps)}
    for stream in streams:
        seen: list[tuple[str, str]] = []
        ids: list[tuple[int, int]] = []
        while not final <= set(seen):
            event = stream.next_event()
            seen.append((event.record["step_slug"], event.record["status"]))
            xid, _, record_id = event.id.partition("-")
            ids.append((int(xid), int(record_id)))
        stream.quiet()
        assert len(seen) == len(set(seen)), seen  # no state sent twice
        assert ids == sorted(set(ids))  # ids only grow: nothing repeated, nothing reordered
        for n in range(steps):
            if (f"s{n}", "running") in seen:  # a step's states in commit order
                assert seen.index((f"s{n}", "running")) < seen.index((f"s{n}", "completed"))


def opening() -> int:
    """The streams past the gate: those that joined the snapshot read about to run."""
    return sum(len(read.afters) for read in live._forming.values())


async def until(check: Callable[[], bool]) -> None:
    """Poll `check` on the event loop until it holds, failing after WAIT seconds."""
    for _ in range(int(WAIT / 0.01)):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out waiting")


def test_streams_opening_at_once_wait_their_turn_beyond_a_few_and_all_open(
    sharing_database: str,
) -> None:
    """A wall of dashboards reconnecting to one worker: only `OPENING_AT_ONCE` streams are
    opened at a time, so a write arriving meanwhile waits behind those few, not behind them
    all; the others wait their turn before any work is done for them, none is refused, and
    every one gets its whole snapshot."""
    slugs = [f"s{n}" for n in range(5)]
    seed_records(sharing_database, "gate", slugs)
    count = 2 * live.OPENING_AT_ONCE + 3

    async def main() -> None:
        app = create_app(Settings(database_url=sharing_database))
        gone = asyncio.Event()  # the clients go away at the end
        answers: list[list[Any]] = [[] for _ in range(count)]

        async def stream(n: int) -> None:
            asked = False

            async def receive() -> dict[str, Any]:
                nonlocal asked
                if not asked:
                    asked = True
                    return {"type": "http.request", "body": b"", "more_body": False}
                await gone.wait()
                return {"type": "http.disconnect"}

            async def send(message: MutableMapping[str, Any]) -> None:
                answers[n].append(message.get("status") or message.get("body"))

            await app(asgi_scope("GET", "/v1/instances/gate/stream"), receive, send)

        async with app.router.lifespan_context(app), contextlib.AsyncExitStack() as held:
            pool: Pool = app.state.pool
            for _ in range(pool.size):  # the snapshots wait for a connection meanwhile
                await held.enter_async_context(pool.connection())
            tasks = [asyncio.create_task(stream(n)) for n in range(count)]
            await until(lambda: opening() == live.OPENING_AT_ONCE)
            for _ in range(count):  # every stream has had its turns of the loop: none more
                await asyncio.sleep(0)
            assert opening() == live.OPENING_AT_ONCE
            assert pool.waiting == 1  # the one read of those streams
            assert not any(answers)
            await held.aclose()
            await until(lambda: all(len(answer) >= 2 for answer in answers))
            gone.set()
            await asyncio.gather(*tasks)
        for answer in answers:
            assert answer[0] == 200
            frames = b"".join(part for part in answer[1:] if isinstance(part, bytes)).decode()
            got = [
                json.loads(line.removeprefix("data: "))["step_slug"]
                for line in frames.split("\n")
                if line.startswith("data: ")
            ]
            assert got == slugs

    asyncio.run(main())


def test_one_tokens_wall_of_opening_streams_does_not_hold_up_another_tokens_stream(
    server_dsn: str,
) -> None:
    """The opening gate is per token and after the access check: while one token's streams
    wait their turn (more than `OPENING_AT_ONCE` of them, their snapshots held up), another
    token's stream passes the gate at once."""
    count = live.OPENING_AT_ONCE + 3
    with migrated_database(server_dsn, "steprecord_gate_tokens_") as url:
        seed_records(url, "gate", ["a"])
        secrets = {}
        with psycopg.connect(url, autocommit=True) as conn:
            for name in ("wall", "other"):
                token, digest = new_token()
                conn.execute(
                    "INSERT INTO api_token (name, scope, token_sha256) VALUES (%s, 'read', %s)",
                    (name, digest),
                )
                secrets[name] = token

        async def main() -> None:
            app = create_app(Settings(database_url=url))
            gone = asyncio.Event()
            started: list[str] = []

            async def stream(name: str) -> None:
                asked = False

                async def receive() -> dict[str, Any]:
                    nonlocal asked
                    if not asked:
                        asked = True
                        return {"type": "http.request", "body": b"", "more_body": False}
                    await gone.wait()
                    return {"type": "http.disconnect"}

                async def send(message: MutableMapping[str, Any]) -> None:
                    if message["type"] == "http.response.start":
                        started.append(name)

                scope = asgi_scope("GET", "/v1/instances/gate/stream")
                scope["headers"].append((b"authorization", f"Bearer {secrets[name]}".encode()))
                await app(scope, receive, send)

            async with app.router.lifespan_context(app), contextlib.AsyncExitStack() as held:
                pool: Pool = app.state.pool
                for _ in range(pool.size):  # the snapshots wait for a connection meanwhile
                    await held.enter_async_context(pool.connection())
                tasks = [asyncio.create_task(stream("wall")) for _ in range(count)]
                await until(lambda: opening() == live.OPENING_AT_ONCE)
                tasks.append(asyncio.create_task(stream("other")))
                await until(lambda: opening() == live.OPENING_AT_ONCE + 1)
                assert not started
                await held.aclose()
                await until(lambda: len(started) == count + 1)
                gone.set()
                await asyncio.gather(*tasks)

        asyncio.run(main())


# --- a stream's memory is bounded by what it sends, not by what the instance holds ----------

# `{"blob": "xx…x"}` as the database writes it: exactly the largest inline output.
BLOB = "x" * (MAX_OUTPUT_BYTES - len('{"blob": ""}'))


def seed_outputs(database_url: str, key: str, count: int) -> list[str]:
    """`count` completed steps of `key`, each with the largest inline output: their slugs."""
    slugs = [f"big{n:02}" for n in range(count)]
    output = json.dumps({"blob": BLOB})
    with psycopg.connect(database_url) as conn:
        instance_id = new_instance(conn, key)
        for ordinal, slug in enumerate(slugs):
            declare(conn, instance_id, slug, ordinal)
            conn.execute(
                "UPDATE workflow_step_record SET status = 'running', started_at = now()"
                " WHERE instance_id = %s AND step_slug = %s",
                (instance_id, slug),
            )
            conn.execute(
                "UPDATE workflow_step_record SET status = 'completed', completed_at = now(),"
                " output = %s::jsonb WHERE instance_id = %s AND step_slug = %s",
                (output, instance_id, slug),
            )
    return slugs


def test_a_stream_read_stops_at_its_byte_budget_and_reads_on_to_every_record(
    sharing_database: str,
) -> None:
    slugs = seed_outputs(sharing_database, "large", 2 * STREAM_READ_BYTES // MAX_OUTPUT_BYTES + 1)

    async def main() -> None:
        held = HeldPool(sharing_database)
        try:
            got: list[str] = []
            position: Position = (0, 0)
            reads = 0
            while True:
                update = await live.read_changes(held.reads, "large", position)
                reads += 1
                assert sum(map(len, update.frames)) < 2 * STREAM_READ_BYTES
                got += slugs_of(update)
                position = update.position
                if not update.more:
                    break
            assert got == slugs  # each once, in order
            assert reads == 3
        finally:
            await held.pool.close()

    asyncio.run(main())


def test_a_stream_sends_each_event_in_a_write_of_its_own(sharing_database: str) -> None:
    slugs = [f"s{n}" for n in range(5)]
    seed_records(sharing_database, "pieces", slugs)

    async def main() -> None:
        app = create_app(Settings(database_url=sharing_database))
        gone = asyncio.Event()
        bodies: list[bytes] = []
        asked = False

        async def receive() -> dict[str, Any]:
            nonlocal asked
            if not asked:
                asked = True
                return {"type": "http.request", "body": b"", "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.body" and message.get("body"):
                bodies.append(message["body"])
                if len(bodies) == len(slugs):
                    gone.set()

        async with app.router.lifespan_context(app):
            scope = asgi_scope("GET", "/v1/instances/pieces/stream")
            await asyncio.wait_for(app(scope, receive, send), WAIT)
        assert [body.count(b"event: record\n") for body in bodies] == [1] * len(slugs)
        sent = [json.loads(body.split(b"data: ")[1])["step_slug"] for body in bodies]
        assert sent == slugs

    asyncio.run(main())


def test_a_stream_whose_client_stops_reading_is_ended(server_dsn: str) -> None:
    with migrated_database(server_dsn, "steprecord_stream_stalled_") as url:
        seed_outputs(url, "unread", 12)  # 12 MiB: more than the sockets' buffers hold
        env = {"STEPRECORD_SEND_TIMEOUT_SECONDS": "1"}
        base, proc = start_server(url, env=env)
        try:
            host, port = base.removeprefix("http://").split(":")
            with socket.socket() as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                sock.connect((host, int(port)))
                sock.sendall(b"GET /v1/instances/unread/stream HTTP/1.1\r\nHost: x\r\n\r\n")
                assert sock.recv(4096).startswith(b"HTTP/1.1 200")  # then reads no more

                def streams_open() -> float:
                    return metric(httpx.get(f"{base}/metrics").text, "steprecord_streams_open")

                eventually(lambda: streams_open() == 1, what="the stream open")
                eventually(lambda: streams_open() == 0, 10, what="the unread stream ended")
        finally:
            stop(proc)
