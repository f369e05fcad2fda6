"""Live updates at scale: many open streams on one worker, and a burst of streams opening.

Run from the repository root: `.venv/bin/python -m tests.bench.fanout [--streams 1000] ...`.
README.md ("Live updates at scale") says what it measures and how to read it. On a fresh
database it starts `steprecord serve --workers 1` and, from this process (asyncio, raw
sockets: one process holds every stream), measures:

1. Fan-out: `--streams` streams spread over `--instances` instances while `--rate` writes per
   second go to those instances, for `--duration` seconds. Every stream must receive every
   write to its instance exactly once, in the stream's order; the report gives the delay from
   each write's request to each stream's event (p50/p99), the worker's resident memory
   before, with the streams open and after, and the worker's CPU time per stream per second
   (beyond the same writes with no stream open).
2. Burst: for each of `--burst` (1,000 and 1,500), that many streams of one instance of
   `--burst-steps` records opened at once while the same writes run: the time until every
   stream has its whole snapshot, how many were refused, and the writes' p50/p99 during the
   burst against the seconds before it; then, as a control, as many `GET /healthz` opened at
   once while the same writes run.

Exits non-zero when a stream missed, repeated or misordered an event, a write failed, or a
stream of the fan-out could not open; a missed goal is reported, not an error.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import multiprocessing
import multiprocessing.synchronize
import os
import resource
import shlex
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import orjson
import psycopg

from tests.bench import common, run

DB_NAME = "steprecord_bench_fanout"
TICK = os.sysconf("SC_CLK_TCK")
GOALS = {"delivery_p99_ms": 250.0, "rss_growth_mb": 100.0, "burst_s": 5.0}
SEED_STEPS = 5  # records of each fan-out instance before the streams open
WRITE_CONNECTIONS = 32  # enough that a slow answer delays no other write
OPEN_WAVE = 20  # fan-out streams opened at a time (the burst is measured on its own)
SETTLE_SECONDS = 15.0  # how long the last events may take to arrive before they count missing
BURST_TIMEOUT = 120.0  # a burst stream without its snapshot after this long counts refused
BEFORE_BURST_SECONDS = 3.0  # the writes' baseline window, just before each burst
WRITER_START_SECONDS = 2.0  # the burst's writer process starting (its first writes wait)


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds a process has used so far."""
    text = Path(f"/proc/{pid}/stat").read_text()
    fields = text[text.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def backends_cpu(database: str) -> float:
    """CPU seconds so far of the PostgreSQL backends connected to `database` (their process
    titles name it); a backend that ended meanwhile is not counted."""
    total = 0.0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes()
            if title.startswith(b"postgres: ") and f" {database} ".encode() in title:
                total += cpu_seconds(int(pid))
        except OSError:
            continue
    return total


def listen_overflows() -> int:
    """How often a listening socket's accept queue overflowed on this machine so far (a
    connection then waits for the client's retransmission, a second or more)."""
    lines = Path("/proc/net/netstat").read_text().splitlines()
    for names, values in zip(lines[::2], lines[1::2], strict=True):
        if names.startswith("TcpExt:"):
            table = dict(zip(names.split()[1:], values.split()[1:], strict=True))
            return int(table.get("ListenOverflows", 0))
    return 0


def reads_so_far(base: str) -> float:
    """The service's reads so far (`steprecord_reads_total`, every pool): each stream read is
    one, and so is each page or record read."""
    with run.HTTP.open(f"{base}/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("steprecord_reads_total{")
    )


def stamp() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def pct(values: Sequence[float], p: float) -> float:
    return run.percentile(values, p)


# --- the streams -----------------------------------------------------------------------------


class SseStream(asyncio.Protocol):
    """One `GET .../stream` over a raw socket: its status, and each event as it arrives
    (arrival time, id, data), parsed as little as possible while the load runs."""

    def __init__(self, host: str, instance: str) -> None:
        self.request = (
            f"GET /v1/instances/{instance}/stream HTTP/1.1\r\nHost: {host}\r\n"
            "Accept: text/event-stream\r\n\r\n"
        ).encode()
        self.instance = instance
        self.status = 0
        self.events: list[tuple[float, bytes, bytes]] = []
        self.keepalives = 0
        self.headers_at = math.nan
        self.ended = False
        self.transport: asyncio.Transport | None = None
        self._head = bytearray()
        self._raw = bytearray()  # chunked body not yet decoded
        self._body = bytearray()  # decoded body not yet split into events
        self._left = -1  # bytes of the current chunk still to come; -1: a size line next
        self._crlf = False  # the CRLF after a chunk is next
        self.count_reached: asyncio.Event = asyncio.Event()
        self.wanted = 0  # set count_reached once this many events arrived

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.write(self.request)

    def connection_lost(self, exc: Exception | None) -> None:
        self.ended = True
        self.count_reached.set()  # nobody waits for a stream that is gone

    def data_received(self, data: bytes) -> None:
        now = time.monotonic()
        if not self.status:
            self._head += data
            end = self._head.find(b"\r\n\r\n")
            if end < 0:
                return
            self.status = int(self._head[: self._head.find(b"\r\n")].split()[1])
            self.headers_at = now
            if self.status != 200:
                if self.transport is not None:
                    self.transport.close()
                return
            data = bytes(self._head[end + 4 :])
        self._raw += data
        self._dechunk()
        self._split(now)

    def _dechunk(self) -> None:
        raw, pos = self._raw, 0
        while pos < len(raw):
            if self._crlf:
                if len(raw) - pos < 2:
                    break
                pos, self._crlf = pos + 2, False
            elif self._left < 0:
                end = raw.find(b"\r\n", pos)
                if end < 0:
                    break
                self._left = int(raw[pos:end].split(b";")[0], 16)
                pos = end + 2
                if self._left == 0:
                    self.ended = True
                    break
            else:
                take = min(self._left, len(raw) - pos)
                self._body += raw[pos : pos + take]
                pos += take
                self._left -= take
                if self._left == 0:
                    self._left, self._crlf = -1, True
        del raw[:pos]

    def _split(self, now: float) -> None:
        body, pos = self._body, 0
        while (end := body.find(b"\n\n", pos)) >= 0:
            frame = bytes(body[pos:end])
            pos = end + 2
            if frame.startswith(b":"):
                self.keepalives += 1
                continue
            event_id, data = b"", b""
            for line in frame.split(b"\n"):
                if line.startswith(b"id: "):
                    event_id = line[4:]
                elif line.startswith(b"data: "):
                    data = line[6:]
            self.events.append((now, event_id, data))
        del body[:pos]
        if self.wanted and len(self.events) >= self.wanted:
            self.count_reached.set()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


async def open_stream(host: str, port: int, instance: str, wanted: int) -> SseStream:
    loop = asyncio.get_running_loop()
    stream = SseStream(f"{host}:{port}", instance)
    stream.wanted = wanted
    try:
        await loop.create_connection(lambda: stream, host, port)
    except OSError:
        stream.ended = True
        stream.count_reached.set()
    return stream


async def await_events(stream: SseStream, seconds: float) -> bool:
    """Whether the stream got its `wanted` events within `seconds` (not refused, not ended)."""
    try:
        async with asyncio.timeout(seconds):
            await stream.count_reached.wait()
    except TimeoutError:
        return False
    return stream.status == 200 and len(stream.events) >= stream.wanted


# --- the writes ------------------------------------------------------------------------------


@dataclass
class Write:
    instance: str
    slug: str
    status: str  # the record's status once this write is applied
    path: str
    body: bytes
    due: float = math.nan  # when the steady rate has it sent; its latency counts from here
    sent: float = math.nan
    answered: float = math.nan
    code: int = 0


def writes(prefix: str, instances: Sequence[str]) -> Iterator[Write]:
    """Round-robin over the instances; on each, a `start` of a new step, then the `complete` of
    that step (one round later), with explicit attempts and timestamps, as events.lua."""
    started: dict[str, str] = {}
    for n in range(10**9):
        instance = instances[n % len(instances)]
        step = n // len(instances) // 2
        slug = f"{prefix}-{step}"
        path = f"/v1/instances/{instance}/steps/{slug}"
        if n // len(instances) % 2 == 0:
            started[slug] = stamp()
            body = {"attempt": 1, "started_at": started[slug]}
            yield Write(instance, slug, "running", f"{path}/start", orjson.dumps(body))
        else:
            body = {
                "attempt": 1,
                "started_at": started.pop(slug, stamp()),
                "completed_at": stamp(),
                "output": {"n": n},
            }
            yield Write(instance, slug, "completed", f"{path}/complete", orjson.dumps(body))


class Writer:
    """Writes at a steady rate over keep-alive connections, each timed from its request to its
    answer; runs until `stop()`."""

    def __init__(self, host: str, port: int, rate: float, source: Iterator[Write]) -> None:
        self.host, self.port, self.rate, self.source = host, port, rate, source
        self.done: list[Write] = []
        self._queue: asyncio.Queue[Write | None] = asyncio.Queue()
        self._stopping = False
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._pace())]
        self._tasks += [asyncio.create_task(self._send()) for _ in range(WRITE_CONNECTIONS)]

    async def stop(self) -> list[Write]:
        self._stopping = True
        await asyncio.gather(*self._tasks)
        return self.done

    async def _pace(self) -> None:
        loop = asyncio.get_running_loop()
        began = loop.time()
        for n, write in enumerate(self.source):
            if self._stopping:
                break
            write.due = began + n / self.rate
            delay = write.due - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            self._queue.put_nowait(write)
        for _ in range(WRITE_CONNECTIONS):
            self._queue.put_nowait(None)

    async def _send(self) -> None:
        reader, writer = await asyncio.open_connection(self.host, self.port)
        try:
            while (write := await self._queue.get()) is not None:
                head = (
                    f"POST {write.path} HTTP/1.1\r\nHost: {self.host}\r\n"
                    f"Content-Type: application/json\r\nContent-Length: {len(write.body)}\r\n\r\n"
                )
                write.sent = time.monotonic()
                writer.write(head.encode() + write.body)
                answer = await reader.readuntil(b"\r\n\r\n")
                lines = answer.decode("latin-1").split("\r\n")
                length = next(
                    int(line.split(":", 1)[1])
                    for line in lines
                    if line.lower().startswith("content-length:")
                )
                await reader.readexactly(length)
                write.answered = time.monotonic()
                write.code = int(lines[0].split()[1])
                self.done.append(write)
        finally:
            writer.close()


def _write_in_process(
    host: str,
    port: int,
    rate: float,
    prefix: str,
    instances: Sequence[str],
    stop: multiprocessing.synchronize.Event,
    results: multiprocessing.Queue[list[Write]],
) -> None:
    async def write() -> list[Write]:
        writer = Writer(host, port, rate, writes(prefix, instances))
        writer.start()
        await asyncio.to_thread(stop.wait)
        return await writer.stop()

    results.put(asyncio.run(write()))


class WriterProcess:
    """A `Writer` in a process of its own, so that the writes' latency is the service's alone:
    in this process they would also wait for the client's own work on the streams (a burst's
    thousand snapshots arriving at once). Times are `time.monotonic()`, one clock for every
    process of the machine."""

    def __init__(self, host: str, port: int, rate: float, prefix: str, instances: list[str]):
        context = multiprocessing.get_context("spawn")
        self._stop = context.Event()
        self._results: multiprocessing.Queue[list[Write]] = context.Queue()
        self._process = context.Process(
            target=_write_in_process,
            args=(host, port, rate, prefix, instances, self._stop, self._results),
            daemon=True,
        )

    def start(self) -> None:
        self._process.start()

    async def stop(self) -> list[Write]:
        self._stop.set()
        try:
            done = await asyncio.to_thread(self._results.get, True, 60)
        finally:
            await asyncio.to_thread(self._process.join, 10)
            if self._process.is_alive():
                self._process.kill()
        return done


def write_latency(done: Sequence[Write], since: float = -math.inf, until: float = math.inf) -> str:
    """p50/p99 of the writes due in [since, until), and how many; each from when the steady
    rate had it due, so a write held back by slow answers counts its wait too."""
    ms = [(w.answered - w.due) * 1000 for w in done if since <= w.due < until]
    return f"p50 {pct(ms, 50):.1f} ms, p99 {pct(ms, 99):.1f} ms ({len(ms)} writes)"


# --- the run ---------------------------------------------------------------------------------


@dataclass
class Report:
    lines: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def say(self, line: str) -> None:
        print(line, file=sys.stderr, flush=True)
        self.lines.append(line)


def seed(dsn: str, instances: Sequence[str], steps: int) -> None:
    """`steps` pending records on each instance, written directly (the setup is not measured)."""
    with psycopg.connect(dsn, autocommit=True) as conn, conn.transaction():
        for key in instances:
            row = conn.execute(
                "INSERT INTO process_instance (instance_key, next_ordinal) VALUES (%s, %s)"
                " RETURNING id",
                (key, steps),
            ).fetchone()
            assert row is not None
            conn.execute(
                "INSERT INTO workflow_step_record (instance_id, step_slug, ordinal, status,"
                " attempt_count) SELECT %s, 'seed-' || o, o, 'pending', 1"
                " FROM generate_series(0, %s - 1) o",
                (row[0], steps),
            )


def record_counts(dsn: str) -> dict[str, int]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT p.instance_key, count(r.id) FROM process_instance p"
            " LEFT JOIN workflow_step_record r ON r.instance_id = p.id GROUP BY 1"
        ).fetchall()
    return {key: count for key, count in rows}


def position(event_id: bytes) -> tuple[int, int]:
    xid, _, record_id = event_id.partition(b"-")
    return int(xid), int(record_id)


@dataclass
class Delivery:
    latencies_ms: list[float] = field(default_factory=list)
    missing: int = 0
    repeated: int = 0
    misordered: int = 0
    collapsed: int = 0  # a `running` never sent because its `complete` came first (allowed)
    unexpected: int = 0


def check_stream(
    stream: SseStream, expected: dict[tuple[str, str], Write], snapshot: int, out: Delivery
) -> None:
    """Every write to the stream's instance exactly once after its snapshot, ids increasing,
    each step's states in commit order."""
    last = (-1, -1)
    seen: dict[tuple[str, str], float] = {}
    for n, (arrived, event_id, data) in enumerate(stream.events):
        here = position(event_id)
        if here <= last:
            out.misordered += 1
        last = here
        if n < snapshot:
            continue
        record = orjson.loads(data)
        key = (record["step_slug"], record["status"])
        if key in seen:
            out.repeated += 1
            continue
        if key[1] == "running" and (key[0], "completed") in seen:
            out.misordered += 1  # a step's states in commit order: never back to running
        seen[key] = arrived
        write = expected.get(key)
        if write is None or record["attempt_count"] != 1:
            out.unexpected += 1
            continue
        out.latencies_ms.append((arrived - write.sent) * 1000)
    for key in expected:
        if key in seen:
            continue
        slug, status = key
        if status == "running" and (slug, "completed") in seen:
            out.collapsed += 1
        else:
            out.missing += 1


def worker_of(base: str) -> int:
    (pid,) = run.worker_pids(run.service_pid(base))
    return pid


def rss_mb(pid: int) -> float:
    return run.rss_kb(pid) / 1024


async def fan_out(base: str, dsn: str, args: argparse.Namespace, report: Report) -> None:
    host, port = base.removeprefix("http://").split(":")
    instances = [f"fan{i}" for i in range(1, args.instances + 1)]
    worker = worker_of(base)
    database = psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]
    seconds = args.duration

    # The same writes with no stream open: what they cost the worker by themselves.
    writer = Writer(host, int(port), args.rate, writes("base", instances))
    cpu, pg, began = cpu_seconds(worker), backends_cpu(str(database)), time.monotonic()
    writer.start()
    await asyncio.sleep(seconds)
    done = await writer.stop()
    alone = (cpu_seconds(worker) - cpu) / (time.monotonic() - began)
    pg_alone = (backends_cpu(str(database)) - pg) / (time.monotonic() - began)
    failed = [w for w in done if w.code not in (200, 201)]
    if failed:
        report.errors.append(f"{len(failed)} writes failed without streams, e.g. {failed[0]}")
    report.say(
        f"writes alone (no stream open): {args.rate:g}/s for {seconds:g} s, {write_latency(done)}"
    )

    counts = record_counts(dsn)
    rss_before = rss_mb(worker)
    streams: list[SseStream] = []
    opening = time.monotonic()
    for wave in range(0, args.streams, OPEN_WAVE):
        keys = [
            instances[n % len(instances)] for n in range(wave, min(wave + OPEN_WAVE, args.streams))
        ]
        batch = await asyncio.gather(*(open_stream(host, int(port), k, counts[k]) for k in keys))
        opened = await asyncio.gather(*(await_events(s, 30) for s in batch))
        streams += batch
        if not all(opened):
            statuses = sorted({s.status for s in batch})
            report.errors.append(f"fan-out: a stream did not open (statuses {statuses})")
            break
    report.say(
        f"opened {len(streams)} streams over {len(instances)} instances in"
        f" {time.monotonic() - opening:.1f} s (in waves of {OPEN_WAVE}, each with its snapshot)"
    )
    rss_open = rss_mb(worker)

    writer = Writer(host, int(port), args.rate, writes("fan", instances))
    reads = reads_so_far(base)
    cpu, pg, began = cpu_seconds(worker), backends_cpu(str(database)), time.monotonic()
    client = resource.getrusage(resource.RUSAGE_SELF)
    writer.start()
    await asyncio.sleep(seconds)
    done = await writer.stop()
    elapsed = time.monotonic() - began
    with_streams = (cpu_seconds(worker) - cpu) / elapsed
    reads = reads_so_far(base) - reads
    pg_streams = (backends_cpu(str(database)) - pg) / elapsed
    client_after = resource.getrusage(resource.RUSAGE_SELF)
    client_cpu = (
        client_after.ru_utime + client_after.ru_stime - client.ru_utime - client.ru_stime
    ) / elapsed
    failed = [w for w in done if w.code not in (200, 201)]
    if failed:
        report.errors.append(f"{len(failed)} writes failed with streams open, e.g. {failed[0]}")

    # Wait for the last events, then check every stream.
    by_instance: dict[str, dict[tuple[str, str], Write]] = defaultdict(dict)
    for write in done:
        if write.code in (200, 201):
            by_instance[write.instance][(write.slug, write.status)] = write
    for stream in streams:
        final = {key: w for key, w in by_instance[stream.instance].items()}
        stream.wanted = counts[stream.instance] + len(final)
        stream.count_reached.clear()
        if len(stream.events) >= stream.wanted or stream.ended:
            stream.count_reached.set()
    settle = time.monotonic()
    await asyncio.gather(*(await_events(s, SETTLE_SECONDS) for s in streams))
    settled = time.monotonic() - settle
    rss_after = rss_mb(worker)
    delivery = Delivery()
    for stream in streams:
        check_stream(stream, by_instance[stream.instance], counts[stream.instance], delivery)
    for stream in streams:
        stream.close()
    await asyncio.sleep(2)  # the worker notices the closed streams
    rss_closed = rss_mb(worker)

    lat = delivery.latencies_ms
    expected = sum(len(by_instance[s.instance]) for s in streams)
    p99 = pct(lat, 99)
    report.say(
        f"fan-out: {len(streams)} streams, {args.rate:g} writes/s for {seconds:g} s (the last"
        f" answered after {elapsed:.1f} s; {write_latency(done)}); {len(lat):,} of"
        f" {expected:,} events delivered"
        f" (+{delivery.collapsed} states overtaken by their step's next write), settled"
        f" {settled:.1f} s after the last write"
    )
    report.say(
        f"  write-to-event: p50 {pct(lat, 50):.0f} ms, p99 {p99:.0f} ms,"
        f" max {max(lat, default=0):.0f} ms (goal p99 <= {GOALS['delivery_p99_ms']:.0f} ms:"
        f" {run.verdict(p99, GOALS['delivery_p99_ms'], False)})"
    )
    growth = rss_after - rss_before
    report.say(
        f"  worker RSS: {rss_before:.0f} MB before, {rss_open:.0f} MB with the streams open,"
        f" {rss_after:.0f} MB after the writes, {rss_closed:.0f} MB once closed; growth"
        f" {growth:.0f} MB (goal <= {GOALS['rss_growth_mb']:.0f} MB:"
        f" {run.verdict(growth, GOALS['rss_growth_mb'], False)})"
    )
    per_stream = (with_streams - alone) / max(len(streams), 1)
    report.say(
        f"  CPU: worker {with_streams:.2f} s/s with the streams, {alone:.2f} s/s for the same"
        f" writes alone: {per_stream * 1e6:.0f} us per stream per second; PostgreSQL (this"
        f" database's backends) {pg_streams:.2f} s/s against {pg_alone:.2f}; this client"
        f" {client_cpu:.2f} s/s; the streams' reads: {reads / max(len(done), 1):.2f} per write"
    )
    wrong = delivery.missing + delivery.repeated + delivery.misordered + delivery.unexpected
    if wrong:
        report.errors.append(
            f"fan-out: {delivery.missing} events missing, {delivery.repeated} repeated,"
            f" {delivery.misordered} out of order, {delivery.unexpected} unexpected"
        )


async def healthz(host: str, port: int) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(f"GET /healthz HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        await reader.readuntil(b"\r\n\r\n")
    finally:
        writer.close()


async def control(base: str, size: int, args: argparse.Namespace, report: Report) -> None:
    """The same number of the cheapest requests (`GET /healthz`, no database) opened at once
    while the same writes run: what any burst of that many requests costs the writes."""
    host, port = base.removeprefix("http://").split(":")
    instances = [f"fan{i}" for i in range(1, args.instances + 1)]
    writer = WriterProcess(host, int(port), args.rate, f"c{size}", instances)
    writer.start()
    await asyncio.sleep(BEFORE_BURST_SECONDS + WRITER_START_SECONDS)
    began = time.monotonic()
    await asyncio.gather(*(healthz(host, int(port)) for _ in range(size)))
    finished = time.monotonic()
    await asyncio.sleep(1.0)
    done = await writer.stop()
    report.say(
        f"control: {size} GET /healthz at once, all answered in {finished - began:.1f} s;"
        f" writes before: {write_latency(done, until=began)}; during:"
        f" {write_latency(done, began, finished)}"
    )


async def burst(base: str, dsn: str, size: int, args: argparse.Namespace, report: Report) -> None:
    host, port = base.removeprefix("http://").split(":")
    key = f"burst{size}"
    seed(dsn, [key], args.burst_steps)
    worker = worker_of(base)
    instances = [f"fan{i}" for i in range(1, args.instances + 1)]
    writer = WriterProcess(host, int(port), args.rate, f"b{size}", instances)
    writer.start()
    await asyncio.sleep(BEFORE_BURST_SECONDS + WRITER_START_SECONDS)
    rss_before, overflows, cpu = rss_mb(worker), listen_overflows(), cpu_seconds(worker)
    database = str(psycopg.conninfo.conninfo_to_dict(dsn)["dbname"])
    pg, reads = backends_cpu(database), reads_so_far(base)
    began = time.monotonic()
    streams = await asyncio.gather(
        *(open_stream(host, int(port), key, args.burst_steps) for _ in range(size))
    )
    await asyncio.gather(*(await_events(s, BURST_TIMEOUT) for s in streams))
    answered = [s for s in streams if s.status == 200 and len(s.events) >= args.burst_steps]
    finished = time.monotonic()
    worker_cpu, pg = cpu_seconds(worker) - cpu, backends_cpu(database) - pg
    reads = reads_so_far(base) - reads
    await asyncio.sleep(1.0)
    done = await writer.stop()
    refused: dict[str, int] = defaultdict(int)
    for stream in streams:
        if stream not in answered:
            refused[str(stream.status or "no answer")] += 1
    arrivals = sorted(s.events[args.burst_steps - 1][0] - began for s in answered)
    heads = sorted(s.headers_at - began for s in streams if s.status)
    wrong = 0
    for stream in answered:
        slugs = [orjson.loads(data)["step_slug"] for _, _, data in stream.events]
        wrong += len(set(slugs[: args.burst_steps])) != args.burst_steps
    total = finished - began
    # The goal: every one of 1,000 streams opened at once has its snapshot within 5 s.
    goal = "n/a"
    if size <= 1000:
        goal = run.verdict(total if not refused else math.inf, GOALS["burst_s"], False)
    report.say(
        f"burst of {size} streams of one instance ({args.burst_steps} records), {args.rate:g}"
        f" writes/s running: all answered in {total:.1f} s (goal <= {GOALS['burst_s']:.0f} s"
        f" for 1,000, none refused: {goal}),"
        f" {len(answered)} with their whole snapshot, refused {dict(refused) or 0}"
    )
    report.say(
        f"  response headers: p50 {pct(heads, 50):.2f} s, max {max(heads, default=math.nan):.2f}"
        f" s; whole snapshot: p50 {pct(arrivals, 50):.2f} s, max"
        f" {max(arrivals, default=math.nan):.2f} s; listen queue overflows"
        f" {listen_overflows() - overflows}"
    )
    report.say(
        f"  writes before: {write_latency(done, until=began)}; during:"
        f" {write_latency(done, began, finished)}"
    )
    report.say(
        f"  CPU until all answered: worker {worker_cpu:.2f} s ({worker_cpu / size * 1000:.2f} ms"
        f" per stream, the writes' share included), PostgreSQL (this database's backends)"
        f" {pg:.2f} s; reads {reads:.0f} ({reads / size:.3f} per stream); worker RSS"
        f" {rss_before:.0f} -> {rss_mb(worker):.0f} MB"
    )
    if wrong:
        report.errors.append(f"burst of {size}: {wrong} streams had a wrong snapshot")
    for stream in streams:
        stream.close()
    await asyncio.sleep(2)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--instances", type=int, default=100)
    parser.add_argument("--rate", type=float, default=200, help="writes per second (200)")
    parser.add_argument("--duration", type=float, default=20, help="seconds of writes (20)")
    parser.add_argument(
        "--burst", default="1000,1500", help="sizes of the bursts, comma-separated ('' for none)"
    )
    parser.add_argument("--burst-steps", type=int, default=100)
    parser.add_argument("--skip-fan-out", action="store_true")
    args = parser.parse_args(argv)
    bursts = [int(n) for n in args.burst.split(",") if n.strip()]
    report = Report()
    with (
        tempfile.TemporaryDirectory(prefix="steprecord-bench-") as tmp_name,
        common.postgres_server(Path(tmp_name)) as server,
        common.fresh_database(server, DB_NAME) as dsn,
    ):
        instances = [f"fan{i}" for i in range(1, args.instances + 1)]
        seed(dsn, instances, SEED_STEPS)
        log = Path(tmp_name) / "service.log"
        with run.service(dsn, log, workers=1) as base:
            model, version = run.cpu_and_postgres(dsn)
            header = [
                f"machine:    {run.CPUS} CPUs (nproc), {model}; load average"
                f" {' '.join(f'{x:.2f}' for x in os.getloadavg())} at the start",
                f"postgresql: {version}",
                f"command:    {shlex.join([Path(sys.orig_argv[0]).name, *sys.orig_argv[1:]])}",
                f"service:    steprecord serve --workers 1; worker RSS idle"
                f" {rss_mb(worker_of(base)):.0f} MB",
            ]
            for line in header:
                report.say(line)
            if not args.skip_fan_out:
                asyncio.run(fan_out(base, dsn, args, report))
            for size in bursts:
                asyncio.run(burst(base, dsn, size, args, report))
                asyncio.run(control(base, size, args, report))
            report.say(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
            errors_in_log = [
                line for line in run.tail(log, 20000).splitlines() if "Traceback" in line
            ]
            if errors_in_log:
                report.errors.append(f"the service logged {len(errors_in_log)} tracebacks")
    print("\n".join(report.lines))
    for error in report.errors:
        print(f"ERROR {error}")
    if not report.errors:
        print("errors: none")
    return 1 if report.errors else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
    except (RuntimeError, psycopg.Error) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
