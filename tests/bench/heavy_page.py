"""The dashboard's heaviest instance page, 1,000 steps of 50 attempts each: its size, its
time, and another client's reads while three of it render at once.

Run from the repository root:
`DATABASE_URL=... .venv-test/bin/python -m tests.bench.heavy_page [--base DIR] [--seconds 10]`,
where `--base` is a tree of an earlier commit to measure too (`git archive REV | tar -x -C
DIR`; it is served with `cwd` there, so its `app` is the one imported; both trees must have
the same schema).

On a fresh database of the server in `DATABASE_URL` it reports, through one tree's service,
an instance `heavy` of 1,000 steps, each failed 50 times (attempts 1-50, each a `fail` with
its own start: 50,000 attempts), and a small instance `calm` of 10 steps. Then for each tree:
one `steprecord serve` (one worker) with two read tokens, and

- the page: `GET /ui/instances/heavy`, its size and its median time over 5 requests;
- the other client alone: a second token reading `GET /v1/instances/calm/steps`, one request
  after the other, for `--seconds`: p50 and p99;
- the same reads while three clients of the first token each ask for the heavy page again and
  again: p50, p99 and the pages answered meanwhile.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from tests.support.databases import create_database, drop_database  # noqa: E402
from tests.support.servers import free_port, stop, wait_ready  # noqa: E402

STEPS, ATTEMPTS = 1000, 50
ENV = {"STEPRECORD_SWEEP_SECONDS": "0", "STEPRECORD_STATEMENT_TIMEOUT": "60"}


@contextmanager
def served(tree: Path, url: str) -> Iterator[tuple[str, list[str]]]:
    """`steprecord serve` of `tree` on `url` with two new read tokens: (its URL, tokens)."""
    env = {**os.environ, **ENV, "DATABASE_URL": url}
    command = [sys.executable, "-m", "app.cli"]
    subprocess.run([*command, "migrate"], cwd=tree, env=env, check=True, capture_output=True)
    tokens = []
    for _ in range(2):
        made = subprocess.run(
            [*command, "token", "create", "r-" + uuid.uuid4().hex[:6], "--scope", "write"],
            cwd=tree,
            env=env,
            check=True,
            capture_output=True,
            text=True,
        )
        tokens.append(made.stdout.strip())
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
        yield base, tokens
    finally:
        stop(proc)


def stamp(value: datetime) -> str:
    return value.astimezone(UTC).isoformat().replace("+00:00", "Z")


def load(base: str, token: str) -> None:
    """The heavy instance (in batches of 100, two at a time) and the calm one."""
    began = datetime.now(UTC) - timedelta(days=1)
    events: list[dict[str, Any]] = []
    for step in range(STEPS):
        for attempt in range(1, ATTEMPTS + 1):
            start = began + timedelta(seconds=step * 60 + attempt)
            events.append(
                {
                    "instance_key": "heavy",
                    "step_slug": f"step-{step:04}",
                    "kind": "fail",
                    "attempt": attempt,
                    "started_at": stamp(start),
                    "completed_at": stamp(start + timedelta(milliseconds=500)),
                    "error_code": "Timeout",
                    "error_message": "Traceback (most recent call last):\n  ...\nTimeout: slow",
                }
            )
    events += [{"instance_key": "calm", "step_slug": f"s{n}", "kind": "declare"} for n in range(10)]
    headers = {"Authorization": f"Bearer {token}"}
    # A step's events stay in one batch, in order: each batch holds 2 whole steps.
    batches = [events[i : i + 100] for i in range(0, len(events), 100)]
    with httpx.Client(base_url=base, headers=headers, timeout=300) as client:

        def send(batch: list[dict[str, Any]]) -> None:
            answer = client.post("/v1/events", json={"events": batch})
            answer.raise_for_status()
            bad = [r for r in answer.json()["results"] if r["status"] >= 300]
            assert not bad, bad[:3]

        with ThreadPoolExecutor(2) as threads:
            list(threads.map(send, batches))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def reads(base: str, token: str, seconds: float) -> list[float]:
    took = []
    headers = {"Authorization": f"Bearer {token}"}
    with httpx.Client(base_url=base, headers=headers, timeout=60) as client:
        ends = time.monotonic() + seconds
        while time.monotonic() < ends:
            began = time.perf_counter()
            client.get("/v1/instances/calm/steps").raise_for_status()
            took.append((time.perf_counter() - began) * 1000)
    return took


def measure(tree: Path, url: str, seconds: float) -> dict[str, Any]:
    with served(tree, url) as (base, (page_token, other)):
        headers = {"Authorization": f"Bearer {page_token}"}
        with httpx.Client(base_url=base, headers=headers, timeout=120) as client:
            client.get("/ui/instances/heavy").raise_for_status()  # warm
            times = []
            for _ in range(5):
                began = time.perf_counter()
                answer = client.get("/ui/instances/heavy")
                times.append((time.perf_counter() - began) * 1000)
                answer.raise_for_status()
            size = len(answer.content)
        alone = reads(base, other, seconds)
        done = threading.Event()
        rendered = [0, 0, 0]

        def render(n: int) -> None:
            with httpx.Client(base_url=base, headers=headers, timeout=120) as client:
                while not done.is_set():
                    client.get("/ui/instances/heavy").raise_for_status()
                    rendered[n] += 1

        with ThreadPoolExecutor(3) as threads:
            running = [threads.submit(render, n) for n in range(3)]
            time.sleep(1)  # the renders under way
            loaded = reads(base, other, seconds)
            done.set()
            for future in running:
                future.result()
    return {
        "size": size,
        "page": statistics.median(times),
        "alone": (statistics.median(alone), percentile(alone, 0.99)),
        "loaded": (statistics.median(loaded), percentile(loaded, 0.99)),
        "pages": sum(rendered),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", type=Path, help="a tree of an earlier commit, measured too")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--database", help="a database this benchmark loaded and kept: reused")
    parser.add_argument("--keep", action="store_true", help="keep the database it loads")
    args = parser.parse_args()
    server_dsn = os.environ.get("DATABASE_URL")
    if not server_dsn:
        raise SystemExit("set DATABASE_URL to a PostgreSQL server (the benchmark makes a database)")
    trees = {"this tree": ROOT, **({"base": args.base.resolve()} if args.base else {})}
    name = "steprecord_bench_heavy_" + uuid.uuid4().hex[:6]
    url = args.database or create_database(server_dsn, name)
    try:
        if not args.database:
            with served(ROOT, url) as (base, tokens):
                began = time.monotonic()
                load(base, tokens[0])
                print(f"loaded {STEPS * ATTEMPTS} attempts in {time.monotonic() - began:.0f} s")
        print("| tree | page KiB | page ms | other alone p50/p99 ms | other, 3 pages at once")
        print("|---|---|---|---|---|")
        for label, tree in trees.items():
            found = measure(tree, url, args.seconds)
            a50, a99 = found["alone"]
            l50, l99 = found["loaded"]
            print(
                f"| {label} | {found['size'] // 1024:,} | {found['page']:.0f}"
                f" | {a50:.1f} / {a99:.1f} | {l50:.1f} / {l99:.1f} ({found['pages']} pages) |",
                flush=True,
            )
    finally:
        if args.keep and not args.database:
            print(f"kept: --database {url}")
        elif not args.database:
            drop_database(server_dsn, name)


if __name__ == "__main__":
    main()
