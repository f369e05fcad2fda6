"""Live updates: one LISTEN connection per worker, and the Server-Sent Events streams it wakes.

The record's triggers notify `steprecord_changes` with the instance's id when a write commits.
Each worker holds one dedicated session on `STEPRECORD_LISTEN_URL` (LISTEN needs a session,
which PgBouncer in transaction mode does not keep) and, per notification, sets the "dirty"
flag of every stream of that instance. A stream then reads what changed since its position
with one short query through the read pool. A flag, not a queue: any number of notifications
before a stream reads costs one read, so a slow client holds no more than its position and
the flag.

A read stops at `STREAM_PAGE` records or once they hold `STREAM_READ_BYTES` of long values,
counted in the database (app/data/stream.py), and reads on at once; the stream writes one
event at a time, and the server takes the next only once the client has read enough of the
last. So a stream holds about one read's records, however large the instance, and one whose
client stops reading waits with them until the server's send deadline ends its connection
(`STEPRECORD_SEND_TIMEOUT_SECONDS`, app/ops/server.py).

Streams of one instance share their reads. A stream that wants to read joins the read of its
instance that is about to run (waiting for a connection, its statement not sent yet) or
starts one; the read runs once, from the lowest position among the streams it serves, and
each stream takes the records after its own position. So the streams of an instance that
open together (a wall of dashboards reconnecting after a deploy), or that one notification
wakes, cost one read and one pool slot, not one each, and each record is rendered once for
all of them. A read that has started is never joined: its snapshot could predate the write
that woke the stream, whereas a read that has not started yet sees every commit made before
the stream asked.

The listener's session is open only while the worker has a stream open: a worker without
streams has nothing to wake, and receiving a notification for every write it and every other
worker takes would cost it CPU for nothing (a tenth of a worker's time under a batch load).
Nothing is lost while the listener is away: a stream's position, not the notifications,
says what it has sent, and once the listener (re)starts every stream reads once. While the
listener is away each keepalive is followed by a read too, so no change waits longer than one
heartbeat; while it listens an idle stream reads nothing.

A stream is held by the token that opened it (or by anonymous access): it ends when that
token is revoked (the worker's token cache tells the hub when its tokens change, and every
stream checks its access again, as it does at each keepalive), after
`STEPRECORD_STREAM_MAX_SECONDS` (a browser's EventSource reconnects by itself, checked
afresh), and a token holds at most `STEPRECORD_STREAMS_PER_TOKEN` streams per worker.

With a read replica, the reads go to the replica while it is healthy and to the primary
otherwise; a position means the same on both (see `stream.STREAM_CHANGES`). A notification
comes from the primary at commit, and the replica may not have replayed that commit yet
when the woken stream reads. So the listener, after each batch of notifications, asks the
primary for its WAL position on its own connection and hands it to the streams it wakes as
their target (a stream keeps the highest), and a stream takes the primary's position once
when it opens. A read served by the replica before it has replayed to the target counts as
behind: the stream reads again shortly, as it does for a change waiting behind an older
transaction, until the replica has caught up or the reads have moved to the primary. A read
served by the primary has every commit, so it meets the targets set before it.
"""

import asyncio
import bisect
import contextlib
import dataclasses
import logging
import re
import signal
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any, Self

import psycopg
from psycopg.rows import dict_row
from starlette.responses import StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .access import tokens
from .core import domain
from .core.db import AsyncConn, DatabaseUnavailable
from .core.problems import validation_problem
from .core.serialize import dumps, record_json
from .data import replication, stream
from .ops.observe import STREAMS_OPEN
from .ops.replica import ReadPool

log = logging.getLogger("steprecord.live")

CHECK_SECONDS = 10.0  # how often an idle listener proves its connection alive
IDLE_SECONDS = 1.0  # how soon a listener notices that no stream is left, and lets go
LISTENER_NAME = "steprecord live updates"  # its application_name
NODES_NAME = "steprecord live updates: nodes"  # the session that reads a cluster's node list
CONNECT_SECONDS = 5.0
NODES_SECONDS = 30.0  # how often the listener reads a Citus cluster's worker list again
MAX_BACKOFF_SECONDS = 5.0
# While a committed change waits behind an older transaction, a stream reads again after this
# long, for a second (such waits are usually short: a transaction that just ended in another
# database, a concurrent write), then less and less often, down to once a second.
BEHIND_SECONDS = 0.05
BEHIND_STEADY_SECONDS = 1.0
MAX_BEHIND_SECONDS = 1.0
RETRY_SECONDS = 1.0  # after a read failed (the database away)
EVENT_ID = re.compile(r"([0-9]{1,20})-([0-9]{1,19})")
MAX_XID8 = 2**64 - 1
MAX_ID = 2**63 - 1
KEEPALIVE = b": keepalive\n\n"
# Streams one token opens at a time on a worker. A wall of dashboards reconnecting after a
# deploy opens a thousand at once, and each costs the worker's one event loop most of a
# millisecond of work (the request, the snapshot, the answer's start); the writes that arrive
# meanwhile would wait behind all of it. Beyond this many, a token's stream waits its turn
# before any of that work, so a write waits behind at most this many openings of each token.
OPENING_AT_ONCE = 16


class Subscription:
    """One open stream of an instance: `dirty` is set when it has something to do: `stale`,
    it may have something to read, and `target` is the primary's WAL position a replica must
    have replayed for that read; `recheck`, the worker's tokens changed and the stream must
    check its access again."""

    __slots__ = ("dirty", "instance_id", "recheck", "stale", "target")

    def __init__(self, instance_id: int) -> None:
        self.instance_id = instance_id
        self.dirty = asyncio.Event()
        self.stale = False
        self.recheck = False
        self.target = 0

    def wake(self, target: int = 0) -> None:
        self.target = max(self.target, target)
        self.stale = True
        self.dirty.set()

    def check_access(self) -> None:
        self.recheck = True
        self.dirty.set()


class Hub:
    """The streams of this worker by instance id, woken by the listener."""

    def __init__(self) -> None:
        self._streams: dict[int, set[Subscription]] = {}
        self._per_holder: dict[int | None, int] = {}  # open streams by token id (None: anonymous)
        self.closing = False
        self.wanted = asyncio.Event()  # set while a stream is open: the listener is needed
        self.listening = asyncio.Event()  # set while LISTEN is in force on every node
        self._nodes: set[str] = set()  # where the notifications come from
        self._listening_on: set[str] = set()

    @contextlib.contextmanager
    def subscribe(self, instance_id: int) -> Iterator[Subscription]:
        subscription = Subscription(instance_id)
        # A change may have committed between the stream's first read and now: read once more.
        subscription.wake()
        self._streams.setdefault(instance_id, set()).add(subscription)
        self.wanted.set()
        STREAMS_OPEN.inc()
        try:
            yield subscription
        finally:
            streams = self._streams[instance_id]
            streams.discard(subscription)
            if not streams:
                del self._streams[instance_id]
            if not self._streams:
                self.wanted.clear()
            STREAMS_OPEN.dec()

    def listen_on(self, nodes: set[str]) -> None:
        """The nodes whose notifications the streams need (one server; a Citus cluster's
        workers)."""
        self._nodes = nodes
        self._listening_changed()

    def listener_up(self, node: str) -> None:
        self._listening_on.add(node)
        self._listening_changed()

    def listener_down(self, node: str) -> None:
        self._listening_on.discard(node)
        self._listening_changed()

    def _listening_changed(self) -> None:
        if self._nodes and self._nodes <= self._listening_on:
            self.listening.set()
        else:
            self.listening.clear()

    def wake(self, instance_id: int, target: int = 0) -> None:
        for subscription in self._streams.get(instance_id, ()):
            subscription.wake(target)

    def wake_all(self, target: int = 0) -> None:
        for streams in self._streams.values():
            for subscription in streams:
                subscription.wake(target)

    def access_changed(self) -> None:
        """The worker's tokens changed (one revoked, the first one created): every stream
        checks its access again now, without reading."""
        for streams in self._streams.values():
            for subscription in streams:
                subscription.check_access()

    def admit(self, holder: int | None, limit: int) -> bool:
        """Count a new stream of `holder` (a token's id; None: anonymous) unless it already
        has `limit` open on this worker; `leave` when it ends."""
        held = self._per_holder.get(holder, 0)
        if held >= limit:
            return False
        self._per_holder[holder] = held + 1
        return True

    def leave(self, holder: int | None) -> None:
        held = self._per_holder.pop(holder) - 1
        if held:
            self._per_holder[holder] = held

    def close(self) -> None:
        """End every stream (the server is shutting down; clients resume elsewhere)."""
        self.closing = True
        self.wake_all()


async def keep_listening(conninfo: str, hub: Hub, *, positions: bool = False) -> None:
    """LISTEN while this worker has a stream open, where the notifications come from: the
    server of `conninfo`, and, on a Citus coordinator, each of its workers too (the record's
    triggers run on the node holding the shard, and notify there; the coordinator may hold
    shards as well), reached with the credentials and database of `conninfo`. The node list
    is read again every `NODES_SECONDS` while a stream is open; each node has a listener of
    its own, so a worker that is down is retried without holding up the others. `positions`
    (a read replica is configured, on one server): wake the streams with the primary's WAL
    position as their target, read after the notifications arrived."""
    listeners: dict[str, asyncio.Task[None]] = {}
    failures = 0
    try:
        while True:
            await hub.wanted.wait()
            try:
                async with asyncio.timeout(CONNECT_SECONDS):
                    nodes = await _notifying_nodes(conninfo)
            except (psycopg.Error, OSError, TimeoutError) as exc:
                log.warning("live-update listener cannot read the database's nodes: %s", exc)
                failures = min(failures + 1, 10)
                await asyncio.sleep(min(0.1 * 2**failures, MAX_BACKOFF_SECONDS))
                continue
            failures = 0
            hub.listen_on(set(nodes))
            for node in set(listeners) - set(nodes):
                listeners.pop(node).cancel()
            for node in nodes:
                if node not in listeners:
                    wal = positions and nodes == [conninfo]
                    listeners[node] = asyncio.create_task(_listen(node, hub, positions=wal))
            await asyncio.sleep(NODES_SECONDS)
    finally:
        for task in listeners.values():
            task.cancel()


async def _notifying_nodes(conninfo: str) -> list[str]:
    """The servers whose notifications the streams need: `conninfo`'s, and a Citus cluster's
    workers."""
    async with await psycopg.AsyncConnection.connect(
        conninfo, autocommit=True, application_name=NODES_NAME
    ) as conn:
        workers = await stream.citus_workers(conn)
    return [
        conninfo,
        *(psycopg.conninfo.make_conninfo(conninfo, host=h, port=p) for h, p in workers),
    ]


async def _listen(conninfo: str, hub: Hub, *, positions: bool) -> None:
    """LISTEN on one server while this worker has a stream open, reconnecting with backoff."""
    loop = asyncio.get_running_loop()
    failures = 0
    try:
        while True:
            await hub.wanted.wait()
            try:
                conn = await asyncio.wait_for(
                    psycopg.AsyncConnection.connect(
                        conninfo,
                        autocommit=True,
                        row_factory=dict_row,
                        application_name=LISTENER_NAME,
                    ),
                    CONNECT_SECONDS,
                )
                async with conn:
                    await stream.listen(conn)
                    if failures:
                        log.info("listening again for live updates")
                    failures = 0
                    # Notifications may have been missed before, or while away.
                    hub.wake_all(await replication.wal_position(conn) if positions else 0)
                    hub.listener_up(conninfo)
                    checked = loop.time()
                    while hub.wanted.is_set():
                        # One batch: those that came while the last query ran, or else the
                        # first packet to arrive (the next ones wait in the backlog meanwhile).
                        batch = [n async for n in conn.notifies(timeout=IDLE_SECONDS, stop_after=1)]
                        async with asyncio.timeout(CONNECT_SECONDS):
                            if not batch:
                                if loop.time() - checked >= CHECK_SECONDS:
                                    await stream.ping(conn)
                                    checked = loop.time()
                                continue
                            target = await replication.wal_position(conn) if positions else 0
                        for notification in batch:
                            with contextlib.suppress(ValueError):
                                hub.wake(int(notification.payload), target)
                    hub.listener_down(conninfo)
                continue  # no stream is left: no session until the next one opens
            except (psycopg.Error, OSError, TimeoutError) as exc:
                log.warning("live-update listener lost its connection: %s", exc)
            except Exception:
                log.exception("live-update listener failed")
            hub.listener_down(conninfo)
            failures = min(failures + 1, 10)
            await asyncio.sleep(min(0.1 * 2**failures, MAX_BACKOFF_SECONDS))
    finally:
        hub.listener_down(conninfo)


@dataclass(frozen=True, slots=True)
class Update:
    """What one read gives one stream: its new events, rendered, and where it reads next."""

    instance_id: int
    frames: list[bytes]  # the events to send, each ready for the wire (empty: nothing new)
    position: stream.Position  # where the stream's next read starts
    more: bool  # a full page: read on at once
    behind: bool  # a change waits (for an older transaction, or for replay): read again soon
    caught_up: bool  # the read saw every commit up to its target


class SharedRead:
    """One read of an instance's changes, for every stream that joined it before it ran."""

    __slots__ = ("afters", "changes", "frames", "low", "positions", "task")

    def __init__(self) -> None:
        self.afters: list[stream.Position] = []  # the positions of the streams it serves
        self.low: stream.Position = (0, 0)  # the position it reads from: the lowest of them
        self.task: asyncio.Future[SharedRead] | None = None
        self.changes: stream.Changes | None = None
        self.positions: list[stream.Position] = []  # each record's, in the read's order
        self.frames: list[bytes] = []  # each record's event, rendered once for all

    def done(self, changes: stream.Changes) -> Self:
        self.positions = [(r["changed_xid"], r["id"]) for r in changes.records]
        self.frames = [_frame(record) for record in changes.records]
        self.changes = dataclasses.replace(changes, records=[])  # the frames are what is sent
        return self

    def update(self, after: stream.Position) -> Update:
        """The read as the stream at `after` sees it: the records after its own position.

        The read started from the lowest position, so it holds every record after `after` up
        to where it ended (its horizon, or its last record for a full page). Its `behind`
        concerns records beyond the lowest position: for a stream further on it may say
        "read again soon" where its own read would not, never the reverse."""
        changes = self.changes
        assert changes is not None
        # A read from (0, 0) where it was asked from further on: the positions came from another
        # server (the instance's shard moved): every stream takes the whole instance again.
        reset = changes.since < self.low
        start = 0 if reset or after <= self.low else bisect.bisect_right(self.positions, after)
        frames = self.frames[start:]
        position = changes.position if reset else max(after, changes.position)
        return Update(
            changes.instance_id, frames, position, changes.more, changes.behind, changes.caught_up
        )


# The reads about to run, by read pool, instance and target: a stream that wants to read
# joins the one of its instance, or starts it. A read leaves this table as it starts.
_forming: dict[tuple[ReadPool, str, int], SharedRead] = {}


async def read_changes(
    reads: ReadPool, instance_key: str, after: stream.Position, target: int = 0
) -> Update:
    """What changed after `after`, through the read pool, in one read shared with the other
    streams of the instance that ask meanwhile (see the module). An instance the replica does
    not have (yet) is looked up on the primary before it counts as unknown."""
    key = (reads, instance_key, target)
    shared = _forming.get(key)
    if shared is None:
        shared = _forming[key] = SharedRead()

        async def work(conn: AsyncConn) -> stream.Changes:
            assert shared is not None
            if _forming.get(key) is shared:
                del _forming[key]  # from now on, a stream that asks starts another read
            shared.low = min(shared.afters)
            return await stream.stream_changes(conn, instance_key, shared.low, target=target)

        shared.task = asyncio.ensure_future(_read_shared(reads, work, key, shared))
        # Read by whoever still waits; when nobody does (every stream gone), consumed here.
        shared.task.add_done_callback(_consume)
    shared.afters.append(after)
    assert shared.task is not None
    # A stream that goes away stops waiting; the read goes on for the others.
    done = await asyncio.shield(shared.task)
    return done.update(after)


async def _read_shared(
    reads: ReadPool,
    work: Callable[[AsyncConn], Awaitable[stream.Changes]],
    key: tuple[ReadPool, str, int],
    shared: SharedRead,
) -> SharedRead:
    try:
        try:
            changes = await reads.run(work)
        except domain.InstanceNotReplayed:
            changes = await reads.on_primary(work)
    finally:
        if _forming.get(key) is shared:  # it failed before its statement ran
            del _forming[key]
    return shared.done(changes)


def _consume(task: asyncio.Future[SharedRead]) -> None:
    if not task.cancelled():
        task.exception()


def parse_event_id(value: str, field: str) -> stream.Position:
    """The position an event id names; a 422 for anything this service did not send."""
    match = EVENT_ID.fullmatch(value)
    if match is None or int(match[1]) > MAX_XID8 or int(match[2]) > MAX_ID:
        raise validation_problem(
            [{"field": field, "message": "not an event id: send the id of the last event seen"}]
        )
    return int(match[1]), int(match[2])


def _frame(record: dict[str, Any]) -> bytes:
    event_id = f"{record['changed_xid']}-{record['id']}".encode()
    return b"event: record\nid: " + event_id + b"\ndata: " + dumps(record_json(record)) + b"\n\n"


async def sse_body(
    reads: ReadPool,
    hub: Hub,
    instance_key: str,
    first: Update,
    *,
    heartbeat: float,
    lifetime: float,
    allowed: Callable[[], bool],
) -> AsyncIterator[bytes]:
    """The stream's body: `first` (what the handler read), then every later change, for at
    most `lifetime` seconds and while `allowed()` (its token still grants it access), which
    it asks at each keepalive and whenever the worker's tokens change."""
    loop = asyncio.get_running_loop()
    ends_at = loop.time() + lifetime
    behind_delay, behind_since = BEHIND_SECONDS, None
    with hub.subscribe(first.instance_id) as subscription:
        # The first stream of a worker starts its listener: send nothing before it listens,
        # so that every write made after the client saw the snapshot wakes this stream.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(hub.listening.wait(), CONNECT_SECONDS)
        if reads.replica is not None:
            # Commits from before the subscription woke no one: a replica must have them too.
            with contextlib.suppress(DatabaseUnavailable):
                subscription.wake(await reads.primary_position())
        covered = 0  # the highest target a read has met
        changes: Update | None = first
        position = first.position
        last_sent = loop.time()
        read_at: float | None = None  # when to read again without a notification
        while not hub.closing:
            if changes is not None:
                # One event per write: the server waits for a client that reads slowly
                # before it takes the next, so the stream holds at most one event in its
                # connection's buffer (and ends when its client stops reading: app/ops/server.py).
                for frame in changes.frames:
                    yield frame
                if changes.frames:
                    last_sent = loop.time()
                position = changes.position
                if changes.more:
                    read_at = loop.time()
                elif changes.behind:
                    now = loop.time()
                    read_at = now + behind_delay
                    behind_since = now if behind_since is None else behind_since
                    if now - behind_since > BEHIND_STEADY_SECONDS:
                        behind_delay = min(behind_delay * 2, MAX_BEHIND_SECONDS)
                else:
                    read_at, behind_delay, behind_since = None, BEHIND_SECONDS, None
                changes = None
            wake_at = min(last_sent + heartbeat, ends_at)
            if read_at is not None:
                wake_at = min(wake_at, read_at)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(wake_at):
                    await subscription.dirty.wait()
            subscription.dirty.clear()
            now = loop.time()
            if hub.closing or now >= ends_at:
                return  # a browser's EventSource reconnects by itself
            keepalive = now >= last_sent + heartbeat
            if subscription.recheck or keepalive:
                subscription.recheck = False
                if not allowed():
                    return  # its token was revoked (or anonymous access ended)
            if subscription.stale or (read_at is not None and now >= read_at):
                subscription.stale = False
                pending = subscription.target
                try:
                    changes = await read_changes(
                        reads, instance_key, position, pending if pending > covered else 0
                    )
                except domain.InstanceNotFound:
                    return  # deleted: the stream ends
                except DatabaseUnavailable as exc:
                    log.warning("stream of %s: read failed, trying again: %s", instance_key, exc)
                    read_at = now + RETRY_SECONDS
                else:
                    if changes.instance_id != first.instance_id:
                        return  # deleted, and its key already taken by a new instance
                    if changes.caught_up:
                        covered = max(covered, pending)
            elif keepalive:
                yield KEEPALIVE
                last_sent = now
                # An idle stream reads nothing at a keepalive while the listener listens (its
                # notifications wake it); while the listener is away it reads, so a change
                # waits no longer than one heartbeat (and every stream reads once when the
                # listener is back).
                if not hub.listening.is_set():
                    subscription.wake()


class SSEResponse(StreamingResponse):
    """`text/event-stream`, never cached or buffered by a proxy; the body is closed (and its
    stream unsubscribed) as soon as the response ends, also when the client went away."""

    media_type = "text/event-stream"

    def __init__(self, body: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(body, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._body = body
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                aclose = getattr(self._body, "aclose", None)
                if aclose is not None:
                    await aclose()
            finally:
                self._on_close()  # also for a body never started (the client went away)


class Openings:
    """ASGI middleware, inside the access check: at most `OPENING_AT_ONCE` streams of one token
    (or of anonymous access) on this worker between their request and the start of their
    answer; its others wait, in order of arrival. None is refused: a stream that waits costs
    nothing but its connection. One token's wall of streams so delays only its own, and a
    request without a valid token is refused before it could wait here."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        # By token id (None: anonymous): its gate, and how many streams hold or wait for it.
        self._gates: dict[int | None, tuple[asyncio.Semaphore, list[int]]] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _is_stream(scope["path"]):
            await self.app(scope, receive, send)
            return
        holder = tokens.admission_of(scope).holder
        slots, users = self._gates.setdefault(holder, (asyncio.Semaphore(OPENING_AT_ONCE), [0]))
        users[0] += 1
        try:
            await self._opening(slots, scope, receive, send)
        finally:
            users[0] -= 1
            if users[0] == 0:
                del self._gates[holder]

    async def _opening(
        self, slots: asyncio.Semaphore, scope: Scope, receive: Receive, send: Send
    ) -> None:
        await slots.acquire()
        held = True

        async def started(message: Message) -> None:
            nonlocal held
            if held and message["type"] == "http.response.start":
                held = False
                slots.release()
            await send(message)

        try:
            await self.app(scope, receive, started)
        finally:
            if held:
                slots.release()


def _is_stream(path: str) -> bool:
    return path.startswith("/v1/instances/") and path.endswith("/stream")


@contextlib.contextmanager
def closed_on_exit_signal(hub: Hub) -> Iterator[None]:
    """End every stream as soon as SIGTERM or SIGINT arrives, then let the server's own handler
    run: the server finishes in-flight requests before it exits, and a stream never finishes
    by itself. Only in the main thread, where signal handlers live."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    loop = asyncio.get_running_loop()
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}

    def handler(signum: int, frame: FrameType | None) -> None:
        loop.call_soon_threadsafe(hub.close)
        chained = previous[signal.Signals(signum)]
        if callable(chained):
            chained(signum, frame)
        elif chained == signal.SIG_DFL:
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)

    for sig in previous:
        signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, chained in previous.items():
            if signal.getsignal(sig) is handler:
                signal.signal(sig, chained)
