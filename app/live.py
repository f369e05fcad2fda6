"""Live updates: one LISTEN connection per worker, and the event streams it wakes.

The record's triggers notify `steprecord_changes` with the instance's id when a write commits.
Each worker holds one dedicated session on `STEPRECORD_LISTEN_URL` (LISTEN needs a session,
which PgBouncer in transaction mode does not keep) and, per notification, sets the "dirty"
flag of every stream of that instance. A stream then reads what changed since its position
with one short query on the pool. A flag, not a queue: any number of notifications before a
stream reads costs one read, so a slow client holds no more than its position and the flag.

Nothing is lost while the listener is away: a stream's position, not the notifications,
says what it has sent, and after the listener reconnects every stream reads once. Each
keepalive is followed by a read too, so no change can wait longer than one heartbeat.
"""

import asyncio
import contextlib
import logging
import re
import signal
import threading
from collections.abc import AsyncIterator, Iterator
from types import FrameType
from typing import Any

import psycopg
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from app import steps
from app.db import DatabaseUnavailable, Pool
from app.errors import validation_problem
from app.observe import STREAMS_OPEN
from app.serialize import dumps, record_json

log = logging.getLogger("steprecord.live")

CHECK_SECONDS = 10.0  # how often an idle listener proves its connection alive
CONNECT_SECONDS = 5.0
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


class Subscription:
    """One open stream of an instance: set `dirty` when it may have something to read."""

    __slots__ = ("dirty", "instance_id")

    def __init__(self, instance_id: int) -> None:
        self.instance_id = instance_id
        self.dirty = asyncio.Event()


class Hub:
    """The streams of this worker by instance id, woken by the listener."""

    def __init__(self) -> None:
        self._streams: dict[int, set[Subscription]] = {}
        self.closing = False

    @contextlib.contextmanager
    def subscribe(self, instance_id: int) -> Iterator[Subscription]:
        subscription = Subscription(instance_id)
        # A change may have committed between the stream's first read and now: read once more.
        subscription.dirty.set()
        self._streams.setdefault(instance_id, set()).add(subscription)
        STREAMS_OPEN.inc()
        try:
            yield subscription
        finally:
            streams = self._streams[instance_id]
            streams.discard(subscription)
            if not streams:
                del self._streams[instance_id]
            STREAMS_OPEN.dec()

    def wake(self, instance_id: int) -> None:
        for subscription in self._streams.get(instance_id, ()):
            subscription.dirty.set()

    def wake_all(self) -> None:
        for streams in self._streams.values():
            for subscription in streams:
                subscription.dirty.set()

    def close(self) -> None:
        """End every stream (the server is shutting down; clients resume elsewhere)."""
        self.closing = True
        self.wake_all()


async def keep_listening(conninfo: str, hub: Hub) -> None:
    """LISTEN for as long as the worker runs, reconnecting with backoff."""
    failures = 0
    while True:
        try:
            conn = await asyncio.wait_for(
                psycopg.AsyncConnection.connect(conninfo, autocommit=True), CONNECT_SECONDS
            )
            async with conn:
                await steps.listen(conn)
                if failures:
                    log.info("listening again for live updates")
                failures = 0
                hub.wake_all()  # notifications may have been missed while away
                while True:
                    async for notification in conn.notifies(timeout=CHECK_SECONDS):
                        with contextlib.suppress(ValueError):
                            hub.wake(int(notification.payload))
                    async with asyncio.timeout(CONNECT_SECONDS):
                        await steps.ping(conn)
        except (psycopg.Error, OSError, TimeoutError) as exc:
            log.warning("live-update listener lost its connection: %s", exc)
        except Exception:
            log.exception("live-update listener failed")
        failures = min(failures + 1, 10)
        await asyncio.sleep(min(0.1 * 2**failures, MAX_BACKOFF_SECONDS))


def parse_event_id(value: str, field: str) -> steps.Position:
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


async def events(
    pool: Pool, hub: Hub, instance_key: str, first: steps.Changes, heartbeat: float
) -> AsyncIterator[bytes]:
    """The stream's body: `first` (what the handler read), then every later change."""
    loop = asyncio.get_running_loop()
    behind_delay, behind_since = BEHIND_SECONDS, None
    with hub.subscribe(first.instance_id) as subscription:
        changes: steps.Changes | None = first
        position = first.position
        last_sent = loop.time()
        read_at: float | None = None  # when to read again without a notification
        while not hub.closing:
            if changes is not None:
                for record in changes.records:
                    yield _frame(record)
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
            wake_at = last_sent + heartbeat
            if read_at is not None:
                wake_at = min(wake_at, read_at)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(wake_at):
                    await subscription.dirty.wait()
            if hub.closing:
                return
            now = loop.time()
            if subscription.dirty.is_set() or (read_at is not None and now >= read_at):
                subscription.dirty.clear()
                try:
                    async with pool.connection() as conn:
                        changes = await steps.stream_changes(conn, instance_key, position)
                except steps.InstanceNotFound:
                    return
                except DatabaseUnavailable as exc:
                    log.warning("stream of %s: read failed, trying again: %s", instance_key, exc)
                    read_at = now + RETRY_SECONDS
            elif now >= last_sent + heartbeat:
                yield KEEPALIVE
                last_sent = now
                # A safety net: had a notification been lost (a listener misconfigured behind
                # PgBouncer, say), its change waits no longer than one heartbeat.
                subscription.dirty.set()


class EventStream(StreamingResponse):
    """`text/event-stream`, never cached or buffered by a proxy; the body is closed (and its
    stream unsubscribed) as soon as the response ends, also when the client went away."""

    media_type = "text/event-stream"

    def __init__(self, body: AsyncIterator[bytes]) -> None:
        super().__init__(body, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._body = body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self._body, "aclose", None)
            if aclose is not None:
                await aclose()


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
