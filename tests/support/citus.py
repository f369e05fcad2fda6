"""Citus clusters of the tests' own: nodes, workers, and which worker holds an instance."""

import contextlib
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psycopg

from app.ops.embedded import EmbeddedPostgres
from tests.support.rows import Conn
from tests.support.servers import free_port


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


def on_citus(db: Conn) -> bool:
    """The connection's database has the citus extension (see `has_citus` for a URL)."""
    return db.execute("SELECT 1 FROM pg_extension WHERE extname = 'citus'").fetchone() is not None


def on_node(node_url: str, database: str) -> str:
    """`database` on the node that `node_url` reaches."""
    return psycopg.conninfo.make_conninfo(node_url, dbname=database)
