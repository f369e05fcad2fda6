"""Where the CPU goes: the service's loads and pgbench's, CPU time per operation by process.

Run from the repository root: `.venv/bin/python -m tests.bench.cpu [--rounds N] [--duration S]`.
On a machine the loads saturate, the ratio of two throughputs is the inverse ratio of the CPU
each spends per operation; this splits that CPU by process kind (the service's workers,
PostgreSQL's backends, the load generator), so a missed ratio shows what is in the way.
It runs `events.lua` against the service and against `floor.py` (the same work with no
framework or features), the limit of single events (`run.limit_events_script`: pgbench
passing the same events to the service's judge function) and `events.sql` (the least
SQL); `batch.lua`, the limit of a batch (`run.limit_batch_script`: the same batches to the
merge function) and `batch.sql`; then
`reads.lua` against the service and the floor, and the page's query; at 16 connections,
with pgbench preparing its statements as the service does (and as `run.py` does), in
alternating rounds, and prints the CPU time per operation of each.
Linux only (it reads /proc).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import resource
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from tests.bench import common, run
from tests.bench.run import Load

TICK = os.sysconf("SC_CLK_TCK")
# A bare ASGI app doing only what a page read needs (floor.py): what the service costs beyond it
# is its framework's and its features'.
FLOOR = "tests.bench.floor:app"
# pgbench prepares its statements, as the service does (and as run.py's limit rows do).
PROTOCOL = "prepared"


def _stat(pid: str) -> tuple[str, int, float, float] | None:
    """(command name, parent pid, own CPU seconds, CPU seconds of reaped children)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    name = text[text.index("(") + 1 : text.rindex(")")]
    fields = text[text.rindex(")") + 2 :].split()
    own = (int(fields[11]) + int(fields[12])) / TICK
    children = (int(fields[13]) + int(fields[14])) / TICK
    return name, int(fields[1]), own, children


def snapshot(service_root: int) -> dict[str, float]:
    """CPU seconds so far of PostgreSQL (its processes, and the backends it has reaped) and of
    the service (the process `service_root` and its workers)."""
    stats = {pid: s for pid in os.listdir("/proc") if pid.isdigit() and (s := _stat(pid))}
    totals = {"postgres": 0.0, "service": 0.0}
    for pid, (name, parent, own, children) in stats.items():
        if name.startswith("postgres"):
            totals["postgres"] += own
            parent_name = stats.get(str(parent), ("",))[0]
            if not parent_name.startswith("postgres"):  # the postmaster reaps the backends
                totals["postgres"] += children
        elif int(pid) == service_root or parent == service_root:
            totals["service"] += own
    return totals


def measured(
    service_root: int, load: Callable[[], Load], *, per_event: bool = False
) -> tuple[Load, dict[str, float]]:
    """The load, and CPU seconds per operation (a request, a pgbench script run; with
    `per_event`, an event) of each process kind while it ran."""
    before = snapshot(service_root)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    result = load()
    elapsed = time.monotonic() - started
    after = snapshot(service_root)
    children_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    rate = result.events_per_s if per_event else result.rate
    operations = max(rate * elapsed, 1.0)
    spent = {kind: (after[kind] - before[kind]) / operations for kind in after}
    spent["load generator"] = (
        children_after.ru_utime + children_after.ru_stime - children.ru_utime - children.ru_stime
    ) / operations
    return result, spent


def line(name: str, load: Load, spent: dict[str, float], unit: float, label: str) -> str:
    digits = 2 if unit == 1e3 else 0
    parts = ", ".join(f"{kind} {seconds * unit:,.{digits}f}" for kind, seconds in spent.items())
    total = sum(spent.values()) * unit
    rate = f"{load.events_per_s:9,.0f}/s"
    return f"{name:8s} {rate}   {label}: {parts}; total {total:,.{digits}f}"


def same_page(base: str, floor_base: str) -> None:
    """The floor answers a page exactly as the service does, so it does the same work."""
    path = f"/v1/instances/r1/steps?order=ordinal&limit={run.READ_LIMIT}"
    answers = [urllib.request.urlopen(url + path).read() for url in (base, floor_base)]
    if answers[0] != answers[1]:
        raise RuntimeError(f"the floor's page differs from the service's:\n{answers}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=4, help="seconds per round (4)")
    parser.add_argument(
        "--loads",
        default="single,batch,reads",
        help="which loads, comma-separated (single,batch,reads)",
    )
    args = parser.parse_args()
    loads = set(args.loads.split(","))
    if not loads or loads - {"single", "batch", "reads"}:
        parser.error("--loads takes single, batch and reads, comma-separated")
    with (
        tempfile.TemporaryDirectory(prefix="steprecord-bench-") as tmp_name,
        common.postgres_server(Path(tmp_name)) as server,
        common.fresh_database(server, run.DB_NAME) as dsn,
        run.service(dsn, Path(tmp_name) / "service.log") as base,
        run.service(dsn, Path(tmp_name) / "floor.log", FLOOR) as floor_base,
    ):
        root = run.service_pid(base)
        bench = run.Bench(
            dsn, base, dsn, base, Path(tmp_name), args.duration, 2, 16, 8, 1, PROTOCOL
        )
        print("\n".join(run.machine(dsn)), file=sys.stderr)
        errors: list[Load] = []
        if "single" in loads:
            errors += single_events(bench, base, floor_base, args.rounds, args.duration)
        if "batch" in loads:
            errors += batches(bench, root, args.rounds, args.duration)
        if "reads" in loads:
            errors += reads(bench, base, floor_base, args.rounds, args.duration)
    return 1 if errors else 0


def same_event(base: str, floor_base: str) -> None:
    """The floor answers an event as the service does: a start the floor recorded, sent again
    to the service, is a replay that answers the very record the floor answered."""
    path = f"/v1/instances/floor-check/steps/s{time.time_ns()}/start"
    body = b'{"attempt":1,"started_at":"2026-12-05T10:00:00Z"}'
    answers = []
    for url in (floor_base, base):
        request = urllib.request.Request(url + path, body, method="POST")
        request.add_header("Content-Type", "application/json")
        answers.append(urllib.request.urlopen(request).read())
    if answers[0] != answers[1]:
        raise RuntimeError(f"the floor's answer to an event differs from the service's:\n{answers}")


def single_events(
    bench: run.Bench, base: str, floor_base: str, rounds: int, duration: float
) -> list[Load]:
    print("single events (events/s), 16 connections: CPU us per event")
    errors: list[Load] = []
    root, floor_root = run.service_pid(base), run.service_pid(floor_base)
    same_event(base, floor_base)
    limit_script = run.limit_events_script(bench.tmp / "limit_events.sql")
    bench.warm_up("single", "events.lua", 16)
    floor = dataclasses.replace(bench, base=floor_base)
    for _ in range(rounds):
        served = measured(
            root, lambda: bench.service_writes("events.lua", 16, 1, duration), per_event=True
        )
        bare = measured(
            floor_root, lambda: floor.service_writes("events.lua", 16, 1, duration), per_event=True
        )
        limit = measured(
            root, lambda: bench.pgbench_writes(limit_script, 2, duration), per_event=True
        )
        least = measured(
            root, lambda: bench.pgbench_writes("events.sql", 2, duration), per_event=True
        )
        print(line("service", *served, 1e6, "us"), flush=True)
        print(line("floor", *bare, 1e6, "us"), flush=True)
        print(line("limit", *limit, 1e6, "us"), flush=True)
        print(line("least", *least, 1e6, "us"), flush=True)
        errors += [load for load, _ in (served, bare, limit, least) if load.errors]
    return errors


def batches(bench: run.Bench, root: int, rounds: int, duration: float) -> list[Load]:
    print("batches of 100 events (events/s), 16 connections: CPU ms per batch")
    errors: list[Load] = []
    size = run.BATCH_SIZE
    limit = run.limit_batch_script(bench.tmp / "limit_batch.sql", size)
    bench.warm_up("batch", "batch.lua", 16, size)
    for _ in range(rounds):
        served = measured(root, lambda: bench.service_writes("batch.lua", 16, size, duration))
        direct = measured(
            root, lambda: bench.pgbench_writes("batch.sql", size, duration, size=size)
        )
        judged = measured(root, lambda: bench.pgbench_writes(limit, size, duration))
        print(line("service", *served, 1e3, "ms"), flush=True)
        print(line("limit", *judged, 1e3, "ms"), flush=True)
        print(line("least", *direct, 1e3, "ms"), flush=True)
        errors += [load for load, _ in (served, direct, judged) if load.errors]
    return errors


def reads(bench: run.Bench, base: str, floor_base: str, rounds: int, duration: float) -> list[Load]:
    print("first pages of 100 records (reads/s), 10^4 records, 16 connections: CPU us per read")
    errors: list[Load] = []
    root, floor_root = run.service_pid(base), run.service_pid(floor_base)
    run.load_read_table(bench.dsn, run.SMALL_TABLE)
    instances = run.SMALL_TABLE // run.STEPS_PER_INSTANCE
    script = run.read_script("ordinal", bench.tmp / "read.sql")
    args_lua = ["r", instances, "ordinal", run.READ_LIMIT]
    same_page(base, floor_base)
    run.wrk(base, "reads.lua", 16, 2, args_lua, 1)
    run.wrk(floor_base, "reads.lua", 16, 2, args_lua, 1)
    for _ in range(rounds):
        served = measured(root, lambda: run.wrk(base, "reads.lua", 16, duration, args_lua, 1))
        bare = measured(
            floor_root, lambda: run.wrk(floor_base, "reads.lua", 16, duration, args_lua, 1)
        )
        direct = measured(
            root,
            lambda: run.pgbench(
                bench.dsn, script, 16, duration, {"instances": instances}, 1, PROTOCOL
            ),
        )
        print(line("service", *served, 1e6, "us"), flush=True)
        print(line("floor", *bare, 1e6, "us"), flush=True)
        print(line("pgbench", *direct, 1e6, "us"), flush=True)
        errors += [load for load, _ in (served, bare, direct) if load.errors]
    return errors


if __name__ == "__main__":
    sys.exit(main())
