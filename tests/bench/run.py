"""The steprecord benchmark: the service side by side with pgbench on one fresh PostgreSQL.

Run from the repository root: `.venv/bin/python -m tests.bench.run [--duration S] [--quick]`.
Each load runs three ways: the service; its limit, pgbench calling the same database
functions with the same arguments; and the least SQL, pgbench writing or reading the same
rows with plain statements. README.md says what each load is and how to read the table.
Exits non-zero when any load had an error (a non-2xx response, a refused batch event, a
socket error, a failed pgbench transaction) or could not run; a missed goal is reported, not
an error.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent.parent
if str(ROOT) not in sys.path:  # also runnable as `python tests/bench/run.py`
    sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402

from app.access.tokens import ANONYMOUS, new_token  # noqa: E402
from app.data import judge  # noqa: E402
from app.data.reads import LIST_PAGE, PAGE_READ_BYTES  # noqa: E402
from tests.bench import queries  # noqa: E402
from tests.bench.common import fresh_database, postgres_server  # noqa: E402

DB_NAME = "steprecord_bench"
WORKERS = 2
INSTANCES = 5000  # the write loads spread their steps over this many instances
BATCH_SIZE = 100
STEPS_PER_INSTANCE = 500  # on average, in the read tables (load_reads.sql)
READ_LIMIT = 100
SMALL_TABLE = 10**4
SMOKE_LARGE = 12_000  # the large read table of `--smoke`: the least that is larger
CPUS = len(os.sched_getaffinity(0))
INSTALL = "apt-get update && apt-get install -y wrk postgresql-client  # pgbench"
TOKEN_NAME = "bench"  # the write token of `--token`: the writer of every request
# The goals, at `--connections` (16) on this machine kind. The throughput goals are the
# service's share of its limit: pgbench calling the same database functions with the same
# arguments (the judge for single events and batches, the page function for reads), which is
# what this design costs PostgreSQL; what the service adds on top is what it controls. The
# least SQL (pgbench writing the same rows, or reading the same page, with plain statements)
# is shown beside it for context, without a goal.
TARGETS = {
    "single": 0.80,
    "batch": 0.85,
    "reads": 0.45,
    "read_growth": 1.2,
    "tail": 3.0,
    "contention": 1000.0,
}
# The three sides of a throughput or latency row, in the order the report shows them.
SIDES = ("service", "limit", "least SQL")
# The contention load: every step of CONTENDED_INSTANCES x CONTENDED_STEPS gets the four events
# of two attempts (start 1, fail 1, start 2, complete 2), each sent COPIES times, all shuffled.
CONTENDED_INSTANCES = 20
CONTENDED_STEPS = 20
COPIES = 3
SMOKE_CONTENDED = 5  # `--smoke`: 5 instances x 5 steps
# What a reordered event may answer: applied, created, a replay, or a stale attempt (an
# attempt-1 event arriving after attempt 2 began). Anything else is an error.
CONTENTION_ANSWERS = {200, 201, 409}
# Never through a proxy: all traffic stays on 127.0.0.1.
HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@dataclass(frozen=True)
class Load:
    """One measured load: its rate, its latency and how many of its operations failed."""

    rate: float  # requests (wrk) or script runs (pgbench) per second
    events_per_op: int
    p50_ms: float
    p99_ms: float
    errors: int
    detail: str = ""

    @property
    def events_per_s(self) -> float:
        return self.rate * self.events_per_op


def median_of(loads: Sequence[Load]) -> Load:
    """Rounds of one load as one: median rate and percentiles, all errors."""
    first = loads[0]

    def median(values: list[float]) -> float:
        return percentile(values, 50)

    return Load(
        rate=median([load.rate for load in loads]),
        events_per_op=first.events_per_op,
        p50_ms=median([load.p50_ms for load in loads]),
        p99_ms=median([load.p99_ms for load in loads]),
        errors=sum(load.errors for load in loads),
        detail=next((load.detail for load in loads if load.detail), ""),
    )


# --- the database and the service ------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def http_status(method: str, url: str, body: bytes | None = None) -> int:
    headers = {"Content-Type": "application/json"}
    if token := os.environ.get("STEPRECORD_BENCH_TOKEN"):
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url, body, headers, method=method)
    try:
        with HTTP.open(request, timeout=10) as response:
            status: int = response.status
            return status
    except urllib.error.HTTPError as exc:
        return exc.code


_service_pids: dict[str, int] = {}


def service_pid(base: str) -> int:
    """The process id of the running service at `base` (its workers are its children)."""
    return _service_pids[base]


def worker_pids(root: int) -> list[int]:
    """The processes that serve requests for the server `root`: its children that
    multiprocessing spawned (uvicorn's workers; not its resource tracker), or `root` itself
    when it serves alone (one worker)."""
    children = []
    for task in Path(f"/proc/{root}/task").iterdir():
        children += (task / "children").read_text().split()
    workers = []
    for pid in map(int, children):
        with suppress(OSError):
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                workers.append(pid)
    return sorted(workers) or [root]


def rss_kb(pid: int) -> int:
    """A process's resident memory now (VmRSS of /proc/PID/status), in kB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise OSError(f"no VmRSS for process {pid}")


@contextmanager
def service(
    dsn: str,
    log: Path,
    asgi_app: str | None = None,
    *,
    workers: int = WORKERS,
    env: dict[str, str] | None = None,
) -> Iterator[str]:
    """`steprecord serve --workers 2` (or `workers`) on the bench database, or uvicorn serving
    `asgi_app` (`module:name`) as many workers, with `env` added to the environment; yields
    its base URL."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    if asgi_app is None:
        command = [sys.executable, "-m", "app.cli", "serve", "--host", "127.0.0.1"]
    else:
        command = [sys.executable, "-m", "uvicorn", asgi_app, "--no-access-log", "--host"]
        command += ["127.0.0.1"]
    command += ["--port", str(port), "--workers", str(workers)]
    environment = {**os.environ, **(env or {}), "DATABASE_URL": dsn}
    with log.open("wb") as out:
        proc = subprocess.Popen(
            command,
            cwd=ROOT,
            env=environment,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the service exited ({proc.returncode}):\n{tail(log)}")
            with suppress(OSError):
                if http_status("GET", f"{base}/readyz") == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the service was not ready within 60 s:\n{tail(log)}")
            time.sleep(0.2)
        _service_pids[base] = proc.pid
        yield base
    finally:
        _service_pids.pop(base, None)
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # its own session: the workers too
                proc.wait()


@contextmanager
def with_token(enabled: bool, *dsns: str) -> Iterator[None]:
    """A write token in each database, before the services start, exported to the wrk scripts."""
    if not enabled:
        yield
        return
    token, digest = new_token()
    for dsn in dsns:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(
                "INSERT INTO api_token (name, scope, token_sha256) VALUES (%s, 'write', %s)",
                (TOKEN_NAME, digest),
            )
    os.environ["STEPRECORD_BENCH_TOKEN"] = token
    try:
        yield
    finally:
        del os.environ["STEPRECORD_BENCH_TOKEN"]


def tail(path: Path, size: int = 3000) -> str:
    return path.read_text(errors="replace")[-size:] if path.exists() else ""


BUSY_SESSIONS = """
SELECT count(*) FROM pg_stat_activity
WHERE datname = current_database() AND pid <> pg_backend_pid()
  AND backend_type = 'client backend' AND state <> 'idle'
"""


def quiesce(conn: psycopg.Connection[tuple[object, ...]], seconds: float = 30) -> None:
    """Wait until no other session of the database is working: the requests a load left in
    flight when its load generator stopped (wrk does not wait for them) would otherwise write
    into the next load's tables."""
    deadline, quiet = time.monotonic() + seconds, 0
    while quiet < 3 and time.monotonic() < deadline:
        row = conn.execute(BUSY_SESSIONS).fetchone()
        quiet = quiet + 1 if row is not None and row[0] == 0 else 0
        time.sleep(0.05)


def reset(dsn: str) -> None:
    """Empty tables and a checkpoint, so that every load starts from the same state (once the
    previous load's last requests are done)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        quiesce(conn)
        conn.execute(
            "TRUNCATE process_instance, workflow_step_record, workflow_step_attempt,"
            " workflow_step_repair RESTART IDENTITY"
        )
        with suppress(psycopg.errors.InsufficientPrivilege):
            conn.execute("CHECKPOINT")


def load_read_table(dsn: str, records: int) -> None:
    """`records` step records over records/500 instances (load_reads.sql), then VACUUM ANALYZE."""
    reset(dsn)
    statements = re.split(r";\s*$", (BENCH / "load_reads.sql").read_text(), flags=re.M)
    with psycopg.connect(dsn, autocommit=True) as conn:
        with conn.transaction():
            for statement in filter(str.strip, statements):
                conn.execute(statement.strip(), {"instances": records // STEPS_PER_INSTANCE})
        conn.execute("VACUUM ANALYZE process_instance, workflow_step_record")
        with suppress(psycopg.errors.InsufficientPrivilege):
            conn.execute("CHECKPOINT")


def read_script(order: str, path: Path) -> Path:
    """The least SQL of a page read (tests/bench/queries.py) as a pgbench script: first page."""
    query = queries.LIST_BY_ORDINAL if order == "ordinal" else queries.LIST_BY_STARTED_AT
    literals = {
        "instance_key": "('r' || :k)",
        "statuses": "NULL",
        "limit": str(READ_LIMIT + 1),  # the service asks for one more to know if a page follows
        "after_ordinal": "-1",
        "after_started_at": "'-infinity'",
        "after_id": "0",
    }
    sql = " ".join((query % literals).split())
    path.write_text(f"\\set k random(1, :instances)\n{sql};\n")
    return path


def pgbench_statement(statement: str, arguments: Sequence[str]) -> str:
    """One of the service's statements (app/data/) as a pgbench command: its text as the
    service sends it, each parameter `$n` replaced by the nth pgbench expression (its cast, the
    service's, kept; an expression with a space in parentheses, so that the cast takes it all)."""
    numbers = {int(n) for n in re.findall(r"\$(\d+)", statement)}
    if numbers != set(range(1, len(arguments) + 1)):
        raise ValueError(f"{len(arguments)} arguments for a statement of {len(numbers)}")
    terms = [f"({a})" if " " in a else a for a in arguments]
    return re.sub(r"\$(\d+)", lambda n: terms[int(n[1]) - 1], statement) + ";"


def writer() -> str:
    """The writer the service names for this run's requests: the token's, or anonymous."""
    return TOKEN_NAME if os.environ.get("STEPRECORD_BENCH_TOKEN") else ANONYMOUS


def judge_call(
    statement: str, index: str, fields: dict[str, str], missing: str, writer: str = ANONYMOUS
) -> str:
    """A judge's statement of app/data/judge.py (APPLY_EVENT, APPLY_EVENTS) as a pgbench
    command, with the arguments the service passes: the index (or indexes), then each field of
    `judge.PARAMS` (its expression in `fields`, `missing` for the others), then the request's
    trace id (none: no `traceparent`), its writer, and the events' labels (none)."""
    unknown = set(fields) - set(judge.PARAMS)
    if unknown:
        raise ValueError(f"not fields of an event: {sorted(unknown)}")
    values = [fields.get(name, missing) for name in judge.PARAMS]
    return pgbench_statement(statement, [index, *values, "NULL", f"'{writer}'", "NULL"])


def limit_events_script(path: Path, writer: str = ANONYMOUS) -> Path:
    """The limit of single events as a pgbench script: the two events of events.sql (the
    `start` of a new step, :r, and the `complete` of the step this client started in its
    previous run, :prev) passed to the service's one-event judge, `judge.APPLY_EVENT`, with the
    arguments the service passes for the same requests of events.lua. Each call is its own
    transaction, as each request is."""
    output = """'{"a":1,"b":"x","n":123}'"""

    def event(key: str, run: str, kind: str, completed: dict[str, str]) -> str:
        fields = {
            "instance_key": f"'e' || {key}",
            "step_slug": f"'s' || :client_id || '-' || {run}",
            "kind": f"'{kind}'",
            "attempt": "1",
            "started_at": "now()",
            **completed,
        }
        return judge_call(judge.APPLY_EVENT, "0", fields, "NULL", writer)

    start = event(":k", ":r", "start", {})
    complete = event(":pk", ":prev", "complete", {"completed_at": "now()", "output": output})
    path.write_text(
        "-- Written by tests/bench/run.py (limit_events_script): the events of events.sql as\n"
        "-- the service passes them to its judge.\n"
        "\\set r random(1, 2000000000)\n\\set k :r % :instances + 1\n"
        f"\\set pk :prev % :instances + 1\n{start}\n{complete}\n\\set prev :r\n"
    )
    return path


def limit_read_script(order: str, path: Path) -> Path:
    """The limit of a page read as a pgbench script: the page function's statement called with
    the arguments the service passes for the first page (app/data/reads.py, `list_steps`)."""
    arguments = ["'r' || :k", f"'{order}'", "-1", "'-infinity'", "0", "NULL", str(READ_LIMIT + 1)]
    arguments.append(str(PAGE_READ_BYTES))
    call = pgbench_statement(LIST_PAGE, arguments)
    path.write_text(f"\\set k random(1, :instances)\n{call}\n")
    return path


def limit_batch_script(path: Path, size: int = BATCH_SIZE, writer: str = ANONYMOUS) -> Path:
    """The limit of a batch as a pgbench script: the events of one batch.lua request (the
    `start` of `size / 2` new steps, the `complete` of the steps this client started in its
    previous run) passed to the service's batch judge, `judge.APPLY_EVENTS`, as the service
    passes them (the indexes, then one array per field of `judge.PARAMS`, each element the
    event's value, then the trace id and the writer). Instances and slugs are those of
    batch.sql, so the limit and the least SQL write the same rows."""
    half = size // 2
    # Event n (1-based): a start of this run's step g = n (n <= half), or a complete of the
    # previous run's step g = n - half. Built from a series, so that the statement has a few
    # parameters (pgbench's extended and prepared protocols take at most 256), not hundreds.
    run = f"CASE WHEN n <= {half} THEN :r::bigint ELSE :prev::bigint END"
    step = f"((n - 1) % {half} + 1)"

    def series(element: str) -> str:
        return f"ARRAY(SELECT {element} FROM generate_series(1, {size}) n ORDER BY n)"

    def array(*items: str) -> str:
        return f"ARRAY[{', '.join(items)}]"

    output = """'{"a":1,"b":"x","n":123}'"""
    fields = {
        "instance_key": series(f"'b' || (({run} + {step} * 7919) % :instances::bigint + 1)"),
        "step_slug": series(f"'s' || :client_id::int || '-' || {run} || '-' || {step}"),
        "kind": array(*["'start'"] * half, *["'complete'"] * half),
        "attempt": array(*["1"] * size),
        "started_at": array(*["now()"] * size),
        "completed_at": array(*["NULL"] * half, *["now()"] * half),
        "output": array(*["NULL"] * half, *[output] * half),
    }
    # The service's statement casts each array to its field's type.
    nulls = f"array_fill(NULL::text, ARRAY[{size}])"
    indexes = array(*map(str, range(size)))
    call = judge_call(judge.APPLY_EVENTS, indexes, fields, nulls, writer)
    path.write_text(
        "-- Written by tests/bench/run.py (limit_batch_script): one batch.lua request as the\n"
        "-- service passes it to its judge.\n"
        f"\\set r random(1, 2000000000)\n{call}\n\\set prev :r\n"
    )
    return path


# --- the load generators -----------------------------------------------------------------


def percentile(values: Sequence[float], p: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(p / 100 * len(ordered)) - 1))]


def wrk(
    base: str, script: str, connections: int, seconds: float, args: Sequence[object], events: int
) -> Load:
    """A wrk run with one of our Lua scripts; every non-2xx and socket error is an error."""
    command = ["wrk", "-t", str(min(connections, CPUS)), "-c", str(connections)]
    command += ["-d", f"{max(1, round(seconds))}s", "--timeout", "10s"]
    command += ["-s", str(BENCH / script), base]
    command += ["--", *map(str, args)]
    env = {**os.environ, "LUA_PATH": f"{BENCH}/?.lua;;"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=seconds + 60)
    found = re.search(r"^BENCH (\{.*\})$", done.stdout, re.M)
    if done.returncode != 0 or found is None:
        return Load(0.0, events, math.nan, math.nan, 1, (done.stderr or done.stdout)[-2000:])
    stats = json.loads(found[1])
    sample = re.search(r"^SAMPLE (.*)$", done.stdout, re.M)
    errors = stats["socket_errors"] + stats["bad_http"] + stats["bad_events"]
    if stats["requests"] == 0:
        errors += 1
    detail = sample[1] if sample else ""
    if stats["socket_errors"]:
        detail = f"{stats['socket_errors']} socket errors/timeouts. {detail}"
    return Load(
        rate=stats["requests"] / (stats["duration_us"] / 1e6),
        events_per_op=events,
        p50_ms=stats["p50_us"] / 1000,
        p99_ms=stats["p99_us"] / 1000,
        errors=errors,
        detail=detail,
    )


def pgbench(
    dsn: str,
    script: Path,
    clients: int,
    seconds: float,
    defines: dict[str, object],
    events: int,
    protocol: str,
    log_dir: Path | None = None,
) -> Load:
    """A pgbench run; with `log_dir`, p50/p99 come from its per-transaction log."""
    command = ["pgbench", "--no-vacuum", "-c", str(clients), "-j", str(min(clients, CPUS))]
    command += ["-T", str(max(1, round(seconds))), "-M", protocol, "-f", str(script)]
    for name, value in defines.items():
        command += ["-D", f"{name}={value}"]
    if log_dir is not None:
        shutil.rmtree(log_dir, ignore_errors=True)
        log_dir.mkdir(parents=True)
        command += ["-l", f"--log-prefix={log_dir}/tx"]
    command.append(dsn)
    done = subprocess.run(command, capture_output=True, text=True, timeout=seconds + 60)
    tps = re.search(r"^tps = ([\d.]+) \(without initial connection time\)", done.stdout, re.M)
    failed = re.search(r"^number of failed transactions: (\d+)", done.stdout, re.M)
    processed = re.search(r"^number of transactions actually processed: (\d+)", done.stdout, re.M)
    if done.returncode != 0 or tps is None or processed is None or processed[1] == "0":
        return Load(0.0, events, math.nan, math.nan, 1, (done.stderr or done.stdout)[-2000:])
    latencies: list[float] = []
    if log_dir is not None:
        for log in log_dir.glob("tx*"):
            for line in log.read_text().splitlines():
                latencies.append(int(line.split()[2]) / 1000)
    errors = int(failed[1]) if failed else 0
    return Load(
        rate=float(tps[1]),
        events_per_op=events,
        p50_ms=percentile(latencies, 50),
        p99_ms=percentile(latencies, 99),
        errors=errors,
        detail=done.stderr[-2000:] if errors else "",
    )


# --- the contention load ---------------------------------------------------------------------


def contended_events(
    instances: int = CONTENDED_INSTANCES, steps: int = CONTENDED_STEPS, seed: int = 7
) -> list[tuple[str, bytes]]:
    """(path, body) of every event of the contention load, duplicated and shuffled."""
    events: list[tuple[str, bytes]] = []
    for n in range(1, instances + 1):
        for m in range(1, steps + 1):
            path = f"/v1/instances/c{n}/steps/s{m}"
            bodies = [
                ("start", {"attempt": 1, "started_at": "2026-12-03T10:00:01Z"}),
                (
                    "fail",
                    {
                        "attempt": 1,
                        "started_at": "2026-12-03T10:00:01Z",
                        "completed_at": "2026-12-03T10:00:02Z",
                        "error_code": "Boom",
                        "error_message": "attempt 1 broke",
                    },
                ),
                ("start", {"attempt": 2, "started_at": "2026-12-03T10:00:03Z"}),
                (
                    "complete",
                    {
                        "attempt": 2,
                        "started_at": "2026-12-03T10:00:03Z",
                        "completed_at": "2026-12-03T10:00:04.5Z",
                        "output": {"n": n, "m": m},
                    },
                ),
            ]
            for kind, body in bodies:
                events += [(f"{path}/{kind}", json.dumps(body).encode())] * COPIES
    random.Random(seed).shuffle(events)
    return events


async def _send_all(base: str, events: list[tuple[str, bytes]], connections: int) -> list[int]:
    """POST every event once over `connections` keep-alive connections; the statuses."""
    host, port = base.removeprefix("http://").split(":")
    token = os.environ.get("STEPRECORD_BENCH_TOKEN")
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    queue = list(enumerate(events))
    queue.reverse()
    statuses = [0] * len(events)

    async def worker() -> None:
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            while queue:
                index, (path, body) = queue.pop()
                head = (
                    f"POST {path} HTTP/1.1\r\nHost: {host}\r\n{auth}"
                    f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
                )
                writer.write(head.encode() + body)
                answer = await reader.readuntil(b"\r\n\r\n")
                lines = answer.decode("latin-1").split("\r\n")
                length = next(
                    int(line.split(":", 1)[1])
                    for line in lines
                    if line.lower().startswith("content-length:")
                )
                await reader.readexactly(length)
                statuses[index] = int(lines[0].split()[1])
        finally:
            writer.close()

    await asyncio.gather(*(worker() for _ in range(connections)))
    return statuses


CONTENTION_STATE = """
-- Ordinals are unique per instance, so 0 .. count - 1 means no gap.
SELECT count(*) AS records,
       count(*) FILTER (WHERE r.status = 'completed' AND r.attempt_count = 2
                          AND r.started_at = '2026-12-03T10:00:03Z'
                          AND r.completed_at = '2026-12-03T10:00:04.5Z'
                          AND r.output = jsonb_build_object(
                                  'n', substr(p.instance_key, 2)::int,
                                  'm', substr(r.step_slug, 2)::int)
                          AND r.error_code IS NULL AND r.lease_expires_at IS NULL) AS right,
       (SELECT count(*) FROM (
            SELECT instance_id FROM workflow_step_record GROUP BY instance_id
            HAVING min(ordinal) = 0 AND max(ordinal) = count(*) - 1) o) AS gapless,
       (SELECT count(*) FROM workflow_step_attempt a
        WHERE a.attempt = 2 AND a.status = 'completed') AS attempts_2,
       (SELECT count(*) FROM workflow_step_attempt a
        WHERE a.attempt = 1 AND a.status NOT IN ('failed', 'superseded')) AS attempts_1_wrong
FROM workflow_step_record r JOIN process_instance p ON p.id = r.instance_id
"""


def contention_wrong(
    dsn: str, instances: int = CONTENDED_INSTANCES, steps: int = CONTENDED_STEPS
) -> list[str]:
    """What is not exactly right after the contention load (nothing, when all is)."""
    steps_total = instances * steps
    with psycopg.connect(dsn) as conn:
        row = conn.execute(CONTENTION_STATE).fetchone()
    assert row is not None
    records, right, gapless, attempts_2, attempts_1_wrong = row
    wrong = []
    if records != steps_total or right != steps_total:
        wrong.append(f"{right} of {records} records as expected (want {steps_total})")
    if gapless != instances:
        wrong.append(f"{gapless} of {instances} instances have ordinals 0..n-1")
    if attempts_2 != steps_total or attempts_1_wrong:
        wrong.append(f"history: {attempts_2} completed attempts 2, {attempts_1_wrong} bad 1s")
    return wrong


# --- the run ---------------------------------------------------------------------------------

Sides = dict[str, Load]  # a load's median round on each side (SIDES), by side


@dataclass
class Bench:
    dsn: str  # the writes and the small read table
    base: str  # the service on it
    large_dsn: str  # the large read table, in a database of its own
    large_base: str  # a second service, on that one
    tmp: Path
    seconds: float
    warmup: float
    connections: int
    tail_connections: int
    read_connections: int
    protocol: str
    smoke: bool = False  # one round of each load, no warm-up: that each runs, not how fast

    def __post_init__(self) -> None:
        self.errors: list[str] = []
        # The workers' resident memory (MB), idle and after each load: (when, service, MB each).
        self.memory: list[tuple[str, str, list[float]]] = []

    @property
    def rounds(self) -> int:
        return 1 if self.smoke else max(2, min(5, round(self.seconds / 2)))

    def check(self, name: str, load: Load) -> Load:
        if load.errors:
            self.errors.append(f"{name}: {load.errors} errors. {load.detail}".strip())
        print(
            f"  {name}: {load.events_per_s:,.0f} events/s, p50/p99"
            f" {fmt(load.p50_ms, '.2f')}/{fmt(load.p99_ms, '.2f')} ms, errors {load.errors}",
            file=sys.stderr,
            flush=True,
        )
        return load

    def alternate(self, name: str, loads: dict[str, Callable[[float], Load]]) -> Sides:
        """Each load in rounds of `seconds / rounds`, one after the other, the order turning
        by one each round, so that other work on the machine skews all alike; the median
        round of each."""
        rounds = self.rounds
        seconds = self.seconds / rounds
        sides = list(loads)
        runs: dict[str, list[Load]] = {side: [] for side in sides}
        for turn in range(rounds):
            shift = turn % len(sides)
            for side in sides[shift:] + sides[:shift]:
                runs[side].append(loads[side](seconds))
        return {
            side: self.check(f"{name}, {rounds} rounds, {side}", median_of(runs[side]))
            for side in sides
        }

    def service_writes(self, script: str, conns: int, events: int, seconds: float) -> Load:
        """One load on empty tables."""
        # Arguments of events.lua and batch.lua: key prefix, instances, lag, batch size.
        args = [script[0], INSTANCES, conns, events]  # keys e1.. or b1.., as in the .sql
        reset(self.dsn)
        return wrk(self.base, script, conns, seconds, args, events)

    def pgbench_writes(
        self, script: str | Path, events: int, seconds: float, **defines: object
    ) -> Load:
        """One pgbench load on empty tables; `script` is a file beside this one, or a path."""
        reset(self.dsn)
        defines = {"instances": INSTANCES, "prev": 0, **defines}
        return pgbench(
            self.dsn, BENCH / script, self.connections, seconds, defines, events, self.protocol
        )

    def warm_up(self, name: str, script: str, conns: int, events: int = 1) -> None:
        if self.warmup:
            self.check(f"{name} (warm-up)", self.service_writes(script, conns, events, self.warmup))

    def single(self) -> tuple[Sides, Load]:
        """Single events: the service, its limit (`limit_events_script`) and the least SQL
        (events.sql); and the load whose p99 / p50 is the tail, at `tail_connections`."""
        conns = self.connections
        limit = limit_events_script(self.tmp / "limit_events.sql", writer())
        self.warm_up("single, service", "events.lua", conns)
        sides = self.alternate(
            "single",
            {
                "service": lambda seconds: self.service_writes("events.lua", conns, 1, seconds),
                "limit": lambda seconds: self.pgbench_writes(limit, 2, seconds),
                "least SQL": lambda seconds: self.pgbench_writes("events.sql", 2, seconds),
            },
        )
        tail = self.tail_connections
        if tail == conns:
            return sides, sides["service"]
        self.warm_up(f"single at {tail} connections, service", "events.lua", tail)
        tail_load = self.alternate(
            f"single at {tail} connections",
            {"service": lambda seconds: self.service_writes("events.lua", tail, 1, seconds)},
        )
        return sides, tail_load["service"]

    def batch_endpoint(self) -> int:
        one = b'{"events":[{"instance_key":"probe","step_slug":"probe","kind":"declare"}]}'
        return http_status("POST", f"{self.base}/v1/events", one)

    def batch(self) -> Sides | None:
        status = self.batch_endpoint()
        if status != 200:
            self.errors.append(f"batch: skipped, POST /v1/events answered {status}")
            print(f"  batch: skipped, POST /v1/events answered {status}", file=sys.stderr)
            return None
        conns, size = self.connections, BATCH_SIZE
        limit = limit_batch_script(self.tmp / "limit_batch.sql", size, writer())
        self.warm_up("batch, service", "batch.lua", conns, size)
        return self.alternate(
            "batch",
            {
                "service": lambda seconds: self.service_writes("batch.lua", conns, size, seconds),
                "limit": lambda seconds: self.pgbench_writes(limit, size, seconds),
                "least SQL": lambda seconds: self.pgbench_writes(
                    "batch.sql", size, seconds, size=size
                ),
            },
        )

    def contention(self) -> Load:
        """The contention load, sent once (events/s = all events / the time until the last
        answer), then checked exactly right."""
        size = SMOKE_CONTENDED if self.smoke else None
        instances, steps = size or CONTENDED_INSTANCES, size or CONTENDED_STEPS
        events = contended_events(instances, steps)
        reset(self.dsn)
        started = time.monotonic()
        statuses = asyncio.run(_send_all(self.base, events, self.connections))
        elapsed = time.monotonic() - started
        bad = [status for status in statuses if status not in CONTENTION_ANSWERS]
        wrong = contention_wrong(self.dsn, instances, steps)
        detail = "; ".join(wrong + ([f"statuses {sorted(set(bad))}"] if bad else []))
        load = Load(len(events) / elapsed, 1, math.nan, math.nan, len(bad) + len(wrong), detail)
        return self.check("contention, service", load)

    def read_throughput(self) -> Sides:
        """Reads/s of the first page at `connections` clients, on the small table."""
        instances = SMALL_TABLE // STEPS_PER_INSTANCE
        args = ["r", instances, "ordinal", READ_LIMIT]
        least = read_script("ordinal", self.tmp / "read_throughput.sql")
        limit = limit_read_script("ordinal", self.tmp / "limit_read_throughput.sql")
        conns = self.connections
        defines: dict[str, object] = {"instances": instances}

        def direct(script: Path) -> Callable[[float], Load]:
            return lambda seconds: pgbench(
                self.dsn, script, conns, seconds, defines, 1, self.protocol
            )

        return self.alternate(
            f"reads at {conns} connections",
            {
                "service": lambda seconds: wrk(self.base, "reads.lua", conns, seconds, args, 1),
                "limit": direct(limit),
                "least SQL": direct(least),
            },
        )

    def reads(self, large: int) -> dict[int, dict[str, Sides]]:
        """p50/p99 of the first page of a random instance: service, limit and least SQL, per
        order.

        The two tables live in two databases, each with its own service, so the loads can
        alternate between them in rounds: other work on the machine then skews both alike.
        """
        tables = {SMALL_TABLE: (self.dsn, self.base), large: (self.large_dsn, self.large_base)}
        for records, (dsn, base) in tables.items():
            started = time.monotonic()
            load_read_table(dsn, records)
            elapsed = time.monotonic() - started
            print(f"  loaded {records:,} records in {elapsed:.0f} s", file=sys.stderr)
            if self.warmup:
                args = ["r", records // STEPS_PER_INSTANCE, "ordinal", READ_LIMIT]
                warm = wrk(base, "reads.lua", self.read_connections, self.warmup, args, 1)
                self.check(f"reads at {records:,} (warm-up)", warm)
        rounds = self.rounds
        seconds = self.seconds / rounds
        conns = self.read_connections
        runs: dict[tuple[int, str], dict[str, list[Load]]] = {}
        for turn in range(rounds):
            for records in sorted(tables, reverse=bool(turn % 2)):
                dsn, base = tables[records]
                instances = records // STEPS_PER_INSTANCE
                for order in ("ordinal", "started_at"):
                    args = ["r", instances, order, READ_LIMIT]
                    scripts = {
                        "limit": limit_read_script(order, self.tmp / f"limit_read_{order}.sql"),
                        "least SQL": read_script(order, self.tmp / f"read_{order}.sql"),
                    }
                    got = runs.setdefault((records, order), {side: [] for side in SIDES})
                    got["service"].append(wrk(base, "reads.lua", conns, seconds, args, 1))
                    for side, script in scripts.items():
                        got[side].append(
                            pgbench(
                                dsn,
                                script,
                                conns,
                                seconds,
                                {"instances": instances},
                                1,
                                self.protocol,
                                self.tmp / "pgbench-log",
                            )
                        )
        results: dict[int, dict[str, Sides]] = {}
        for (records, order), got in sorted(runs.items()):
            name = f"reads order={order} at {records:,}, {rounds} rounds"
            results.setdefault(records, {})[order] = {
                side: self.check(f"{name}, {side}", median_of(got[side])) for side in SIDES
            }
        return results

    def note_memory(self, when: str) -> None:
        """The resident memory of each service's workers now (VmRSS), for the report."""
        for label, base in (("service", self.base), ("large-table service", self.large_base)):
            with suppress(KeyError, OSError):
                megabytes = [rss_kb(pid) / 1024 for pid in worker_pids(service_pid(base))]
                self.memory.append((when, label, megabytes))
                shown = ", ".join(f"{mb:.0f}" for mb in megabytes)
                print(f"  RSS of the {label}'s workers {when}: {shown} MB", file=sys.stderr)


# --- the report ------------------------------------------------------------------------------


def cpu_and_postgres(dsn: str) -> tuple[str, str]:
    """The CPU's model name and the PostgreSQL server's version, for a report's header."""
    model = "unknown CPU"
    with suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT version()").fetchone()
    return model, row[0] if row else "unknown"


def machine(dsn: str) -> list[str]:
    model, version = cpu_and_postgres(dsn)
    wrk_version = subprocess.run(["wrk", "-v"], capture_output=True, text=True).stdout
    pgbench_version = subprocess.run(["pgbench", "--version"], capture_output=True, text=True)
    return [
        f"machine:    {CPUS} CPUs (nproc), {model}; load average"
        f" {' '.join(f'{x:.2f}' for x in os.getloadavg())} at the start (other work skews it)",
        f"postgresql: {version}",
        f"tools:      {wrk_version.split(' Copyright')[0].strip()};"
        f" {pgbench_version.stdout.strip()}",
        f"command:    {shlex.join(sys.orig_argv)}",
    ]


def verdict(value: float, target: float, at_least: bool) -> str:
    if math.isnan(value):
        return "n/a"
    return "met" if (value >= target if at_least else value <= target) else "MISSED"


def rows_label(records: int) -> str:
    power = round(math.log10(records))
    return f"10^{power}" if 10**power == records else f"{records:,}"


def fmt(value: float, spec: str = ",.0f") -> str:
    return "n/a" if math.isnan(value) else format(value, spec)


def times(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.2f}x"


def ratio(a: float, b: float) -> float:
    return a / b if b else math.nan


def report(
    bench: Bench,
    header: list[str],
    single: tuple[Sides, Load],
    batch: Sides | None,
    reads: dict[int, dict[str, Sides]],
    read_rate: Sides,
    contention: Load,
) -> str:
    rows: list[tuple[str, ...]] = []

    def throughput(label: str, sides: Sides, target: float) -> None:
        rates = {side: sides[side].events_per_s for side in SIDES}
        quotient = ratio(rates["service"], rates["limit"])
        rows.append(
            (
                label,
                *(fmt(rates[side]) for side in SIDES),
                times(quotient),
                times(ratio(rates["service"], rates["least SQL"])),
                f">= {target:.2f}x {verdict(quotient, target, True)}",
            )
        )

    def latency(load: Load) -> str:
        return f"{fmt(load.p50_ms, '.2f')} / {fmt(load.p99_ms, '.2f')}"

    conns = bench.connections
    single_sides, tail_load = single
    throughput(f"single events/s, {conns} conn", single_sides, TARGETS["single"])
    if batch is None:
        rows.append((f"batch events/s, {BATCH_SIZE}/request", "skipped", "", "", "", "", ""))
    else:
        label = f"batch events/s, {BATCH_SIZE}/request, {conns} conn"
        throughput(label, batch, TARGETS["batch"])
    label = f"reads/s, limit={READ_LIMIT}, {rows_label(SMALL_TABLE)} rows, {conns} conn"
    throughput(label, read_rate, TARGETS["reads"])
    tail_ratio = ratio(tail_load.p99_ms, tail_load.p50_ms)
    rows.append(
        (
            f"single p99/p50, {bench.tail_connections} conn",
            f"{times(tail_ratio)} ({fmt(tail_load.p50_ms, '.1f')}"
            f"/{fmt(tail_load.p99_ms, '.1f')} ms)",
            "",
            "",
            "",
            "",
            f"<= {TARGETS['tail']:.0f}x {verdict(tail_ratio, TARGETS['tail'], False)}",
        )
    )
    right = "no" if contention.errors else "yes"
    rows.append(
        (
            f"contention events/s, {conns} conn, exactly right: {right}",
            fmt(contention.events_per_s),
            "",
            "",
            "",
            "",
            f">= {TARGETS['contention']:,.0f}/s"
            f" {verdict(contention.events_per_s, TARGETS['contention'], True)}",
        )
    )
    small, large = sorted(reads)
    for order in ("ordinal", "started_at"):
        for records in (small, large):
            sides = reads[records][order]
            p50 = {side: sides[side].p50_ms for side in SIDES}
            rows.append(
                (
                    f"read {order}, {rows_label(records)} rows, p50/p99 ms",
                    *(latency(sides[side]) for side in SIDES),
                    f"{times(ratio(p50['service'], p50['limit']))} p50",
                    f"{times(ratio(p50['service'], p50['least SQL']))} p50",
                    "",
                )
            )
        growth = [
            ratio(reads[large][order][s].p50_ms, reads[small][order][s].p50_ms) for s in SIDES
        ]
        rows.append(
            (
                f"read {order}, p50 {rows_label(large)} / {rows_label(small)}",
                *map(times, growth),
                "",
                "",
                f"<= {TARGETS['read_growth']:.1f}x "
                + verdict(growth[0], TARGETS["read_growth"], False),
            )
        )
    titles = (
        "measurement",
        "service",
        "limit",
        "least SQL",
        "service/limit",
        "service/least SQL",
        "goal",
    )
    lines = [*header, "", *table(titles, rows), ""]
    lines.append(
        f"{bench.seconds:g} s per load, as the median of {bench.rounds} rounds alternating"
        f" service, limit and least SQL; writes over {INSTANCES} instances; reads limit="
        f"{READ_LIMIT} at {bench.read_connections} connection(s); pgbench -M {bench.protocol}"
    )
    if bench.smoke:
        lines.append("--smoke: one 1 s round of each side, no warm-up; its figures measure nothing")
    lines += ["", *memory_table(bench.memory)]
    lines += [f"ERROR {error}" for error in bench.errors] or ["errors: none"]
    return "\n".join(lines)


def table(titles: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Rows as aligned text: the first column left, the last one as it is, the others right."""
    last = len(titles) - 1
    widths = [max(len(row[i]) for row in [titles, *rows]) for i in range(last)]
    lines = []
    for row in [titles, *rows]:
        cells = [row[0].ljust(widths[0])]
        cells += [cell.rjust(width) for cell, width in zip(row[1:last], widths[1:], strict=True)]
        lines.append("  ".join([*cells, row[last]]).rstrip())
    return lines


def memory_table(memory: Sequence[tuple[str, str, list[float]]]) -> list[str]:
    """Resident memory (MB) of each worker of each service, idle and after each load."""
    if not memory:
        return ["worker RSS: not read (no /proc?)"]
    moments = list(dict.fromkeys(when for when, _, _ in memory))
    services = list(dict.fromkeys(label for _, label, _ in memory))
    at = {(when, label): mbs for when, label, mbs in memory}
    rows = []
    for label in services:
        count = max(len(mbs) for (_, name), mbs in at.items() if name == label)
        for worker in range(count):
            cells = []
            for when in moments:
                mbs = at.get((when, label), [])
                cells.append(f"{mbs[worker]:.0f}" if worker < len(mbs) else "")
            rows.append((f"{label}, worker {worker + 1}", *cells, ""))
    return table(("worker RSS, MB", *moments, ""), rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=10, help="seconds per load (10)")
    parser.add_argument(
        "--quick", action="store_true", help="a short run: 3 s loads, 10^5 rows as the large table"
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help=f"that every load runs without an error (CI): one 1 s round of each side, no"
        f" warm-up, {SMOKE_LARGE:,} rows as the large table; its figures measure nothing",
    )
    parser.add_argument("--large", type=int, help="rows of the large read table (10^6)")
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument(
        "--tail-connections",
        type=int,
        default=16,
        help="connections of the single events' p99/p50 (16: the single load's own rounds)",
    )
    parser.add_argument(
        "--read-connections",
        type=int,
        default=1,
        help="clients of the read loads (1: the latency of a request, not of a queue)",
    )
    parser.add_argument(
        "--pgbench-protocol",
        choices=("simple", "extended", "prepared"),
        default="prepared",
        help="pgbench's query protocol (prepared: as the service, which prepares its statements)",
    )
    parser.add_argument(
        "--token", action="store_true", help="create a write token; every request carries it"
    )
    args = parser.parse_args(argv)
    seconds = 1.0 if args.smoke else 3.0 if args.quick and args.duration == 10 else args.duration
    large = args.large or (SMOKE_LARGE if args.smoke else 10**5 if args.quick else 10**6)
    if large % (4 * STEPS_PER_INSTANCE) or large <= SMALL_TABLE:
        parser.error(f"--large must be a multiple of {4 * STEPS_PER_INSTANCE} above {SMALL_TABLE}")
    missing = [tool for tool in ("wrk", "pgbench") if shutil.which(tool) is None]
    if missing:
        print(f"missing {', '.join(missing)}; install with: {INSTALL}", file=sys.stderr)
        return 2

    def terminate(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)  # unwinds through the finally blocks

    signal.signal(signal.SIGTERM, terminate)
    with (
        tempfile.TemporaryDirectory(prefix="steprecord-bench-") as tmp_name,
        postgres_server(Path(tmp_name)) as server,
        fresh_database(server, DB_NAME) as dsn,
        fresh_database(server, f"{DB_NAME}_large", like=DB_NAME) as large_dsn,
        with_token(args.token, dsn, large_dsn),
        service(dsn, Path(tmp_name) / "service.log") as base,
        service(large_dsn, Path(tmp_name) / "service-large.log") as large_base,
    ):
        header = machine(dsn)
        print("\n".join(header), file=sys.stderr)
        bench = Bench(
            dsn=dsn,
            base=base,
            large_dsn=large_dsn,
            large_base=large_base,
            tmp=Path(tmp_name),
            seconds=seconds,
            warmup=0 if args.smoke else min(2.0, seconds / 3),
            connections=args.connections,
            tail_connections=args.tail_connections,
            read_connections=args.read_connections,
            protocol=args.pgbench_protocol,
            smoke=args.smoke,
        )
        bench.note_memory("idle")
        single = bench.single()
        bench.note_memory("after single")
        batch = bench.batch()
        bench.note_memory("after batch")
        contention = bench.contention()
        bench.note_memory("after contention")
        reads = bench.reads(large)
        bench.note_memory("after reads")
        throughput = bench.read_throughput()
        bench.note_memory("after reads/s")
        print(report(bench, header, single, batch, reads, throughput, contention))
    return 1 if bench.errors else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
    except (RuntimeError, psycopg.Error) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
