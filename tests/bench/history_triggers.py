"""What revision 0023 (the judge on Citus) costs the judge on one node: the history's row
triggers, which replaced statement triggers with transition tables (Citus cannot run those on
a shard), and the judge's statements as they are now.

Run from the repository root:
`.venv-test/bin/python -m tests.bench.history_triggers [--duration 8] [--rounds 5]`.

On run.py's PostgreSQL (the server in DATABASE_URL, else an embedded one), one database of
its own, migrated to head. Each round installs one variant of the judge's SQL:

- 0022: app/sql/ as revision 0022 froze it (statement triggers, the judge before 0023);
- 0022+row: the same with app/sql/attempt_history.sql of the source (the row triggers);
- 0023: app/sql/ of the source;

then empties the tables, CHECKPOINTs, and runs pgbench at 16 clients:

- single: run.py's single events as the service sends them, one `steprecord_apply_event`
  call a transaction (a `start` of a new step, then the `complete` of the step the client
  started in its previous run);
- batch: run.py's limit batch, 100 events a `steprecord_apply_events` call (50 starts of new
  steps, 50 completes of the previous run's).

The variants alternate, the order turning each round; the table shows each one's median
round in events/s and its ratio to 0022. Exits non-zero on any failed transaction; after each
round it checks that every record that is not pending has its attempt in the history.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import psycopg

from app.sql import frozen_as_of, source
from tests.bench import common, run, writers

HISTORY = "attempt_history.sql"
JUDGE = ("judge_rules.sql", "apply_events.sql", "apply_event.sql", "heartbeat.sql", HISTORY)
BEFORE, AFTER = frozen_as_of(22), source()
KINDS = {
    "0022": "\n".join(BEFORE[name] for name in JUDGE),
    "0022+row": "\n".join(BEFORE[name] for name in JUDGE if name != HISTORY) + AFTER[HISTORY],
    "0023": "\n".join(AFTER[name] for name in JUDGE),
}
INSTANCES = 5000
CLIENTS = 16

# run.py's single events (limit_events.sql), with the instance's id the service passes first.
SINGLE = """\\set r random(1, 2000000000)
\\set k :r % :instances + 1
\\set pk :prev % :instances + 1
SELECT * FROM steprecord_apply_event(steprecord_instance_id('e' || :k), 0::int, ('e' || :k)::text, ('s' || :client_id || '-' || :r)::text, 'start'::text, 1::bigint, now()::timestamptz, NULL::timestamptz, NULL::text, NULL::text, NULL::text, NULL::text, NULL::bigint, NULL::int);
SELECT * FROM steprecord_apply_event(steprecord_instance_id('e' || :pk), 0::int, ('e' || :pk)::text, ('s' || :client_id || '-' || :prev)::text, 'complete'::text, 1::bigint, now()::timestamptz, now()::timestamptz, '{"a":1,"b":"x","n":123}'::text, NULL::text, NULL::text, NULL::text, NULL::bigint, NULL::int);
\\set prev :r
"""  # noqa: E501

UNRECORDED = """
SELECT count(*) FROM workflow_step_record r WHERE r.status <> 'pending' AND NOT EXISTS (
    SELECT 1 FROM workflow_step_attempt a
    WHERE a.instance_id = r.instance_id AND a.record_id = r.id AND a.attempt = r.attempt_count)
"""


def round_of(url: str, kind: str, script: Path, events: int, seconds: float) -> run.Load:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(KINDS[kind])
        conn.execute("TRUNCATE process_instance, workflow_step_record, workflow_step_attempt")
        conn.execute("CHECKPOINT")
    defines = {"instances": INSTANCES, "prev": 0}
    load = run.pgbench(url, script, CLIENTS, seconds, defines, events, "prepared")
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(UNRECORDED).fetchone()
    assert row is not None
    assert row[0] == 0, f"{kind}: {row[0]} records without their attempt"
    return load


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    errors = 0
    with (
        tempfile.TemporaryDirectory() as tmp,
        common.postgres_server(Path(tmp)) as server,
        common.fresh_database(server, "steprecord_bench_history") as url,
    ):
        scripts = {
            "single": (Path(tmp) / "single.sql", 2),
            "batch": (writers.batch_script(Path(tmp) / "batch.sql", None), run.BATCH_SIZE),
        }
        scripts["single"][0].write_text(SINGLE)
        loads: dict[tuple[str, str], list[run.Load]] = {}
        kinds = list(KINDS)
        for number in range(args.rounds):
            order = kinds[number % 2 :] + kinds[: number % 2]
            for load_name, (script, events) in scripts.items():
                for kind in order:
                    load = round_of(url, kind, script, events, args.duration)
                    errors += load.errors
                    if load.errors:
                        print(f"{load_name}/{kind}: {load.detail}")
                    loads.setdefault((load_name, kind), []).append(load)
        print(f"| load | judge | events/s (median of {args.rounds}) | ratio to 0022 |")
        print("|---|---|---|---|")
        for load_name in scripts:
            base = run.median_of(loads[(load_name, "0022")]).events_per_s
            for kind in kinds:
                rate = run.median_of(loads[(load_name, kind)]).events_per_s
                print(f"| {load_name} | {kind} | {rate:,.0f} | {rate / base:.2f} |")
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
