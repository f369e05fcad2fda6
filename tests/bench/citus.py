"""steprecord on a Citus cluster against one node, on one machine: throughput, and the
PostgreSQL CPU per event of each node.

Run from the repository root: `.venv-test/bin/python -m tests.bench.citus [--duration S]
[--rounds N] [--loads ...] [--shards N]`. Linux only (it reads /proc); needs Citus installed in a
PostgreSQL here, wrk and pgbench.

In one sitting it starts, in a temporary directory, a one-node PostgreSQL and a Citus cluster
(a coordinator and two workers, `tests.support.citus.citus_cluster`), all from the same PostgreSQL
binaries; makes a database on each (on the cluster, the extension in every node's database
and the workers added, as an operator does) and migrates it with `steprecord migrate`, which
distributes the schema on the cluster; starts `steprecord serve --workers 2` against each;
and loads the read benchmark's table (as tests/bench/plans.py does, written with the triggers
off). Then, one load at a time, each side in turn for `--rounds` rounds of `--duration`
seconds (so that other work on the machine skews all sides alike):

- replays: `replays.lua`, a `start` of attempt 1 of an existing record (judged, answered,
  nothing written: the one-event judge's lookup and lock, through the service);
- reads: `reads.lua`, first pages of 100 records of a random instance;
- steps: `steps.lua`, reads across instances: first pages of 100 records of one status (a
  random one of four) over every instance (`GET /v1/steps?status=…`; on the cluster a
  statement over every shard, merged on the coordinator);
- calls: pgbench calling the judge's function (`steprecord_apply_event`) with the replays'
  events, as the service calls it: on one node; on the coordinator, delegated (Citus sends
  the whole call to the worker holding the instance); on the coordinator, not delegated (the
  same call inside `BEGIN … END`: Citus delegates a call only outside a transaction block, so
  the function runs on the coordinator and routes each of its statements to the worker); and
  on a worker (every node can query: the worker delegates to itself or the other worker; a
  service cannot be pointed at a worker yet, since its migration and readiness check read
  `alembic_version`, which stays on the coordinator);
- stats: `stats.lua`, step statistics over the attempts that started in one minute (about
  2,400 of them; on the cluster every shard's go to the coordinator);
- single: `events.lua` (a `start` of a new step, then its `complete`);
- batch: `batch.lua` (100 events a request).

Each row gives the rate, p99, how many answers were not 2xx (a refused event is reported, the
run goes on), the cluster's rate as a share of one node's, and the CPU time per event (per
call, per read) of each PostgreSQL node, of the service and of the load generator, from
/proc: a node's CPU is its postmaster's and every process it started, ended ones included.
Everything started is stopped at the end, also on failure.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402
from psycopg import sql  # noqa: E402
from psycopg.conninfo import make_conninfo  # noqa: E402

from app.cli.migrate import migrate  # noqa: E402
from app.data import judge  # noqa: E402
from app.ops.distribution import SHARD_COUNT  # noqa: E402
from app.ops.embedded import EmbeddedPostgres  # noqa: E402
from tests.bench import plans, run  # noqa: E402
from tests.bench.run import Load  # noqa: E402
from tests.support.citus import citus_bin_path, citus_cluster  # noqa: E402
from tests.support.databases import create_database, server_directory  # noqa: E402
from tests.support.servers import free_port  # noqa: E402

NAME = "steprecord_bench_citus"
TICK = os.sysconf("SC_CLK_TCK")
CONNECTIONS = 16
# The read table: plans.load's instances r1..rN of 100-900 steps; steps 0..94 of each are never
# pending (pending are the last 5 %), so a start of attempt 1 is a replay on every one of them.
READ_INSTANCES = 40
REPLAY_STEPS = 95
LOADS = ("replays", "reads", "steps", "stats", "calls", "single", "batch")
# The replay of a start as the service passes it to the judge (app/data/judge.py).
REPLAY = {
    "instance_key": "'r' || :k",
    "step_slug": "'step-' || :s",
    "kind": "'start'",
    "attempt": "1",
    "started_at": "'2026-01-01T00:00:00Z'",
}
CALL = run.judge_call(judge.APPLY_EVENT, "0", REPLAY, "NULL")
PICK = f"\\set k random(1, :instances)\n\\set s random(0, {REPLAY_STEPS - 1})\n"


@dataclass
class Side:
    """One side of a comparison: how to run one round, and the nodes whose CPU it spends."""

    name: str
    nodes: dict[str, Path]  # node name -> its data directory
    service: str | None  # the service's base URL, when the load goes through one
    prepare: Callable[[], None] | None = None  # before each round, not measured
    log: Path | None = None  # the service's log, for the cause of a refusal
    runs: list[Load] = field(default_factory=list)
    seconds: float = 0.0
    cpu: dict[str, float] = field(default_factory=dict)


def _stat(pid: int) -> tuple[int, float, float] | None:
    """(parent pid, own CPU seconds, CPU seconds of reaped children) of a process."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    own = (int(fields[11]) + int(fields[12])) / TICK
    return int(fields[1]), own, (int(fields[13]) + int(fields[14])) / TICK


def postmaster(data_dir: Path) -> int:
    return int((data_dir / "pgdata" / "postmaster.pid").read_text().split()[0])


def cpu_now(nodes: dict[str, Path], service: str | None) -> dict[str, float]:
    """CPU seconds so far of each node (its postmaster, the processes it started and those it
    reaped) and of the service (its supervisor and workers)."""
    stats = {int(pid): s for pid in os.listdir("/proc") if pid.isdigit() and (s := _stat(int(pid)))}
    roots = {postmaster(path): name for name, path in nodes.items()}
    if service is not None:
        roots[run.service_pid(service)] = "service"
    totals = dict.fromkeys(roots.values(), 0.0)
    for pid, (parent, own, reaped) in stats.items():
        if pid in roots:
            totals[roots[pid]] += own + (reaped if roots[pid] != "service" else 0.0)
        elif parent in roots:
            totals[roots[parent]] += own
    return totals


def measure(side: Side, load: Callable[[], Load]) -> None:
    """One round of `load` on `side`, its CPU added to the side's."""
    if side.prepare is not None:
        side.prepare()
    before = cpu_now(side.nodes, side.service)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    result = load()
    elapsed = time.monotonic() - started
    after = cpu_now(side.nodes, side.service)
    children_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    spent = {name: after[name] - before[name] for name in after}
    spent["load generator"] = (
        children_after.ru_utime + children_after.ru_stime - children.ru_utime - children.ru_stime
    )
    side.runs.append(result)
    side.seconds += elapsed
    for name, seconds in spent.items():
        side.cpu[name] = side.cpu.get(name, 0.0) + seconds
    print(
        f"  {side.name}: {result.events_per_s:,.0f}/s, p99 {run.fmt(result.p99_ms, '.1f')} ms,"
        f" not 2xx {result.errors}",
        file=sys.stderr,
        flush=True,
    )


def compare(title: str, sides: list[tuple[Side, Callable[[], Load]]], rounds: int) -> list[str]:
    """Each side once unmeasured (connections opened, caches filled), then each in turn, the
    order turning each round; the report's lines."""
    print(title, file=sys.stderr, flush=True)
    for side, load in sides:
        if side.prepare is not None:
            side.prepare()
        load()
    for turn in range(rounds):
        shift = turn % len(sides)
        for side, load in sides[shift:] + sides[:shift]:
            measure(side, load)
    lines = [title]
    base = run.median_of(sides[0][0].runs)
    for side, _ in sides:
        result = run.median_of(side.runs)
        operations = max(sum(r.events_per_s for r in side.runs) * side.seconds / len(side.runs), 1)
        cpu = ", ".join(
            f"{name} {seconds / operations * 1e6:,.0f}" for name, seconds in side.cpu.items()
        )
        postgres = sum(s for name, s in side.cpu.items() if name in side.nodes) / operations * 1e6
        if result.errors:
            share = f"REFUSED: {result.errors} not 2xx. {result.detail[:300]}{cause(side.log)}"
        elif side is sides[0][0] or base.errors:
            share = ""
        else:
            share = f"{result.events_per_s / base.events_per_s:.2f}x of {sides[0][0].name}"
        lines.append(
            f"  {side.name:26s} {result.events_per_s:9,.0f}/s"
            f"  p99 {run.fmt(result.p99_ms, '6.1f')} ms  {share}"
        )
        lines.append(f"  {'':26s} CPU us each: {cpu}; PostgreSQL {postgres:,.0f}")
    return lines


def cause(log: Path | None) -> str:
    """The last database error in the service's log (a 500's traceback ends with it)."""
    if log is None or not log.exists():
        return ""
    errors = re.findall(r"^psycopg\.errors\.\w+: .*$", log.read_text(errors="replace"), re.M)
    return f" Last database error in the service's log: {errors[-1]}" if errors else ""


def pgbench_script(tmp: Path, name: str, body: str) -> Path:
    path = tmp / name
    path.write_text(body)
    return path


@contextmanager
def one_node(root: Path, bin_path: Path) -> Iterator[EmbeddedPostgres]:
    node = EmbeddedPostgres(root / "one-node", bin_path=bin_path, port=free_port())
    try:
        node.start()
        yield node
    finally:
        node.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=10, help="seconds per round (10)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--loads", default=",".join(LOADS), help=f"comma-separated: {LOADS}")
    parser.add_argument(
        "--setting",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a setting of the cluster's database (ALTER DATABASE … SET), e.g."
        " citus.max_adaptive_executor_pool_size=1; repeatable",
    )
    parser.add_argument(
        "--shards",
        type=int,
        default=SHARD_COUNT,
        help=f"shards per distributed table ({SHARD_COUNT}, what `steprecord migrate` chooses)",
    )
    args = parser.parse_args()
    loads = args.loads.split(",")
    if not loads or set(loads) - set(LOADS):
        parser.error(f"--loads takes {', '.join(LOADS)}, comma-separated")
    missing = [tool for tool in ("wrk", "pgbench") if shutil.which(tool) is None]
    if missing:
        sys.exit(f"missing {', '.join(missing)}; install with: {run.INSTALL}")
    bin_path = citus_bin_path()
    if bin_path is None:
        sys.exit("Citus is not installed in any PostgreSQL here")
    report: list[str] = []
    with ExitStack() as stack:
        root = stack.enter_context(server_directory())
        single = stack.enter_context(one_node(root, bin_path))
        cluster = stack.enter_context(citus_cluster(root, bin_path, shards=args.shards))
        one_url = create_database(single.url, NAME)
        cluster_url = create_database(cluster.url, NAME)
        with psycopg.connect(cluster.url, autocommit=True) as conn:
            for setting in args.setting:
                name, _, value = setting.partition("=")
                conn.execute(
                    sql.SQL("ALTER DATABASE {} SET {} = {}").format(
                        sql.Identifier(NAME), sql.SQL(name), sql.Literal(value)
                    )
                )
        worker_url = make_conninfo(cluster.workers[0].url, dbname=NAME)
        for url in (one_url, cluster_url):
            migrate(url)
            plans.load(url, READ_INSTANCES)
        one_base = stack.enter_context(run.service(one_url, root / "one-node.log"))
        cluster_base = stack.enter_context(run.service(cluster_url, root / "cluster.log"))
        report += run.machine(one_url)
        report.append(
            f"cluster:    a coordinator and 2 workers (Citus, {args.shards} shards), one node"
            f" beside it, all on this machine; {args.rounds} rounds of {args.duration:g} s per"
            f" side, {CONNECTIONS} connections; CPU in us per event, call or read"
            + (f"; database settings: {', '.join(args.setting)}" if args.setting else "")
        )
        one_nodes = {"one node": single.data_dir}
        cluster_nodes = {"coordinator": cluster.coordinator.data_dir}
        cluster_nodes |= {f"worker{n}": w.data_dir for n, w in enumerate(cluster.workers, 1)}

        def wrk(side: Side, script: str, wrk_args: list[object], size: int) -> Load:
            return run.wrk(side.service or "", script, CONNECTIONS, args.duration, wrk_args, size)

        def pgbench(url: str, script: Path) -> Load:
            defines: dict[str, object] = {"instances": READ_INSTANCES}
            return run.pgbench(url, script, CONNECTIONS, args.duration, defines, 1, "prepared")

        for name in loads:
            one = Side("one node", one_nodes, one_base, log=root / "one-node.log")
            distributed = Side("cluster", cluster_nodes, cluster_base, log=root / "cluster.log")
            sides: list[tuple[Side, Callable[[], Load]]]
            if name in ("replays", "reads", "steps", "stats"):
                script = f"{name}.lua"
                title = {
                    "replays": "replayed single events (replays.lua), events/s",
                    "reads": "first pages of 100 records (reads.lua), reads/s",
                    "steps": "first pages of 100 records across instances (steps.lua), reads/s",
                    "stats": "step statistics over a minute's attempts (stats.lua), reads/s",
                }[name]
                wrk_args: list[object] = ["r", READ_INSTANCES]
                if name == "replays":
                    wrk_args += [REPLAY_STEPS]
                elif name == "reads":
                    wrk_args += ["ordinal", run.READ_LIMIT]
                elif name == "stats":
                    wrk_args = []
                else:
                    wrk_args = [run.READ_LIMIT]
                sides = [
                    (side, partial(wrk, side, script, wrk_args, 1)) for side in (one, distributed)
                ]
            elif name == "calls":
                title = "the judge's function called by pgbench (replayed events), calls/s"
                delegated = pgbench_script(root, "call.sql", PICK + CALL + "\n")
                in_block = pgbench_script(
                    root, "call_in_block.sql", f"{PICK}BEGIN;\n{CALL}\nEND;\n"
                )
                sides = [
                    (Side("one node", one_nodes, None), partial(pgbench, one_url, delegated)),
                    (
                        Side("cluster, delegated", cluster_nodes, None),
                        partial(pgbench, cluster_url, delegated),
                    ),
                    (
                        Side("cluster, not delegated", cluster_nodes, None),
                        partial(pgbench, cluster_url, in_block),
                    ),
                    (
                        Side("cluster, called on worker1", cluster_nodes, None),
                        partial(pgbench, worker_url, delegated),
                    ),
                ]
            else:
                script, size = ("events.lua", 1) if name == "single" else ("batch.lua", 100)
                kind = "single events" if name == "single" else "batches of 100"
                title = f"{kind} ({script}), events/s"
                wrk_args = [script[0], run.INSTANCES, CONNECTIONS, size]
                one.prepare = partial(run.reset, one_url)  # empty tables, a checkpoint
                distributed.prepare = partial(run.reset, cluster_url)
                sides = [
                    (side, partial(wrk, side, script, wrk_args, size))
                    for side in (one, distributed)
                ]
            report += compare(title, sides, args.rounds)
    print("\n".join(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
