"""What tracing costs single-event writes: the service before tracing, and after it with no
OTLP endpoint and while exporting.

Run from the repository root:
`.venv-test/bin/python -m tests.bench.tracing --base REV [--duration 10] [--rounds 5]`.

`--base` names the commit before tracing: it is checked out with `git worktree add --detach`
into a temporary directory (removed at the end; nothing else of the repository is touched).
On run.py's PostgreSQL (the server in DATABASE_URL, else an embedded one), three services
run `steprecord serve --workers 2` on 127.0.0.1, each on a database of its own that its own
tree migrates:

- base: the `--base` tree (started with PYTHONSAFEPATH and PYTHONPATH on the worktree, so
  that its `app` is imported, not this tree's);
- off: this tree with no OTEL_* endpoint;
- export: this tree exporting to an OTLP/HTTP receiver in this process
  (OTEL_EXPORTER_OTLP_ENDPOINT; the SDK's default batching), which decodes and counts every
  span it gets.

Each answers /readyz with its own head revision before the loads (a check that the base
really runs the old code). After a warm-up of each, run.py's single events (events.lua, 16
connections) go to the three in alternating rounds (the order turning by one each round), each
round on emptied tables after a CHECKPOINT; the table shows each service's median round
(rate, p50, p99) and its ratio to the base. The export service is stopped (its last batch
flushed) before the spans are counted: about two per request (the server span and its
database call) are expected. Exits non-zero on any error: a non-2xx answer or socket error
in a load, a service that is not the tree it should be, or no spans received.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import psycopg

from tests.bench import common, run
from tests.support.databases import create_database, drop_database
from tests.support.tracing import OtlpReceiver, otlp_receiver

CONNECTIONS = 16
VARIANTS = ("base", "off", "export")
# Variables of the OpenTelemetry SDK that would turn tracing on (or change it) in a service.
OTEL = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_SDK_DISABLED")


class BenchError(RuntimeError):
    pass


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


@contextmanager
def environment(**values: str | None) -> Iterator[None]:
    """os.environ with these values (None: unset) while a service starts: run.service gives
    its process this process's environment, plus what it is told to add."""
    saved = {name: os.environ.get(name) for name in values}
    try:
        for name, value in values.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextmanager
def worktree(revision: str, where: Path) -> Iterator[tuple[Path, str]]:
    """`revision` checked out (detached) at `where`, removed on the way out; and its commit."""
    commit = subprocess.run(
        ["git", "-C", str(run.ROOT), "rev-parse", "--verify", f"{revision}^{{commit}}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    subprocess.run(
        ["git", "-C", str(run.ROOT), "worktree", "add", "--detach", str(where), commit],
        capture_output=True,
        check=True,
    )
    try:
        yield where, commit
    finally:
        subprocess.run(
            ["git", "-C", str(run.ROOT), "worktree", "remove", "--force", str(where)],
            capture_output=True,
        )


@contextmanager
def empty_database(server: str, name: str) -> Iterator[str]:
    """A new database the base service migrates itself (its `serve` migrates to its head)."""
    url = create_database(server, name)
    try:
        yield url
    finally:
        drop_database(server, name)


def schema_of(base: str) -> str:
    with run.HTTP.open(f"{base}/readyz", timeout=10) as response:
        schema: str = json.load(response)["schema"]
        return schema


def head_of(tree: Path) -> str:
    """The head revision of a tree's migrations (its files, read by that tree's alembic)."""
    code = "from app.main import schema_head; print(schema_head())"
    env = {**os.environ, "PYTHONSAFEPATH": "1", "PYTHONPATH": str(tree)}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tree, env=env, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise BenchError(f"cannot read the head revision of {tree}:\n{done.stderr[-2000:]}")
    return done.stdout.strip()


def writes(base: str, dsn: str, seconds: float) -> run.Load:
    """run.py's single events at 16 connections, on emptied tables."""
    run.reset(dsn)
    return run.wrk(base, "events.lua", CONNECTIONS, seconds, ["e", run.INSTANCES, CONNECTIONS], 1)


def checked(name: str, load: run.Load) -> run.Load:
    say(
        f"  {name}: {load.rate:,.0f} requests/s, p50/p99 {run.fmt(load.p50_ms, '.2f')}"
        f"/{run.fmt(load.p99_ms, '.2f')} ms, errors {load.errors}"
    )
    if load.errors:
        raise BenchError(f"{name}: {load.errors} errors. {load.detail}".strip())
    return load


def write_spans(receiver: OtlpReceiver) -> int:
    """Spans of the write load: the events' server spans and their database calls."""
    return sum(
        1
        for span in receiver.spans()
        if span.name == "apply_event" or span.name.startswith("POST /v1/instances/")
    )


def report(
    header: list[str],
    commit: str,
    medians: dict[str, run.Load],
    spans: int,
    requests: float,
    args: argparse.Namespace,
) -> str:
    base = medians["base"]

    def row(label: str, cells: list[str]) -> str:
        return f"| {label} | " + " | ".join(cells) + " |"

    def cells(value: Callable[[run.Load], float], spec: str) -> list[str]:
        out = [run.fmt(value(base), spec)]
        for name in VARIANTS[1:]:
            load = medians[name]
            quotient = run.times(run.ratio(value(load), value(base)))
            out.append(f"{run.fmt(value(load), spec)} ({quotient})")
        return out

    lines = [*header, ""]
    lines.append(row("measurement", [f"base {commit[:8]}", "no endpoint", "exporting"]))
    lines.append("|---|---:|---:|---:|")
    lines.append(row(f"single events/s, {CONNECTIONS} conn", cells(lambda x: x.rate, ",.0f")))
    lines.append(row("p50 ms", cells(lambda x: x.p50_ms, ".2f")))
    lines.append(row("p99 ms", cells(lambda x: x.p99_ms, ".2f")))
    lines += [
        "",
        f"{args.rounds} rounds of {args.duration / args.rounds:g} s per service, alternating"
        " base, no endpoint, exporting (the order turning each round); the median round of"
        " each (ratio to the base); events.lua over emptied tables, after a warm-up and a"
        " CHECKPOINT.",
        f"exported: {spans:,} write spans received (about {2 * requests:,.0f} expected: two per"
        " request, the server span and its database call).",
        "errors: none",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    assert __doc__ is not None
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the commit before tracing (a revision)")
    parser.add_argument("--duration", type=float, default=10, help="seconds per service (10)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per service (5)")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.duration < args.rounds:
        parser.error("--rounds must be at least 1 and --duration at least 1 s per round")
    missing = [tool for tool in ("wrk", "pgbench", "git") if shutil.which(tool) is None]
    if missing:  # pgbench only for the machine line's versions
        say(f"missing {', '.join(missing)}; install with: {run.INSTALL}")
        return 2

    def terminate(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)  # unwinds through the finally blocks

    signal.signal(signal.SIGTERM, terminate)
    pid = os.getpid()
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="steprecord-trace-")))
        tree, commit = stack.enter_context(worktree(args.base, tmp / "base"))
        server = stack.enter_context(common.postgres_server(tmp))
        dsns = {
            "base": stack.enter_context(empty_database(server, f"steprecord_bench_tb_{pid}")),
            "off": stack.enter_context(common.fresh_database(server, f"steprecord_bench_to_{pid}")),
            "export": stack.enter_context(
                common.fresh_database(server, f"steprecord_bench_te_{pid}")
            ),
        }
        header = run.machine(dsns["off"])
        say("\n".join(header))
        receiver = stack.enter_context(otlp_receiver())
        unset: dict[str, str | None] = dict.fromkeys(OTEL)
        added = {
            "base": {"PYTHONSAFEPATH": "1", "PYTHONPATH": str(tree)},  # its tree's `app`
            "off": {},
            "export": {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_SERVICE_NAME": "bench"},
        }
        bases: dict[str, str] = {}
        services = ExitStack()
        stack.enter_context(services)  # stopped before the receiver: the last batch flushed
        for name in VARIANTS:
            log = tmp / f"service-{name}.log"
            with environment(**unset):  # no OTEL_* variable of this process reaches them
                bases[name] = services.enter_context(run.service(dsns[name], log, env=added[name]))
        heads = {"base": head_of(tree), "off": head_of(run.ROOT), "export": head_of(run.ROOT)}
        for name in VARIANTS:
            if schema_of(bases[name]) != heads[name]:
                raise BenchError(f"the {name} service is not at {heads[name]}: not its tree")
        if heads["base"] == heads["off"]:
            raise BenchError(f"--base {args.base} has the same head revision as this tree")
        say(f"base {commit[:12]} at {heads['base']}; this tree at {heads['off']}")
        warmup = min(2.0, args.duration / args.rounds / 2)
        for name in VARIANTS:
            checked(f"{name} (warm-up)", writes(bases[name], dsns[name], warmup))
        rounds: dict[str, list[run.Load]] = {name: [] for name in VARIANTS}
        seconds = args.duration / args.rounds
        for number in range(1, args.rounds + 1):
            shift = (number - 1) % len(VARIANTS)  # each its turn first: no place is favoured
            for name in VARIANTS[shift:] + VARIANTS[:shift]:
                rounds[name].append(
                    checked(f"{name}, round {number}", writes(bases[name], dsns[name], seconds))
                )
        medians = {name: run.median_of(loads) for name, loads in rounds.items()}
        requests = sum(load.rate * max(1, round(seconds)) for load in rounds["export"])
        requests += medians["export"].rate * max(1, round(warmup))
        services.close()
        spans = write_spans(receiver)
        if not spans:
            raise BenchError("the exporting service sent no spans")
        print(report(header, commit, medians, spans, requests, args), flush=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except (RuntimeError, psycopg.Error, subprocess.CalledProcessError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
    except Exception as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        sys.exit(1)
