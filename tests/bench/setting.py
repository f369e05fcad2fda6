"""What one setting is worth: two services of this tree, one with `--set NAME=VALUE` added to
its environment, under run.py's loads in alternating rounds.

Run from the repository root:
`.venv-test/bin/python -m tests.bench.setting --set STEPRECORD_PREPARE_THRESHOLD=0
[--duration 10] [--rounds 5]`.

On run.py's PostgreSQL (the server in DATABASE_URL, else an embedded one) each service runs
`steprecord serve --workers 2` on a database of its own: "as is" with the environment as it
is, "with" with the settings added. The loads are run.py's, at 16 connections: single events
(events.lua), batches of 100 (batch.lua), each round on emptied tables after a CHECKPOINT,
and first-page reads (reads.lua) of a table of 10^4 records loaded into both databases. The
rounds alternate between the two services, the order turning each round; the table shows
each service's median round and the ratio of "with" to "as is". Exits non-zero on any error.
This is how each lever of tests/bench/README.md was measured before it was kept or dropped.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

from tests.bench import common, run

CONNECTIONS = 16
SIDES = ("as is", "with")


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def loads(base: str, dsn: str) -> dict[str, Callable[[float], run.Load]]:
    """The loads of one service, each a function of its duration."""
    reads = run.SMALL_TABLE // run.STEPS_PER_INSTANCE

    def writes(script: str, events: int) -> Callable[[float], run.Load]:
        def load(seconds: float) -> run.Load:
            run.reset(dsn)
            args = [script[0], run.INSTANCES, CONNECTIONS, events]
            return run.wrk(base, script, CONNECTIONS, seconds, args, events)

        return load

    def page_reads(seconds: float) -> run.Load:
        args = ["r", reads, "ordinal", run.READ_LIMIT]
        return run.wrk(base, "reads.lua", CONNECTIONS, seconds, args, 1)

    return {
        "single events/s": writes("events.lua", 1),
        "batch events/s": writes("batch.lua", run.BATCH_SIZE),
        "page reads/s": page_reads,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--set", action="append", required=True, metavar="NAME=VALUE", help="repeatable"
    )
    parser.add_argument("--duration", type=float, default=10, help="seconds per round (10)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per service (5)")
    args = parser.parse_args(argv)
    added = dict(item.split("=", 1) for item in args.set)
    if missing := [tool for tool in ("wrk",) if shutil.which(tool) is None]:
        say(f"missing {', '.join(missing)}; install with: {run.INSTALL}")
        return 2
    errors: list[str] = []
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="steprecord-set-")))
        server = stack.enter_context(common.postgres_server(tmp))
        pid = os.getpid()
        dsns = {
            side: stack.enter_context(common.fresh_database(server, f"steprecord_bench_s{i}_{pid}"))
            for i, side in enumerate(SIDES)
        }
        header = run.machine(dsns["as is"])
        bases = {
            "as is": stack.enter_context(run.service(dsns["as is"], tmp / "as-is.log")),
            "with": stack.enter_context(run.service(dsns["with"], tmp / "with.log", env=added)),
        }
        work = {side: loads(bases[side], dsns[side]) for side in SIDES}
        medians: dict[str, dict[str, run.Load]] = {}
        for name in work["as is"]:
            if name == "page reads/s":
                for dsn in dsns.values():
                    run.load_read_table(dsn, run.SMALL_TABLE)
            for side in SIDES:  # a warm-up of each
                work[side][name](min(3.0, args.duration))
            rounds: dict[str, list[run.Load]] = {side: [] for side in SIDES}
            for turn in range(args.rounds):
                for side in SIDES[turn % 2 :] + SIDES[: turn % 2]:
                    load = work[side][name](args.duration)
                    rate = load.rate * load.events_per_op
                    say(f"  {name}, {side}: {rate:,.0f}, errors {load.errors}")
                    if load.errors:
                        errors.append(f"{name}, {side}: {load.detail}")
                    rounds[side].append(load)
            medians[name] = {side: run.median_of(rounds[side]) for side in SIDES}
    settings = " ".join(f"{k}={v}" for k, v in added.items())
    print("\n".join(header))
    print(f"\n{'load, 16 connections':<22} {'as is':>22} {'with ' + settings:>40}")
    for name, by_side in medians.items():
        cells = []
        for side in SIDES:
            load = by_side[side]
            rate = load.rate * load.events_per_op
            cells.append(f"{rate:,.0f} (p50 {load.p50_ms:.2f}, p99 {load.p99_ms:.2f} ms)")
        as_is, with_ = (by_side[s].rate for s in SIDES)
        print(f"{name:<22} {cells[0]:>22} {cells[1]:>34} {run.times(run.ratio(with_, as_is))}")
    print("errors: " + ("; ".join(errors) if errors else "none"))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
