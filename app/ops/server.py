"""The HTTP server's defences against slow and numerous clients.

uvicorn closes an idle keep-alive connection (`timeout_keep_alive`) and bounds a request's
header size, but waits forever for the end of a request's headers and for its body: a client
that sends one header line, or one byte of its body, every few seconds (slow loris) holds its
connection, and enough of them hold every connection a worker can take. `DeadlineProtocol`
is uvicorn's HTTP protocol with two deadlines:

- the headers: `STEPRECORD_HEADER_TIMEOUT_SECONDS` (default 10) after the connection opened,
  or after the first byte of a later request on a kept-alive connection, the headers must be
  complete;
- the body: `STEPRECORD_BODY_TIMEOUT_SECONDS` (default 30) after the headers, the body must
  be complete (a request without one is complete with its headers).

Past either, the client gets `408` (when no response is under way) and the connection is
closed. The response is not bounded by them (an event stream), but its client must read it:
once the connection's send buffer is full, some of it must be taken within
`STEPRECORD_SEND_TIMEOUT_SECONDS` (default 30), or the connection is closed (its buffer
dropped). A client that stops reading an event stream, or a large page, so ends it, and the
memory the answer held goes with it.

uvicorn also keeps a connection open after an answer sent before the request's body was read
(a 401, a 413 by the declared length), reading and dropping the rest of the body for as long
as the client sends it. `CloseAfterEarlyAnswer` marks such an answer `connection: close`, so
the connection ends with it: an unauthenticated client declaring a huge body and sending it
slowly holds its connection for no longer than its answer takes.

`ServerConfig` carries the deadlines to each worker (uvicorn hands its config to the workers
of `--workers N`), and the concurrency bound: `STEPRECORD_MAX_CONNECTIONS` (default 1000)
connections per worker, beyond which a request is answered 503 at once.
"""

import asyncio
from typing import Any

import uvicorn
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ..core.problems import Problem
from ..core.serialize import dumps

HEADER_TIMEOUT_SECONDS = 10.0
BODY_TIMEOUT_SECONDS = 30.0
SEND_TIMEOUT_SECONDS = 30.0

REQUEST_TIMEOUT = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"connection: close\r\ncontent-length: 40\r\n\r\n"
    b"the request's headers came too slowly.\r\n"
)


def _body_timeout_answer(seconds: float) -> bytes:
    problem = Problem(
        408,
        "request_timeout",
        f"the request's body did not arrive within {seconds:g} seconds of its headers"
        " (STEPRECORD_BODY_TIMEOUT_SECONDS): send it at once, or in smaller requests",
    )
    body = dumps(problem.body())
    return (
        b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/problem+json\r\n"
        b"connection: close\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )


class ServerConfig(uvicorn.Config):
    """uvicorn's config, plus the deadlines the protocol reads."""

    def __init__(
        self,
        *args: Any,
        header_timeout: float = HEADER_TIMEOUT_SECONDS,
        body_timeout: float = BODY_TIMEOUT_SECONDS,
        send_timeout: float = SEND_TIMEOUT_SECONDS,
        **kw: Any,
    ):
        kw["http"] = DeadlineProtocol
        super().__init__(*args, **kw)
        self.header_timeout = header_timeout
        self.body_timeout = body_timeout
        self.send_timeout = send_timeout


class DeadlineProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, closing a connection whose request headers or body are
    late, or whose client stopped reading the answer."""

    def __init__(self, config: uvicorn.Config, *args: Any, **kw: Any) -> None:
        super().__init__(config, *args, **kw)
        self.header_timeout = float(getattr(config, "header_timeout", HEADER_TIMEOUT_SECONDS))
        self.body_timeout = float(getattr(config, "body_timeout", BODY_TIMEOUT_SECONDS))
        self.header_deadline: asyncio.TimerHandle | None = None
        self.send_timeout = float(getattr(config, "send_timeout", SEND_TIMEOUT_SECONDS))
        self.body_deadline: asyncio.TimerHandle | None = None
        self.send_deadline: asyncio.TimerHandle | None = None
        self.buffered = 0  # the send buffer's size when its deadline was (re)armed

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm()  # a later request on a kept-alive connection: its own deadline

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()
        # Its body must follow in time (a request without one completes in this same call).
        self.body_deadline = self.loop.call_later(self.body_timeout, self._body_expired)

    def on_message_complete(self) -> None:
        self._disarm_body()
        super().on_message_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._disarm_body()
        self._disarm_send()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()  # the answer waits until the client has read some of it
        if self.send_deadline is None:
            self.buffered = self.transport.get_write_buffer_size()
            self.send_deadline = self.loop.call_later(self.send_timeout, self._send_expired)

    def resume_writing(self) -> None:
        self._disarm_send()
        super().resume_writing()

    def _disarm_send(self) -> None:
        if self.send_deadline is not None:
            self.send_deadline.cancel()
            self.send_deadline = None

    def _send_expired(self) -> None:
        self.send_deadline = None
        if self.transport.is_closing():
            return
        buffered = self.transport.get_write_buffer_size()
        if buffered < self.buffered:  # the client read some: it has as long again
            self.buffered = buffered
            self.send_deadline = self.loop.call_later(self.send_timeout, self._send_expired)
            return
        self.logger.info("closed a connection whose client stopped reading its answer")
        self.transport.abort()

    def _arm(self) -> None:
        if self.header_deadline is None:
            self.header_deadline = self.loop.call_later(self.header_timeout, self._expired)

    def _disarm(self) -> None:
        if self.header_deadline is not None:
            self.header_deadline.cancel()
            self.header_deadline = None

    def _disarm_body(self) -> None:
        if self.body_deadline is not None:
            self.body_deadline.cancel()
            self.body_deadline = None

    def _body_expired(self) -> None:
        self.body_deadline = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_started:
            self.transport.write(_body_timeout_answer(self.body_timeout))
        self.logger.info("closed a connection whose request body took too long")
        self.transport.close()

    def _expired(self) -> None:
        self.header_deadline = None
        if self.transport.is_closing():
            return
        if self.cycle is None or self.cycle.response_complete:
            self.transport.write(REQUEST_TIMEOUT)
        self.logger.info("closed a connection whose request headers took too long")
        self.transport.close()


class CloseAfterEarlyAnswer:
    """ASGI middleware: an answer that starts before the request's body was read whole says
    `connection: close`, so the server closes the connection once it is sent (see above)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _has_body(scope):
            await self.app(scope, receive, send)
            return
        read = False

        async def receiving() -> Message:
            nonlocal read
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                read = True
            return message

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start" and not read:
                headers = [*message.get("headers", ()), (b"connection", b"close")]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receiving, sending)


def _has_body(scope: Scope) -> bool:
    for name, value in scope["headers"]:
        if name == b"transfer-encoding" or (name == b"content-length" and value.strip() != b"0"):
            return True
    return False
