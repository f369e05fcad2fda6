"""Connections: a small async pool for requests and a sync engine for migrations.

The pool opens connections on demand and never backs off: while PostgreSQL is down every
request fails fast with `DatabaseUnavailable`, and the first request after it is back
connects again. Connections run in autocommit: every event is one statement, atomic by
itself, so a 2xx means it is committed.
"""

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import psycopg
from psycopg.rows import dict_row
from sqlalchemy import Engine, create_engine
from sqlalchemy.pool import NullPool

AsyncConn = psycopg.AsyncConnection[dict[str, Any]]


class DatabaseUnavailable(Exception):
    """PostgreSQL cannot be reached (or no connection came free) in time."""


class Pool:
    def __init__(
        self,
        conninfo: str,
        *,
        size: int,
        timeout: float,
        prepare_threshold: int | None,
        on_change: Callable[[int, int], None] | None = None,
    ) -> None:
        self._on_change = on_change
        self._conninfo = conninfo
        self._timeout = timeout
        self._prepare_threshold = prepare_threshold
        self._slots = asyncio.Semaphore(size)
        self._idle: list[AsyncConn] = []
        self.size = size
        self.in_use = 0
        self.waiting = 0

    async def _connect(self) -> AsyncConn:
        conn = await psycopg.AsyncConnection.connect(
            self._conninfo, autocommit=True, row_factory=dict_row
        )
        conn.prepare_threshold = self._prepare_threshold
        return conn

    def _take_idle(self) -> AsyncConn | None:
        while self._idle:
            conn = self._idle.pop()
            with contextlib.suppress(psycopg.OperationalError):
                conn.pgconn.consume_input()  # notices a server that closed the socket
            if conn.pgconn.status == psycopg.pq.ConnStatus.OK:
                return conn
            asyncio.get_running_loop().create_task(conn.close())
        return None

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[AsyncConn]:
        self._changed(waiting=1)
        try:
            await asyncio.wait_for(self._slots.acquire(), self._timeout)
        except TimeoutError:
            raise DatabaseUnavailable("no database connection came free in time") from None
        finally:
            self._changed(waiting=-1)
        conn: AsyncConn | None = None
        try:
            conn = self._take_idle()
            if conn is None:
                try:
                    conn = await asyncio.wait_for(self._connect(), self._timeout)
                except (psycopg.OperationalError, OSError, TimeoutError) as exc:
                    raise DatabaseUnavailable(str(exc) or "connection timed out") from exc
            self._changed(in_use=1)
            try:
                yield conn
            except psycopg.OperationalError as exc:
                self._discard_idle()
                raise DatabaseUnavailable(str(exc)) from exc
            finally:
                self._changed(in_use=-1)
        finally:
            if conn is not None:
                if conn.closed or conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                    await conn.close()
                else:
                    self._idle.append(conn)
            self._slots.release()

    def _changed(self, in_use: int = 0, waiting: int = 0) -> None:
        self.in_use += in_use
        self.waiting += waiting
        if self._on_change is not None:
            self._on_change(self.in_use, self.waiting)

    def _discard_idle(self) -> None:
        """After one connection broke the others are suspect too (a restart drops them all)."""
        idle, self._idle = self._idle, []
        for conn in idle:
            asyncio.get_running_loop().create_task(conn.close())

    async def close(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            await conn.close()


def sync_engine(conninfo: str) -> Engine:
    """A SQLAlchemy engine on psycopg for alembic, taking a libpq URL or conninfo as is."""
    return create_engine(
        "postgresql+psycopg://", creator=lambda: psycopg.connect(conninfo), poolclass=NullPool
    )
