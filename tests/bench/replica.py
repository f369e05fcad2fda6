"""Reads/s with and without a streaming replica, under a concurrent write load.

Run from the repository root: `.venv/bin/python -m tests.bench.replica [--duration S]`.
It starts an embedded PostgreSQL primary and a streaming replica of it (`pg_basebackup -R`) in
a temporary directory, loads the read table of run.py (`load_reads.sql`), then measures the
same two loads at once, once with the service reading from the primary and once with
`STEPRECORD_READ_DATABASE_URL` set to the replica: wrk `reads.lua` (first page of a random
instance) and wrk `events.lua` (single events). The report says reads/s, read latency,
events/s and which database served the reads (the service's `steprecord_reads_total`).
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
from contextlib import contextmanager
from pathlib import Path

from app.cli import migrate
from app.embedded import EmbeddedPostgres
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
    service,
    wrk,
)
from tests.helpers import make_replica


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=10, help="seconds per load (10)")
    parser.add_argument("--records", type=int, default=10**5, help="rows of the read table")
    parser.add_argument("--read-connections", type=int, default=8)
    parser.add_argument("--write-connections", type=int, default=8)
    args = parser.parse_args()
    errors: list[str] = []
    rows: list[tuple[str, Load, Load, str]] = []
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
                instances = args.records // STEPS_PER_INSTANCE
                for label, extra in (
                    ("primary only", {}),
                    ("with replica", {"STEPRECORD_READ_DATABASE_URL": replica.url}),
                ):
                    with environment(**extra), service(primary.url, tmp / "service.log") as base:
                        time.sleep(2)  # the replica's first health check
                        together(base, 2, args, instances)  # warm-up
                        before = reads_by_pool(base)
                        reads, writes = together(base, args.duration, args, instances)
                        after = reads_by_pool(base)
                    served = {pool: after.get(pool, 0) - before.get(pool, 0) for pool in after}
                    total = sum(served.values()) or 1
                    share = f"{100 * served.get('replica', 0) / total:.0f}% replica"
                    for name, load in (("reads", reads), ("writes", writes)):
                        if load.errors:
                            errors.append(f"{label} {name}: {load.errors} errors. {load.detail}")
                    rows.append((label, reads, writes, share))
                    print(f"  {label}: {reads.rate:,.0f} reads/s, {share}", file=sys.stderr)
            finally:
                replica.stop()
        finally:
            primary.stop()
    print("\n".join(header))
    print(
        f"reads: {args.read_connections} connections, first page (limit {READ_LIMIT}) of a random"
        f" instance of {args.records:,} records; writes: {args.write_connections} connections of"
        f" single events; service --workers {WORKERS}; {args.duration:g} s"
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
