"""Reads/s with and without a streaming replica, under a concurrent write load.

Run from the repository root: `.venv/bin/python -m tests.bench.replica [--duration S]`.
It starts an embedded PostgreSQL primary and a streaming replica of it (`pg_basebackup -R`) in
a temporary directory, loads the read table of run.py (`load_reads.sql`), then measures the
same two loads at once on two services (`--workers 2` each, both up for the whole run, measured
in alternating rounds): one reading from the primary, one with `STEPRECORD_READ_DATABASE_URL`
set to the replica. The loads: wrk `reads.lua` (first page of a random instance) and wrk
`events.lua` (single events). The report says reads/s, read latency, events/s (medians of the
rounds) and which database served the reads (the service's `steprecord_reads_total`).
Exits non-zero when any load had an error.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from app.cli.migrate import migrate
from app.ops.embedded import EmbeddedPostgres
from tests.bench.run import (
    HTTP,
    INSTANCES,
    READ_LIMIT,
    STEPS_PER_INSTANCE,
    WORKERS,
    Load,
    fmt,
    load_read_table,
    machine,
    median_of,
    service,
    wrk,
)
from tests.support.databases import make_replica


@contextmanager
def environment(**values: str) -> Iterator[None]:
    """Variables the service started meanwhile inherits."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def reads_by_pool(base: str) -> dict[str, float]:
    with HTTP.open(f"{base}/metrics", timeout=10) as response:
        text = response.read().decode()
    found = re.findall(r'^steprecord_reads_total\{pool="(\w+)"\} ([\d.e+]+)$', text, re.M)
    return {pool: float(count) for pool, count in found}


def together(
    base: str, seconds: float, args: argparse.Namespace, instances: int
) -> tuple[Load, Load]:
    """The read load and the write load at the same time."""
    writes: list[Load] = []
    writer = threading.Thread(
        target=lambda: writes.append(
            wrk(
                base,
                "events.lua",
                args.write_connections,
                seconds,
                ["e", INSTANCES, args.write_connections, 1],
                1,
            )
        )
    )
    writer.start()
    try:
        read_args = ["r", instances, "ordinal", READ_LIMIT]
        reads = wrk(base, "reads.lua", args.read_connections, seconds, read_args, 1)
    finally:
        writer.join()
    return reads, writes[0]


def measure(
    args: argparse.Namespace, tmp: Path, primary: str, replica: str, errors: list[str]
) -> list[tuple[str, Load, Load, str]]:
    """Both services at once, measured in alternating rounds (other work on the machine then
    skews both alike); the median of the rounds."""
    instances = args.records // STEPS_PER_INSTANCE
    setups: dict[str, dict[str, str]] = {
        "primary only": {},
        "with replica": {"STEPRECORD_READ_DATABASE_URL": replica},
    }
    with ExitStack() as stack:
        bases: dict[str, str] = {}
        for label, extra in setups.items():
            with environment(**extra):
                log = tmp / f"service-{len(bases)}.log"
                bases[label] = stack.enter_context(service(primary, log))
        time.sleep(2)  # the replica's first health check
        for base in bases.values():
            together(base, 2, args, instances)  # warm-up
        runs: dict[str, list[tuple[Load, Load]]] = {label: [] for label in bases}
        served: dict[str, dict[str, float]] = {label: {} for label in bases}
        for turn in range(args.rounds):
            for label in sorted(bases, reverse=bool(turn % 2)):
                before = reads_by_pool(bases[label])
                reads, writes = together(bases[label], args.duration / args.rounds, args, instances)
                after = reads_by_pool(bases[label])
                for pool, count in after.items():
                    served[label][pool] = served[label].get(pool, 0) + count - before.get(pool, 0)
                runs[label].append((reads, writes))
                print(f"  {label}: {reads.rate:,.0f} reads/s", file=sys.stderr, flush=True)
    rows = []
    for label, loads in runs.items():
        reads, writes = median_of([r for r, _ in loads]), median_of([w for _, w in loads])
        for name, load in (("reads", reads), ("writes", writes)):
            if load.errors:
                errors.append(f"{label} {name}: {load.errors} errors. {load.detail}")
        total = sum(served[label].values()) or 1
        rows.append(
            (label, reads, writes, f"{100 * served[label].get('replica', 0) / total:.0f}% replica")
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=15, help="seconds per setup (15)")
    parser.add_argument("--records", type=int, default=10**5, help="rows of the read table")
    parser.add_argument("--read-connections", type=int, default=8)
    parser.add_argument("--write-connections", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per setup")
    args = parser.parse_args()
    errors: list[str] = []
    with tempfile.TemporaryDirectory(prefix="steprecord-bench-replica-") as tmp_name:
        tmp = Path(tmp_name)
        primary = EmbeddedPostgres(tmp / "primary")
        primary.start()
        try:
            migrate(primary.url)
            load_read_table(primary.url, args.records)
            replica = make_replica(primary, tmp / "replica")
            try:
                header = machine(primary.url)
                rows = measure(args, tmp, primary.url, replica.url, errors)
            finally:
                replica.stop()
        finally:
            primary.stop()
    print("\n".join(header))
    print(
        f"reads: {args.read_connections} connections, first page (limit {READ_LIMIT}) of a random"
        f" instance of {args.records:,} records; writes: {args.write_connections} connections of"
        f" single events; service --workers {WORKERS}; {args.duration:g} s in"
        f" {args.rounds} alternating rounds (median)"
    )
    print(f"{'':<14}{'reads/s':>9}  {'read p50/p99 ms':>16}  {'events/s':>9}  served by")
    for label, reads, writes, share in rows:
        latency = f"{fmt(reads.p50_ms, '.1f')} / {fmt(reads.p99_ms, '.1f')}"
        print(f"{label:<14}{reads.rate:>9,.0f}  {latency:>16}  {writes.rate:>9,.0f}  {share}")
    for error in errors:
        print(f"ERROR {error}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
