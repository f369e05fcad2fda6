"""Growth, measured: one node and Citus clusters of 1, 2, 3 and 4 workers on one machine, every
PostgreSQL node capped at the same fraction of a core.

Run from the repository root (as root, for the caps): `.venv/bin/python -m tests.bench.growth
[--cap 0.2] [--duration S] [--rounds N] [--loads ...] [--no-cap]`. Linux only (it reads /proc);
needs Citus installed in a PostgreSQL here, wrk and pgbench.

Each node gets a cgroup v1 `cpu` group of its own (`/sys/fs/cgroup/cpu/steprecord-growth-PID/
NODE`): its postmaster is put there right after it starts, with the processes it has started
so far (the ones it starts later inherit the group). The groups are capped at `--cap` of a core
(`cpu.cfs_quota_us` = cap * `cpu.cfs_period_us`) once every database is migrated and loaded,
so that a node of a cluster is as large as the one node, and the machine's two cores hold a
cluster of four workers, its coordinator and the load generator. The groups are removed at the
end, also on failure. `--no-cap` runs without them (where cgroups are not writable): the nodes
then share the machine's cores, and a cluster cannot pass one node.

In one sitting, in a temporary directory: a one-node PostgreSQL and four clusters (a
coordinator and 1 to 4 workers, `tests.support.citus.citus_cluster`), all from the same binaries;
a database on each, migrated with `steprecord migrate`, holding the read benchmark's table
(`--instances` instances r1.., as tests/bench/plans.py loads it). Then each load, each side
once briefly unmeasured and then in turn for `--rounds` rounds (the order turning each round):

- calls: pgbench calling the judge's function as the service calls it (tests/bench/citus.py's
  call): replays (a `start` of attempt 1 of an existing record) and new records (a `start` of
  a new step of an existing instance), 16 connections to the one node or the coordinator,
  which delegates each call to the instance's worker;
- routed: the same calls as the service sends them on a cluster, each pgbench client
  connected to one worker and calling only the instances whose shards are on it, each shard's
  instances through that shard's copy of the judge on the worker (app/sql/shard_judge.sql; a
  pgbench script per shard), 8 connections per worker (8 to the one node, its judge);
- single and batch: through `steprecord serve --workers 2` (uncapped) pointed at the one node
  or the coordinator, each event sent to its instance's node: wrk with events.lua (64
  connections) and batch.lua (10 events a request, 8 connections), on emptied tables (these
  run last: emptying drops the read table).

Per side: the median round's events/s, its ratio to one node's in the same run, what the last
worker added (as a share of one node's rate), and each node's CPU time per event (its
postmaster and every process it started, ended ones included, from /proc) with the share of its
cap it used; then the goals. Everything started is stopped at the end, also on failure.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402
from psycopg.conninfo import make_conninfo  # noqa: E402

from app.cli.migrate import migrate  # noqa: E402
from tests.bench import citus, plans, run  # noqa: E402
from tests.bench.citus import CALL, PICK, REPLAY_STEPS, Side  # noqa: E402
from tests.bench.run import Load  # noqa: E402
from tests.support.citus import citus_bin_path, citus_cluster  # noqa: E402
from tests.support.databases import create_database, server_directory  # noqa: E402

NAME = "steprecord_bench_growth"
CGROUP_CPU = Path("/sys/fs/cgroup/cpu")
WORKERS = (1, 2, 3, 4)
CONNECTIONS = 16  # to the one node or the coordinator, as the service's pools would
ROUTED_CONNECTIONS = 8  # to each worker (and to the one node)
WARM = 3.0  # seconds of each pgbench round, uncapped, before its window: connections warm up
SETTLE = 0.3  # seconds between capping again and the window (a few periods)
# Seconds each service runs uncapped before the rounds: its pools warm up (on a cluster each
# connection compiles the judge's copy of every shard it meets once).
SERVICE_WARM_UP = 10.0
# wrk's connections for single events: enough requests in flight that every capped node has
# work queued while the others are throttled (16 left 4 workers at 60-80 % of their caps).
SERVICE_CONNECTIONS = 64
BATCH = (10, 8)  # events per request, connections: a request on a capped cluster takes seconds
TICK = os.sysconf("SC_CLK_TCK")
LOADS = ("calls", "routed", "single", "batch")
# One client (the load generator) may use a service worker's whole pool, and wait for it as
# long as the capped database makes it: the database, not the service's admission control,
# is what this measures.
SERVICE_ENV = {
    "STEPRECORD_POOL_SHARE_PER_TOKEN": "10",
    "STEPRECORD_DB_TIMEOUT": "30",
    # Each event straight to the node holding its instance (app/ops/nodes.py).
    "STEPRECORD_CITUS_DIRECT": "true",
}
# A new record: a `start` of attempt 1 of a new step (one client's random slug) of an existing
# instance, with the same arguments as citus.CALL's replay otherwise.
NEW = (
    "SELECT * FROM steprecord_apply_event(steprecord_instance_id(('r' || :k)::text), 0::int,"
    " ('r' || :k)::text, ('g' || :client_id || '-' || :r)::text, 'start'::text, 1::bigint,"
    " '2026-01-01T00:00:00Z'::timestamptz, NULL::timestamptz, NULL::text, NULL::text,"
    " NULL::text, NULL::text, NULL::bigint, NULL::int);"
)
NEW_PICK = "\\set k random(1, :instances)\n\\set r random(1, 2000000000)\n"
# The instances' shards and the workers holding them, asked of the coordinator.
PLACEMENTS = """
SELECT n.nodeport, pl.shardid, array_agg(k ORDER BY k) FROM generate_series(1, %s) k
JOIN pg_dist_placement pl ON pl.shardid = get_shard_id_for_distribution_column(
    'process_instance', steprecord_instance_id('r' || k))
JOIN pg_dist_node n ON n.groupid = pl.groupid
GROUP BY n.nodeport, pl.shardid
"""
# A shard's copy of the judge on the worker holding it, made if needed (as the service asks).
SHARD_JUDGE = "SELECT steprecord_shard_judge(%s)"
JUDGE = "steprecord_apply_event"

NO_CGROUPS = (
    "cannot make a cgroup under {path} ({error}): capping each node needs cgroup v1's `cpu`"
    " controller mounted there and the right to write it (root). Run as root where it is, or"
    " pass --no-cap to measure with every node uncapped (the nodes then share the machine's"
    " cores, so a cluster on one machine cannot pass one node: the ratios say what a cluster"
    " costs, not how it grows)."
)


class Caps:
    """This run's cgroup v1 `cpu` groups: under one group of the run's, one group per node,
    capped at `cap` of a core each once `limit` is called, and one uncapped for this process
    and what it starts besides the nodes (the services, wrk, pgbench). The run's group weighs
    `shares` against the machine's other work, so that every node gets its cap while other
    work competes for the cores (None: no groups at all)."""

    def __init__(self, cap: float | None, period_us: int, shares: int) -> None:
        self.cap = cap
        self.period_us = period_us
        self.shares = shares
        self.root = CGROUP_CPU / f"steprecord-growth-{os.getpid()}"
        self.nodes: list[Path] = []

    def open(self) -> None:
        if self.cap is None:
            return
        self.root.mkdir()
        (self.root / "cpu.shares").write_text(str(self.shares))
        (self.root / "bench").mkdir()
        move(self.root / "bench", os.getpid())

    def add(self, name: str, data_dir: Path) -> Path | None:
        """The node's postmaster into a group of its own, then what it has started so far
        (moving the postmaster first: what it starts meanwhile inherits its group)."""
        if self.cap is None:
            return None
        group = self.root / name
        group.mkdir()
        self.nodes.append(group)
        pid = citus.postmaster(data_dir)
        move(group, pid)
        for task in Path(f"/proc/{pid}/task").iterdir():
            for child in (task / "children").read_text().split():
                move(group, int(child))
        return group

    def limit(self, groups: list[Path] | None = None) -> None:
        """Each node's group (or each of `groups`) capped."""
        if self.cap is None:
            return
        for group in self.nodes if groups is None else groups:
            (group / "cpu.cfs_period_us").write_text(str(self.period_us))
            (group / "cpu.cfs_quota_us").write_text(str(round(self.cap * self.period_us)))

    def release(self, groups: list[Path]) -> None:
        """The groups uncapped, while a side's new connections open and fill their caches."""
        for group in groups:
            (group / "cpu.cfs_quota_us").write_text("-1")

    def close(self) -> None:
        """Whatever is left in a group back to the machine's root group, then the groups
        removed."""
        if self.cap is None or not self.root.exists():
            return
        for group in [*self.nodes, self.root / "bench", self.root]:
            with suppress(OSError):
                for pid in (group / "cgroup.procs").read_text().split():
                    move(CGROUP_CPU, int(pid))
            try:
                group.rmdir()
            except OSError as error:
                print(f"could not remove the cgroup {group}: {error}", file=sys.stderr)


def move(group: Path, pid: int) -> None:
    with suppress(ProcessLookupError):  # it ended meanwhile
        (group / "cgroup.procs").write_text(f"{pid}\n")


@contextmanager
def caps(cap: float | None, period_us: int, shares: int) -> Iterator[Caps]:
    groups = Caps(cap, period_us, shares)
    try:
        try:
            groups.open()
        except OSError as error:
            sys.exit(NO_CGROUPS.format(path=CGROUP_CPU, error=error.strerror or error))
        yield groups
    finally:
        groups.close()


@dataclass
class Setup:
    """One side's database: the one node or a cluster."""

    name: str  # "one node", "1 worker", ...
    url: str  # its database on the one node or the coordinator
    nodes: dict[str, Path]  # node name -> data directory, as citus.cpu_now takes them
    ports: dict[int, str]  # a worker's port -> its database's URL (none for the one node)
    # node URL -> the judge's function to call -> its instances (r<n>)
    routes: dict[str, dict[str, list[int]]] = field(default_factory=dict)
    groups: list[Path] = field(default_factory=list)  # its nodes' cgroups
    base: str | None = None  # the service's URL, once started


def placements(url: str, ports: dict[int, str], instances: int) -> dict[str, dict[str, list[int]]]:
    """The instances each worker holds, by the worker's database URL (`ports`: port -> URL),
    and by the copy of the judge for their shard there."""
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(PLACEMENTS, (instances,)).fetchall()
    routes: dict[str, dict[str, list[int]]] = {}
    for port, shard, keys in rows:
        worker = ports[int(port)]
        with psycopg.connect(worker, autocommit=True) as conn:
            (name,) = conn.execute(SHARD_JUDGE, (shard,)).fetchone() or (None,)
        if name is None:
            raise RuntimeError(f"the worker at port {port} made no copy of shard {shard}")
        routes.setdefault(worker, {})[str(name)] = list(keys)
    if len(routes) != len(ports):
        raise RuntimeError(f"some worker holds none of the {instances} instances: {routes}")
    return routes


def pick(keys: list[int]) -> str:
    """pgbench lines setting :k to one of `keys` at random."""
    if len(keys) == 1:
        return f"\\set k {keys[0]}\n"
    whens = " ".join(f"when :j = {n} then {key}" for n, key in enumerate(keys[:-1]))
    return f"\\set j random(0, {len(keys) - 1})\n\\set k case {whens} else {keys[-1]} end\n"


def script(tmp: Path, name: str, kind: str, keys: list[int] | None, function: str = JUDGE) -> Path:
    """The judge's call (`kind`: replays or new), on random instances of all or of `keys`,
    to `function` (the judge, or a shard's copy of it)."""
    if kind == "replays":
        head = PICK if keys is None else pick(keys) + f"\\set s random(0, {REPLAY_STEPS - 1})\n"
        call = CALL
    else:
        head = NEW_PICK if keys is None else pick(keys) + "\\set r random(1, 2000000000)\n"
        call = NEW
    call = call.replace(f"{JUDGE}(", f"{function}(", 1)
    return citus.pgbench_script(tmp, name, head + call + "\n")


def process_cpu(pid: int) -> float:
    """CPU seconds so far of a running process (all its threads)."""
    text = Path(f"/proc/{pid}/stat").read_text()
    fields = text[text.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def pgbench_round(
    side: Side,
    targets: list[tuple[str, list[Path]]],
    clients: int,
    instances: int,
    seconds: float,
    logs: Path,
    caps: Caps,
    groups: list[Path],
) -> None:
    """One round on `side`: pgbench on every (URL, scripts) at once, `clients` each. For WARM
    seconds the side's nodes run uncapped (`groups`), while its connections open and fill
    their caches (a new backend of a Citus node plans the function's statements for each shard
    it reaches, several ms of CPU each); then capped again, and counted are the calls that end
    in the next `seconds` (from pgbench's per-transaction logs) and the CPU spent meanwhile."""
    shutil.rmtree(logs, ignore_errors=True)
    caps.release(groups)
    procs = []
    for n, (url, paths) in enumerate(targets):
        (logs / str(n)).mkdir(parents=True)
        command = ["pgbench", "--no-vacuum", "-c", str(clients), "-j", str(min(clients, run.CPUS))]
        command += ["-T", str(math.ceil(WARM + SETTLE + seconds) + 1), "-M", "prepared"]
        command += [arg for path in paths for arg in ("-f", str(path))]
        command += ["-D", f"instances={instances}", "-l", f"--log-prefix={logs / str(n)}/tx", url]
        procs.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    time.sleep(WARM)
    caps.limit(groups)
    time.sleep(SETTLE)
    start, before = time.time(), citus.cpu_now(side.nodes, None)
    before["load generator"] = sum(process_cpu(proc.pid) for proc in procs)
    time.sleep(seconds)
    end, after = time.time(), citus.cpu_now(side.nodes, None)
    after["load generator"] = sum(process_cpu(proc.pid) for proc in procs)
    errors, detail = 0, ""
    for proc in procs:
        out, err = proc.communicate(timeout=60)
        failed = re.search(rb"^number of failed transactions: (\d+)", out, re.M)
        if proc.returncode != 0 or failed is None or int(failed[1]):
            errors += int(failed[1]) if failed and int(failed[1]) else 1
            detail = detail or (err or out).decode(errors="replace")[-2000:]
    calls = 0
    for log in logs.glob("*/tx*"):
        for line in log.read_text().splitlines():
            fields = line.split()  # client, transaction, time, script, epoch s, its us
            calls += fields[2].isdigit() and start <= int(fields[4]) + int(fields[5]) / 1e6 < end
    result = Load(calls / (end - start), 1, math.nan, math.nan, errors, detail)
    side.runs.append(result)
    side.seconds += end - start
    for name in after:
        side.cpu[name] = side.cpu.get(name, 0.0) + after[name] - before[name]
    print(f"  {side.name}: {result.events_per_s:,.0f}/s, errors {errors}", file=sys.stderr)


def rounds(
    title: str,
    sides: list[tuple[Side, Callable[[], None], Callable[[], None] | None]],
    count: int,
    cap: float | None,
) -> tuple[list[str], list[float]]:
    """Each side's warm-up (if any), then one round of each side in turn, `count` times, the
    order turning each time; the report's lines and each side's median events/s."""
    print(title, file=sys.stderr, flush=True)
    for _, _, warm_up in sides:
        if warm_up is not None:
            warm_up()
    for turn in range(count):
        shift = turn % len(sides)
        for _, measure, _ in sides[shift:] + sides[:shift]:
            measure()
    lines, rates = [title], []
    for side, _, _ in sides:
        result = run.median_of(side.runs)
        rates.append(result.events_per_s)
        base, previous = rates[0], rates[-2] if len(rates) > 1 else 0.0
        if result.errors:
            share = f"FAILED: {result.errors} errors. {result.detail[:300]}{citus.cause(side.log)}"
        elif len(rates) == 1:
            share = ""
        else:
            share = f"{result.events_per_s / base:5.2f}x"
            if len(rates) > 2:
                share += f", {(result.events_per_s - previous) / base:+.2f}x of one node"
        events = max(sum(r.events_per_s for r in side.runs) * side.seconds / len(side.runs), 1)
        cpu = ", ".join(f"{name} {s / events * 1e6:,.0f}" for name, s in side.cpu.items())
        postgres = sum(s for name, s in side.cpu.items() if name in side.nodes) / events * 1e6
        lines.append(f"  {side.name:10s} {result.events_per_s:8,.0f}/s  {share}")
        lines.append(f"  {'':10s} CPU us per event: {cpu}; PostgreSQL {postgres:,.0f}")
        if cap is not None:
            used = ", ".join(
                f"{name} {side.cpu.get(name, 0.0) / (cap * side.seconds):.0%}"
                for name in side.nodes
            )
            lines.append(f"  {'':10s} share of its cap used: {used}")
    return lines, rates


def judge(
    root: Path, setups: list[Setup], load: str, kind: str, args: argparse.Namespace, caps: Caps
) -> tuple[list[str], str, list[float]]:
    """The judge's calls (`kind`: replays or new) by pgbench, through the one node or the
    coordinator (`load` calls) or each worker for its own instances (routed)."""
    sides: list[tuple[Side, Callable[[], None], Callable[[], None] | None]] = []
    for setup in setups:
        tag = setup.name.replace(" ", "-")
        if load == "calls":
            targets = [(setup.url, [script(root, f"{tag}-{kind}.sql", kind, None)])]
            clients = CONNECTIONS
        else:
            targets = [
                (
                    url,
                    [
                        script(root, f"{tag}-{kind}-{n}-{m}.sql", kind, keys, function)
                        for m, (function, keys) in enumerate(copies.items())
                    ],
                )
                for n, (url, copies) in enumerate(setup.routes.items())
            ]
            clients = ROUTED_CONNECTIONS
        side = Side(setup.name, setup.nodes, None)
        logs = root / "pgbench" / tag
        measure = partial(
            pgbench_round, side, targets, clients, args.instances, args.duration, logs, caps
        )
        sides.append((side, partial(measure, setup.groups), None))
    what = "replayed events" if kind == "replays" else "new records"
    if load == "calls":
        title = f"judge via coordinator, {what}"
        detail = f"{CONNECTIONS} connections to the one node or the coordinator"
    else:
        title = f"judge routed, {what}"
        detail = f"{ROUTED_CONNECTIONS} connections to each worker (to the one node)"
    lines, rates = rounds(f"{title} (pgbench, {detail}), events/s", sides, args.rounds, caps.cap)
    return lines, title, rates


def through_service(
    root: Path, setups: list[Setup], load: str, args: argparse.Namespace, caps: Caps
) -> tuple[list[str], str, list[float]]:
    """Single events or batches through each side's service (its pools warmed up first, the
    side's nodes uncapped meanwhile)."""
    lua, size, connections = ("events.lua", 1, SERVICE_CONNECTIONS)
    if load == "batch":
        lua, (size, connections) = "batch.lua", BATCH
    wrk_args = [lua[0], run.INSTANCES, connections, size]
    sides: list[tuple[Side, Callable[[], None], Callable[[], None] | None]] = []
    for setup in setups:
        side = Side(setup.name, setup.nodes, setup.base, log=service_log(root, setup))
        wrk = partial(run.wrk, setup.base or "", lua, connections, args=wrk_args, events=size)
        measure = partial(citus.measure, side, partial(wrk, args.duration))
        sides.append((side, measure, partial(warm_up, caps, setup.groups, wrk)))
    title = "service, single events" if load == "single" else f"service, batches of {size}"
    head = f"{title} ({lua}, {connections} connections), events/s"
    lines, rates = rounds(head, sides, args.rounds, caps.cap)
    return lines, title, rates


def warm_up(caps: Caps, groups: list[Path], load: Callable[[float], Load]) -> None:
    """The load for SERVICE_WARM_UP seconds with the side's nodes uncapped."""
    caps.release(groups)
    try:
        load(SERVICE_WARM_UP)
    finally:
        caps.limit(groups)


def service_log(root: Path, setup: Setup) -> Path:
    return root / f"{setup.name.replace(' ', '-')}.log"


def goals(curves: dict[str, list[float]]) -> list[str]:
    """The issue's goals, met or missed, from each load's curve (one node, then 1-4 workers)."""
    lines = ["goals (4 workers against one node; each added worker's gain, as a share of it)"]

    def verdict(value: float, target: float) -> str:
        return "met" if value >= target else f"MISSED by {target - value:.2f}x"

    for name, curve in curves.items():
        if not name.startswith("judge routed") and name != "service, single events":
            continue
        one, four = curve[0], curve[-1]
        target = 2.0 if name.startswith("service") else 2.5
        lines.append(
            f"  {name}: 4 workers {four / one:.2f}x (>= {target}x: {verdict(four / one, target)})"
        )
        if name.startswith("judge routed"):
            gains = [(curve[n] - curve[n - 1]) / one for n in range(2, len(curve))]
            worst = min(gains)
            listed = ", ".join(f"+{g:.2f}x" for g in gains)
            lines.append(
                f"    added workers 2, 3, 4: {listed} (each >= 0.5x: {verdict(worst, 0.5)})"
            )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cap", type=float, default=0.2, help="of a core, per node (0.2)")
    parser.add_argument("--period-us", type=int, default=100_000, help="cpu.cfs_period_us")
    parser.add_argument("--no-cap", action="store_true", help="no cgroups: every node uncapped")
    parser.add_argument(
        "--shares", type=int, default=32768, help="cpu.shares of the run's group (32768)"
    )
    parser.add_argument("--duration", type=float, default=4, help="seconds per round (4)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--instances", type=int, default=120, help="of the read table (120)")
    parser.add_argument("--shards", type=int, default=32, help="per distributed table (32)")
    parser.add_argument("--loads", default=",".join(LOADS), help=f"comma-separated: {LOADS}")
    args = parser.parse_args()
    chosen = set(args.loads.split(","))
    if not chosen or chosen - set(LOADS):
        parser.error(f"--loads takes {', '.join(LOADS)}, comma-separated")
    missing = [tool for tool in ("wrk", "pgbench") if shutil.which(tool) is None]
    if missing:
        sys.exit(f"missing {', '.join(missing)}; install with: {run.INSTALL}")
    bin_path = citus_bin_path()
    if bin_path is None:
        sys.exit("Citus is not installed in any PostgreSQL here")
    cap = None if args.no_cap else args.cap
    report: list[str] = []
    curves: dict[str, list[float]] = {}
    with ExitStack() as stack:
        groups = stack.enter_context(caps(cap, args.period_us, args.shares))
        root = stack.enter_context(server_directory())
        started = time.monotonic()
        node = stack.enter_context(citus.one_node(root, bin_path))
        one_group = groups.add("one-node", node.data_dir)
        one_url = create_database(node.url, NAME)
        setups = [Setup("one node", one_url, {"one node": node.data_dir}, {})]
        setups[0].groups = [one_group] if one_group else []
        for workers in WORKERS:
            cluster = stack.enter_context(
                citus_cluster(root / f"w{workers}", bin_path, workers, args.shards)
            )
            nodes = {"coordinator": cluster.coordinator.data_dir}
            nodes |= {f"worker{n}": w.data_dir for n, w in enumerate(cluster.workers, 1)}
            added = [groups.add(f"w{workers}-{name}", path) for name, path in nodes.items()]
            url = create_database(cluster.url, NAME)
            name = f"{workers} worker" + ("s" if workers > 1 else "")
            ports = {int(w.port or 0): make_conninfo(w.url, dbname=NAME) for w in cluster.workers}
            setups.append(Setup(name, url, nodes, ports))
            setups[-1].groups = [group for group in added if group is not None]
        for setup in setups:
            print(f"migrating and loading {setup.name}", file=sys.stderr, flush=True)
            migrate(setup.url)
            plans.load(setup.url, args.instances)
            if setup.ports:
                setup.routes = placements(setup.url, setup.ports, args.instances)
            else:
                setup.routes = {setup.url: {JUDGE: list(range(1, args.instances + 1))}}
        if {"single", "batch"} & chosen:
            for setup in setups:
                service = run.service(setup.url, service_log(root, setup), env=SERVICE_ENV)
                setup.base = stack.enter_context(service)
        groups.limit()
        setup_seconds = time.monotonic() - started
        report += run.machine(one_url)
        capped = (
            f"every PostgreSQL node capped at {cap:g} of a core (cgroup v1 cpu, period"
            f" {args.period_us} us)"
            if cap is not None
            else "no caps (--no-cap): every node shares the machine's cores"
        )
        report.append(
            f"sides:      one node; Citus clusters of a coordinator and 1-4 workers"
            f" ({args.shards} shards); {capped}; the services and load generators uncapped;"
            f" {args.rounds} rounds of {args.duration:g} s per side (pgbench: after {WARM:g} s"
            f" of warm-up in each round; the services: after {SERVICE_WARM_UP:g} s once);"
            f" {args.instances} instances; set up in {setup_seconds:.0f} s"
        )

        for load in (load for load in LOADS if load in chosen):
            if load in ("calls", "routed"):
                for kind in ("replays", "new"):
                    lines, title, rates = judge(root, setups, load, kind, args, groups)
                    report += lines
                    curves[title] = rates
            else:
                lines, title, rates = through_service(root, setups, load, args, groups)
                report += lines
                curves[title] = rates
        report += goals(curves)
        report.append(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print("\n".join(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
