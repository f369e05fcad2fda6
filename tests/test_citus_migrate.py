"""`migrate` and `serve` on a Citus cluster: a migrate with nothing to do changes nothing on any
node, so `serve` starts while a worker is down; a migrate that must change a worker that is
down names it and changes nothing."""

import uuid
from collections.abc import Iterator

import httpx
import psycopg
import pytest
from alembic import command

from app.cli.migrate import migrate
from app.main import alembic_config, schema_head
from tests.support.citus import CitusCluster, one_key_per_worker
from tests.support.databases import create_database, drop_database
from tests.support.http import post, problem, record
from tests.support.servers import start_server, steprecord, stop
from tests.support.waits import eventually

# Where distribution writes: the functions (their settings), the database's settings, the
# tables, their triggers and keys, and Citus's catalogs of what is distributed. A statement
# that changes a row of one (DDL, even one that sets what was already so) gives the row a new
# version: a new `xmin` and `ctid`.
CATALOGS = {
    "pg_proc": "pronamespace = 'public'::regnamespace",
    "pg_db_role_setting": (
        "setdatabase = (SELECT oid FROM pg_database WHERE datname = current_database())"
    ),
    "pg_class": "relnamespace = 'public'::regnamespace",
    "pg_trigger": "true",
    "pg_constraint": "connamespace = 'public'::regnamespace",
    "pg_dist_object": "true",
    "pg_dist_partition": "true",
}


def row_versions(url: str) -> dict[str, list[tuple[str, str]]]:
    """Each catalog's rows (of this database) on the node of `url`, by version."""
    with psycopg.connect(url, autocommit=True) as conn:
        return {
            catalog: conn.execute(
                f"SELECT xmin::text, ctid::text FROM {catalog} WHERE {where} ORDER BY 1, 2"
            ).fetchall()
            for catalog, where in CATALOGS.items()
        }


def nodes(url: str, cluster: CitusCluster) -> list[str]:
    """The URLs of `url`'s database on the coordinator and on each worker."""
    return [url] + [
        psycopg.conninfo.make_conninfo(url, port=worker.port) for worker in cluster.workers
    ]


@pytest.fixture
def cluster_database(own_citus: CitusCluster) -> Iterator[tuple[CitusCluster, str]]:
    """A database on a cluster of the test's own, migrated by `steprecord migrate`; every
    worker running again at the end, whatever the test stopped."""
    name = f"steprecord_migrate_{uuid.uuid4().hex[:8]}"
    url = create_database(own_citus.url, name)
    try:
        migrate(url)
        yield own_citus, url
    finally:
        for worker in own_citus.workers:
            worker.start()
        drop_database(own_citus.url, name)


def test_a_second_migrate_at_head_changes_no_catalog_row_on_any_node(
    citus: CitusCluster,
) -> None:
    name = f"steprecord_migrate_{uuid.uuid4().hex[:8]}"
    url = create_database(citus.url, name)
    try:
        migrate(url)
        before = [row_versions(node) for node in nodes(url, citus)]
        assert before[0]["pg_db_role_setting"], "the database's setting is there"
        assert all(versions["pg_dist_partition"] for versions in before)
        migrate(url)
        assert [row_versions(node) for node in nodes(url, citus)] == before
    finally:
        drop_database(citus.url, name)


def test_serve_starts_while_a_worker_is_down_and_serves_the_other_workers_instances(
    cluster_database: tuple[CitusCluster, str],
) -> None:
    cluster, url = cluster_database
    down, up = one_key_per_worker(url, cluster)
    stopped = cluster.workers[0]
    stopped.stop()
    base, proc = start_server(url)  # migrates first, at head: it reaches no worker
    try:
        with httpx.Client(base_url=base, timeout=30) as client:
            written = post(client, "start", instance=up, step="s0")
            assert written.status_code == 201, written.text
            assert record(client, up, "s0")["status"] == "running"
            refused = post(client, "start", instance=down, step="s0")
            body = problem(refused, 503, "unavailable")
            assert refused.headers["Retry-After"].isdigit()
            assert "a database node holding this data" in body["detail"]
            assert str(stopped.port) not in refused.text

            stopped.start()

            def retried() -> bool:
                response = post(client, "start", instance=down, step="s0")
                assert response.status_code in (200, 201, 503), response.text
                return response.status_code != 503

            eventually(retried, 30, 0.2, "the stopped worker's instance after its restart")
            for key in (down, up):
                written = post(client, "start", instance=key, step="s1")
                assert written.status_code == 201, written.text
                assert record(client, key, "s0")["status"] == "running"
    finally:
        stop(proc)


def test_a_migrate_that_must_change_a_worker_that_is_down_names_it_and_changes_nothing(
    cluster_database: tuple[CitusCluster, str],
) -> None:
    cluster, url = cluster_database
    config = alembic_config()
    config.attributes["database_url"] = url
    # The next release's migrations are still to run, among them one that changes the
    # workers (0030 replaces the judge's functions on every node).
    command.downgrade(config, "0029")
    with psycopg.connect(url, autocommit=True) as conn:
        behind = conn.execute("SELECT version_num FROM alembic_version").fetchone()
    assert behind is not None
    assert behind[0] != schema_head()
    stopped = cluster.workers[0]
    stopped.stop()

    for args, said in (
        (("migrate",), "steprecord migrate could not migrate the database"),
        (("serve", "--port", "0"), "steprecord serve did not start: could not migrate"),
    ):
        done = steprecord(url, *args)
        assert done.returncode == 1, done.stderr
        assert said in done.stderr
        assert f"(at revision {behind[0]}) to revision {schema_head()}" in done.stderr
        assert f"the Citus worker 127.0.0.1:{stopped.port} cannot be reached" in done.stderr
        assert "Start that worker" in done.stderr
        assert "Traceback" not in done.stderr
    with psycopg.connect(url, autocommit=True) as conn:
        assert conn.execute("SELECT version_num FROM alembic_version").fetchone() == behind

    stopped.start()
    done = steprecord(url, "migrate")
    assert done.returncode == 0, done.stderr
    with psycopg.connect(url, autocommit=True) as conn:
        assert conn.execute("SELECT version_num FROM alembic_version").fetchone() == (
            schema_head(),
        )
