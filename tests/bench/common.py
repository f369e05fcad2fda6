"""The benchmarks' PostgreSQL: the server they run on, and their scratch databases on it."""

import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
from psycopg.conninfo import make_conninfo

from app.cli.migrate import migrate
from app.ops.embedded import EmbeddedPostgres
from tests.support.databases import migrated_database


@contextmanager
def postgres_server(tmp: Path) -> Iterator[str]:
    """The server named by DATABASE_URL, or an embedded PostgreSQL started for the run."""
    url = os.environ.get("DATABASE_URL")
    if url:
        yield url
        return
    embedded = EmbeddedPostgres(tmp / "postgres")
    print("starting an embedded PostgreSQL", file=sys.stderr)
    try:
        yield embedded.start()
    finally:
        embedded.stop()


@contextmanager
def fresh_database(server: str, name: str, like: str | None = None) -> Iterator[str]:
    """A new, migrated database on the server, dropped at the end; with `like`, a copy of that
    freshly migrated database (no session may be connected to it), which is quicker."""
    with psycopg.connect(server, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {name}" + (f" TEMPLATE {like}" if like else ""))
    try:
        dsn = make_conninfo(server, dbname=name)
        if like is None:
            migrate(dsn)
        yield dsn
    finally:
        try:
            with psycopg.connect(server, autocommit=True) as conn:
                conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        except psycopg.Error as exc:
            print(f"warning: could not drop {name}: {exc}", file=sys.stderr)


@contextmanager
def scratch_database(bench: str) -> Iterator[str]:
    """A database of the benchmark `bench`'s own, migrated to head, on the server DATABASE_URL
    names (on a Citus coordinator, on every node) or an embedded PostgreSQL; dropped at the end."""
    with (
        tempfile.TemporaryDirectory(prefix=f"steprecord-bench-{bench}-") as tmp,
        postgres_server(Path(tmp)) as server,
        migrated_database(server, f"steprecord_bench_{bench}_") as url,
    ):
        yield url
