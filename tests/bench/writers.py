"""What keeping the writer costs the judge: revision 0024's judge (no writer) against the
head's (`p_reported_by`, written into `updated_by` and the history's `reported_by`), in one
sitting, on the same PostgreSQL.

Run from the repository root, with `DATABASE_URL` naming a PostgreSQL server (its database is
only used to create and drop two of this harness's own):
`.venv-test/bin/python -m tests.bench.writers [--duration 10] [--rounds 5] [--clients 8]`.

Two databases, `steprecord_bench_writers_base` migrated to revision 0024 and
`steprecord_bench_writers_head` migrated to head (dropped at the end). pgbench calls each
database's judge with the arguments the service passes (app/data/judge.py), the head's with
the writer `ci-runner`, the base's without one (it has no such argument):

- single: per transaction, `steprecord_apply_event` twice, the `start` of a new step and the
  `complete` of the step this client started in its previous run (limit_events.sql's load);
- batch: per transaction, one `steprecord_apply_events` of 100 events, 50 `start` of new
  steps and 50 `complete` of the steps this client started in its previous run
  (run.py's `limit_batch_script`).

Rounds alternate base and head (the order turning each round), each on emptied tables after
a CHECKPOINT; the table shows each side's median round (events/s, p50 and p99 of a
transaction) and head ÷ base. Exits non-zero on any failed transaction.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import psycopg
from alembic import command
from psycopg.conninfo import make_conninfo

from app.main import alembic_config
from tests.bench import run

BASE_REVISION = "0024"
SIDES = ("base", "head")
INSTANCES = 5000
WRITER = "ci-runner"


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


@contextmanager
def database_at(server: str, name: str, revision: str) -> Iterator[str]:
    with psycopg.connect(server, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {name}")
    try:
        dsn = make_conninfo(server, dbname=name)
        config = alembic_config()
        config.attributes["database_url"] = dsn
        command.upgrade(config, revision)
        yield dsn
    finally:
        with psycopg.connect(server, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def single_script(path: Path, writer: str | None) -> Path:
    """limit_events.sql's two events, with the instance's id first as the service sends it,
    and with the writer last when `writer` is given."""
    last = "" if writer is None else f", NULL::text, '{writer}'::text"

    def call(key: str, slug: str, kind: str, completed: str, output: str) -> str:
        return (
            f"SELECT * FROM steprecord_apply_event(steprecord_instance_id({key}), 0::int,"
            f" {key}, {slug}, '{kind}'::text, 1::bigint, now()::timestamptz, {completed},"
            f" {output}, NULL::text, NULL::text, NULL::text, NULL::bigint, NULL::int{last});"
        )

    key, prev_key = "('e' || :k)::text", "('e' || :pk)::text"
    slug, prev_slug = (
        "('s' || :client_id || '-' || :r)::text",
        ("('s' || :client_id || '-' || :prev)::text"),
    )
    output = """'{"a":1,"b":"x","n":123}'::text"""
    path.write_text(
        "\\set r random(1, 2000000000)\n\\set k :r % :instances + 1\n"
        "\\set pk :prev % :instances + 1\n"
        + call(key, slug, "start", "NULL::timestamptz", "NULL::text")
        + "\n"
        + call(prev_key, prev_slug, "complete", "now()::timestamptz", output)
        + "\n\\set prev :r\n"
    )
    return path


def batch_script(path: Path, writer: str | None) -> Path:
    """run.py's batch of 100 events, with the writer `writer`, or without the trace id and
    the writer (None: the base has no such argument; the trace id keeps its default)."""
    run.limit_batch_script(path, writer=writer or WRITER)
    if writer is None:
        text = path.read_text()
        marker = f", NULL::text, '{WRITER}'::text);"
        assert text.count(marker) == 1, "run.py's batch script changed: update this harness"
        path.write_text(text.replace(marker, ");"))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--clients", type=int, default=8)
    args = parser.parse_args(argv)
    server = os.environ.get("DATABASE_URL")
    if not server:
        say("set DATABASE_URL to a PostgreSQL server")
        return 2
    loads: dict[tuple[str, str], list[run.Load]] = {}
    errors: list[str] = []
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        dsns = {
            "base": stack.enter_context(
                database_at(server, "steprecord_bench_writers_base", BASE_REVISION)
            ),
            "head": stack.enter_context(
                database_at(server, "steprecord_bench_writers_head", "head")
            ),
        }
        scripts = {
            ("single", "base"): single_script(tmp / "single_base.sql", None),
            ("single", "head"): single_script(tmp / "single_head.sql", WRITER),
            ("batch", "base"): batch_script(tmp / "batch_base.sql", None),
            ("batch", "head"): batch_script(tmp / "batch_head.sql", WRITER),
        }
        events = {"single": 2, "batch": 100}
        for load in ("single", "batch"):
            for n in range(args.rounds):
                order = SIDES[n % 2 :] + SIDES[: n % 2]
                for side in order:
                    run.reset(dsns[side])
                    say(f"{load} round {n + 1}/{args.rounds}: {side}")
                    result = run.pgbench(
                        dsns[side],
                        scripts[(load, side)],
                        args.clients,
                        args.duration,
                        {"instances": INSTANCES, "prev": 0},
                        events[load],
                        "prepared",
                        log_dir=tmp / "log",
                    )
                    if result.errors:
                        errors.append(f"{load} {side}: {result.detail}")
                    loads.setdefault((load, side), []).append(result)
        with psycopg.connect(dsns["head"]) as conn:
            written = conn.execute(
                "SELECT count(*) FILTER (WHERE updated_by = %s), count(*)"
                " FROM workflow_step_record",
                (WRITER,),
            ).fetchone()
        assert written is not None
        if written[0] != written[1] or not written[1]:
            errors.append(f"head: {written[0]} of {written[1]} records name the writer")
        version = subprocess.run(
            ["psql", server, "-XAtc", "SELECT version()"], capture_output=True, text=True
        ).stdout.strip()
    print(f"postgresql: {version}")
    print(
        f"command:    .venv-test/bin/python -m tests.bench.writers --duration {args.duration:g}"
        f" --rounds {args.rounds} --clients {args.clients}"
    )
    print(f"{'load':<34}{f'base ({BASE_REVISION})':>24}{'head (writer)':>24}{'head/base':>11}")
    for load in ("single", "batch"):
        base, head = (run.median_of(loads[(load, side)]) for side in SIDES)
        title = f"{load}, {args.clients} clients, events/s p50/p99 ms"

        def shown(x: run.Load) -> str:
            return f"{x.events_per_s:,.0f} {x.p50_ms:.2f}/{x.p99_ms:.2f}"

        ratio = head.events_per_s / base.events_per_s
        print(f"{title:<34}{shown(base):>24}{shown(head):>24}{ratio:>10.3f}x")
    print(f"rounds: {args.rounds} x {args.duration:g} s per side and load, medians shown")
    print("errors: " + ("; ".join(errors) if errors else "none"))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
