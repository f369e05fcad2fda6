"""Writes during a flood of `/readyz`: single writes alone, then while 900 `/readyz` arrive
150 at a time, on this tree and optionally on another one (`--base DIR`, a tree of an earlier
commit, e.g. `git archive REV | tar -x -C DIR`).

Run from the repository root:
`.venv-test/bin/python -m tests.bench.readyz [--base DIR] [--rounds 3] [--calls 900]`.

On a fresh, migrated database (run.py's: the server in DATABASE_URL, else an embedded
PostgreSQL), each tree serves with `steprecord serve --workers 2` (a tree from `--base` is
imported through PYTHONSAFEPATH and PYTHONPATH). A round, for each tree in turn: one client
sends `start` of new steps one after another for `--quiet` seconds (writes alone), then again
while a separate process sends `--calls` GET /readyz, `--concurrency` at a time (writes during
the flood). It reports each tree's median round: the writes' p50 and p99 alone and during the
flood, the flood's duration and how many readiness checks the service ran for it
(`steprecord_readiness_checks_total`; a tree without that counter ran one per call). Exits
non-zero on any answer other than 201 to a write or 200 to `/readyz`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.bench import common, run

CHECKS = "steprecord_readiness_checks_total"


async def _flood(base: str, calls: int, concurrency: int) -> dict[str, float]:
    left = calls
    bad = 0

    async def caller(client: httpx.AsyncClient) -> None:
        nonlocal left, bad
        while left > 0:
            left -= 1
            if (await client.get(f"{base}/readyz")).status_code != 200:
                bad += 1

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=60) as client:
        began = time.monotonic()
        await asyncio.gather(*(caller(client) for _ in range(concurrency)))
        return {"seconds": time.monotonic() - began, "bad": bad}


def checks(base: str) -> float | None:
    """The service's readiness checks so far; None for a tree that does not count them."""
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        if line.startswith(CHECKS + " "):
            return float(line.split()[1])
    return None


def writes(base: str, until: threading.Event | float) -> list[float]:
    """Sequential `start`s of new steps; their latencies in ms. Until the event is set, or for
    that many seconds."""
    key = "r" + uuid.uuid4().hex[:8]
    latencies: list[float] = []
    if isinstance(until, float):
        stop_at = time.monotonic() + until

        def over() -> bool:
            return time.monotonic() >= stop_at
    else:
        over = until.is_set
    with httpx.Client(base_url=base, timeout=30) as client:
        while not over():
            began = time.perf_counter()
            status = client.post(f"/v1/instances/{key}/steps/s{len(latencies)}/start").status_code
            latencies.append((time.perf_counter() - began) * 1000)
            if status != 201:
                raise SystemExit(f"a write answered {status}")
    return latencies


@dataclass
class Round:
    alone_p50: float
    alone_p99: float
    flood_p50: float
    flood_p99: float
    flood_seconds: float
    checks: float


def one_round(base: str, args: argparse.Namespace) -> Round:
    alone = writes(base, float(args.quiet))
    before = checks(base)
    done = threading.Event()
    during: list[float] = []
    writer = threading.Thread(target=lambda: during.extend(writes(base, done)))
    writer.start()
    try:
        flood = subprocess.run(
            [
                *(sys.executable, "-m", "tests.bench.readyz", "--flood", base),
                *("--calls", str(args.calls), "--concurrency", str(args.concurrency)),
            ],
            cwd=run.ROOT,
            capture_output=True,
            text=True,
        )
    finally:
        done.set()
        writer.join()
    if flood.returncode != 0:
        raise SystemExit(f"the flood failed:\n{flood.stderr[-3000:]}")
    result = json.loads(flood.stdout)
    if result["bad"]:
        raise SystemExit(f"{result['bad']} /readyz answers were not 200")
    after = checks(base)
    ran = args.calls if before is None or after is None else after - before
    return Round(
        run.percentile(alone, 50),
        run.percentile(alone, 99),
        run.percentile(during, 50),
        run.percentile(during, 99),
        result["seconds"],
        ran,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, help="a tree of an earlier commit to compare")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=900)
    parser.add_argument("--concurrency", type=int, default=150)
    parser.add_argument("--quiet", type=int, default=5, help="seconds of writes alone")
    parser.add_argument("--flood", metavar="URL", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.flood:
        print(json.dumps(asyncio.run(_flood(args.flood, args.calls, args.concurrency))))
        return 0
    trees: dict[str, dict[str, str]] = {"this": {}}
    if args.base is not None:
        base = str(args.base.resolve())
        trees = {"base": {"PYTHONSAFEPATH": "1", "PYTHONPATH": base}, **trees}
    rounds: dict[str, list[Round]] = {name: [] for name in trees}
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        server = stack.enter_context(common.postgres_server(tmp))
        dsn = stack.enter_context(common.fresh_database(server, "steprecord_bench_readyz"))
        for _ in range(args.rounds):
            for name, env in trees.items():
                with run.service(dsn, tmp / f"{name}.log", env=env) as url:
                    rounds[name].append(one_round(url, args))
    print(
        f"{args.calls} GET /readyz, {args.concurrency} at a time; single writes one after"
        f" another; median of {args.rounds} rounds (ms)"
    )
    print("| tree | writes alone p50 / p99 | during the flood p50 / p99 | flood s | checks |")
    print("|---|---|---|---|---|")
    for name, found in rounds.items():
        m = {f: statistics.median([getattr(r, f) for r in found]) for f in Round.__annotations__}
        print(
            f"| {name} | {m['alone_p50']:.1f} / {m['alone_p99']:.1f}"
            f" | {m['flood_p50']:.1f} / {m['flood_p99']:.1f}"
            f" | {m['flood_seconds']:.1f} | {m['checks']:.0f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
