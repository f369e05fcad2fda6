"""Connections: a small async pool for requests and a sync engine for migrations.

The pool opens connections on demand and never backs off: while PostgreSQL is down every
request fails fast with `DatabaseUnavailable`, and the first request after it is back
connects again. Connections run in autocommit: every event is one statement, atomic by
itself, so a 2xx means it is committed.

Each use of a connection is bounded by `statement_timeout`: when it runs over, psycopg sends
PostgreSQL a cancel request (the protocol's own, which PgBouncer forwards), the statement ends
with `query_canceled` and the connection goes back to the pool. The bound needs no session
setting, no startup parameter and no extra round trip, so it holds behind PgBouncer in
transaction mode as well. A server that does not even answer the cancel within
`CANCEL_GRACE` seconds is treated as lost.

A request holds at most its token's and its tenant's share of the connections, and the pool's
last few (its reserve) go only to a request whose token and tenant hold none (app/core/shares.py);
work that is no request's is not counted. A connection on which the database raised an error
that no caller handled is closed, never given to the next request.

While tracing is on (app/core/tracing.py), a request's use of a connection, from waiting for it
to giving it back, is a client span of the request's span.
"""

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import psycopg
from psycopg.rows import dict_row
from psycopg.types.array import ListBinaryDumper
from sqlalchemy import Engine, create_engine
from sqlalchemy.pool import NullPool

from . import shares, tracing

AsyncConn = psycopg.AsyncConnection[dict[str, Any]]

CANCEL_GRACE = 0.5
# The server ended the session (admin or crash shutdown, or not accepting connections yet).
SESSION_ENDED = frozenset({"57P01", "57P02", "57P03"})


class DatabaseUnavailable(Exception):
    """PostgreSQL cannot be reached (or no connection came free) in time.

    Its text (`str(exc)`) is for the log only: the driver's message names the database's host,
    port, user and database. `public` says what happened in words a client may read."""

    def __init__(self, logged: str, public: str = "the database cannot be reached") -> None:
        super().__init__(logged)
        self.public = public


class PoolExhausted(DatabaseUnavailable):
    """Every connection of the pool is in use: the database is busy, not down."""

    def __init__(self, logged: str) -> None:
        super().__init__(logged, "every database connection of this service is in use")


# What a client is told of a statement the database refused as an outage, by SQLSTATE class
# (or the whole code): never the driver's message, which names where the database is.
PUBLIC_BY_SQLSTATE = {
    "08": "the connection to the database was lost",
    "57P01": "the database is shutting down",
    "57P02": "the database is shutting down",
    "57P03": "the database is starting up or not accepting connections",
    "57014": "the database cancelled the statement",
    "55P03": "a lock was not granted within the database's lock timeout",
    "53": "the database is out of a resource (connections, memory or disk)",
    "40": "the statement collided with a concurrent one",
    "25006": "the database is read-only (a standby not promoted yet)",
}


# On Citus the coordinator reports a worker it cannot reach as a connection failure (08006)
# of its own statement, naming the worker's host and port; the service's connection to the
# coordinator is intact.
REMOTE_NODE_FAILED = "connection to the remote node "


def remote_node_failed(exc: psycopg.Error) -> bool:
    """The database (a Citus coordinator) could not reach a node holding the data."""
    message = exc.diag.message_primary or ""
    return (exc.sqlstate or "").startswith("08") and message.startswith(REMOTE_NODE_FAILED)


# A role the service runs as that misses a right it needs (a release whose migrations added a
# function, before the grant was run again).
MISSING_RIGHT = (
    "the service's database role lacks a right this request needs: the operator runs"
    " `steprecord grant ROLE` as the database's owner"
)

NODE_UNREACHABLE = "a database node holding this data (a Citus worker) cannot be reached"


def public_reason(exc: psycopg.Error) -> str:
    """Why a statement failed as an outage, in words fit for a client (see `PUBLIC_BY_SQLSTATE`)."""
    if remote_node_failed(exc):
        return NODE_UNREACHABLE
    sqlstate = exc.sqlstate or ""
    reason = PUBLIC_BY_SQLSTATE.get(sqlstate) or PUBLIC_BY_SQLSTATE.get(sqlstate[:2])
    if reason is None and isinstance(exc, psycopg.OperationalError) and not sqlstate:
        return "the connection to the database was lost"  # a broken socket has no SQLSTATE
    return reason or "the database could not run the statement"


class TokenBusy(PoolExhausted):
    """Every connection of the request's share is in use by its own token (429, not 503)."""


class Pool:
    def __init__(
        self,
        conninfo: str,
        *,
        size: int,
        timeout: float,
        statement_timeout: float,
        prepare_threshold: int | None,
        on_change: Callable[[str, int], None] | None = None,
        tracer: tracing.Tracer | None = None,
        share: int | None = None,
        tenant_share: int | None = None,
        reserve: int = 0,
        configure: Callable[[AsyncConn], Awaitable[None]] | None = None,
    ) -> None:
        self._on_change = on_change
        self._configure = configure
        self._tracer = tracer
        self._conninfo = conninfo
        self._timeout = timeout
        self._statement_timeout = statement_timeout
        self._prepare_threshold = prepare_threshold
        # Each principal's share of the connections (app/core/shares.py); None: no shares.
        self._shares = (
            None
            if share is None
            else shares.Shares(min(share, size), min(tenant_share or share, size))
        )
        # The pool's slots: `taken` of `size`, the last `reserve` free ones only for a request
        # whose shares hold none; requests waiting for one, in order of arrival, with theirs.
        self.reserve = min(reserve, size - 1)
        self.taken = 0
        self._waiters: collections.deque[tuple[asyncio.Future[None], list[shares.Share]]] = (
            collections.deque()
        )
        self._idle: list[AsyncConn] = []
        # What a client is told when this pool's server cannot be reached or went away (None:
        # the words for the database itself); a Citus node's pool names it as such.
        self.unreachable: str | None = None
        self.size = size
        self.in_use = 0
        self.waiting = 0
        if on_change is not None:  # both counts are reported from the start
            on_change("in_use", 0)
            on_change("waiting", 0)

    async def _connect(self) -> AsyncConn:
        conn = await psycopg.AsyncConnection.connect(
            self._conninfo, autocommit=True, row_factory=dict_row
        )
        # Times come back in UTC, which the answers render natively (PgBouncer keeps the
        # setting per client, as it does for every time zone change).
        await conn.execute("SET TimeZone TO 'UTC'")
        conn.prepare_threshold = self._prepare_threshold
        # Lists (the judge's arrays) go as binary arrays: psycopg dumps a batch's arrays about
        # seven times faster than as text, which it escapes element by element.
        conn.adapters.register_dumper(list, ListBinaryDumper)
        if self._configure is not None:  # the rest of the session, as the caller wants it
            await self._configure(conn)
        return conn

    @property
    def conninfo(self) -> str:
        return self._conninfo

    def _take_idle(self) -> AsyncConn | None:
        while self._idle:
            conn = self._idle.pop()
            with contextlib.suppress(psycopg.OperationalError):
                conn.pgconn.consume_input()  # notices a server that closed the socket
            if conn.pgconn.status == psycopg.pq.ConnStatus.OK:
                return conn
            asyncio.get_running_loop().create_task(conn.close())
        return None

    def connection(
        self, *, wait: bool = True, name: str | Callable[..., Any] | None = None
    ) -> AbstractAsyncContextManager[AsyncConn]:
        """A connection; `wait=False`: `PoolExhausted` at once when none is free now.

        While tracing, a request's use of it is a span called `name` (the data function it
        runs, or the function whose name it takes: `tracing.name_of`)."""
        if self._tracer is None:  # the one check tracing costs when it is off
            return self._connection(wait)
        failures = (DatabaseUnavailable, psycopg.Error)
        connection = self._connection(wait)
        return tracing.database_call(self._tracer, connection, name, self._conninfo, failures)

    @asynccontextmanager
    async def _connection(self, wait: bool) -> AsyncIterator[AsyncConn]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout  # waiting for a slot and connecting, together
        principal = None if self._shares is None else shares.PRINCIPAL.get()
        held: list[shares.Share] = []
        try:
            if principal is not None:
                await self._take_shares(principal, held, deadline - loop.time() if wait else 0)
            await self._take_slot(held, deadline if wait else None)
            async with self._connected(deadline, held) as conn:
                yield conn
        finally:
            if self._shares is not None:
                for share in held:
                    share.slots.release()
                    self._shares.leave(share)

    async def _take_shares(
        self, principal: shares.Principal, held: list[shares.Share], wait: float
    ) -> None:
        """A slot of the principal's token share, then of its tenant's, within `wait` seconds,
        added to `held`: `TokenBusy` when the connections of either are all busy,
        `PoolExhausted` when they are still coming (the database is slow to give them: an
        outage answers 503, not 429)."""
        assert self._shares is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        wanted = [self._shares.of(principal.token, self._shares.size)]
        if principal.tenant is not None:
            wanted.append(self._shares.of(principal.tenant, self._shares.tenant_size))
        try:
            for share in wanted:
                left = max(deadline - loop.time(), 0) if wait else 0
                if not await self._shares.take(share, left):
                    break
                held.append(share)
        finally:
            for share in wanted[len(held) :]:
                self._shares.leave(share)
        if len(held) == len(wanted):
            return
        # A token's requests may wait for their tenant's share: busy is busy either way.
        busy = next((s for s in reversed(wanted) if s.saturated), None)
        if busy is None or wait <= 0:
            raise PoolExhausted("no database connection came free in time")
        if busy.key == principal.token:
            whose, setting = "this token already uses its", "STEPRECORD_POOL_SHARE_PER_TOKEN"
        else:
            whose = "the tokens of this key prefix already use their"
            setting = "STEPRECORD_POOL_SHARE_PER_TENANT"
        raise TokenBusy(
            f"{whose} {busy.size} database connections of this worker's {self.size} ({setting})"
        )

    def _may_take(self, held: list[shares.Share]) -> bool:
        """Whether a request holding `held` may take a slot of the pool now: one beyond the
        reserve is free, or one of the reserve and its shares hold none."""
        free = self.size - self.taken
        return free > self.reserve or (free > 0 and all(s.pooled == 0 for s in held))

    def _grant(self, held: list[shares.Share]) -> None:
        self.taken += 1
        for share in held:
            share.pooled += 1

    async def _take_slot(self, held: list[shares.Share], deadline: float | None) -> None:
        """A slot of the pool for a request holding `held`: at once when it may take one (a
        slot given back goes straight to the first waiter that may take it, so no waiter is
        passed by), else by `deadline` (None: not at all), or `PoolExhausted`."""
        if self._may_take(held):
            self._grant(held)  # without yielding
            return
        if deadline is None:
            raise PoolExhausted("every database connection is in use")
        loop = asyncio.get_running_loop()
        granted: asyncio.Future[None] = loop.create_future()
        waiter = (granted, held)
        self._waiters.append(waiter)
        self._changed(waiting=1)
        try:
            await asyncio.wait([granted], timeout=max(deadline - loop.time(), 0))
        except BaseException:  # cancelled while waiting: the client went away
            if granted.done():
                self._release_slot(held)  # given to it meanwhile: to the next waiter
            else:
                self._waiters.remove(waiter)
            raise
        finally:
            self._changed(waiting=-1)
        if not granted.done():
            self._waiters.remove(waiter)
            raise PoolExhausted("no database connection came free in time")

    def _release_slot(self, held: list[shares.Share]) -> None:
        """Give a slot back, to the first waiters that may take what is free."""
        self.taken -= 1
        for share in held:
            share.pooled -= 1
        for waiter in list(self._waiters):
            if self.taken >= self.size:
                break
            granted, theirs = waiter
            if self._may_take(theirs):
                self._waiters.remove(waiter)
                self._grant(theirs)
                granted.set_result(None)

    @asynccontextmanager
    async def _connected(
        self, deadline: float, held: list[shares.Share]
    ) -> AsyncIterator[AsyncConn]:
        """A connection, once a slot of the pool is held (it gives the slot back)."""
        loop = asyncio.get_running_loop()
        conn: AsyncConn | None = None
        try:
            conn = self._take_idle()
            if conn is None:
                try:
                    conn = await asyncio.wait_for(self._connect(), deadline - loop.time())
                except (psycopg.OperationalError, OSError, TimeoutError) as exc:
                    logged = str(exc) or "connecting timed out"
                    public = self.unreachable or "the database cannot be reached"
                    raise DatabaseUnavailable(logged, public) from exc
            self._changed(in_use=1)
            for share in held:
                share.connected += 1
            try:
                # The first expiry cancels the statement; the second, if the server has not
                # answered the cancel, makes psycopg close the connection.
                async with asyncio.timeout(self._statement_timeout + CANCEL_GRACE):
                    async with asyncio.timeout(self._statement_timeout):
                        yield conn
            except psycopg.OperationalError as exc:
                if lost(conn, exc):
                    self._discard_idle()
                    if self.unreachable is not None:
                        raise DatabaseUnavailable(str(exc), self.unreachable) from exc
                raise DatabaseUnavailable(str(exc), public_reason(exc)) from exc
            except psycopg.errors.ReadOnlySqlTransaction as exc:  # a standby, until promoted
                raise DatabaseUnavailable(str(exc), public_reason(exc)) from exc
            except psycopg.errors.InsufficientPrivilege as exc:  # a right not granted yet
                raise DatabaseUnavailable(str(exc), MISSING_RIGHT) from exc
            except psycopg.Error:
                # Any other error of the database that no caller handled (the data modules
                # handle the refusals they expect): the session may keep a state that the next
                # request must not meet, so it is closed, not given back.
                await conn.close()
                raise
            except TimeoutError:
                bound = f"{self._statement_timeout:g} s statement timeout"
                if conn.closed:
                    self._discard_idle()
                    text = f"no answer from the database within the {bound}"
                    raise DatabaseUnavailable(text, text) from None
                text = f"cancelled at the {bound}"
                raise DatabaseUnavailable(text, text) from None
            finally:
                self._changed(in_use=-1)
                for share in held:
                    share.connected -= 1
        finally:
            if conn is not None:
                if conn.closed or conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                    await conn.close()
                else:
                    self._idle.append(conn)
            self._release_slot(held)

    def _changed(self, in_use: int = 0, waiting: int = 0) -> None:
        """Count a change, and report the count that changed ("in_use" or "waiting")."""
        if in_use:
            self.in_use += in_use
            if self._on_change is not None:
                self._on_change("in_use", self.in_use)
        if waiting:
            self.waiting += waiting
            if self._on_change is not None:
                self._on_change("waiting", self.waiting)

    def _discard_idle(self) -> None:
        """After one connection was lost the others are suspect too (a restart drops them all)."""
        idle, self._idle = self._idle, []
        for conn in idle:
            asyncio.get_running_loop().create_task(conn.close())

    async def close(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            await conn.close()


def lost(conn: AsyncConn, exc: psycopg.OperationalError) -> bool:
    """The connection is gone, as opposed to a statement refused on a healthy one.

    A timeout, a lock or resource limit (classes 53, 55, 57014) or a deadlock (class 40)
    leaves the connection usable; a broken socket, class 08 or the end of the session does not,
    except a Citus worker the coordinator could not reach (the connection to the coordinator
    is fine, and so are the pool's others).
    """
    sqlstate = exc.sqlstate or ""
    if not conn.closed and remote_node_failed(exc):
        return False
    return conn.closed or sqlstate.startswith("08") or sqlstate in SESSION_ENDED


def sync_engine(conninfo: str) -> Engine:
    """A SQLAlchemy engine on psycopg for alembic, taking a libpq URL or conninfo as is."""
    return create_engine(
        "postgresql+psycopg://", creator=lambda: psycopg.connect(conninfo), poolclass=NullPool
    )
