"""What a batch's call costs on a Citus worker against the number of shard groups it touches.

Run from the repository root: `.venv-test/bin/python -m tests.bench.shard_groups [--shards N]
[--calls N] [--events N]`. It starts a Citus cluster of its own (a coordinator and two
workers on loopback ports, in a temporary directory, stopped at the end; each table with
`--shards` shards), migrates a database there, and finds instance keys of one worker, by
shard. Then, on one connection to the coordinator, it times `--calls` calls of the shard
function (`steprecord_apply_events_on_shard`, as the service calls it for one worker's part
of a batch) with `--events` events of new steps: a `start` of each, then a `complete` of
each, of instances drawn from one shard group, then from all of that worker's groups. The
first calls of each kind prepare the connection's statements (once per shard group) and are
not timed. It prints the wall time per call and per event: the difference between the two
is the cost of the groups beyond the first.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402

from app.cli import migrate  # noqa: E402
from app.data.judge import APPLY_EVENTS_ON_SHARD  # noqa: E402
from tests.helpers import (  # noqa: E402
    citus_bin_path,
    citus_cluster,
    create_database,
    server_directory,
)

NAME = "steprecord_bench_shard_groups"
PLACEMENT = (
    "SELECT pl.groupid, pl.shardid FROM pg_dist_placement pl WHERE pl.shardid ="
    " get_shard_id_for_distribution_column('process_instance', steprecord_instance_id(%s))"
)
STARTED = "2026-01-01T00:00:00Z"
COMPLETED = "2026-01-01T00:00:01Z"


def call(conn: psycopg.Connection[tuple[object, ...]], keys: list[str], slugs: list[str]) -> None:
    """A `start` of attempt 1 of each step, then its `complete`: two calls."""
    n = len(keys)
    for kind in ("start", "complete"):
        done = kind == "complete"
        params = [
            list(range(n)),
            keys,
            slugs,
            [kind] * n,
            [1] * n,
            [STARTED] * n,
            [COMPLETED if done else None] * n,
            ['{"ok": true}' if done else None] * n,
            *([[None] * n] * 5),
            None,
            "bench",
        ]
        with psycopg.RawCursor(conn) as cur:
            cur.execute(APPLY_EVENTS_ON_SHARD, params)  # alone, as the service calls it
            assert len(cur.fetchall()) == n


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=32, help="shards per table (32)")
    parser.add_argument("--calls", type=int, default=40, help="timed pairs of calls (40)")
    parser.add_argument("--events", type=int, default=50, help="events a call (50)")
    args = parser.parse_args()
    bin_path = citus_bin_path()
    if bin_path is None:
        sys.exit("Citus is not installed in any PostgreSQL here")
    rng = random.Random(1)
    with server_directory() as root, citus_cluster(root, bin_path, shards=args.shards) as c:
        url = create_database(c.url, NAME)
        migrate(url)
        with psycopg.connect(url, autocommit=True) as conn:
            by_worker: dict[int, dict[int, list[str]]] = {}
            for n in range(args.shards * args.events * 4):
                key = f"k{n}"
                row = conn.execute(PLACEMENT, (key,)).fetchone()
                assert row is not None
                by_worker.setdefault(int(row[0]), {}).setdefault(int(row[1]), []).append(key)
            groups = next(iter(by_worker.values()))
            one = groups[min(groups)]
            every = [key for keys in groups.values() for key in keys]
            print(
                f"cluster: a coordinator and 2 workers (Citus, {args.shards} shards);"
                f" {args.calls} timed pairs of calls of {args.events} events each"
            )
            sides = (("one shard group", "one", one), (f"{len(groups)} shard groups", "all", every))
            for label, slug, pool in sides:
                for n in range(args.calls + 2):  # the first two prepare the statements
                    if n == 2:
                        began = time.perf_counter()
                    keys = rng.sample(pool, args.events)
                    call(conn, keys, [f"{slug}-{n}-{i}" for i in range(args.events)])
                each = (time.perf_counter() - began) / args.calls / 2
                print(
                    f"  {label:>16}: {each * 1000:6.1f} ms a call,"
                    f" {each / args.events * 1e6:5.0f} us an event"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
