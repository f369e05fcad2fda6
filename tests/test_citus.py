"""On a Citus cluster: a coordinator and two workers of the tests' own (the `citus` fixture)."""

import uuid

import psycopg

from tests.helpers import CitusCluster, create_database, drop_database, rows_on_worker


def test_a_database_made_on_the_cluster_spreads_a_distributed_table_over_both_workers(
    citus: CitusCluster,
) -> None:
    name = f"steprecord_citus_{uuid.uuid4().hex[:8]}"
    url = create_database(citus.url, name)
    try:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("CREATE TABLE spread (key text PRIMARY KEY)")
            conn.execute("SELECT create_distributed_table('spread', 'key')")
            conn.execute("INSERT INTO spread SELECT 'k' || g FROM generate_series(1, 200) g")
        on_workers = [
            rows_on_worker(psycopg.conninfo.make_conninfo(worker.url, dbname=name), "spread")
            for worker in citus.workers
        ]
        assert sum(on_workers) == 200
        assert all(count > 0 for count in on_workers), on_workers
    finally:
        drop_database(citus.url, name)
