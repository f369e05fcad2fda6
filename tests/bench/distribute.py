"""How long `steprecord migrate` takes to distribute a single-node database that gets Citus.

Run from the repository root: `.venv-test/bin/python -m tests.bench.distribute [--records N]`.
It starts a Citus cluster of its own (a coordinator and two workers on loopback ports, in a
temporary directory, stopped at the end), makes a database on the coordinator without the
extension, migrates it (one node), and loads N records (default 10^6): N/10 instances of 10
records each, every record completed with one attempt in the history and a small inline
output. The load writes rows directly, with the tables' triggers off
(`session_replication_role = replica`): it measures the distribution, not the judge. Then it
does what the operations guide tells an operator (the extension in the database on every
node, the workers added) and times `migrate`, which distributes the tables and copies their
rows to the workers' shards; it checks that every row arrived.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402

from app.cli.migrate import migrate  # noqa: E402
from tests.support.citus import add_citus_nodes, citus_bin_path, citus_cluster  # noqa: E402

NAME = "steprecord_bench_distribute"
LOAD = """
SET session_replication_role = replica;
INSERT INTO process_instance (id, instance_key, next_ordinal)
SELECT steprecord_instance_id('run-' || i), 'run-' || i, 10
FROM generate_series(1, %(instances)s) i;
INSERT INTO workflow_step_record (instance_id, step_slug, ordinal, status, attempt_count,
                                  output, started_at, completed_at, changed_xid)
SELECT p.id, 'step-' || s, s, 'completed', 1, '{"ok": true}',
       now() - interval '1 hour', now(), pg_current_xact_id()
FROM process_instance p, generate_series(0, 9) s;
INSERT INTO workflow_step_attempt (instance_id, record_id, attempt, status, output,
                                   started_at, completed_at)
SELECT r.instance_id, r.id, 1, 'completed', r.output, r.started_at, r.completed_at
FROM workflow_step_record r;
SET session_replication_role = origin
"""
COUNT = (
    "SELECT (SELECT count(*) FROM workflow_step_record),"
    " (SELECT count(*) FROM workflow_step_attempt)"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    args = parser.parse_args()
    bin_path = citus_bin_path()
    if bin_path is None:
        raise SystemExit("Citus is not installed here: run ../shared/citus/install first")
    with (
        tempfile.TemporaryDirectory(prefix="steprecord-bench-distribute-") as tmp,
        citus_cluster(Path(tmp), bin_path, shards=32) as cluster,  # as measured: 32 shards
    ):
        with psycopg.connect(cluster.url, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{NAME}"')
        url = psycopg.conninfo.make_conninfo(cluster.url, dbname=NAME)
        migrate(url)
        started = time.perf_counter()
        with psycopg.connect(url, autocommit=True) as conn:
            for statement in LOAD.strip().split(";\n"):
                conn.execute(statement, {"instances": max(args.records // 10, 1)})
            conn.execute("VACUUM ANALYZE")
            before = conn.execute(COUNT).fetchone()
        print(f"loaded {before} records and attempts in {time.perf_counter() - started:.0f} s")
        for worker in cluster.workers:
            with psycopg.connect(worker.url, autocommit=True) as conn:
                conn.execute(f'CREATE DATABASE "{NAME}"')
            worker_url = psycopg.conninfo.make_conninfo(worker.url, dbname=NAME)
            with psycopg.connect(worker_url, autocommit=True) as conn:
                conn.execute("CREATE EXTENSION citus")
        add_citus_nodes(url, [worker.url for worker in cluster.workers])
        started = time.perf_counter()
        migrate(url)
        took = time.perf_counter() - started
        with psycopg.connect(url, autocommit=True) as conn:
            after = conn.execute(COUNT).fetchone()
        assert after == before, (before, after)
        assert before is not None
        per_million = took / before[0] * 1_000_000
        print(
            f"distributed {before[0]:,} records and {before[1]:,} attempts in {took:.1f} s:"
            f" {per_million:.1f} s per million records"
        )


if __name__ == "__main__":
    main()
