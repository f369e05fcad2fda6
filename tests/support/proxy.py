"""A TCP proxy to PostgreSQL that can stop answering: a hung server, as a client sees it."""

import select
import socket
import threading
from types import TracebackType

import psycopg


class FreezableProxy:
    """A TCP proxy to PostgreSQL that can stop answering.

    Frozen, it accepts connections and never answers them, and relays nothing on the open
    ones: a hung server, as far as a client can tell. Thawed, it drops what it held and
    relays new connections again.
    """

    def __init__(self, upstream: tuple[str, int], *, frozen: bool = False) -> None:
        self._upstream = upstream
        self._frozen = frozen
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._peers: dict[socket.socket, socket.socket] = {}
        self._held: list[socket.socket] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "FreezableProxy":
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stopping.set()
        self._thread.join(10)
        with self._lock:
            self._drop_all()
        self._listener.close()

    def url(self, database_url: str) -> str:
        return psycopg.conninfo.make_conninfo(database_url, host="127.0.0.1", port=self.port)

    def freeze(self) -> None:
        with self._lock:
            self._frozen = True

    def thaw(self) -> None:
        with self._lock:
            self._drop_all()
            self._frozen = False

    def _drop_all(self) -> None:
        for sock in [*self._peers, *self._held]:
            sock.close()
        self._peers.clear()
        self._held.clear()

    def _run(self) -> None:
        while not self._stopping.is_set():
            with self._lock:
                watched = [self._listener, *([] if self._frozen else self._peers)]
            readable, _, _ = select.select(watched, [], [], 0.05)
            with self._lock:
                for sock in readable:
                    if sock is self._listener:
                        self._accept()
                    elif sock in self._peers and not self._frozen:
                        self._relay(sock)

    def _accept(self) -> None:
        client, _ = self._listener.accept()
        if self._frozen:
            self._held.append(client)
            return
        host, port = self._upstream
        if host.startswith("/"):  # a Unix socket directory, as the embedded server uses
            server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            server.connect(f"{host}/.s.PGSQL.{port}")
        else:
            server = socket.create_connection(self._upstream)
        self._peers[client], self._peers[server] = server, client

    def _relay(self, sock: socket.socket) -> None:
        peer = self._peers[sock]
        try:
            data = sock.recv(65536)
            if data:
                peer.sendall(data)
                return
        except OSError:
            pass
        for end in (sock, peer):
            self._peers.pop(end, None)
            end.close()


def upstream(database_url: str) -> tuple[str, int]:
    """The host (or socket directory) and port of the PostgreSQL that `database_url` reaches."""
    info = psycopg.conninfo.conninfo_to_dict(database_url)
    return str(info.get("host", "127.0.0.1")), int(str(info.get("port", 5432)))
