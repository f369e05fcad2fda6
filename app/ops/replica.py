"""Reads from a PostgreSQL streaming replica, and from the primary whenever it cannot serve.

A read path gets its read connection from `ReadPool`: `run(work)` for one read, `connection()`
for work in several steps (a dashboard page). `run` runs `work` on the replica while the
replica is healthy, otherwise on the primary. A replica read that fails (the
connection lost, refused, cancelled) is run once more on the primary (reads are idempotent)
and the replica is marked down until the background check finds it healthy again, so a read
never fails because of the replica. A replica whose connections are all busy is not down: the
read that finds none free goes to the primary at once, and the next ones try the replica
again. Without a replica every read runs on the primary. The live-update streams read
through it too (see `app.live` for how they stay exact across the two servers).

How the lag is measured (every `check_interval(max_lag)` seconds, in the background, never per
request). Each round first asks the primary for its WAL write position and notes the
service's clock just before asking: every commit acknowledged before that moment ends at or
before that position. Then it asks the replica how far it has replayed. The replica holds
every commit acknowledged before moment t if it has replayed past the primary's position of
moment t; its staleness is therefore `now - t` for the latest sampled t whose position it
has replayed. This is right on an idle primary (nothing new: the replica is at the
position, staleness about zero, where `now() - pg_last_xact_replay_timestamp()` would grow
without bound), right while replay is paused or slow (the position it has reached grows
old), and needs no agreement between the two servers' clocks. A replica that has not
replayed any position sampled within the bound is lagging beyond it.

When the primary cannot be asked, the replica alone is asked: caught up with all the WAL it
received means no lag, otherwise the age of its last replayed commit. A server that is not in
recovery (not a standby, or promoted) is not used for reads.
"""

import asyncio
import contextlib
import logging
import math
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TypeVar

import psycopg
from psycopg.rows import dict_row

from ..core.db import AsyncConn, DatabaseUnavailable, Pool, PoolExhausted
from ..data import replication
from . import observe

T = TypeVar("T")
log = logging.getLogger("steprecord.replica")


def check_interval(max_lag: float) -> float:
    """Seconds between two checks: at most a second, and a quarter of the lag bound."""
    return min(1.0, max_lag / 4)


class ReadPool:
    """The pool a read uses: the replica while it is healthy, the primary otherwise."""

    def __init__(self, primary: Pool, replica: Pool | None = None) -> None:
        self.primary = primary
        self.replica = replica
        # Only the background check makes the replica healthy (never before its first look).
        self.healthy = False
        self.downs = 0

    async def run(self, work: Callable[[AsyncConn], Awaitable[T]]) -> T:
        """`work` on a read connection; on the primary when the replica fails it, or when
        every connection to the replica is busy right now (a busy replica is not a down one:
        it stays in use, and this one read goes to the primary without waiting)."""
        if self.replica is not None and self.healthy:
            try:
                async with self.replica.connection(wait=False, name=work) as conn:
                    result = await work(conn)
            except PoolExhausted:
                pass
            except DatabaseUnavailable as exc:
                self.mark_down(str(exc))
            else:
                observe.count_read("replica")
                return result
        return await self.on_primary(work)

    async def on_primary(self, work: Callable[[AsyncConn], Awaitable[T]]) -> T:
        """`work` on the primary, whatever the replica's state."""
        async with self.primary.connection(name=work) as conn:
            result = await work(conn)
        observe.count_read("primary")
        return result

    async def primary_position(self) -> int:
        """The primary's WAL position now: a read that has replayed to it has every commit
        acknowledged before this call."""
        async with self.primary.connection() as conn:
            return await replication.wal_position(conn)

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[AsyncConn]:
        """A read connection for work done in several steps (a dashboard page): the replica
        while healthy, the primary when the replica cannot give one (or has none free right
        now). Unlike `run`, a failure after that is not repeated on the primary; it marks the
        replica down all the same."""
        if self.replica is not None and self.healthy:
            stack = contextlib.AsyncExitStack()
            try:
                conn = await stack.enter_async_context(self.replica.connection(wait=False))
            except PoolExhausted:
                pass
            except DatabaseUnavailable as exc:
                self.mark_down(str(exc))
            else:
                try:
                    async with stack:
                        yield conn
                except DatabaseUnavailable as exc:
                    self.mark_down(str(exc))
                    raise
                observe.count_read("replica")
                return
        async with self.primary.connection() as conn:
            yield conn
        observe.count_read("primary")

    def mark_down(self, reason: str) -> None:
        self.downs += 1  # a check that began before this cannot make it healthy again
        if self.healthy:
            log.warning("reads go to the primary: the replica failed a read (%s)", reason)
        self.healthy = False
        observe.replica_in_use(False)

    async def close(self) -> None:
        if self.replica is not None:
            await self.replica.close()


class Staleness:
    """How old the newest primary WAL position a replica has replayed is (see the module)."""

    def __init__(self, keep: float) -> None:
        self._keep = keep
        self._samples: deque[tuple[float, int]] = deque()

    def primary_at(self, moment: float, position: int) -> None:
        self._samples.append((moment, position))
        while self._samples[0][0] < moment - self._keep:
            self._samples.popleft()

    def lag(self, now: float, replayed: int) -> float:
        """Seconds the replica is behind; infinite when no position kept is replayed yet."""
        covered = [moment for moment, position in self._samples if position <= replayed]
        return max(0.0, now - max(covered)) if covered else math.inf


class _Link:
    """One connection of the check's own, so that a busy pool never makes a healthy replica
    look down; reopened after any failure."""

    def __init__(self, conninfo: str, timeout: float) -> None:
        self._conninfo = conninfo
        self._timeout = timeout
        self._conn: AsyncConn | None = None

    async def ask(self, query: Callable[[AsyncConn], Awaitable[T]]) -> T:
        try:
            async with asyncio.timeout(self._timeout):
                if self._conn is None or self._conn.closed:
                    self._conn = await psycopg.AsyncConnection.connect(
                        self._conninfo, autocommit=True, row_factory=dict_row
                    )
                    self._conn.prepare_threshold = None
                return await query(self._conn)
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.close()


async def keep_checking(
    reads: ReadPool, primary: str, replica: str, *, max_lag: float, answer_within: float
) -> None:
    """Measure the replica's lag forever and route the reads accordingly."""
    every = check_interval(max_lag)
    staleness = Staleness(keep=max_lag + 2 * every)
    links = _Link(primary, answer_within), _Link(replica, answer_within)
    loop = asyncio.get_running_loop()
    try:
        while True:
            await _check(reads, staleness, *links, max_lag=max_lag, clock=loop.time)
            await asyncio.sleep(every)
    finally:
        for link in links:
            await link.close()


async def _check(
    reads: ReadPool,
    staleness: Staleness,
    primary: _Link,
    replica: _Link,
    *,
    max_lag: float,
    clock: Callable[[], float],
) -> None:
    downs = reads.downs
    moment = clock()
    asked_primary = True
    try:
        staleness.primary_at(moment, await primary.ask(replication.wal_position))
    except (psycopg.Error, OSError, TimeoutError):
        asked_primary = False
    try:
        state = await replica.ask(replication.replay_state)
    except (psycopg.Error, OSError, TimeoutError) as exc:
        _route(reads, downs, math.inf, max_lag, f"unreachable: {exc or 'timed out'}")
        return
    if not state["in_recovery"]:
        _route(reads, downs, math.inf, max_lag, "not a standby (not in recovery)")
        return
    if state["replayed"] is None:
        lag = math.inf
    elif asked_primary:
        lag = staleness.lag(clock(), state["replayed"])
    elif state["caught_up"]:
        lag = 0.0
    else:
        seconds = state["behind_seconds"]
        lag = math.inf if seconds is None else max(0.0, seconds)
    behind = f"more than {max_lag:g} s" if math.isinf(lag) else f"{lag:.1f} s"
    _route(reads, downs, lag, max_lag, f"{behind} behind the primary")


def _route(reads: ReadPool, downs: int, lag: float, max_lag: float, why: str) -> None:
    observe.replica_lag(lag)
    healthy = lag <= max_lag and reads.downs == downs
    if healthy != reads.healthy:
        if healthy:
            log.info("reads go to the replica (%s)", why)
        else:
            log.warning("reads go to the primary: the replica is %s", why)
    reads.healthy = healthy
    observe.replica_in_use(healthy)
