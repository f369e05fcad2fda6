"""The HTTP server's defences against slow and numerous clients.

uvicorn closes an idle keep-alive connection (`timeout_keep_alive`) and bounds a request's
header size, but waits forever for the end of a request's headers: a client that sends one
header line every few seconds (slow loris) holds its connection, and enough of them hold
every connection a worker can take. `HeaderDeadlineProtocol` is uvicorn's HTTP protocol with
a deadline for the headers: `STEPRECORD_HEADER_TIMEOUT_SECONDS` (default 10) after the
connection opened, or after the first byte of a later request on a kept-alive connection,
the headers must be complete; otherwise the client gets `408` (when no response is under
way) and the connection is closed. The body and the response are not bounded by it (a slow
upload, an event stream).

`ServerConfig` carries the deadline to each worker (uvicorn hands its config to the workers
of `--workers N`), and the concurrency bound: `STEPRECORD_MAX_CONNECTIONS` (default 1000)
connections per worker, beyond which a request is answered 503 at once.
"""

import asyncio
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

HEADER_TIMEOUT_SECONDS = 10.0

REQUEST_TIMEOUT = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"connection: close\r\ncontent-length: 40\r\n\r\n"
    b"the request's headers came too slowly.\r\n"
)


class ServerConfig(uvicorn.Config):
    """uvicorn's config, plus the header deadline the protocol reads."""

    def __init__(self, *args: Any, header_timeout: float = HEADER_TIMEOUT_SECONDS, **kw: Any):
        kw["http"] = HeaderDeadlineProtocol
        super().__init__(*args, **kw)
        self.header_timeout = header_timeout


class HeaderDeadlineProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, closing a connection whose request headers are late."""

    def __init__(self, config: uvicorn.Config, *args: Any, **kw: Any) -> None:
        super().__init__(config, *args, **kw)
        self.header_timeout = float(getattr(config, "header_timeout", HEADER_TIMEOUT_SECONDS))
        self.header_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm()  # a later request on a kept-alive connection: its own deadline

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self.header_deadline is None:
            self.header_deadline = self.loop.call_later(self.header_timeout, self._expired)

    def _disarm(self) -> None:
        if self.header_deadline is not None:
            self.header_deadline.cancel()
            self.header_deadline = None

    def _expired(self) -> None:
        self.header_deadline = None
        if self.transport.is_closing():
            return
        if self.cycle is None or self.cycle.response_complete:
            self.transport.write(REQUEST_TIMEOUT)
        self.logger.info("closed a connection whose request headers took too long")
        self.transport.close()
