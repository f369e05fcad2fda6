"""The step statistics query (`GET /v1/stats/steps`, the dashboard's statistics page) over
10^6 attempts: its plan and time for windows of 1 hour, 24 hours, 7 days and 30 days.

Run from the repository root: `.venv-test/bin/python -m tests.bench.stats [--attempts N]`.
It creates a fresh database on the server in `DATABASE_URL` (or an embedded PostgreSQL in a
temporary directory), migrates it, and loads N attempts (default 10^6) spread evenly over
the last 90 days: 100,000 instances of 5 records each, 2 attempts a record (the first failed
or superseded, the second completed or failed), over 20 step names, a quarter of them Celery
tasks (`name:uuid` slugs). The load writes rows directly, with the tables' triggers off
(`session_replication_role = replica`): it measures reads, not the judge. Then, for each
window ending now, it prints the statement's `EXPLAIN (ANALYZE, BUFFERS)` and the median and
worst of `--rounds` timed runs after a warm-up, with the attempts in the window.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402

from app.data.stats import step_stats_query  # noqa: E402
from tests.bench.common import scratch_database  # noqa: E402

WINDOWS = {
    "1 h": timedelta(hours=1),
    "24 h": timedelta(hours=24),
    "7 d": timedelta(days=7),
    "30 d": timedelta(days=30),
}
SPREAD = timedelta(days=90)


LOAD = """
SET session_replication_role = replica;
INSERT INTO process_instance (id, instance_key, created_at)
SELECT steprecord_instance_id('bench-' || i), 'bench-' || i,
       %(now)s - %(spread)s * (i::float8 / %(instances)s)
FROM generate_series(1, %(instances)s) i;
INSERT INTO workflow_step_record (instance_id, step_slug, ordinal, status, attempt_count,
                                  started_at, completed_at, error_code, changed_xid)
SELECT p.id,
       CASE WHEN n % 4 = 0 THEN 'tasks.step_' || n || ':' || gen_random_uuid()
            ELSE 'step-' || n END,
       s, 'completed', 2, p.created_at + s * interval '1 minute',
       p.created_at + s * interval '1 minute' + interval '30 seconds', NULL,
       pg_current_xact_id()
FROM process_instance p, generate_series(0, 4) s,
     LATERAL (SELECT (split_part(p.instance_key, '-', 2)::int * 7 + s * 3) % 20 AS n) x;
INSERT INTO workflow_step_attempt (instance_id, record_id, attempt, status, started_at,
                                   completed_at, error_code)
SELECT r.instance_id, r.id, a,
       CASE WHEN a = 1 AND r.id % 3 = 0 THEN 'superseded'
            WHEN a = 1 THEN 'failed'
            WHEN r.id % 17 = 0 THEN 'failed'
            ELSE 'completed' END,
       r.started_at + (a - 1) * interval '10 seconds',
       r.started_at + (a - 1) * interval '10 seconds'
           + (r.id % 1000) * interval '20 milliseconds',
       CASE WHEN (a = 1 AND r.id % 3 <> 0) OR (a = 2 AND r.id % 17 = 0) THEN 'Boom' END
FROM workflow_step_record r, generate_series(1, 2) a;
SET session_replication_role = origin;
"""


def load(url: str, attempts: int, now: datetime) -> None:
    instances = max(attempts // 10, 1)
    started = time.perf_counter()
    with psycopg.connect(url, autocommit=True) as conn:
        for statement in LOAD.strip().split(";\n"):
            params = {"now": now, "spread": SPREAD, "instances": instances}
            conn.execute(statement.strip().rstrip(";"), params if "%(" in statement else None)
        conn.execute("VACUUM ANALYZE workflow_step_attempt")
        conn.execute("VACUUM ANALYZE workflow_step_record")
        conn.execute("VACUUM ANALYZE process_instance")
        row = conn.execute("SELECT count(*) FROM workflow_step_attempt").fetchone()
        assert row is not None
    print(f"loaded {row[0]:,} attempts in {time.perf_counter() - started:.0f} s")


def measure(url: str, now: datetime, rounds: int) -> list[dict[str, Any]]:
    sql = step_stats_query(prefix=False)
    results = []
    with psycopg.connect(url, autocommit=True) as conn:
        for label, window in WINDOWS.items():
            params = {"since": now - window, "until": now, "limit": 100}
            in_window = conn.execute(
                "SELECT count(*) FROM workflow_step_attempt"
                " WHERE started_at >= %(since)s AND started_at < %(until)s",
                params,
            ).fetchone()
            assert in_window is not None
            plan = conn.execute("EXPLAIN (ANALYZE, BUFFERS) " + sql, params).fetchall()
            conn.execute(sql, params).fetchall()  # warm-up
            times = []
            for _ in range(rounds):
                started = time.perf_counter()
                conn.execute(sql, params).fetchall()
                times.append((time.perf_counter() - started) * 1000)
            result = {
                "window": label,
                "attempts": in_window[0],
                "median_ms": statistics.median(times),
                "max_ms": max(times),
            }
            results.append(result)
            print(f"\n=== window {label}: {in_window[0]:,} attempts in it")
            print("\n".join(str(line[0]) for line in plan))
            print(f"median {result['median_ms']:.1f} ms, worst {result['max_ms']:.1f} ms")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attempts", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    now = datetime.now(UTC)
    with scratch_database("stats") as url:
        load(url, args.attempts, now)
        results = measure(url, now, args.rounds)
    print("\nwindow   attempts   median     worst   per 1,000 attempts")
    for r in results:
        per = r["median_ms"] / max(r["attempts"], 1) * 1000
        print(
            f"{r['window']:>6} {r['attempts']:>10,} {r['median_ms']:>8.1f} ms"
            f" {r['max_ms']:>7.1f} ms {per:>8.2f} ms"
        )


if __name__ == "__main__":
    main()
