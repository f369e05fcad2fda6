"""The plans of the hot reads on a Citus cluster: one instance's record, a page of an
instance's records, an instance with its counts, a step's attempts, a page of `/v1/steps`, a
page of `/v1/instances`, the dashboard's instance steps, its Stuck and Failing lists, and the
step statistics; and the judge's one-event call, delegated to the worker holding the instance
and, inside a transaction block, run on the coordinator.

Run from the repository root: `.venv-test/bin/python -m tests.bench.plans [--instances N]`.
It starts a Citus cluster of its own (a coordinator and two workers, as the tests do; Citus
must be installed in a PostgreSQL here), creates and migrates a database on it, which
distributes the schema, and loads the read benchmark's table (as `load_reads.sql` makes it:
N instances, default 200, of 500 steps on average) with one attempt per started record,
written directly with the tables' triggers off: it shows reads, not the judge. Then it
prints each read's `EXPLAIN` with the parameters the service passes, and stops the cluster.
`--keep` leaves the cluster running until Enter is pressed (to try statements by hand).
"""

from __future__ import annotations

import argparse
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402

from app.cli.migrate import migrate  # noqa: E402
from app.data import dashboard, reads, stats  # noqa: E402
from tests.support.citus import citus_bin_path, citus_cluster  # noqa: E402
from tests.support.databases import create_database, server_directory  # noqa: E402

# The read benchmark's table (see load_reads.sql), its rows made on the coordinator from the
# keys alone (Citus reads no distributed table to write another here).
INSTANCES = """
INSERT INTO process_instance (id, instance_key, next_ordinal)
SELECT steprecord_instance_id('r' || i), 'r' || i, (ARRAY[100, 300, 700, 900])[mod(i, 4) + 1]
FROM generate_series(1, %(instances)s) i
"""
RECORDS = """
INSERT INTO workflow_step_record (instance_id, step_slug, ordinal, status, attempt_count,
                                  output, started_at, completed_at, error_code, error_message,
                                  changed_xid)
SELECT steprecord_instance_id('r' || i), 'step-' || o, o, s.status, 1,
       CASE WHEN s.status = 'completed' THEN jsonb_build_object('a', 1, 'b', 'x', 'n', o) END,
       CASE WHEN s.status <> 'pending' THEN s.started_at END,
       CASE WHEN s.status IN ('completed', 'failed') THEN s.started_at + interval '1 s' END,
       CASE WHEN s.status = 'failed' THEN 'E_BENCH' END,
       CASE WHEN s.status = 'failed' THEN 'failed on purpose' END, '1'::xid8
FROM generate_series(1, %(instances)s) i
CROSS JOIN generate_series(0, 899) o
CROSS JOIN LATERAL (SELECT (ARRAY[100, 300, 700, 900])[mod(i, 4) + 1] AS steps) n
CROSS JOIN LATERAL (
    SELECT CASE WHEN o >= n.steps * 0.95 THEN 'pending'
                WHEN mod(o, 17) = 0 THEN 'running'
                WHEN mod(o, 23) = 0 THEN 'failed'
                ELSE 'completed' END AS status,
           timestamptz '2026-01-01 00:00:00Z'
               + make_interval(secs => mod(o * 7919, n.steps)) AS started_at
) s
WHERE o < n.steps
"""
ATTEMPTS = """
INSERT INTO workflow_step_attempt (instance_id, record_id, attempt, status, started_at,
                                   completed_at, error_code, error_message, created_at,
                                   updated_at)
SELECT r.instance_id, r.id, 1, r.status, r.started_at, r.completed_at, r.error_code,
       r.error_message, r.started_at, r.updated_at
FROM workflow_step_record r WHERE r.started_at IS NOT NULL
"""
TABLES = ("process_instance", "workflow_step_record", "workflow_step_attempt")
NOW = datetime(2026, 1, 1, 0, 30, tzinfo=UTC)


def load(url: str, instances: int) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        for table in TABLES:
            conn.execute(f"ALTER TABLE {table} DISABLE TRIGGER USER")
        conn.execute(INSTANCES, {"instances": instances})
        conn.execute(RECORDS, {"instances": instances})
        conn.execute(ATTEMPTS)
        # Stuck: a few running records whose lease expired.
        conn.execute(
            "UPDATE workflow_step_record SET lease_expires_at = %s"
            " WHERE status = 'running' AND mod(id, 5) = 0",
            (NOW - timedelta(minutes=1),),
        )
        for table in TABLES:
            conn.execute(f"ALTER TABLE {table} ENABLE TRIGGER USER")
            conn.execute(f"ANALYZE {table}")


def reads_to_explain(conn: psycopg.Connection[Any]) -> list[tuple[str, str, dict[str, Any]]]:
    key = "r7"
    row = conn.execute("SELECT steprecord_instance_id(%s)", (key,)).fetchone()
    assert row is not None
    instance_id = row[0]
    recent = {"before": "infinity", "before_id": 0, "updated_after": None, "limit": 51}
    window = {"since": NOW - timedelta(days=1), "until": NOW, "limit": 100}
    return [
        (
            "One record (GET /v1/instances/{key}/steps/{slug})",
            reads.GET_STEP,
            {"instance_key": key, "instance_id": instance_id, "step_slug": "step-3"},
        ),
        (
            "A page of an instance's records (GET /v1/instances/{key}/steps), by ordinal",
            "SELECT * FROM steprecord_list_page(%(key)s, 'ordinal', -1, '-infinity', 0, NULL, 101,"
            " 16777216)",
            {"key": key},
        ),
        (
            "An instance with its counts (GET /v1/instances/{key})",
            reads.GET_INSTANCE,
            {"instance_key": key, "instance_id": instance_id},
        ),
        (
            "A step's attempts (GET /v1/instances/{key}/steps/{slug}/attempts)",
            reads.LIST_ATTEMPTS,
            {
                "instance_key": key,
                "instance_id": instance_id,
                "step_slug": "step-3",
                "after_attempt": 0,
                "limit": 51,
            },
        ),
        (
            "A page of GET /v1/steps (failed and running, newest first)",
            reads.list_recent_query(
                ["failed", "running"], updated_after=False, lease_expired=False
            ),
            recent,
        ),
        (
            "A page of GET /v1/instances (newest first)",
            reads.list_instances_query(prefix=False, has=None),
            {"before_created_at": "infinity", "before_id": 0, "limit": 51},
        ),
        (
            "The dashboard's instance page: its steps",
            dashboard.INSTANCE_STEPS,
            {"instance_id": instance_id, "limit": 201},
        ),
        (
            "The dashboard's Stuck list (running, lease expired)",
            reads.list_recent_query(["running"], updated_after=False, lease_expired=True),
            recent,
        ),
        (
            "The dashboard's Failing list of one step",
            dashboard.failed_of_step_query(prefix=False),
            {"name": "step-23", "grouped_like": "step-23:%", "limit": 50},
        ),
        (
            "Step statistics over a day (GET /v1/stats/steps)",
            stats.step_stats_query(prefix=False),
            window,
        ),
    ]


# The judge's one-event call as the service makes it (app/data/judge.py, APPLY_EVENT): a
# `start` of attempt 1 of an existing record, a replay. Outside a transaction block the
# coordinator sends the whole call to the worker holding the instance; inside one, Citus does
# not delegate: the function runs on the coordinator, which routes each of its statements.
JUDGE_CALL = (
    "SELECT * FROM steprecord_apply_event(steprecord_instance_id(%(key)s::text), 0, %(key)s,"
    " 'step-3', 'start', 1, '2026-01-01T00:00:00Z', NULL, NULL, NULL, NULL, NULL, NULL, NULL)"
)


def explain_calls(conn: psycopg.Connection[Any]) -> None:
    """The judge's call: its plan and what it sends, delegated and in a transaction block."""
    params = {"key": "r7"}
    print("## The judge's one-event call (POST .../start), delegated\n")
    print(explain(conn, JUDGE_CALL, params))
    print(f"\nsent to the workers: {shard_statements(conn, JUDGE_CALL, params, True)}\n")
    print("## The same call inside a transaction block (not delegated)\n")
    with conn.transaction():
        print(explain(conn, JUDGE_CALL, params))
        print(f"\nsent to the workers: {shard_statements(conn, JUDGE_CALL, params, True)}\n")


def explain(conn: psycopg.Connection[Any], statement: str, params: dict[str, Any]) -> str:
    rows = conn.execute("EXPLAIN (COSTS OFF) " + statement, params).fetchall()
    return "\n".join(row[0] for row in rows)


def shard_statements(
    conn: psycopg.Connection[Any], statement: str, params: dict[str, Any], show: bool = False
) -> str:
    """The statements the coordinator sends to the workers for one run of `statement` (a
    function's too, which EXPLAIN does not show), counted per worker; with `show`, each
    statement too, on a line of its own (its first 200 characters)."""
    sent: list[str] = []
    texts: list[str] = []

    def note(notice: psycopg.errors.Diagnostic) -> None:
        sent.append(notice.message_detail or "")
        texts.append(" ".join((notice.message_primary or "").split())[:200])

    conn.add_notice_handler(note)
    conn.execute("SET citus.log_remote_commands = on")
    conn.execute("SET client_min_messages = log")
    try:
        conn.execute(statement, params).fetchall()
    finally:
        conn.execute("RESET client_min_messages")
        conn.execute("RESET citus.log_remote_commands")
        conn.remove_notice_handler(note)
    workers: dict[str, int] = {}
    for detail in filter(None, sent):
        worker = detail.split(" connectionId")[0]
        workers[worker] = workers.get(worker, 0) + 1
    counts = ", ".join(f"{count} {worker}" for worker, count in sorted(workers.items()))
    return "\n".join([counts, *texts]) if show else counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--instances", type=int, default=200)
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    bin_path = citus_bin_path()
    if bin_path is None:
        sys.exit("Citus is not installed in any PostgreSQL here")
    # 32 shards (Citus's default), as docs/scaling.md shows the plans; `migrate` would make 8.
    with server_directory() as root, citus_cluster(root, bin_path, shards=32) as cluster:
        url = create_database(cluster.url, "steprecord_plans")
        migrate(url)
        load(url, args.instances)
        with psycopg.connect(url, autocommit=True) as conn:
            for title, statement, params in reads_to_explain(conn):
                print(f"## {title}\n")
                try:
                    print(explain(conn, statement, params))
                    print(f"\nsent to the workers: {shard_statements(conn, statement, params)}")
                except psycopg.Error as exc:
                    print(f"REFUSED: {exc}".strip())
                print()
            explain_calls(conn)
        if args.keep:
            print(f"cluster at {url}; Enter stops it", flush=True)
            sys.stdin.readline()


if __name__ == "__main__":
    main()
