"""Live streams (SSE) read on a thread of their own: records and keepalives."""

import contextlib
import json
import queue
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx

WAIT = 10.0  # the longest any expected event may take here (the promise is a second)


KEEPALIVE = ": keepalive"


@dataclass(frozen=True)
class Event:
    id: str
    data: str

    @property
    def record(self) -> Any:
        return json.loads(self.data)


class Stream:
    """An SSE stream read on a thread of its own: records and keepalives land in a queue.

    `close()` closes the connection under the reader, so it ends even between keepalives.
    """

    def __init__(self, url: str, headers: dict[str, str] | None = None, **params: str) -> None:
        self.items: queue.Queue[Event | str | BaseException] = queue.Queue()
        self.response_headers: httpx.Headers | None = None
        self._response: httpx.Response | None = None
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(
            target=self._read, args=(url, headers or {}, params), daemon=True
        )
        self._thread.start()
        assert self._ready.wait(WAIT), "the stream did not open"

    def _read(self, url: str, headers: dict[str, str], params: dict[str, str]) -> None:
        try:
            timeout = httpx.Timeout(WAIT)
            with (
                httpx.Client(timeout=timeout) as client,
                client.stream("GET", url, headers=headers, params=params) as response,
            ):
                assert response.status_code == 200, response.read()
                self.response_headers, self._response = response.headers, response
                self._ready.set()
                fields: dict[str, str] = {}
                for line in response.iter_lines():
                    if self._stop.is_set():
                        return
                    if line.startswith(":"):
                        self.items.put(line)
                    elif line:
                        name, _, value = line.partition(": ")
                        fields[name] = value
                    elif fields:
                        assert fields.pop("event") == "record", fields
                        self.items.put(Event(fields.pop("id"), fields.pop("data")))
                        assert not fields, fields
        except BaseException as exc:
            self.items.put(exc)
        finally:
            self._ready.set()

    def next_item(self, timeout: float = WAIT) -> Event | str:
        item = self.items.get(timeout=timeout)
        if isinstance(item, BaseException):
            raise item
        return item

    def next_event(self, timeout: float = WAIT) -> Event:
        """The next record event, skipping keepalives."""
        deadline = time.monotonic() + timeout
        while True:
            item = self.next_item(max(deadline - time.monotonic(), 0.01))
            if isinstance(item, Event):
                return item

    def events(self, count: int) -> list[Event]:
        return [self.next_event() for _ in range(count)]

    def quiet(self, keepalives: int = 2) -> None:
        """No record arrives before `keepalives` keepalives do (nothing else is pending)."""
        for _ in range(keepalives):
            item = self.next_item()
            assert item == KEEPALIVE, f"unexpected {item}"

    def ended(self) -> bool:
        """The server ended the stream (the reader saw its end and stopped by itself)."""
        return not self._thread.is_alive() and not self._stop.is_set()

    def close(self) -> None:
        self._stop.set()
        if self._response is not None and self._thread.is_alive():
            # Wakes the reader blocked in recv(): closing the response would wait for it.
            connection = self._response.extensions["network_stream"].get_extra_info("socket")
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
        self._thread.join(WAIT)
        assert not self._thread.is_alive()
