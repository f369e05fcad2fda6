"""The tests' shared helpers, in one place: PostgreSQL databases, service processes and
PgBouncer, waiting on a condition, reading metrics, HTTP shorthands, and the browser."""

import contextlib
import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import psycopg
import pytest
from playwright.sync_api import Browser, sync_playwright

from app.cli import migrate
from app.embedded import EmbeddedPostgres

ROOT = Path(__file__).resolve().parent.parent
T = TypeVar("T")

T0 = "2026-12-02T10:00:00Z"
T1 = "2026-12-02T10:00:01Z"
T2 = "2026-12-02T10:00:02Z"
T3 = "2026-12-02T10:00:03Z"
T4 = "2026-12-02T10:00:04Z"


def asgi_scope(method: str, path: str, body: bytes | None = None) -> dict[str, Any]:
    """The ASGI scope of a direct request (loopback, no token: anonymous access) to call an app
    in-process; with `body`, a JSON body of that length."""
    headers = [(b"host", b"127.0.0.1")]
    if body is not None:
        headers += [(b"content-type", b"application/json")]
        headers += [(b"content-length", str(len(body)).encode())]
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
        "state": {},
    }


def step_path(instance: str = "order-1", step: str = "charge") -> str:
    return f"/v1/instances/{instance}/steps/{step}"


def post(
    client: httpx.Client,
    kind: str,
    body: Any = None,
    instance: str = "order-1",
    step: str = "charge",
) -> httpx.Response:
    url = f"{step_path(instance, step)}/{kind}"
    if body is None:
        return client.post(url)
    return client.post(url, json=body)


def record(client: httpx.Client, instance: str = "order-1", step: str = "charge") -> Any:
    response = client.get(step_path(instance, step))
    assert response.status_code == 200, response.text
    return response.json()


def exists(client: httpx.Client, key: str) -> bool:
    return client.get(f"/v1/instances/{key}").status_code == 200


def age(database_url: str, instance_key: str, days: int) -> None:
    """Make an instance look last written `days` ago (its creation and every record's
    updated_at; the history does not take part in the rule)."""
    # By the instance's id, derived from its key: on Citus, each update is the shard's.
    with psycopg.connect(database_url) as conn:
        conn.execute(
            "UPDATE process_instance SET created_at = now() - %s * interval '1 day'"
            " WHERE id = steprecord_instance_id(%s)",
            (days, instance_key),
        )
        conn.execute(
            "UPDATE workflow_step_record SET updated_at = now() - %s * interval '1 day'"
            " WHERE instance_id = steprecord_instance_id(%s)",
            (days, instance_key),
        )


def problem(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    body: dict[str, Any] = response.json()
    assert body["code"] == code, body
    assert body["status"] == status
    assert {"type", "title", "detail"} <= body.keys()
    return body


def attempts(client: httpx.Client, instance: str = "order-1", step: str = "charge") -> Any:
    """Every attempt of a step's history, in attempt order."""
    response = client.get(f"{step_path(instance, step)}/attempts", params={"limit": 1000})
    assert response.status_code == 200, response.text
    return response.json()["items"]


def history(client: httpx.Client, instance: str = "order-1", step: str = "charge") -> Any:
    """The history in short: `(attempt, status)` of each attempt."""
    return [(a["attempt"], a["status"]) for a in attempts(client, instance, step)]


# --- waiting -----------------------------------------------------------------------------


def eventually(
    check: Callable[[], bool], seconds: float = 15, interval: float = 0.05, what: str = ""
) -> float:
    """Poll `check` until it holds; the seconds that took. Fails after `seconds`."""
    began = time.monotonic()
    while not check():
        waited = time.monotonic() - began
        assert waited < seconds, f"timed out after {seconds} s waiting for {what or 'it'}"
        time.sleep(interval)
    return time.monotonic() - began


def wait_for(
    what: str, probe: Callable[[], T | None], seconds: float = 15, interval: float = 0.05
) -> T:
    """Poll `probe` every `interval` until it gives something truthy, and return that. Fails
    after `seconds`."""
    found: list[T | None] = [None]

    def check() -> bool:
        found[0] = probe()
        return bool(found[0])

    eventually(check, seconds, interval, what=what)
    assert found[0] is not None
    return found[0]


def lock_waits(watcher: psycopg.Connection[Any]) -> int:
    """Sessions of the watcher's database waiting for a lock (the service's, through PgBouncer
    too): how a test knows that a request it sent is now blocked on a row it holds. On Citus
    the sessions of every node: a row's lock is waited for on the worker that holds it."""
    citus = watcher.execute("SELECT 1 FROM pg_extension WHERE extname = 'citus'").fetchone()
    view = "pg_stat_activity" if citus is None else "citus_stat_activity"
    row = watcher.execute(
        f"SELECT count(*) FROM {view}"
        " WHERE datname = current_database() AND wait_event_type = 'Lock'"
    ).fetchone()
    assert row is not None
    return int(row[0])


def steprecord(database_url: str, *args: str, **run: Any) -> subprocess.CompletedProcess[str]:
    """The `steprecord` command on `database_url`, its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "app.cli", *args],
        env={**os.environ, "DATABASE_URL": database_url},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        **run,
    )


# --- live streams ------------------------------------------------------------------------

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


# --- metrics -------------------------------------------------------------------------------


def metric(text: str, name: str, **labels: str) -> float:
    """The value of the sample `name` with these labels in a Prometheus text page; fails when
    there is none."""
    for line in text.splitlines():
        if not (line.startswith(name + "{") or line.startswith(name + " ")):
            continue
        series, value = line.rsplit(" ", 1)
        found = dict(re.findall(r'(\w+)="([^"]*)"', series))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(value)
    raise AssertionError(f"no {name} {labels} in the metrics")


def counter(text: str, name: str, **labels: str) -> float:
    """A counter's value: 0 while it has no sample yet (nothing counted)."""
    try:
        return metric(text, name, **labels)
    except AssertionError:
        return 0.0


def metrics(url: str) -> str:
    """The service's Prometheus page."""
    response = httpx.get(f"{url}/metrics", timeout=10)
    assert response.status_code == 200, response.text
    return response.text


# --- databases and processes ---------------------------------------------------------------


def create_database(server_dsn: str, name: str) -> str:
    """A new database on the server; on a Citus coordinator, on every node of its cluster, with
    the extension in each and the workers added, as an operator would set one up."""
    workers = citus_workers(server_dsn)
    for dsn in (server_dsn, *workers):
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            conn.execute(f'CREATE DATABASE "{name}"')
    url = psycopg.conninfo.make_conninfo(server_dsn, dbname=name)
    if workers:
        for dsn in workers:
            with psycopg.connect(
                psycopg.conninfo.make_conninfo(dsn, dbname=name), autocommit=True
            ) as conn:
                conn.execute("CREATE EXTENSION citus")
        add_citus_nodes(url, workers)
    return url


def drop_database(server_dsn: str, name: str) -> None:
    for dsn in (server_dsn, *citus_workers(server_dsn)):
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def has_citus(url: str) -> bool:
    """The database has the citus extension (so `steprecord migrate` distributed it)."""
    with psycopg.connect(url, autocommit=True) as conn:
        return (
            conn.execute("SELECT 1 FROM pg_extension WHERE extname = 'citus'").fetchone()
            is not None
        )


def citus_workers(server_dsn: str) -> list[str]:
    """The maintenance URLs of the workers of the Citus cluster whose coordinator `server_dsn`
    reaches (its own database's node list), or none when that is no Citus coordinator."""
    if not has_citus(server_dsn):
        return []
    with psycopg.connect(server_dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT nodename, nodeport FROM pg_dist_node WHERE noderole = 'primary'"
            " AND groupid <> 0 ORDER BY nodeid"
        ).fetchall()
    return [psycopg.conninfo.make_conninfo(server_dsn, host=host, port=port) for host, port in rows]


def add_citus_nodes(coordinator_url: str, workers: list[str]) -> None:
    info = psycopg.conninfo.conninfo_to_dict(coordinator_url)
    with psycopg.connect(coordinator_url, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS citus")
        conn.execute("SELECT citus_set_coordinator_host(%s, %s)", (info["host"], info["port"]))
        for dsn in workers:
            worker = psycopg.conninfo.conninfo_to_dict(dsn)
            conn.execute("SELECT citus_add_node(%s, %s)", (worker["host"], worker["port"]))


def citus_bin_path() -> Path | None:
    """The bin directory of the newest PostgreSQL installed here that has Citus, if any."""
    for pg_config in sorted(
        Path("/usr/lib/postgresql").glob("*/bin/pg_config"),
        key=lambda path: int(path.parent.parent.name) if path.parent.parent.name.isdigit() else 0,
        reverse=True,
    ):
        done = subprocess.run([pg_config, "--sharedir"], capture_output=True, text=True)
        if (Path(done.stdout.strip()) / "extension" / "citus.control").exists():
            return pg_config.parent
    return None


@dataclass
class CitusCluster:
    """A coordinator and its workers: private PostgreSQL servers on loopback ports."""

    coordinator: EmbeddedPostgres
    workers: list[EmbeddedPostgres]

    @property
    def url(self) -> str:
        """The coordinator's maintenance database, where the tests create theirs."""
        return self.coordinator.url


def rows_on_worker(worker_url: str, table: str) -> int:
    """How many rows of a distributed table a worker holds in its own shards (the physical
    tables named `<table>_<shard id>`, which Citus hides from ordinary catalog queries)."""
    with psycopg.connect(worker_url, autocommit=True) as conn:
        conn.execute("SET citus.override_table_visibility TO off")
        shards = conn.execute(
            "SELECT relname FROM pg_class WHERE relkind = 'r' AND relname ~ %s",
            (f"^{table}_[0-9]+$",),
        ).fetchall()
        total = 0
        for (shard,) in shards:
            row = conn.execute(f'SELECT count(*) FROM "{shard}"').fetchone()
            assert row is not None
            total += int(row[0])
    return total


_NODE_OF = """
SELECT n.nodeport FROM pg_dist_placement pl
JOIN pg_dist_node n ON n.groupid = pl.groupid
WHERE pl.shardid = get_shard_id_for_distribution_column(
    'process_instance', steprecord_instance_id(%s))
"""


_WORKER_OF = """
SELECT n.nodename, n.nodeport FROM pg_dist_placement pl
JOIN pg_dist_node n ON n.groupid = pl.groupid
WHERE pl.shardid = get_shard_id_for_distribution_column(
    'process_instance', steprecord_instance_id(%s))
"""


@dataclass(frozen=True)
class OneShard:
    """Where a plan test loads its instances so that one shard holds as many rows as one
    node's table would: on Citus the hashes of the instances' first shard (Citus hashes a
    bigint with `hashint8`), the number of shards, and that shard's table; on one node every
    hash, one "shard" and the table itself."""

    low: int
    high: int
    shards: int
    table: str


def one_shard(conn: psycopg.Connection[Any]) -> OneShard:
    """The first shard of the instances on Citus (see `OneShard`), or the whole table."""
    citus = conn.execute("SELECT 1 FROM pg_extension WHERE extname = 'citus'").fetchone()
    if citus is None:
        return OneShard(-(2**31), 2**31 - 1, 1, "process_instance")
    row = conn.execute(
        "SELECT shardminvalue::int, shardmaxvalue::int, count(*) OVER (),"
        " 'process_instance_' || shardid"
        " FROM pg_dist_shard WHERE logicalrelid = 'process_instance'::regclass"
        " ORDER BY shardminvalue::int LIMIT 1"
    ).fetchone()
    assert row is not None
    return OneShard(*row)


def one_key_per_worker(url: str, citus: CitusCluster) -> list[str]:
    """An instance key whose shard is on each worker, in the workers' order."""
    ports = [int(worker.port or 0) for worker in citus.workers]
    found: dict[int, str] = {}
    with psycopg.connect(url, autocommit=True) as conn:
        for n in range(100):
            key = f"run-{uuid.uuid4().hex[:8]}-{n}"
            row = conn.execute(_NODE_OF, (key,)).fetchone()
            assert row is not None
            found.setdefault(int(row[0]), key)
            if len(found) == len(ports):
                break
    assert sorted(found) == sorted(ports), found
    return [found[port] for port in ports]


def node_of(url: str, key: str) -> str:
    """The URL (in `url`'s database) of the server holding instance `key`'s rows, where the
    record's triggers run and notify: `url` itself, or on Citus the instance's worker."""
    if not has_citus(url):
        return url
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(_WORKER_OF, (key,)).fetchone()
    assert row is not None
    return psycopg.conninfo.make_conninfo(url, host=row[0], port=row[1])


@contextmanager
def citus_cluster(
    root: Path, bin_path: Path, workers: int = 2, shards: int | None = None
) -> Iterator[CitusCluster]:
    """Starts a coordinator and `workers` workers under `root` (the extension created in each
    maintenance database, the workers added), and stops them all on the way out. `shards`:
    each distributed table's number of shards (`citus.shard_count`; None: what `steprecord
    migrate` chooses, 8, 4 on each of two workers)."""
    # wal_level = logical: Citus moves shards by logical replication unless told to block writes.
    settings = {"shared_preload_libraries": "citus", "wal_level": "logical"}
    if shards is not None:
        settings["citus.shard_count"] = str(shards)
    nodes: list[EmbeddedPostgres] = []
    try:
        for name in ("coordinator", *(f"worker{n}" for n in range(1, workers + 1))):
            node = EmbeddedPostgres(
                root / name, bin_path=bin_path, port=free_port(), settings=settings
            )
            nodes.append(node)
            node.start()
        for node in nodes[1:]:
            with psycopg.connect(node.url, autocommit=True) as conn:
                conn.execute("CREATE EXTENSION citus")
        add_citus_nodes(nodes[0].url, [node.url for node in nodes[1:]])
        yield CitusCluster(nodes[0], nodes[1:])
    finally:
        for node in nodes:
            with contextlib.suppress(RuntimeError):  # a test may have stopped it already
                node.stop()


@contextmanager
def migrated_database(server_dsn: str, prefix: str) -> Iterator[str]:
    """A database of a test module's own, migrated to head, dropped afterwards."""
    name = prefix + uuid.uuid4().hex[:8]
    url = create_database(server_dsn, name)
    try:
        migrate(url)
        yield url
    finally:
        drop_database(server_dsn, name)


@contextmanager
def owned_database(server_dsn: str, prefix: str) -> Iterator[str]:
    """An empty database owned by a role of its own that holds no other right (no superuser,
    no CREATEDB, no CREATEROLE), as on a managed PostgreSQL: the URL that logs in as that
    role. On a Citus coordinator the role is made on every node (Citus propagates it) and owns
    the database on each. Both are dropped afterwards."""
    name = prefix + uuid.uuid4().hex[:8]
    url = create_database(server_dsn, name)
    nodes = (server_dsn, *citus_workers(server_dsn))
    try:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(f"CREATE ROLE {name} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE")
        for dsn in nodes:
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute(f'ALTER DATABASE "{name}" OWNER TO {name}')
        yield psycopg.conninfo.make_conninfo(url, user=name)
    finally:
        drop_database(server_dsn, name)
        for dsn in nodes:
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute(f"DROP ROLE IF EXISTS {name}")


@contextmanager
def login_role(server_dsn: str, prefix: str) -> Iterator[str]:
    """A role of a test's own that may log in and holds no right of its own (made by the
    server's administrator, as a managed PostgreSQL's admin would; on Citus, on every node),
    dropped afterwards: drop the databases that granted it something first."""
    name = prefix + uuid.uuid4().hex[:8]
    with psycopg.connect(server_dsn, autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {name} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE")
    try:
        yield name
    finally:
        for dsn in (server_dsn, *citus_workers(server_dsn)):
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute(f"DROP ROLE IF EXISTS {name}")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise RuntimeError("server did not become ready")


def stop(proc: subprocess.Popen[bytes]) -> None:
    """Stop a server started by `start_server`, and whatever of its process group is left: a
    worker whose supervisor died before it would otherwise run on, orphaned."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def start_server(
    database_url: str,
    *extra: str,
    env: dict[str, str] | None = None,
    stdout: Any = None,
    stderr: Any = None,
) -> tuple[str, subprocess.Popen[bytes]]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "serve", "--port", str(port), *extra],
        env={**os.environ, **(env or {}), "DATABASE_URL": database_url},
        cwd=ROOT,
        stdout=stdout,
        stderr=stderr,
        start_new_session=True,  # its own process group, workers included: see `stop`
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc)
    except BaseException:
        stop(proc)
        raise
    return url, proc


# What a service behind the PgBouncer below needs: no server-side prepared statements, which
# PgBouncer before 1.21 (Debian 12 has 1.18) does not carry across transactions.
BEHIND_PGBOUNCER = {"STEPRECORD_PREPARE_THRESHOLD": "none"}


@contextmanager
def logged_server(
    database_url: str, log: Path, *extra: str, env: dict[str, str] | None = None
) -> Iterator[str]:
    """`start_server` with its stdout (the JSON log lines) written to `log`; yields its URL
    and stops it on the way out."""
    with log.open("wb") as out:
        url, proc = start_server(database_url, *extra, env=env, stdout=out)
    try:
        yield url
    finally:
        stop(proc)


@contextmanager
def pgbouncer(database_url: str) -> Iterator[str]:
    """PgBouncer in transaction pool mode in front of the database; yields its URL. Stopped,
    and its working directory removed, on the way out."""
    info = psycopg.conninfo.conninfo_to_dict(database_url)
    workdir = Path(tempfile.mkdtemp(prefix="steprecord-pgbouncer-"))
    if os.geteuid() == 0:  # PgBouncer will not run as root; it switches to nobody
        shutil.chown(workdir, "nobody")
    port = free_port()
    ini = workdir / "pgbouncer.ini"
    ini.write_text(
        "[databases]\n"
        f"* = host={info.get('host', '127.0.0.1')} port={info.get('port', 5432)} user=postgres\n"
        "[pgbouncer]\n"
        f"listen_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n"
        "auth_type = any\npool_mode = transaction\n"
        "max_client_conn = 500\ndefault_pool_size = 20\n"
        f"logfile = {workdir}/pgbouncer.log\npidfile = {workdir}/pgbouncer.pid\n"
    )
    ini.chmod(0o644)
    command = ["pgbouncer", *(["-u", "nobody"] if os.geteuid() == 0 else []), str(ini)]
    proc = subprocess.Popen(command, cwd=workdir)
    url = psycopg.conninfo.make_conninfo(
        "", host="127.0.0.1", port=port, user="postgres", dbname=str(info["dbname"])
    )
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                with psycopg.connect(url, connect_timeout=2) as conn:
                    conn.execute("SELECT 1")
                break
            except psycopg.OperationalError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)


@contextmanager
def server_directory() -> Iterator[Path]:
    """A directory for PostgreSQL servers a test starts, removed afterwards. Not under pytest's
    temporary root: a concurrent pytest run of the same user makes that private again, and a
    server running as another user (the embedded one under root) then cannot open its files."""
    directory = Path(tempfile.mkdtemp(prefix="steprecord-test-"))
    directory.chmod(0o755)
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def make_replica(primary: EmbeddedPostgres, data_dir: Path) -> EmbeddedPostgres:
    """A hot standby streaming from `primary`: a base backup with its recovery settings."""
    replica = EmbeddedPostgres(data_dir)
    replica._prepare_dirs()
    replica._run(
        "pg_basebackup",
        "-D",
        str(replica.pgdata),
        "-d",
        primary.url,
        "-R",
        "-X",
        "stream",
        "-c",
        "fast",
    )
    replica.start()
    return replica


CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


SCREENSHOTS = ROOT / "tests" / "screenshots"
ARTIFACTS = ROOT / "tests" / "artifacts"


def screenshot(page: Any, name: str, *, full_page: bool = True) -> Path:
    """A browser test's screenshot: into tests/artifacts/ (ignored by git), or, with
    STEPRECORD_SCREENSHOTS=1, into tests/screenshots/, the committed pictures of the dashboard."""
    folder = SCREENSHOTS if os.environ.get("STEPRECORD_SCREENSHOTS") == "1" else ARTIFACTS
    folder.mkdir(exist_ok=True)
    target = folder / f"{name}.png"
    page.screenshot(path=str(target), full_page=full_page)
    return target


@contextmanager
def chromium_browser() -> Iterator[Browser]:
    """Debian's chromium driven by Playwright (never a downloaded browser), closed on exit;
    FileNotFoundError when it is not installed."""
    chromium = shutil.which("chromium")
    if chromium is None:
        raise FileNotFoundError("Debian's chromium is not installed: apt-get install chromium")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


def access_loaded(log: Path, workers: int, tokens: int, *, anonymous: bool = False) -> bool:
    """Whether every worker of a server logging to `log` now enforces `tokens` active tokens
    and that anonymous policy: each worker logs a line whenever its view of access changes,
    so its last such line is what it enforces."""
    latest: dict[int, tuple[int, bool]] = {}
    for line in log.read_text().splitlines():
        entry = json.loads(line) if line.startswith("{") else {}
        if "active_tokens" in entry:
            latest[entry["worker"]] = (entry["active_tokens"], entry["anonymous_allowed"])
    return len(latest) == workers and set(latest.values()) == {(tokens, anonymous)}


# --- an OTLP/HTTP trace receiver -------------------------------------------------------------


@dataclass(frozen=True)
class Span:
    """A span as an OTLP receiver got it: ids in lowercase hex, `parent_span_id` empty for a
    root span; `kind` is "server", "client", "internal"...; `service` the resource's
    `service.name`."""

    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: str
    attributes: dict[str, Any]
    service: str | None


class OtlpReceiver:
    """What a receiver started by `otlp_receiver` got: every span of every export, decoded."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.exports = 0
        self._spans: list[Span] = []
        self._lock = threading.Lock()

    def spans(self, trace_id: str | None = None) -> list[Span]:
        with self._lock:
            return [s for s in self._spans if trace_id is None or s.trace_id == trace_id]

    def take(self, body: bytes) -> None:
        """Decode one `ExportTraceServiceRequest` (the protobuf of POST /v1/traces)."""
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )
        from opentelemetry.proto.trace.v1.trace_pb2 import Span as SpanMessage

        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        spans = []
        for resource_spans in request.resource_spans:
            resource = _otlp_attributes(resource_spans.resource.attributes)
            service = resource.get("service.name")
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    kind = SpanMessage.SpanKind.Name(span.kind).removeprefix("SPAN_KIND_")
                    spans.append(
                        Span(
                            name=span.name,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            kind=kind.lower(),
                            attributes=_otlp_attributes(span.attributes),
                            service=None if service is None else str(service),
                        )
                    )
        with self._lock:
            self.exports += 1
            self._spans += spans


def _otlp_attributes(pairs: Any) -> dict[str, Any]:
    """OTLP key-values as a dict of plain values (strings, numbers, booleans)."""
    return {
        pair.key: getattr(pair.value, pair.value.WhichOneof("value") or "", None) for pair in pairs
    }


@contextmanager
def otlp_receiver() -> Iterator[OtlpReceiver]:
    """A real OTLP/HTTP receiver on a free port of 127.0.0.1, in a thread of this process: it
    answers POST /v1/traces (protobuf, gzip or not) as a collector does and keeps every span.
    Its `url` is what OTEL_EXPORTER_OTLP_ENDPOINT takes. Stopped on the way out."""
    import gzip
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceResponse,
    )

    reply = ExportTraceServiceResponse().SerializeToString()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if self.path != "/v1/traces":
                self.send_error(404)
                return
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            try:
                receiver.take(body)
            except Exception:  # not an export: a collector answers 400
                self.send_error(400)
                return
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # no line per export on the test's output

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    receiver = OtlpReceiver(f"http://127.0.0.1:{server.server_address[1]}")
    thread = threading.Thread(target=server.serve_forever, name="otlp-receiver", daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def require_celery_services() -> None:
    """Skip (fail in CI) unless RabbitMQ (the broker) and Redis (the results) answer on
    127.0.0.1, as every Celery test needs them."""

    def answers(port: int) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return True
        except OSError:
            return False

    missing = [name for name, port in (("RabbitMQ", 5672), ("Redis", 6379)) if not answers(port)]
    if missing:
        reason = f"{' and '.join(missing)} not answering on 127.0.0.1: Celery tests need them"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)


def task_plans(text: str) -> str:
    """The shards' part of an EXPLAIN's text: on Citus the plan of each task shown (the lines
    under a `->  Task`) that reads a shard, without the coordinator's merge of the shards' rows
    above it (a Sort there orders what the shards sent, it sorts no shard) nor a task that
    merges the results of a statement's parts (branches Citus ran as subplans of their own,
    each read under its LIMIT: `read_intermediate_result`); on one server the whole plan."""
    if "Custom Scan (Citus" not in text:
        return text
    tasks: list[list[str]] = []
    task_indent: int | None = None
    for line in text.splitlines():
        indent = len(line) - len(line.lstrip())
        if task_indent is not None and indent <= task_indent:
            task_indent = None
        if line.lstrip().startswith("->  Task"):
            task_indent = indent
            tasks.append([])
        elif task_indent is not None:
            tasks[-1].append(line)
    kept = [
        line
        for task in tasks
        if not any("read_intermediate_result" in line for line in task)
        for line in task
    ]
    assert kept, text
    return "\n".join(kept)
