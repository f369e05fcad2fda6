"""Instance labels: the label filter of `GET /v1/instances` over 10^6 labelled instances, and
what labels add to a write (single events and batches, in one sitting).

Run from the repository root: `.venv-test/bin/python -m tests.bench.labels [--instances N]`.
It creates a fresh database on the server in `DATABASE_URL` (or an embedded PostgreSQL in a
temporary directory) and migrates it.

1. Reads. It loads N instances (default 10^6), each with 5 labels and one completed record
   (`env` of 3 values, `team` of 20, `dag` of 100, `region` of 10, `customer` of N/100), the
   labels' GIN index built after the load (as `CREATE INDEX` on a table that has rows). Then,
   for each filter, it prints the `EXPLAIN (ANALYZE, BUFFERS)` of the list's statement
   (`reads.list_instances_query`, a page of 100) and the median and worst of `--rounds`
   timed runs after a warm-up: a rare label (100 instances), two labels together (~3,300),
   a common one (a third of the table), and one that no instance has.
2. Writes. On emptied tables, the judge's functions as the service calls them, one client,
   rounds alternating with and without labels (the order turning each round): a `start` of a
   new instance (its labels written with it), a `complete` of that step sending the same
   labels again (no write of the instance: they are already there), and batches of 100
   `start`s of new instances. Events per second and the median call, per side.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402

from app.data.judge import APPLY_EVENT, APPLY_EVENTS  # noqa: E402
from app.data.reads import PAGE_SUMMARIES, list_instances_query  # noqa: E402
from tests.bench.common import scratch_database  # noqa: E402

LOAD = """
TRUNCATE process_instance CASCADE;
DROP INDEX ix_process_instance_labels;
INSERT INTO process_instance (id, instance_key, created_at, next_ordinal, labels)
SELECT steprecord_instance_id('bench-' || i), 'bench-' || i,
       now() - (%(instances)s - i) * interval '1 second', 1,
       jsonb_build_object('env', (ARRAY['prod', 'staging', 'dev'])[i %% 3 + 1],
                          'team', 't' || i %% 20, 'dag', 'd' || i %% 100,
                          'region', 'r' || i %% 10, 'customer', 'c' || i %% %(customers)s)
FROM generate_series(1, %(instances)s) i;
SET session_replication_role = replica;
INSERT INTO workflow_step_record (instance_id, step_slug, ordinal, status, attempt_count,
                                  started_at, completed_at, changed_xid)
SELECT p.id, 'step', 0, 'completed', 1, p.created_at, p.created_at + interval '1 second',
       pg_current_xact_id()
FROM process_instance p;
SET session_replication_role = origin;
CREATE INDEX ix_process_instance_labels ON process_instance USING gin (labels jsonb_path_ops)
"""

FILTERS = {
    "rare (customer=c42)": {"customer": "c42"},
    "two (env=prod, dag=d7)": {"env": "prod", "dag": "d7"},
    "common (env=prod)": {"env": "prod"},
    "none (customer=nobody)": {"customer": "nobody"},
}


def load(url: str, instances: int) -> None:
    started = time.perf_counter()
    params = {"instances": instances, "customers": max(instances // 100, 1)}
    with psycopg.connect(url, autocommit=True) as conn:
        for statement in LOAD.strip().split(";\n"):
            conn.execute(statement.strip(), params if "%(" in statement else None)
        conn.execute("VACUUM ANALYZE process_instance")
        conn.execute("VACUUM ANALYZE workflow_step_record")
    print(f"loaded {instances:,} instances in {time.perf_counter() - started:.0f} s")


def timed(run: Callable[[], Any], rounds: int) -> list[float]:
    run()  # warm-up
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        run()
        times.append((time.perf_counter() - started) * 1000)
    return times


def measure_reads(url: str, rounds: int) -> list[tuple[str, int, float, float]]:
    sql = list_instances_query(prefix=False, has=None, labels=True)
    results = []
    with psycopg.connect(url, autocommit=True) as conn:
        for name, labels in FILTERS.items():
            params = {
                "before_created_at": "infinity",
                "before_id": 0,
                "created_after": None,
                "limit": 101,
                "labels": json.dumps(labels),
            }
            matching = conn.execute(
                "SELECT count(*) FROM process_instance WHERE labels @> %s::jsonb",
                (params["labels"],),
            ).fetchone()
            assert matching is not None
            plan = conn.execute("EXPLAIN (ANALYZE, BUFFERS) " + sql, params).fetchall()

            def run() -> None:
                # As the service runs it: the page planned with its labels on every call
                # (reads.prepared), then the summaries of its instances.
                page = conn.execute(sql, params, prepare=False).fetchall()  # noqa: B023
                ids = [row[0] for row in page[:100]]
                conn.execute(PAGE_SUMMARIES, {"ids": ids}).fetchall()

            times = timed(run, rounds)
            results.append((name, matching[0], statistics.median(times), max(times)))
            print(f"\n=== {name}: {matching[0]:,} instances match")
            print("\n".join(str(line[0]) for line in plan))
            print(f"median {statistics.median(times):.2f} ms, worst {max(times):.2f} ms")
    return results


LABELS = json.dumps({"env": "prod", "team": "t3", "dag": "d7", "region": "r1", "customer": "c42"})
NOW = "2026-12-07T10:00:00+00:00"


def single(conn: psycopg.Connection[Any], key: str, kind: str, labels: str | None) -> None:
    args = [0, key, "s", kind, 1, NOW, NOW if kind == "complete" else None]
    args += [None] * 6 + [None, "bench", labels]
    with psycopg.RawCursor(conn) as cur:
        cur.execute(APPLY_EVENT, args)
        cur.fetchall()


def batch(conn: psycopg.Connection[Any], keys: list[str], labels: str | None) -> None:
    n = len(keys)
    args: list[Any] = [list(range(n)), keys, ["s"] * n, ["start"] * n, [1] * n, [NOW] * n]
    args += [[None] * n] * 7 + [None, "bench", [labels] * n]
    with psycopg.RawCursor(conn) as cur:
        cur.execute(APPLY_EVENTS, args)
        cur.fetchall()


def measure_writes(url: str, events: int, rounds: int) -> dict[str, dict[str, list[float]]]:
    """Per load and side: events/s and the median call (ms) of each round."""
    found: dict[str, dict[str, list[float]]] = {}

    def note(load: str, side: str, count: int, times: list[float]) -> None:
        rates = found.setdefault(f"{load} events/s", {"without": [], "with": []})
        rates[side].append(count / (sum(times) / 1000))
        calls = found.setdefault(f"{load} p50 ms", {"without": [], "with": []})
        calls[side].append(statistics.median(times))

    with psycopg.connect(url, autocommit=True) as conn:
        for round_ in range(rounds):
            sides = [("without", None), ("with", LABELS)]
            for side, labels in sides if round_ % 2 == 0 else sides[::-1]:
                conn.execute("TRUNCATE process_instance CASCADE")
                keys = [f"w{round_}-{side}-{i}" for i in range(events)]
                starts, completes = [], []
                for key in keys:
                    started = time.perf_counter()
                    single(conn, key, "start", labels)
                    starts.append((time.perf_counter() - started) * 1000)
                for key in keys:
                    started = time.perf_counter()
                    single(conn, key, "complete", labels)
                    completes.append((time.perf_counter() - started) * 1000)
                note("single start (new instance)", side, events, starts)
                note("single complete (labels again)", side, events, completes)
                batches = []
                for first in range(0, events, 100):
                    chunk = [f"b{round_}-{side}-{i}" for i in range(first, first + 100)]
                    started = time.perf_counter()
                    batch(conn, chunk, labels)
                    batches.append((time.perf_counter() - started) * 1000)
                note("batch of 100 starts", side, events, batches)
            print(f"round {round_ + 1} of {rounds} done")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--instances", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=21, help="timed runs of each filter")
    parser.add_argument("--events", type=int, default=2000, help="events per write round")
    parser.add_argument("--write-rounds", type=int, default=5, help="0: measure reads only")
    args = parser.parse_args()
    with scratch_database("labels") as url:
        with psycopg.connect(url) as conn:
            version = conn.execute("SELECT version()").fetchone()
        print(f"postgresql: {version[0] if version else '?'}")
        writes = measure_writes(url, args.events, args.write_rounds) if args.write_rounds else {}
        load(url, args.instances)
        reads = measure_reads(url, args.rounds)
    print(f"\nlabel filter, a page of 100 of {args.instances:,} instances with 5 labels each")
    print("filter                            matching     p50 ms   worst ms")
    for name, matching, median, worst in reads:
        print(f"{name:<30} {matching:>11,} {median:>10.2f} {worst:>10.2f}")
    print(f"\nwrites, one client, medians of {args.write_rounds} rounds of {args.events} events")
    print("load                                       without labels  with 5 labels  with/without")
    for load_name, sides in writes.items():
        without, with_ = statistics.median(sides["without"]), statistics.median(sides["with"])
        print(f"{load_name:<42} {without:>14.2f} {with_:>14.2f} {with_ / without:>12.3f}x")


if __name__ == "__main__":
    main()
