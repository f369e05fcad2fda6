"""Fixtures: a real PostgreSQL migrated by alembic, a live server, and clean tables per test.

With `DATABASE_URL` set, the tests create (and finally drop) their own database on that
server; without it they start an embedded PostgreSQL in a temporary directory.
"""

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from playwright.sync_api import Browser

from app.cli import migrate
from app.embedded import EmbeddedPostgres
from tests.helpers import chromium_browser

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def server_dsn(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A maintenance connection string to a PostgreSQL server the tests may create databases on."""
    url = os.environ.get("DATABASE_URL")
    if url:
        yield url
        return
    embedded = EmbeddedPostgres(tmp_path_factory.mktemp("embedded"))
    try:
        yield embedded.start()
    finally:
        embedded.stop()


def create_database(server_dsn: str, name: str) -> str:
    with psycopg.connect(server_dsn, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
        conn.execute(f'CREATE DATABASE "{name}"')
    return psycopg.conninfo.make_conninfo(server_dsn, dbname=name)


def drop_database(server_dsn: str, name: str) -> None:
    with psycopg.connect(server_dsn, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def database_url(server_dsn: str) -> Iterator[str]:
    """A fresh database, migrated to head by alembic."""
    name = f"steprecord_test_{os.getpid()}"
    url = create_database(server_dsn, name)
    migrate(url)
    try:
        yield url
    finally:
        drop_database(server_dsn, name)


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


@pytest.fixture
def own_postgres(tmp_path: Path) -> Iterator[EmbeddedPostgres]:
    """An embedded PostgreSQL of the test's own, which the test may stop and start."""
    embedded = EmbeddedPostgres(tmp_path / "pg")
    embedded.start()
    try:
        yield embedded
    finally:
        embedded.stop()


@pytest.fixture
def scratch_database(server_dsn: str) -> Iterator[str]:
    """An empty database of the test's own (for migration tests)."""
    name = f"steprecord_scratch_{uuid.uuid4().hex[:12]}"
    url = create_database(server_dsn, name)
    try:
        yield url
    finally:
        drop_database(server_dsn, name)


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


@contextmanager
def pgbouncer(database_url: str) -> Iterator[str]:
    """PgBouncer in transaction pool mode in front of the database; yields its URL."""
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


@pytest.fixture(scope="session")
def server_url(database_url: str) -> Iterator[str]:
    """The shared server; through PgBouncer with two workers when STEPRECORD_TEST_PGBOUNCER=1
    (its live-update listener then connects directly)."""
    with ExitStack() as stack:
        url = database_url
        extra: tuple[str, ...] = ()
        # A quick sweeper, so lease tests wait about a second, not five; frequent keepalives,
        # so stream readers notice soon that they may stop.
        env = {"STEPRECORD_SWEEP_SECONDS": "0.2", "STEPRECORD_STREAM_HEARTBEAT_SECONDS": "0.3"}
        if os.environ.get("STEPRECORD_TEST_PGBOUNCER") == "1":
            url, extra = stack.enter_context(pgbouncer(database_url)), ("--workers", "2")
            env["STEPRECORD_LISTEN_URL"] = database_url  # LISTEN needs a session of its own
        base, proc = start_server(url, *extra, env=env)
        try:
            yield base
        finally:
            stop(proc)


@pytest.fixture(autouse=True)
def _clean_tables(database_url: str) -> None:
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(
            # In the order the writers lock them (the sweeper takes the record, then the
            # history), so a sweep in flight cannot deadlock with the cleanup.
            "TRUNCATE process_instance, workflow_step_record, workflow_step_attempt"
            " RESTART IDENTITY"
        )


@pytest.fixture
def client(server_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server_url, timeout=30) as c:
        yield c


@pytest.fixture(scope="session")
def shared_client(server_url: str) -> Iterator[httpx.Client]:
    """A client for property tests, whose examples share one function-scoped setup."""
    with httpx.Client(base_url=server_url, timeout=60) as c:
        yield c


@pytest.fixture
def db(database_url: str) -> Iterator[psycopg.Connection[tuple[object, ...]]]:
    """A raw connection inside a transaction that is rolled back after the test."""
    with psycopg.connect(database_url) as conn:
        try:
            yield conn
        finally:
            conn.rollback()


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    """Debian's chromium, one per test module. Without it the browser tests are skipped,
    except in CI (`CI=true`), where they fail."""
    try:
        with chromium_browser() as browser:
            yield browser
    except FileNotFoundError as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI needs the browser tests: {exc}")
        pytest.skip(str(exc))
