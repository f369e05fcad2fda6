"""What one judge call costs a Citus worker, by the shape of the call, against one node.

Run from the repository root: `.venv/bin/python -m tests.bench.call_shapes [--rounds 3]
[--duration 6] [--clients 8]`. Linux only (it reads /proc); needs Citus installed in a
PostgreSQL here, and pgbench. About three minutes.

In one sitting, in a temporary directory: a one-node PostgreSQL and a Citus cluster of a
coordinator and one worker (8 shards), from the same binaries, each database migrated and
loaded with the read benchmark's table (120 instances, as tests/bench/plans.py loads it).
pgbench (`-M prepared`, `--clients` connections, uncapped) calls the one-event judge for the
instances of one shard, with tests/bench/growth.py's two loads: replays (a `start` of attempt
1 of an existing record) and new records (a `start` of a new step). Each shape in turn, for
`--rounds` rounds of `--duration` s; per shape the median round's calls/s and PostgreSQL's CPU
per call (the node's processes, from /proc).

The shapes (on the worker, every call for an instance the worker holds):

- one node: the service's statement (`judge.APPLY_EVENT`), as one node runs it;
- delegated: the same statement on the worker, as the service sends it there today. Citus
  plans every call of a distributed function with parameters anew (it keeps no generic plan
  of it), and each of the function's statements goes through Citus's executor;
- generic: the same, the session's `plan_cache_mode = force_generic_plan`: the call planned
  once per connection (what the service cannot set for its sessions: some of the one-instance
  reads they carry Citus cannot plan generically);
- twin: the judge made from its template (app/sql/apply_event.sql) under another name, on
  the distributed tables, created on the worker alone: not one of Citus's objects, so its
  call is planned once per connection, yet its statements are still Citus's. (A function
  `migrate` creates is one of Citus's objects, copied to every node, and its calls are planned
  anew like the judge's: a twin made that way gains nothing.)
- shard: the shard's copy of the judge that the service calls (app/sql/shard_judge.sql, made
  by `steprecord_shard_judge`): the same statements on the shard's own tables, after Citus's
  shard metadata lock and the placement check; Citus's executor is left out of its
  statements (the history trigger's write still goes through it).

Everything started is stopped at the end, also on failure.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402
from psycopg.conninfo import make_conninfo  # noqa: E402

from app.cli.migrate import migrate  # noqa: E402
from tests.bench import citus, plans  # noqa: E402
from tests.bench.citus import CALL, REPLAY_STEPS  # noqa: E402
from tests.bench.growth import NEW, pick  # noqa: E402
from tests.support.citus import citus_bin_path, citus_cluster  # noqa: E402
from tests.support.databases import create_database, server_directory  # noqa: E402

NAME = "steprecord_bench_call_shapes"
INSTANCES = 120
GENERIC = {"PGOPTIONS": "-c plan_cache_mode=force_generic_plan"}
SHARD_OF = "SELECT get_shard_id_for_distribution_column(%s, steprecord_instance_id(%s))"
TWIN = "SELECT steprecord_apply_event_text(%s, %s, %s, %s, '')"
TABLES = ("workflow_step_record", "process_instance", "workflow_step_attempt")


def pgbench(url: str, script: Path, clients: int, seconds: int, env: dict[str, str]) -> int:
    """Calls made in `seconds` (pgbench exits non-zero or counts a failure: stop)."""
    command = ["pgbench", "--no-vacuum", "-c", str(clients), "-j", "2", "-T", str(seconds)]
    command += ["-M", "prepared", "-f", str(script), url]
    done = subprocess.run(
        command, capture_output=True, text=True, env={**os.environ, **env}, check=False
    )
    made = re.search(r"actually processed: (\d+)", done.stdout)
    failed = re.search(r"failed transactions: (\d+)", done.stdout)
    if done.returncode != 0 or made is None or (failed and int(failed[1])):
        sys.exit(f"pgbench failed:\n{done.stdout[-1500:]}\n{done.stderr[-1500:]}")
    return int(made[1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=int, default=6, help="seconds per round (6)")
    parser.add_argument("--clients", type=int, default=8, help="pgbench connections (8)")
    args = parser.parse_args()
    bin_path = citus_bin_path()
    if bin_path is None:
        sys.exit("Citus is not installed in any PostgreSQL here")
    with ExitStack() as stack:
        root = stack.enter_context(server_directory())
        node = stack.enter_context(citus.one_node(root, bin_path))
        one_url = create_database(node.url, NAME)
        cluster = stack.enter_context(citus_cluster(root / "cluster", bin_path, 1, 8))
        cluster_url = create_database(cluster.url, NAME)
        for url in (one_url, cluster_url):
            migrate(url)
            plans.load(url, INSTANCES)
        worker_url = make_conninfo(cluster.workers[0].url, dbname=NAME)
        with psycopg.connect(cluster_url, autocommit=True) as conn:
            shards = {
                k: int(conn.execute(SHARD_OF, ("process_instance", f"r{k}")).fetchone()[0])  # type: ignore[index]
                for k in range(1, INSTANCES + 1)
            }
            shard = shards[1]
            keys = [k for k, s in shards.items() if s == shard]
        with psycopg.connect(worker_url, autocommit=True) as conn:
            row = conn.execute(TWIN, ("_bench_twin", *TABLES)).fetchone()
            assert row is not None
            conn.execute("SET citus.enable_ddl_propagation = off")  # on this node alone
            conn.execute(str(row[0]))
            row = conn.execute("SELECT steprecord_shard_judge(%s)", (shard,)).fetchone()
            assert row is not None
            assert row[0] is not None
            copy = str(row[0])
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        heads = {
            "replays": pick(keys) + f"\\set s random(0, {REPLAY_STEPS - 1})\n",
            "new records": pick(keys) + "\\set r random(1, 2000000000)\n",
        }
        calls = {"replays": CALL, "new records": NEW}
        one_nodes = {"one node": node.data_dir}
        worker_nodes = {"worker": cluster.workers[0].data_dir}
        shapes = [
            ("one node", one_url, one_nodes, "steprecord_apply_event", {}),
            ("delegated", worker_url, worker_nodes, "steprecord_apply_event", {}),
            ("generic", worker_url, worker_nodes, "steprecord_apply_event", GENERIC),
            ("twin", worker_url, worker_nodes, "steprecord_apply_event_bench_twin", {}),
            ("shard", worker_url, worker_nodes, copy, {}),
        ]
        print(
            f"one node and a one-worker cluster (8 shards), uncapped; pgbench {args.clients}"
            f" connections, {args.rounds} rounds of {args.duration} s; the {len(keys)}"
            f" instances of shard {shard}"
        )
        for load, call in calls.items():
            rates: dict[str, list[float]] = {shape[0]: [] for shape in shapes}
            cpus: dict[str, list[float]] = {shape[0]: [] for shape in shapes}
            for turn in range(args.rounds):
                for name, url, nodes, function, env in shapes[turn % 2 :] + shapes[: turn % 2]:
                    body = heads[load] + call.replace("steprecord_apply_event(", f"{function}(")
                    script = citus.pgbench_script(tmp, f"{name}.sql", body + "\n")
                    before = citus.cpu_now(nodes, None)
                    made = pgbench(url, script, args.clients, args.duration, env)
                    after = citus.cpu_now(nodes, None)
                    spent = sum(after.values()) - sum(before.values())
                    rates[name].append(made / args.duration)
                    cpus[name].append(spent / made * 1e6)
            print(f"{load}: calls/s (median round), PostgreSQL's CPU per call (median, range)")
            one = statistics.median(cpus["one node"])
            for name in rates:
                cpu = statistics.median(cpus[name])
                print(
                    f"  {name:10} {statistics.median(rates[name]):7,.0f}/s"
                    f"  {cpu:6,.0f} us ({min(cpus[name]):,.0f}-{max(cpus[name]):,.0f})"
                    f"  {cpu / one:4.2f}x one node's"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
