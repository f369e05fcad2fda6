"""A request's memory bounded by what it answers, and slow bodies: a worker's memory for large
pages and unread streams, and what clients sending slow bodies without a token hold.

Run from the repository root:
`DATABASE_URL=... .venv/bin/python -m tests.bench.bounds [--base DIR]`, where `--base` is a
tree of an earlier commit to measure too (`git archive REV | tar -x -C DIR`; it is served with
`cwd` there, so its `app` is the one imported).

For each tree, on a fresh database of the server in `DATABASE_URL`: one `steprecord serve`
(one worker, `STEPRECORD_MAX_CONNECTIONS=20`), a read token (so a request without one is
refused 401), and an instance of 84 steps each with an inline output of 1 MiB. It measures
the worker's resident memory (sampled every 5 ms, its peak over the idle value before):

- one `GET /v1/instances/big/steps?limit=1000`, read whole; then five at once;
- 16 streams of the instance whose clients never read (a receive buffer of 4 KiB), for 5 s;

and then 22 clients without a token, each sending `POST /v1/events` with `Content-Length:
1000000000` and one byte of body every 4 s, for 12 s: how many connections the server ended,
and how a `GET /healthz` from another client was answered meanwhile (every half second).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import psycopg  # noqa: E402

from tests.support.databases import create_database, drop_database  # noqa: E402
from tests.support.servers import free_port, stop, wait_ready  # noqa: E402

STEPS = 84
BLOB = "x" * (1024 * 1024 - len('{"blob": ""}'))
ENV = {"STEPRECORD_MAX_CONNECTIONS": "20", "STEPRECORD_SWEEP_SECONDS": "0"}


@contextmanager
def served(tree: Path, url: str) -> Iterator[tuple[str, subprocess.Popen[bytes], str]]:
    """`steprecord serve` of `tree` on `url`, with a read token: (its URL, process, token)."""
    env = {**os.environ, **ENV, "DATABASE_URL": url}
    command = [sys.executable, "-m", "app.cli"]
    subprocess.run([*command, "migrate"], cwd=tree, env=env, check=True, capture_output=True)
    made = subprocess.run(
        [*command, "token", "create", "bench", "--scope", "read"],
        cwd=tree,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    port = free_port()
    proc = subprocess.Popen(
        [*command, "serve", "--port", str(port)],
        cwd=tree,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, proc)
        yield base, proc, made.stdout.strip()
    finally:
        stop(proc)


def seed(url: str) -> None:
    output = json.dumps({"blob": BLOB})
    with psycopg.connect(url) as conn:
        conn.execute(
            "INSERT INTO process_instance (id, instance_key)"
            " VALUES (steprecord_instance_id('big'), 'big')"
        )
        for n in range(STEPS):
            conn.execute(
                "INSERT INTO workflow_step_record (instance_id, step_slug, ordinal, status,"
                " attempt_count, started_at) VALUES (steprecord_instance_id('big'), %s, %s,"
                " 'running', 1, now())",
                (f"s{n:02}", n),
            )
            conn.execute(
                "UPDATE workflow_step_record SET status = 'completed', completed_at = now(),"
                " output = %s::jsonb WHERE instance_id = steprecord_instance_id('big')"
                " AND step_slug = %s",
                (output, f"s{n:02}"),
            )


def peak_rise(pid: int, work: Callable[[], None]) -> tuple[float, float]:
    """The worker's resident memory before `work` (MB), and its peak rise while it runs."""
    before = rss(pid)
    peak = [before]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss(pid))
            time.sleep(0.005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        work()
    finally:
        done.set()
        sampler.join()
    return before / 1e6, (peak[0] - before) / 1e6


def rss(pid: int) -> int:
    """A process's resident memory in bytes (Linux)."""
    resident = Path(f"/proc/{pid}/statm").read_text().split()[1]
    return int(resident) * os.sysconf("SC_PAGE_SIZE")


def pages(base: str, token: str, count: int, statuses: Counter[int]) -> Callable[[], None]:
    """`count` reads at once of the instance's first page of `limit=1000`; their statuses
    counted in `statuses` (a 503: the statement timeout)."""

    def work() -> None:
        def one(_: int) -> None:
            answer = httpx.get(
                f"{base}/v1/instances/big/steps",
                params={"limit": 1000},
                headers={"Authorization": f"Bearer {token}"},
                timeout=120,
            )
            statuses[answer.status_code] += 1

        with ThreadPoolExecutor(count) as threads:
            list(threads.map(one, range(count)))

    return work


def unread_streams(base: str, token: str, count: int, seconds: float) -> Callable[[], None]:
    host, port = base.removeprefix("http://").split(":")

    def work() -> None:
        with ExitStack() as held:
            for _ in range(count):
                sock = held.enter_context(socket.socket())
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                sock.connect((host, int(port)))
                sock.sendall(
                    b"GET /v1/instances/big/stream HTTP/1.1\r\nHost: x\r\n"
                    + f"Authorization: Bearer {token}\r\n\r\n".encode()
                )
            time.sleep(seconds)

    return work


def slow_bodies(base: str, count: int, seconds: float) -> tuple[int, float, Counter[str]]:
    """`count` slow bodies without a token for `seconds`: how many connections the server
    ended, the second by which the last of those ended, and the answers to /healthz
    meanwhile."""
    host, port = base.removeprefix("http://").split(":")
    answers: Counter[str] = Counter()
    last_end = 0.0
    with ExitStack() as held:
        socks = []
        for _ in range(count):
            sock = held.enter_context(socket.create_connection((host, int(port))))
            sock.sendall(
                b"POST /v1/events HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                b"content-length: 1000000000\r\n\r\n{"
            )
            sock.setblocking(False)
            socks.append(sock)
        began = last_byte = time.monotonic()
        open_ = set(range(count))
        while time.monotonic() - began < seconds:
            try:
                status = str(httpx.get(f"{base}/healthz", timeout=2).status_code)
            except httpx.HTTPError as exc:
                status = type(exc).__name__
            answers[status] += 1
            trickle = time.monotonic() - last_byte >= 4
            for n in sorted(open_):
                if ended(socks[n]) or (trickle and not sent(socks[n])):
                    open_.discard(n)
                    last_end = time.monotonic() - began
            if trickle:
                last_byte = time.monotonic()
            time.sleep(0.5)
    return count - len(open_), last_end, answers


def ended(sock: socket.socket) -> bool:
    """Whether the server closed the connection (what it sent is read and dropped)."""
    try:
        while True:
            if not sock.recv(65536):
                return True
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True


def sent(sock: socket.socket) -> bool:
    """One more byte of the body sent (False: the connection is gone)."""
    try:
        sock.sendall(b"x")
    except OSError:
        return False
    return True


def measure(tree: Path, server_dsn: str) -> dict[str, object]:
    name = "steprecord_bench_bounds_" + uuid.uuid4().hex[:6]
    url = create_database(server_dsn, name)
    try:
        with served(tree, url) as (base, proc, token):
            seed(url)
            statuses: Counter[int] = Counter()
            idle, one = peak_rise(proc.pid, pages(base, token, 1, statuses))
            _, five = peak_rise(proc.pid, pages(base, token, 5, statuses))
            _, streams = peak_rise(proc.pid, unread_streams(base, token, 16, 5.0))
            closed, within, answers = slow_bodies(base, 22, 12.0)
        return {
            "idle MB": round(idle),
            "one page of limit=1000: peak rise MB": round(one),
            "five at once: peak rise MB": round(five),
            "the six pages' statuses": dict(statuses),
            "16 unread streams, 5 s: peak rise MB": round(streams),
            "slow bodies: connections ended by the server of 22": closed,
            "slow bodies: the last ended after s": round(within, 1),
            "slow bodies: /healthz answers": dict(answers),
        }
    finally:
        drop_database(server_dsn, name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, help="a tree of an earlier commit, measured too")
    args = parser.parse_args()
    server_dsn = os.environ.get("DATABASE_URL")
    if not server_dsn:
        raise SystemExit("set DATABASE_URL to a PostgreSQL server (the benchmark makes a database)")
    trees = {"this tree": ROOT, **({"base": args.base.resolve()} if args.base else {})}
    for label, tree in trees.items():
        print(label, json.dumps(measure(tree, server_dsn), indent=2), flush=True)


if __name__ == "__main__":
    main()
