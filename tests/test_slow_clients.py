"""Slow and numerous clients cannot take the HTTP server from the others (app/ops/server.py).

A real `steprecord serve`, with a header deadline of one second (the default is ten), a body
deadline of three (the default is thirty) and at most four connections per worker, so that
all show quickly.
"""

import select
import socket
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import httpx
import pytest

from tests.support.servers import logged_server
from tests.support.waits import eventually

HEADER_TIMEOUT = 1.0
BODY_TIMEOUT = 3.0
MAX_CONNECTIONS = 4
SETTINGS = {
    "STEPRECORD_HEADER_TIMEOUT_SECONDS": str(HEADER_TIMEOUT),
    "STEPRECORD_BODY_TIMEOUT_SECONDS": str(BODY_TIMEOUT),
    "STEPRECORD_MAX_CONNECTIONS": str(MAX_CONNECTIONS),
}


@pytest.fixture(scope="module")
def url(own_database: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("slow") / "stdout.jsonl"
    with logged_server(own_database, log, env=SETTINGS) as url:
        yield url


@contextmanager
def raw_connection(url: str) -> Iterator[socket.socket]:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        yield sock


def read_response(sock: socket.socket) -> bytes:
    """One whole response to a request of /healthz (its body is short and has a length)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        assert chunk, data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1])
        for line in head.lower().split(b"\r\n")
        if b"content-length" in line
    )
    while len(body) < length:
        body += sock.recv(4096)
    return head


def trickle_until_closed(
    sock: socket.socket, client: httpx.Client, began: float
) -> tuple[float, bytes]:
    """Send one more header line whenever the server has said nothing for a fifth of a second,
    with a normal request from another connection in between, until the server closes the
    connection: the seconds since `began` (a moment before the server's deadline started), and
    what the server sent."""
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: steprecord\r\n")
    received = b""
    while time.monotonic() - began < 10 * HEADER_TIMEOUT:
        assert client.get("/healthz").status_code == 200  # the others are served meanwhile
        readable, _, _ = select.select([sock], [], [], 0.2)
        try:
            if not readable:
                sock.sendall(b"X-Slow: 1\r\n")
                continue
            chunk = sock.recv(4096)
        except (BrokenPipeError, ConnectionResetError):
            return time.monotonic() - began, received
        if not chunk:
            return time.monotonic() - began, received
        received += chunk
    raise AssertionError(f"still open after {10 * HEADER_TIMEOUT} s")


@pytest.mark.parametrize("kept_alive", [False, True], ids=["new", "after-a-request"])
def test_a_client_trickling_its_headers_is_cut_off_while_others_are_served(
    url: str, kept_alive: bool
) -> None:
    # The server's deadline starts when it accepts the connection, or (kept alive) once it has
    # answered the first request: `began` is taken before either, so the server cannot have
    # cut the connection before the deadline and still pass.
    with httpx.Client(base_url=url, timeout=5) as client:
        began = time.monotonic()
        with raw_connection(url) as sock:
            if kept_alive:  # a first request answered normally; the deadline is per request
                sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: steprecord\r\n\r\n")
                assert read_response(sock).startswith(b"HTTP/1.1 200")
            took, said = trickle_until_closed(sock, client, began)
    assert HEADER_TIMEOUT * 0.9 <= took < HEADER_TIMEOUT + 4, took
    assert said.startswith(b"HTTP/1.1 408"), said


def test_connections_beyond_the_bound_are_answered_503_at_once(url: str) -> None:
    with ExitStack() as held:
        for _ in range(MAX_CONNECTIONS):
            sock = held.enter_context(raw_connection(url))
            sock.sendall(b"GET /healthz HTTP/1.1\r\n")  # each held open, headers unfinished
        with httpx.Client(base_url=url, timeout=5) as client:
            assert client.get("/healthz").status_code == 503
    with httpx.Client(base_url=url, timeout=5) as client:  # those gone, served again
        eventually(lambda: client.get("/healthz").status_code == 200, what="a 200")


def test_the_header_deadline_does_not_bound_a_slow_body(url: str) -> None:
    body = b'{"events": []}'
    pieces = [body[i : i + 3] for i in range(0, len(body), 3)]
    with raw_connection(url) as sock:
        sock.sendall(
            b"POST /v1/events HTTP/1.1\r\nHost: steprecord\r\ncontent-type: application/json\r\n"
            + f"content-length: {len(body)}\r\n\r\n".encode()
        )
        began = time.monotonic()
        for piece in pieces:  # a piece each time the server stays silent for 0.4 s
            readable, _, _ = select.select([sock], [], [], 0.4)
            assert not readable, sock.recv(4096)
            sock.sendall(piece)
        assert time.monotonic() - began > HEADER_TIMEOUT  # longer than the header deadline
        answer = sock.recv(4096)
    assert answer.startswith(b"HTTP/1.1 "), answer
    assert not answer.startswith(b"HTTP/1.1 408"), answer


def trickle_body_until_closed(sock: socket.socket, began: float, limit: float) -> bytes:
    """Send one more byte of a body whenever the server has said nothing for a fifth of a
    second, until it closes the connection: what it sent. Fails after `limit` seconds."""
    received = b""
    while time.monotonic() - began < limit:
        readable, _, _ = select.select([sock], [], [], 0.2)
        try:
            if not readable:
                sock.sendall(b"x")
                continue
            chunk = sock.recv(4096)
        except (BrokenPipeError, ConnectionResetError):
            return received
        if not chunk:
            return received
        received += chunk
    raise AssertionError(f"still open after {limit} s; the server sent {received!r}")


def test_a_body_that_does_not_arrive_within_its_deadline_gets_408_and_the_connection_closes(
    url: str,
) -> None:
    with raw_connection(url) as sock:
        sock.sendall(
            b"POST /v1/events HTTP/1.1\r\nHost: steprecord\r\ncontent-type: application/json\r\n"
            b"content-length: 100000\r\n\r\n{"
        )
        began = time.monotonic()
        said = trickle_body_until_closed(sock, began, 10 * BODY_TIMEOUT)
        took = time.monotonic() - began
    assert BODY_TIMEOUT * 0.9 <= took < BODY_TIMEOUT + 4, took
    assert said.startswith(b"HTTP/1.1 408"), said
    assert b"request_timeout" in said, said


# Answered before the body is read: too large for any endpoint by its declared length, and
# unauthenticated (through a proxy, which no token-less service lets in).
EARLY_ANSWERS = {
    "413": b"POST /v1/events HTTP/1.1\r\n",
    "401": b"POST /v1/events HTTP/1.1\r\nX-Forwarded-For: 203.0.113.7\r\n",
}


@pytest.mark.parametrize("status", sorted(EARLY_ANSWERS))
def test_an_answer_sent_before_the_body_was_read_closes_the_connection(
    url: str, status: str
) -> None:
    with raw_connection(url) as sock:
        sock.sendall(
            EARLY_ANSWERS[status] + b"Host: steprecord\r\ncontent-type: application/json\r\n"
            b"content-length: 1000000000\r\n\r\n{"
        )
        began = time.monotonic()
        said = trickle_body_until_closed(sock, began, BODY_TIMEOUT / 2)
    head = said.partition(b"\r\n\r\n")[0].lower()
    assert head.startswith(b"http/1.1 " + status.encode()), said
    assert b"\r\nconnection: close" in head, said


def test_slow_bodies_of_unauthenticated_clients_do_not_take_every_connection(url: str) -> None:
    with ExitStack() as held:
        for _ in range(2 * MAX_CONNECTIONS):  # each still sending its body, a byte at a time
            sock = held.enter_context(raw_connection(url))
            sock.sendall(
                EARLY_ANSWERS["401"] + b"Host: steprecord\r\ncontent-length: 1000000000\r\n\r\n{"
            )
            said = trickle_body_until_closed(sock, time.monotonic(), BODY_TIMEOUT / 2)
            assert said.startswith(b"HTTP/1.1 401"), said
        with httpx.Client(base_url=url, timeout=5) as client:
            assert client.get("/healthz").status_code == 200
