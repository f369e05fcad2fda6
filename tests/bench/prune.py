"""Writes while `steprecord prune` runs: single events with and without a prune alongside.

Run from the repository root:
`.venv-test/bin/python -m tests.bench.prune [--instances 100000] [--steps 10] [--duration 10]`.

On a fresh, migrated database (run.py's: the server in DATABASE_URL, else an embedded
PostgreSQL), it loads N finished instances of S completed records each, created and last
written 3 days ago (the records' history is written by their own triggers), then VACUUM
ANALYZE. With `steprecord serve --workers 2` on it, wrk sends run.py's single events
(events.lua, 16 connections) for --duration seconds, once alone and once while
`steprecord prune --older-than 1d` deletes the old instances; it reports both loads' rate,
p50 and p99 and the prune's wall time and records deleted per second.

The write load's keys are p1 .. p5000 (new instances, as run.py's); the old instances are
numbered on from there, overlapping the last --touch of them (250 by default), so a few writes
land on old instances: those are kept by the prune (their last write is now), and their row
locks meet the prune's. Exits non-zero on any error: a non-2xx answer or socket error in a
load, a prune that fails, or an instance older than the cutoff left that the writes never
touched (or any other count that does not add up).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import psycopg

from app.ops import pruning
from tests.bench import common, run

PREFIX = "p"
CONNECTIONS = 16
GOAL = 2.0  # p99 during the prune at most this many times p99 without
APP_NAME = "steprecord-bench-prune"  # the prune's application_name, to see it start
PRUNE_TIMEOUT = 3600.0

# The old instances: keys p<first> .. p<first + instances - 1>, created 3 days ago (spread
# over an hour, so the prune's (created_at, id) walk meets the touched ones all along), each
# with `steps` completed records, written one second apart. The records are inserted step by
# step across all instances, as load_reads.sql does; their triggers write the history.
LOAD_INSTANCES = """
INSERT INTO process_instance (id, instance_key, next_ordinal, created_at)
SELECT steprecord_instance_id('p' || (%(first)s::bigint + i)), 'p' || (%(first)s::bigint + i),
       %(steps)s::bigint,
       now() - interval '3 days' - make_interval(secs => mod(i * 7919, 3600))
FROM generate_series(0::bigint, %(instances)s::bigint - 1) i
"""
LOAD_RECORDS = """
INSERT INTO workflow_step_record (instance_id, step_slug, ordinal, status, attempt_count,
                                  output, started_at, completed_at, created_at, updated_at)
SELECT p.id, 'step-' || o, o, 'completed', 1, jsonb_build_object('a', 1, 'b', 'x', 'n', o),
       p.created_at + make_interval(secs => 2 * o),
       p.created_at + make_interval(secs => 2 * o + 1),
       p.created_at + make_interval(secs => 2 * o),
       p.created_at + make_interval(secs => 2 * o + 1)
FROM generate_series(0, %(steps)s::int - 1) o
CROSS JOIN process_instance p
ORDER BY o, p.id
"""
LOADED = """
SELECT (SELECT count(*) FROM process_instance) AS instances,
       (SELECT count(*) FROM workflow_step_record) AS records,
       (SELECT count(*) FROM workflow_step_attempt) AS attempts
"""
# After the prune: the instances created before the cutoff that are still there, by why.
# `stale` ones were last written before the cutoff and are finished: the prune should have
# deleted them. `outside` ones have a key the write load never sends.
LEFT_OVER = """
WITH old AS (
    SELECT p.id, substr(p.instance_key, 2)::bigint AS n,
           COALESCE(max(r.updated_at), p.created_at) AS last_write,
           COALESCE(bool_or(r.status IN ('pending', 'running')), false) AS unfinished
    FROM process_instance p LEFT JOIN workflow_step_record r ON r.instance_id = p.id
    WHERE p.created_at < %(cutoff)s
    GROUP BY p.id
)
SELECT count(*) AS kept,
       count(*) FILTER (WHERE last_write < %(cutoff)s AND NOT unfinished) AS stale,
       count(*) FILTER (WHERE n < %(first)s OR n > %(last)s) AS outside
FROM old
"""
SEEN = """
SELECT 1 FROM pg_stat_activity WHERE application_name = %s AND query LIKE '%%process_instance%%'
"""
SUMMARY = re.compile(
    r"deleted (\d+) instances, (\d+) records and (\d+) attempts last written before (\S+)"
)


class BenchError(RuntimeError):
    pass


@dataclass
class Pruned:
    instances: int
    records: int
    attempts: int
    cutoff: datetime
    wall: float  # the process, start to exit
    startup: float  # start until its first query on process_instance was seen
    started: float  # time.monotonic() of its start
    ended: float  # and of its exit


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def checkpoint(dsn: str) -> None:
    with (
        psycopg.connect(dsn, autocommit=True) as conn,
        suppress(psycopg.errors.InsufficientPrivilege),
    ):
        conn.execute("CHECKPOINT")


def load(dsn: str, instances: int, steps: int, first: int) -> None:
    params = {"instances": instances, "steps": steps, "first": first}
    started = time.monotonic()
    with psycopg.connect(dsn, autocommit=True) as conn:
        with conn.transaction():
            conn.execute(LOAD_INSTANCES, params)
            conn.execute(LOAD_RECORDS, params)
        row = conn.execute(LOADED).fetchone()
        assert row is not None
        want = (instances, instances * steps, instances * steps)
        if tuple(row) != want:
            raise BenchError(f"loaded (instances, records, attempts) {tuple(row)}, want {want}")
        elapsed = time.monotonic() - started
        say(f"  loaded {instances:,} instances x {steps} records in {elapsed:.0f} s")
        conn.execute("VACUUM ANALYZE process_instance, workflow_step_record, workflow_step_attempt")
    checkpoint(dsn)


def writes(base: str, seconds: float, instances: int) -> run.Load:
    """run.py's single events (events.lua) at 16 connections over keys p1 .. p<instances>."""
    return run.wrk(base, "events.lua", CONNECTIONS, seconds, [PREFIX, instances, CONNECTIONS], 1)


def checked(name: str, loaded: run.Load) -> run.Load:
    say(
        f"  {name}: {loaded.rate:,.0f} requests/s, p50/p99 {run.fmt(loaded.p50_ms, '.2f')}"
        f"/{run.fmt(loaded.p99_ms, '.2f')} ms, errors {loaded.errors}"
    )
    if loaded.errors:
        raise BenchError(f"{name}: {loaded.errors} errors. {loaded.detail}".strip())
    return loaded


@contextmanager
def prune_process(dsn: str, log: Path, batch_size: int | None) -> Iterator[subprocess.Popen[bytes]]:
    """`steprecord prune --older-than 1d` on the bench database, in a session of its own (so a
    Ctrl-C reaches it only through us); stopped on the way out if it still runs."""
    command = [sys.executable, "-m", "app.cli", "prune", "--older-than", "1d"]
    if batch_size is not None:
        command += ["--batch-size", str(batch_size)]
    env = {**os.environ, "DATABASE_URL": dsn, "PGAPPNAME": APP_NAME}
    with log.open("wb") as out:
        proc = subprocess.Popen(
            command, cwd=run.ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def during_prune(
    dsn: str, base: str, tmp: Path, seconds: float, instances: int, batch_size: int | None
) -> tuple[run.Load, Pruned, tuple[float, float]]:
    """The write load while the prune runs: the prune starts, wrk starts as soon as the prune
    is seen querying process_instance, then the prune is waited for."""
    log = tmp / "prune.log"
    with prune_process(dsn, log, batch_size) as proc:
        started = time.monotonic()
        ended: list[float] = []
        waiter = threading.Thread(
            target=lambda: (proc.wait(), ended.append(time.monotonic())), daemon=True
        )
        waiter.start()
        with psycopg.connect(dsn, autocommit=True) as conn:
            while conn.execute(SEEN, (APP_NAME,)).fetchone() is None:
                if proc.poll() is not None:
                    if proc.returncode != 0:
                        raise BenchError(f"the prune failed ({proc.returncode}):\n{run.tail(log)}")
                    break
                if time.monotonic() - started > 120:
                    raise BenchError(f"the prune did not start within 120 s:\n{run.tail(log)}")
                time.sleep(0.01)
        startup = time.monotonic() - started
        say(f"  prune started ({startup:.1f} s to its first query); the write load follows")
        window_start = time.monotonic()
        loaded = writes(base, seconds, instances)
        window = (window_start, window_start + max(1, round(seconds)))
        if waiter.is_alive():
            say("  the write load ended before the prune; waiting for the prune")
        waiter.join(PRUNE_TIMEOUT)
        if waiter.is_alive():
            raise BenchError(f"the prune did not finish within {PRUNE_TIMEOUT:g} s")
        output = run.tail(log)
        if proc.returncode != 0:
            raise BenchError(f"the prune failed ({proc.returncode}):\n{output}")
    found = SUMMARY.search(output)
    if found is None:
        raise BenchError(f"no summary line in the prune's output:\n{output}")
    pruned = Pruned(
        instances=int(found[1]),
        records=int(found[2]),
        attempts=int(found[3]),
        cutoff=datetime.fromisoformat(found[4]),
        wall=ended[0] - started,
        startup=startup,
        started=started,
        ended=ended[0],
    )
    return checked("writes during the prune", loaded), pruned, window


def check_left(dsn: str, pruned: Pruned, instances: int, steps: int, first: int) -> int:
    """The old instances left after the prune, all written by the load since the cutoff; the
    prune's counts add up. Answers how many were kept."""
    last = first + instances - 1
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            LEFT_OVER, {"cutoff": pruned.cutoff, "first": first, "last": last}
        ).fetchone()
    assert row is not None
    kept, stale, outside = row
    wrong = []
    if stale:
        wrong.append(f"{stale} finished instances last written before the cutoff are left")
    if outside:
        wrong.append(f"{outside} old instances left have a key the writes never send")
    if pruned.instances + kept != instances:
        wrong.append(f"deleted {pruned.instances} + kept {kept} is not the {instances} loaded")
    if pruned.records != pruned.instances * steps or pruned.attempts != pruned.records:
        wrong.append(
            f"deleted {pruned.records} records and {pruned.attempts} attempts of"
            f" {pruned.instances} instances, want {steps} of each per instance"
        )
    if wrong:
        raise BenchError("after the prune: " + "; ".join(wrong))
    return int(kept)


def report(
    header: list[str],
    alone: run.Load,
    during: run.Load,
    pruned: Pruned,
    window: tuple[float, float],
    kept: int,
    args: argparse.Namespace,
    touch: int,
) -> str:
    def row(label: str, without: str, with_prune: str, quotient: str = "", goal: str = "") -> str:
        return f"| {label} | {without} | {with_prune} | {quotient} | {goal} |"

    p99_ratio = run.ratio(during.p99_ms, alone.p99_ms)
    working = pruned.wall - pruned.startup
    lines = [*header, ""]
    lines.append(row("measurement", "no prune", "during prune", "during/no", "goal"))
    lines.append("|---|---:|---:|---:|---|")
    lines.append(
        row(
            f"single events/s, {CONNECTIONS} conn",
            run.fmt(alone.rate),
            run.fmt(during.rate),
            run.times(run.ratio(during.rate, alone.rate)),
        )
    )
    lines.append(
        row(
            "p50 ms",
            run.fmt(alone.p50_ms, ".2f"),
            run.fmt(during.p50_ms, ".2f"),
            run.times(run.ratio(during.p50_ms, alone.p50_ms)),
        )
    )
    lines.append(
        row(
            "p99 ms",
            run.fmt(alone.p99_ms, ".2f"),
            run.fmt(during.p99_ms, ".2f"),
            run.times(p99_ratio),
            f"<= {GOAL:g}x {run.verdict(p99_ratio, GOAL, False)}",
        )
    )
    lines.append(row("prune wall s", "", f"{pruned.wall:.1f}"))
    rate = run.ratio(pruned.records, pruned.wall)
    lines.append(row("prune records deleted/s", "", run.fmt(rate)))
    lines.append("")
    wrk_start, wrk_end = window
    overlap = max(0.0, min(wrk_end, pruned.ended) - max(wrk_start, pruned.started))
    share = overlap / (wrk_end - wrk_start)
    if pruned.ended < wrk_end:
        timing = (
            f"the prune FINISHED BEFORE the write load: it ran during {share:.0%} of the"
            f" {wrk_end - wrk_start:g} s load (a larger --instances or a shorter --duration"
            " makes it cover all of it)"
        )
    else:
        timing = (
            f"the prune ran through the whole {wrk_end - wrk_start:g} s write load and"
            f" {pruned.ended - wrk_end:.1f} s beyond it"
        )
    batch = f" --batch-size {args.batch_size}" if args.batch_size else ""
    batch_note = "" if batch else f" (its default batch size, {pruning.BATCH})"
    lines += [
        f"{args.instances:,} finished instances x {args.steps} completed records (each with its"
        " attempt in the history), created and last written 3 days ago, VACUUM ANALYZE;"
        f" writes: events.lua, {CONNECTIONS} connections, {args.duration:g} s each, keys"
        f" {PREFIX}1..{PREFIX}{run.INSTANCES} of which the last {touch} are old instances,"
        " after a warm-up and a CHECKPOINT before each load.",
        f"prune: `steprecord prune --older-than 1d{batch}`{batch_note} deleted"
        f" {pruned.instances:,} instances, {pruned.records:,} records and"
        f" {pruned.attempts:,} attempts in {pruned.wall:.1f} s wall ({pruned.startup:.1f} s of it"
        f" start-up before its first query: {run.fmt(run.ratio(pruned.records, working))}"
        " records/s without it); " + timing + ".",
        f"kept: {kept} instances older than the cutoff, every one written by the write load"
        " since; none left that should have gone.",
        "errors: none",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    assert __doc__ is not None
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--instances", type=int, default=10**5, help="old instances (10^5)")
    parser.add_argument("--steps", type=int, default=10, help="records per instance (10)")
    parser.add_argument("--duration", type=float, default=10, help="seconds per write load (10)")
    parser.add_argument(
        "--touch",
        type=int,
        default=250,
        help=f"old instances among the write load's {run.INSTANCES} keys (250; 0: none)",
    )
    parser.add_argument("--batch-size", type=int, help="the prune's --batch-size (its default)")
    args = parser.parse_args(argv)
    if args.instances < 1 or args.steps < 1 or args.duration < 1:
        parser.error("--instances and --steps must be at least 1, --duration at least 1 s")
    touch = min(args.touch, args.instances)
    if not 0 <= touch <= run.INSTANCES:
        parser.error(f"--touch must be from 0 to {run.INSTANCES}")
    first = run.INSTANCES - touch + 1  # the first old instance's key number
    missing = [tool for tool in ("wrk", "pgbench") if shutil.which(tool) is None]
    if missing:  # pgbench only for the machine line's versions
        say(f"missing {', '.join(missing)}; install with: {run.INSTALL}")
        return 2

    def terminate(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)  # unwinds through the finally blocks

    signal.signal(signal.SIGTERM, terminate)
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="steprecord-prune-")))
        server = stack.enter_context(common.postgres_server(tmp))
        dsn = stack.enter_context(
            common.fresh_database(server, f"steprecord_bench_prune_{os.getpid()}")
        )
        header = run.machine(dsn)
        say("\n".join(header))
        load(dsn, args.instances, args.steps, first)
        base = stack.enter_context(run.service(dsn, tmp / "service.log"))
        warmup = min(2.0, args.duration / 3)
        checked("warm-up", writes(base, warmup, run.INSTANCES))
        checkpoint(dsn)
        alone = checked("writes, no prune", writes(base, args.duration, run.INSTANCES))
        checkpoint(dsn)
        during, pruned, window = during_prune(
            dsn, base, tmp, args.duration, run.INSTANCES, args.batch_size
        )
        kept = check_left(dsn, pruned, args.instances, args.steps, first)
        print(report(header, alone, during, pruned, window, kept, args, touch), flush=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except (RuntimeError, psycopg.Error) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
    except Exception as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        sys.exit(1)
