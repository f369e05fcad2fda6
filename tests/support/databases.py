"""PostgreSQL databases, roles and servers of the tests' own, and who waits on their locks."""

import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg

from app.cli.migrate import migrate
from app.ops.embedded import EmbeddedPostgres
from tests.support.citus import add_citus_nodes, citus_workers


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


def revision_of(url: str) -> str:
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT version_num FROM alembic_version").fetchone()
    assert row is not None
    return str(row[0])
