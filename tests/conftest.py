"""Fixtures: a real PostgreSQL migrated by alembic, a live server, and clean tables per test.

With `DATABASE_URL` set, the tests create (and finally drop) their own database on that
server; without it they start an embedded PostgreSQL in a temporary directory. With
`STEPRECORD_TEST_CITUS=1` they run on a Citus cluster of their own (a coordinator and two
workers) instead.
"""

import os
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from playwright.sync_api import Browser, Page

from app.cli.migrate import migrate
from app.ops.embedded import EmbeddedPostgres
from tests.support.browser import chromium_browser
from tests.support.citus import CitusCluster, citus_bin_path, citus_cluster
from tests.support.databases import (
    create_database,
    drop_database,
    migrated_database,
    server_directory,
)
from tests.support.rows import Conn
from tests.support.servers import BEHIND_PGBOUNCER, pgbouncer, start_server, stop
from tests.support.streams import Stream


@pytest.fixture(scope="session")
def server_dsn(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """A maintenance connection string to a PostgreSQL server the tests may create databases on:
    with STEPRECORD_TEST_CITUS=1 the coordinator of the `citus` cluster, where every database
    the tests create is made on all its nodes."""
    if os.environ.get("STEPRECORD_TEST_CITUS") == "1":
        cluster: CitusCluster = request.getfixturevalue("citus")
        yield cluster.url
        return
    url = os.environ.get("DATABASE_URL")
    if url:
        yield url
        return
    with server_directory() as directory:
        embedded = EmbeddedPostgres(directory)
        try:
            yield embedded.start()
        finally:
            embedded.stop()


def _citus_bin_path() -> Path:
    """Where Citus is installed. Without it the Citus tests are skipped, except in CI
    (`CI=true`), where they fail."""
    bin_path = citus_bin_path()
    if bin_path is None:
        reason = "Citus is not installed in any PostgreSQL here"
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI needs the Citus tests: {reason}")
        pytest.skip(reason)
    return bin_path


@pytest.fixture(scope="session")
def citus() -> Iterator[CitusCluster]:
    """A Citus cluster of the tests' own: a coordinator and two workers, stopped at the end."""
    bin_path = _citus_bin_path()
    with server_directory() as root, citus_cluster(root, bin_path) as cluster:
        yield cluster


@pytest.fixture
def own_citus() -> Iterator[CitusCluster]:
    """A Citus cluster of one test's own, whose nodes the test may stop and start (each is
    stopped at the end, whatever the test left running)."""
    bin_path = _citus_bin_path()
    with server_directory() as root, citus_cluster(root, bin_path) as cluster:
        yield cluster


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


@pytest.fixture
def server_dir() -> Iterator[Path]:
    """A directory for a PostgreSQL server the test starts (see `server_directory`)."""
    with server_directory() as directory:
        yield directory


@pytest.fixture
def own_postgres() -> Iterator[EmbeddedPostgres]:
    """An embedded PostgreSQL of the test's own, which the test may stop and start."""
    with server_directory() as directory:
        embedded = EmbeddedPostgres(directory / "pg")
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


@pytest.fixture(scope="module")
def own_database(server_dsn: str) -> Iterator[str]:
    """A database of the test module's own, migrated to head, for servers the tests start."""
    with migrated_database(server_dsn, "steprecord_own_") as url:
        yield url


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
        if os.environ.get("STEPRECORD_TEST_CITUS") == "1":
            # A batch of 1,000 events is 1,000 calls on a cluster: about 2 s on a quiet machine,
            # past the default 5 s statement timeout beside CI's other runs. No test of the
            # shared server is about that timeout (those start servers of their own).
            env["STEPRECORD_STATEMENT_TIMEOUT"] = "20"
        if os.environ.get("STEPRECORD_TEST_PGBOUNCER") == "1":
            url, extra = stack.enter_context(pgbouncer(database_url)), ("--workers", "2")
            env |= BEHIND_PGBOUNCER
            env["STEPRECORD_LISTEN_URL"] = database_url  # LISTEN needs a session of its own
        base, proc = start_server(url, *extra, env=env)
        try:
            yield base
        finally:
            stop(proc)


# The fixtures that reach the shared database: a test that uses any of them starts from empty
# tables; any other test (pure functions, servers of its own) starts no PostgreSQL for it.
SHARED_DATABASE = {"database_url", "server_url", "client", "shared_client", "db"}


@pytest.fixture(autouse=True)
def _clean_tables(request: pytest.FixtureRequest) -> None:
    if SHARED_DATABASE.isdisjoint(request.fixturenames):
        return
    database_url: str = request.getfixturevalue("database_url")
    with psycopg.connect(database_url, autocommit=True) as conn:
        # Every row of the four tables hangs off an instance (their foreign keys), so without
        # an instance they are empty: a test that wrote nothing leaves nothing to empty. On
        # Citus the TRUNCATE takes about 0.2 s (every shard, in two phases), the look 1 ms.
        if conn.execute("SELECT 1 FROM process_instance LIMIT 1").fetchone() is None:
            return
        conn.execute(
            # In the order the writers lock them (the sweeper takes the record, then the
            # history), so a sweep in flight cannot deadlock with the cleanup.
            "TRUNCATE process_instance, workflow_step_record, workflow_step_attempt,"
            " workflow_step_repair"
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


@pytest.fixture
def open_stream(server_url: str) -> Iterator[Callable[..., Stream]]:
    """Opens streams on the shared server; every one is closed after the test."""
    opened: list[Stream] = []

    def open_(instance: str = "order-1", **kwargs: Any) -> Stream:
        stream = Stream(f"{server_url}/v1/instances/{instance}/stream", **kwargs)
        opened.append(stream)
        return stream

    yield open_
    for stream in opened:
        stream.close()


@pytest.fixture
def instance_id(db: Conn) -> int:
    """The id of instance `run-1`, inserted in the test's transaction (raw SQL tests)."""
    row = db.execute(
        "INSERT INTO process_instance (id, instance_key)"
        " VALUES (steprecord_instance_id('run-1'), 'run-1') RETURNING id"
    ).fetchone()
    assert row is not None
    return int(row[0])


@pytest.fixture
def page(browser: Browser, server_url: str) -> Iterator[Page]:
    """A browser page on the shared server, 1100 by 700 pixels; closed after the test."""
    context = browser.new_context(base_url=server_url, viewport={"width": 1100, "height": 700})
    try:
        yield context.new_page()
    finally:
        context.close()


# On the Citus run (STEPRECORD_TEST_CITUS=1), the tests that reach a database through one of
# these fixtures, and the cluster's own tests; the others (pure functions, a server of their
# own on one node) run the same in the one-node run, so the cluster's run leaves them out, and
# so it does the modules marked `same_on_any_database` (what they test happens in the service
# or the client, before or after the database, the same on one node and on Citus; each says
# why).
CLUSTER_FIXTURES = {"server_dsn", "citus", "own_citus"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("STEPRECORD_TEST_CITUS") != "1":
        return
    kept: list[pytest.Item] = []
    left: list[pytest.Item] = []
    for item in items:
        on_cluster = item.path.name.startswith("test_citus") or (
            not CLUSTER_FIXTURES.isdisjoint(getattr(item, "fixturenames", ()))
            and item.get_closest_marker("same_on_any_database") is None
        )
        (kept if on_cluster else left).append(item)
    if left:
        config.hook.pytest_deselected(items=left)
        items[:] = kept
