"""What `record_celery` costs a Celery worker: a chain of no-op tasks with and without it.

Run from the repository root:
`.venv-test/bin/python -m tests.bench.celery_chain [--tasks 1000] [--rounds 3]`.

It creates a fresh database (on DATABASE_URL's server, else in an embedded PostgreSQL in a
temporary directory), migrates it, starts `steprecord serve` (one worker) on 127.0.0.1, and
two Celery workers (solo pool, concurrency 1) on RabbitMQ at 127.0.0.1:5672, each consuming a
queue of its own: (a) this module's app as is, (b) the same app with
`record_celery(app, service, lease_seconds=60)`. In alternating rounds (after one warm-up
chain each) it sends each worker a chain of N no-op tasks and measures the wall time from
sending the chain until the last task is done (its `task_postrun`, in the worker): tasks/s,
the median of the rounds. Each message of a Celery chain carries the chain's remaining
signatures, so a chain of N tasks serializes O(N^2) signatures: tasks/s falls as N grows in
both configurations alike (the time added per task does not).

The time steprecord adds to each task is measured inside the worker: this module connects a
receiver of its own to each signal `record_celery` uses (`task_prerun`, `task_success`,
`task_failure`, `task_retry`, `task_revoked`, `task_postrun`, `before_task_publish`) before
`record_celery` connects its receivers and another one after, and Celery calls the receivers
of a signal in the order they were connected, so the time between the two is the time spent
in steprecord's receivers. The same brackets run in (a), with nothing between them. The last
task's `task_postrun` receiver sends the round's timings and the chain's end to Redis
(127.0.0.1:6379/9, a list per worker the driver waits on with BLPOP); no result backend.

Exits non-zero when anything failed: a task raised, a worker or the service stopped, a chain
did not finish in time, a worker logged an error or a steprecord report it dropped or that
was refused, or a recorded chain's instance does not hold exactly N completed records
(checked through the service's HTTP API after each recorded chain).
Everything it starts is stopped at the end, also on an error, SIGTERM or Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import celery
import kombu
import kombu.exceptions
import psycopg
import redis
from celery import Celery, bootsteps, chain, signals
from kombu import Exchange, Queue

from tests.bench import common, run

BROKER: Final = os.environ.get("STEPRECORD_BENCH_BROKER", "amqp://guest:guest@127.0.0.1:5672//")
REDIS: Final = os.environ.get("STEPRECORD_BENCH_REDIS", "redis://127.0.0.1:6379/9")
QUEUE: Final = os.environ.get("STEPRECORD_BENCH_QUEUE", "steprecord-bench")
# Set in the worker processes only: STEPRECORD_BENCH_WORKER=1 connects the timing receivers,
# and STEPRECORD_BENCH_SERVICE (the service's URL) also records the app with record_celery.
IN_WORKER: Final = os.environ.get("STEPRECORD_BENCH_WORKER") == "1"
SERVICE: Final = os.environ.get("STEPRECORD_BENCH_SERVICE")
WAKEUP: Final = float(os.environ.get("STEPRECORD_BENCH_WAKEUP", "0"))  # seconds; see HubWakeup
LEASE_SECONDS: Final = 60

NOOP: Final = "steprecord_bench.noop"
LAST: Final = "steprecord_bench.last"
# Every signal record_celery connects a receiver to (steprecord_client/celery.py, connect()).
BRACKETED: Final = (
    "task_prerun",
    "before_task_publish",
    "task_success",
    "task_failure",
    "task_retry",
    "task_revoked",
    "task_postrun",
)
GOAL_MS: Final = 3.0  # the goal: p50 of the time added per task

app = Celery("steprecord_bench", broker=BROKER)
app.conf.update(
    task_default_queue=QUEUE,
    task_ignore_result=True,  # no result backend: the end of a chain comes through Redis
    task_acks_late=True,  # as docs/celery.md recommends
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)


@app.task(name=NOOP)
def noop(i: int) -> int:
    return i


@app.task(name=LAST)
def last(token: str) -> str:
    """The chain's last task: a no-op too; its `task_postrun` reports the round."""
    return token


def report_key(queue: str) -> str:
    """The Redis list a worker reports to (readiness, errors, each round's end)."""
    return f"steprecord-bench:{queue}"


# --- inside the worker ---------------------------------------------------------------------


class Probe:
    """The worker's timing receivers: brackets record_celery's receivers of every signal and
    reports each round (one chain, ended by the task LAST) to Redis."""

    def __init__(self, queue: str) -> None:
        self.key = report_key(queue)
        self.redis = redis.Redis.from_url(REDIS)
        self.mark = 0.0  # perf_counter() at the opening receiver of the current signal
        self.task_start = 0.0
        self.added: dict[str, float] = {}
        # Per task of the round: [in-worker ms, added ms, added ms by signal (BRACKETED)...]
        self.tasks: list[list[float]] = []

    def push(self, kind: str, **fields: Any) -> None:
        self.redis.rpush(self.key, json.dumps({"kind": kind, **fields}))
        self.redis.expire(self.key, 3600)

    def opening(self, name: str) -> Callable[..., None]:
        def receiver(**_: Any) -> None:
            now = time.perf_counter()
            if name == "task_prerun":
                self.task_start = now
                self.added = {}
            self.mark = now

        return receiver

    def closing(self, name: str) -> Callable[..., None]:
        def receiver(**kwargs: Any) -> None:
            now = time.perf_counter()
            self.added[name] = self.added.get(name, 0.0) + (now - self.mark)
            if name == "task_failure":
                exc = kwargs.get("exception")
                self.push("error", task=str(kwargs.get("task_id")), error=repr(exc))
            elif name == "task_postrun":
                self.task_done(now, kwargs.get("sender"), kwargs.get("args"))

        return receiver

    def task_done(self, now: float, task: Any, args: Any) -> None:
        added = [self.added.get(name, 0.0) * 1000 for name in BRACKETED]
        self.tasks.append([(now - self.task_start) * 1000, sum(added), *added])
        if getattr(task, "name", None) != LAST:
            return
        tasks, self.tasks = self.tasks, []
        self.push(
            "done",
            token=str(args[0]) if args else "",
            root_id=str(task.request.root_id or task.request.id),
            finished=time.time(),
            tasks=tasks,
        )

    def connect_opening(self) -> None:
        for name in BRACKETED:
            getattr(signals, name).connect(self.opening(name), weak=False)

    def connect_closing(self) -> None:
        for name in BRACKETED:
            getattr(signals, name).connect(self.closing(name), weak=False)
        signals.worker_ready.connect(lambda **_: self.push("ready"), weak=False)


class HubWakeup(bootsteps.StartStopStep):
    """Wakes the worker's event loop every WAKEUP seconds. With RabbitMQ and the solo pool,
    about one hop in ten of a chain otherwise stalls until the loop's next timer (1 s, or up
    to 10 s with the AMQP heartbeat's timer): the next message is delivered while the worker
    is still in the previous one and the loop does not notice it (a kombu hub race, as in
    celery/celery#3978). That stall has nothing to do with steprecord and would swamp what is
    measured; this bounds it to WAKEUP."""

    requires = ("celery.worker.components:Hub",)

    def start(self, worker: Any) -> None:
        if worker.hub is not None:
            worker.hub.call_repeatedly(WAKEUP, _nothing)


def _nothing() -> None:
    pass


if IN_WORKER:
    if WAKEUP > 0:
        app.steps["worker"].add(HubWakeup)
    probe = Probe(QUEUE)
    probe.connect_opening()  # before record_celery's receivers ...
    if SERVICE:
        from steprecord_client.celery import record_celery

        record_celery(app, SERVICE, lease_seconds=LEASE_SECONDS)
    probe.connect_closing()  # ... and after them


# --- the driver ----------------------------------------------------------------------------

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent.parent
CONFIGS: Final = {
    "plain": "(a) without recording",
    "recorded": f"(b) record_celery(lease_seconds={LEASE_SECONDS})",
}


class BenchError(RuntimeError):
    """Something failed: the run goes on no further and exits non-zero."""


def answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


@contextmanager
def process_group(
    command: Sequence[str], env: dict[str, str], log: Path, stop_signal: int
) -> Iterator[subprocess.Popen[bytes]]:
    """A process of its own session (so Ctrl-C reaches only us); at the end `stop_signal`,
    a few seconds' grace, then SIGKILL to its whole process group."""
    with log.open("wb") as out:
        proc = subprocess.Popen(
            list(command),
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            with suppress(ProcessLookupError):
                proc.send_signal(stop_signal)
            with suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of its group
        proc.wait()


@contextmanager
def service(dsn: str, log: Path) -> Iterator[str]:
    """`steprecord serve` (one worker) on the database; yields its base URL."""
    port = run.free_port()
    base = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "app.cli", "serve", "--host", "127.0.0.1"]
    command += ["--port", str(port), "--workers", "1"]
    env = {**os.environ, "DATABASE_URL": dsn}
    with process_group(command, env, log, signal.SIGTERM) as proc:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise BenchError(f"the service exited ({proc.returncode}):\n{run.tail(log)}")
            with suppress(OSError):
                if run.http_status("GET", f"{base}/readyz") == 200:
                    break
            if time.monotonic() > deadline:
                raise BenchError(f"the service was not ready within 60 s:\n{run.tail(log)}")
            time.sleep(0.2)
        yield base


@contextmanager
def own_queue(label: str) -> Iterator[str]:
    """A queue of its own, declared empty now and deleted afterwards."""
    name = f"steprecord-bench-{label}-{uuid.uuid4().hex[:10]}"
    queue = Queue(name, Exchange(name, type="direct"), routing_key=name)
    with app.connection_for_write() as conn:
        bound = queue(conn.default_channel)
        bound.declare()
        bound.purge()
    try:
        yield name
    finally:
        try:
            with app.connection_for_write() as conn:
                queue(conn.default_channel).delete()
        except Exception as exc:
            print(f"warning: could not delete queue {name}: {exc}", file=sys.stderr)


@dataclass
class Worker:
    label: str
    queue: str
    proc: subprocess.Popen[bytes]
    log: Path
    redis: redis.Redis

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def next_report(self, deadline: float) -> dict[str, Any]:
        """The worker's next report; fails when the worker stops or the deadline passes."""
        while True:
            if self.proc.poll() is not None:
                raise BenchError(
                    f"worker {self.label} exited ({self.proc.returncode}):\n{self.tail()}"
                )
            left = deadline - time.monotonic()
            if left <= 0:
                raise BenchError(f"worker {self.label}: timed out:\n{self.tail()}")
            popped = self.redis.blpop([report_key(self.queue)], timeout=max(1, min(2, left)))
            if popped is not None:
                report: dict[str, Any] = json.loads(popped[1])
                return report

    def tail(self) -> str:
        return self.output()[-3000:]


@contextmanager
def worker(
    label: str, tmp: Path, client: redis.Redis, service_url: str | None, wakeup: float
) -> Iterator[Worker]:
    """A Celery worker (solo pool) on a queue of its own, ready."""
    with own_queue(label) as queue:
        client.delete(report_key(queue))
        env = {
            **os.environ,
            "STEPRECORD_BENCH_WORKER": "1",
            "STEPRECORD_BENCH_BROKER": BROKER,
            "STEPRECORD_BENCH_REDIS": REDIS,
            "STEPRECORD_BENCH_QUEUE": queue,
            "STEPRECORD_BENCH_WAKEUP": str(wakeup),
        }
        env.pop("STEPRECORD_BENCH_SERVICE", None)
        if service_url is not None:
            env["STEPRECORD_BENCH_SERVICE"] = service_url
        command = [
            sys.executable, "-m", "celery", "-A", "tests.bench.celery_chain", "worker",
            "--pool", "solo", "--concurrency", "1", "--queues", queue,
            "--hostname", f"bench-{label}-{uuid.uuid4().hex[:6]}@%h", "--without-gossip",
            "--without-mingle", "--without-heartbeat", "--loglevel", "WARNING",
        ]  # fmt: skip
        log = tmp / f"worker-{label}.log"
        try:
            with process_group(command, env, log, signal.SIGTERM) as proc:
                running = Worker(label, queue, proc, log, client)
                report = running.next_report(time.monotonic() + 60)
                if report["kind"] != "ready":
                    raise BenchError(f"worker {label}: {report} before it was ready")
                yield running
        finally:
            client.delete(report_key(queue))


@dataclass
class Round:
    config: str
    tasks: int
    seconds: float
    per_task: list[list[float]]  # as Probe.tasks

    @property
    def rate(self) -> float:
        return self.tasks / self.seconds


@dataclass
class Bench:
    tasks: int
    base: str
    workers: dict[str, Worker]
    rounds: dict[str, list[Round]] = field(default_factory=dict)

    def chain_round(self, config: str, tasks: int) -> Round:
        """One chain of `tasks` no-op tasks through the worker of `config`, checked."""
        running = self.workers[config]
        token = uuid.uuid4().hex
        steps = [noop.si(i).set(queue=running.queue) for i in range(tasks - 1)]
        steps.append(last.si(token).set(queue=running.queue))
        flow = chain(*steps)
        started = time.time()
        flow.apply_async()
        deadline = time.monotonic() + 120 + tasks * 0.2
        while True:
            report = running.next_report(deadline)
            if report["kind"] == "error":
                failed = f"task {report['task']} failed: {report['error']}"
                raise BenchError(f"{CONFIGS[config]}: {failed}")
            if report["kind"] == "done" and report["token"] == token:
                break
        if len(report["tasks"]) != tasks:
            raise BenchError(
                f"{CONFIGS[config]}: the worker timed {len(report['tasks'])} tasks of {tasks}"
            )
        if config == "recorded":
            self.check_records(report["root_id"], tasks)
        return Round(config, tasks, report["finished"] - started, report["tasks"])

    def check_records(self, key: str, tasks: int) -> None:
        """The chain's instance holds exactly `tasks` completed records, one per task."""
        items: list[dict[str, Any]] = []
        cursor: str | None = None
        while True:
            query = {"limit": "1000", **({"cursor": cursor} if cursor else {})}
            url = f"{self.base}/v1/instances/{urllib.parse.quote(key)}/steps?"
            url += urllib.parse.urlencode(query)
            try:
                with run.HTTP.open(url, timeout=30) as response:
                    page = json.load(response)
            except OSError as exc:
                raise BenchError(f"reading the records of instance {key}: {exc}") from exc
            items += page["items"]
            cursor = page.get("next_cursor")
            if not cursor:
                break
        completed = [r for r in items if r.get("status") == "completed"]
        slugs = {r.get("step_slug") for r in completed}
        if len(items) != tasks or len(completed) != tasks or len(slugs) != tasks:
            statuses: dict[str, int] = {}
            for r in items:
                statuses[str(r.get("status"))] = statuses.get(str(r.get("status")), 0) + 1
            raise BenchError(
                f"instance {key}: {len(items)} records ({statuses}), {len(slugs)} distinct"
                f" completed steps; want {tasks} completed"
            )

    def run(self, rounds: int) -> None:
        warmup = min(self.tasks, 50)
        for config in CONFIGS:
            self.progress(f"warm-up, {warmup} tasks", self.chain_round(config, warmup))
        for number in range(1, rounds + 1):
            for config in CONFIGS:
                done = self.chain_round(config, self.tasks)
                self.rounds.setdefault(config, []).append(done)
                self.progress(f"round {number}/{rounds}", done)

    @staticmethod
    def progress(what: str, done: Round) -> None:
        added = [task[1] for task in done.per_task]
        print(
            f"  {what}, {CONFIGS[done.config]}: {done.rate:,.0f} tasks/s"
            f" ({done.seconds:.2f} s), added ms p50 {run.percentile(added, 50):.3f}",
            file=sys.stderr,
            flush=True,
        )


def trouble(log: str) -> list[str]:
    """A worker's log lines of steprecord reports not delivered or refused, and its errors
    (a receiver that raised, say: Celery logs it and goes on)."""
    marks = ("steprecord:", "ERROR/", "CRITICAL/")
    return [line for line in log.splitlines() if any(mark in line for mark in marks)]


def machine(dsn: str, loadavg: tuple[float, float, float], wakeup_ms: float) -> list[str]:
    model, version = run.cpu_and_postgres(dsn)
    loop = (
        f"event loop woken every {wakeup_ms:g} ms (HubWakeup)"
        if wakeup_ms > 0
        else "event loop not woken (--hub-wakeup-ms 0)"
    )
    return [
        f"machine:    {run.CPUS} CPUs (nproc), {model}; load average"
        f" {' '.join(f'{x:.2f}' for x in loadavg)} at the start (other work skews it)",
        f"postgresql: {version}",
        f"celery:     {celery.__version__}, kombu {importlib.metadata.version('kombu')}; broker"
        f" {BROKER.replace('guest:guest@', '')}; solo pool, concurrency 1; {loop}",
        f"command:    {shlex.join(sys.orig_argv)}",
    ]


def report(bench: Bench, header: list[str], rounds: int) -> str:
    def ms(values: list[float], p: float) -> str:
        return run.fmt(run.percentile(values, p), ".3f")

    rows: list[tuple[str, ...]] = []
    summary: dict[str, dict[str, float]] = {}
    for config, title in CONFIGS.items():
        done = bench.rounds[config]
        per_task = [task for one in done for task in one.per_task]
        in_worker = [task[0] for task in per_task]
        added = [task[1] for task in per_task]
        rate = run.percentile([one.rate for one in done], 50)
        summary[config] = {
            "rate": rate,
            "in_worker_p50": run.percentile(in_worker, 50),
            "added_p50": run.percentile(added, 50),
        }
        rows.append(
            (
                title,
                run.fmt(rate),
                run.fmt(1000 / rate, ".3f") if rate else "n/a",
                ms(in_worker, 50),
                ms(in_worker, 99),
                ms(added, 50),
                ms(added, 99),
            )
        )
    titles = (
        "configuration",
        "tasks/s (median)",
        "wall ms/task",
        "in-worker ms p50",
        "p99",
        "added ms p50",
        "p99",
    )
    lines = [*header, ""]
    lines.append("| " + " | ".join(titles) + " |")
    lines.append("|---|" + "---:|" * (len(titles) - 1))
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    lines.append("")
    recorded = [task for one in bench.rounds["recorded"] for task in one.per_task]
    by_signal = [
        f"{name} {ms([task[2 + i] for task in recorded], 50)}"
        for i, name in enumerate(BRACKETED)
        if any(task[2 + i] for task in recorded)
    ]
    added_p50 = summary["recorded"]["added_p50"]

    def tenth(which: int) -> str:
        size = max(1, bench.tasks // 10)
        part = [
            task[1]
            for one in bench.rounds["recorded"]
            for task in (one.per_task[:size] if which == 0 else one.per_task[-size:])
        ]
        return ms(part, 50)

    plain, with_recording = summary["plain"], summary["recorded"]
    lines += [
        f"{bench.tasks} no-op tasks per chain, {rounds} round(s) of each, alternating (a) and"
        " (b) after one warm-up chain each; tasks/s is the median round: N / (last task's"
        " task_postrun in the worker - the driver's apply_async of the chain); wall ms/task"
        " its inverse.",
        "in-worker ms: per task, the worker's first task_prerun receiver to its last"
        " task_postrun receiver (the task, its signals and publishing the chain's next"
        f" message); percentiles over every task of the {rounds} round(s).",
        "added ms: per task, the time inside steprecord's signal receivers, measured by"
        " receivers of this benchmark connected to each of those signals just before and"
        " just after record_celery connects its own (Celery calls them in connection order);"
        " in (a) the same brackets with nothing between them.",
        f"added ms p50 by signal in (b): {', '.join(by_signal) or 'n/a'}.",
        f"added ms p50 in (b) along the chain: first tenth {tenth(0)}, last tenth {tenth(-1)}.",
        "cross-check without the brackets, (b) - (a): in-worker ms p50"
        f" {with_recording['in_worker_p50'] - plain['in_worker_p50']:+.3f},"
        f" wall ms/task {1000 / with_recording['rate'] - 1000 / plain['rate']:+.3f}.",
        f"goal: added ms p50 <= {GOAL_MS:g} per task:"
        f" {run.verdict(added_p50, GOAL_MS, False)} ({run.fmt(added_p50, '.3f')} ms).",
        "errors: none",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    assert __doc__ is not None
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=1000, help="tasks per chain (1000)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per configuration (3)")
    parser.add_argument(
        "--hub-wakeup-ms",
        type=float,
        default=5,
        help="wake each worker's event loop this often; 0: never, and chains stall (HubWakeup)",
    )
    args = parser.parse_args(argv)
    if args.tasks < 2 or args.rounds < 1:
        parser.error("--tasks must be at least 2 and --rounds at least 1")
    wakeup = max(0.0, args.hub_wakeup_ms) / 1000
    loadavg = os.getloadavg()
    broker = urllib.parse.urlsplit(BROKER)
    redis_url = urllib.parse.urlsplit(REDIS)
    missing = [
        f"{name} at {url.hostname}:{url.port}"
        for name, url, port in (("RabbitMQ", broker, 5672), ("Redis", redis_url, 6379))
        if not answers(url.hostname or "127.0.0.1", url.port or port)
    ]
    if missing:
        print(f"error: {' and '.join(missing)} not answering", file=sys.stderr)
        return 2

    def terminate(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)  # unwinds through the finally blocks

    signal.signal(signal.SIGTERM, terminate)
    client = redis.Redis.from_url(REDIS, socket_timeout=30)  # above BLPOP's timeout
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="steprecord-celery-")))
        server = stack.enter_context(common.postgres_server(tmp))
        dsn = stack.enter_context(
            common.fresh_database(server, f"steprecord_bench_celery_{os.getpid()}")
        )
        base = stack.enter_context(service(dsn, tmp / "service.log"))
        workers = {
            "plain": stack.enter_context(worker("plain", tmp, client, None, wakeup)),
            "recorded": stack.enter_context(worker("recorded", tmp, client, base, wakeup)),
        }
        header = machine(dsn, loadavg, args.hub_wakeup_ms)
        print("\n".join(header), file=sys.stderr, flush=True)
        bench = Bench(args.tasks, base, workers)
        try:
            bench.run(args.rounds)
        finally:
            problems = [line for each in workers.values() for line in trouble(each.output())]
        if problems:
            shown = "\n".join(problems[:20])
            raise BenchError(
                f"{len(problems)} errors or dropped reports in the workers' logs:\n{shown}"
            )
        print(report(bench, header, args.rounds), flush=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except (BenchError, psycopg.Error, redis.RedisError, kombu.exceptions.KombuError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
    except Exception as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        sys.exit(1)
