"""The dashboard's instance page with 1,000 steps: server render and browser load times.

Run from the repository root: `.venv-test/bin/python -m tests.bench.ui [--rounds N]`.
It creates a fresh database (on the server in `DATABASE_URL`, or an embedded PostgreSQL in a
temporary directory), starts `steprecord serve`, reports one instance of 1,000 steps through
the batch endpoint (a tenth of them retried, some still running), then measures:

- server: `GET /ui/instances/{key}` answered in full (the three queries and the template),
  over HTTP from this process, median and p95 of `--rounds` requests after a warm-up;
- browser: Debian's chromium loading the same page from a blank tab until its `load` event
  (request, HTML, stylesheet, script, layout), median and p95 of `--rounds` loads, and the
  part after the last byte of HTML arrived.

`--screenshot PATH` also writes a picture of a small, realistic instance page (the README's).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from tests.bench.common import scratch_database  # noqa: E402
from tests.support.browser import chromium_browser  # noqa: E402
from tests.support.servers import start_server, stop  # noqa: E402

STEPS = 1000
KEY = "bench-1000"


def stamp(value: datetime) -> str:
    return value.astimezone(UTC).isoformat().replace("+00:00", "Z")


def send(client: httpx.Client, events: list[dict[str, Any]]) -> None:
    for start in range(0, len(events), 1000):
        answer = client.post("/v1/events", json={"events": events[start : start + 1000]})
        answer.raise_for_status()
        bad = [r for r in answer.json()["results"] if r["status"] >= 300]
        assert not bad, bad[:3]


def load_big_instance(client: httpx.Client) -> None:
    """1,000 steps over an hour: every tenth failed once and was retried, the last 20 still
    run, every fiftieth's first attempt was superseded. Four batches, each of distinct steps."""
    base = datetime.now(UTC) - timedelta(hours=1)
    phases: list[list[dict[str, Any]]] = [[], [], [], []]
    for i in range(STEPS):
        start = base + timedelta(seconds=3 * i)
        event = {"instance_key": KEY, "step_slug": f"step-{i:04}", "attempt": 1}
        phases[0].append({**event, "kind": "start", "started_at": stamp(start)})
        end = stamp(start + timedelta(seconds=2))
        if i >= STEPS - 20:
            continue
        if i % 50 == 0:
            phases[1].append({**event, "kind": "start", "attempt": 2, "started_at": end})
        elif i % 10 == 0:
            fail = {"error_code": "Timeout", "error_message": "upstream took too long"}
            phases[1].append({**event, "kind": "fail", "completed_at": end, **fail})
            retry = stamp(start + timedelta(seconds=4))
            phases[2].append({**event, "kind": "start", "attempt": 2, "started_at": retry})
            done = stamp(start + timedelta(seconds=6))
            phases[3].append({**event, "kind": "complete", "attempt": 2, "completed_at": done})
        else:
            phases[1].append({**event, "kind": "complete", "completed_at": end, "output": {"n": i}})
    for events in phases:
        send(client, events)


def load_demo_instance(client: httpx.Client, key: str) -> None:
    """A small order, as an orchestrator reports it: a retry, a superseded worker, a swept
    step, one running now and one still to come."""
    now = datetime.now(UTC)

    def at(seconds: float) -> str:
        return stamp(now - timedelta(seconds=120) + timedelta(seconds=seconds))

    e = {"instance_key": key}
    events: list[dict[str, Any]] = [
        {**e, "step_slug": "validate", "kind": "start", "attempt": 1, "started_at": at(0)},
        {**e, "step_slug": "validate", "kind": "complete", "attempt": 1, "completed_at": at(4)},
        {**e, "step_slug": "reserve-stock", "kind": "start", "attempt": 1, "started_at": at(5)},
        {**e, "step_slug": "charge", "kind": "start", "attempt": 1, "started_at": at(6)},
        {
            **e,
            "step_slug": "charge",
            "kind": "fail",
            "attempt": 1,
            "completed_at": at(20),
            "error_code": "CardDeclined",
            "error_message": "issuer said no",
        },
    ]
    events += [
        {
            **e,
            "step_slug": "reserve-stock",
            "kind": "complete",
            "attempt": 1,
            "completed_at": at(25),
        },
        {**e, "step_slug": "charge", "kind": "start", "attempt": 2, "started_at": at(30)},
        {
            **e,
            "step_slug": "charge",
            "kind": "complete",
            "attempt": 2,
            "completed_at": at(41),
            "output": {"charge_id": "ch_1"},
        },
        {**e, "step_slug": "pack", "kind": "start", "attempt": 1, "started_at": at(42)},
        {**e, "step_slug": "pack", "kind": "start", "attempt": 2, "started_at": at(60)},
        {**e, "step_slug": "pack", "kind": "complete", "attempt": 2, "completed_at": at(75)},
        {**e, "step_slug": "label", "kind": "start", "attempt": 1, "started_at": at(76)},
        {
            **e,
            "step_slug": "label",
            "kind": "fail",
            "attempt": 1,
            "completed_at": at(96),
            "error_code": "lease_expired",
            "error_message": "no heartbeat arrived before the lease expired",
        },
        {**e, "step_slug": "label", "kind": "start", "attempt": 2, "started_at": at(98)},
        {**e, "step_slug": "notify", "kind": "declare"},
    ]
    for event in events:  # one at a time: later events of a step build on earlier ones
        send(client, [event])


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--screenshot", type=Path, help="also write the README's picture here")
    args = parser.parse_args()
    if shutil.which("chromium") is None:
        sys.exit("needs Debian's chromium: apt-get install chromium")
    with scratch_database("ui") as url:
        base, proc = start_server(url, env={"STEPRECORD_SWEEP_SECONDS": "0"})
        try:
            with httpx.Client(base_url=base, timeout=60) as client:
                load_big_instance(client)
                page_path = f"/ui/instances/{KEY}"
                for _ in range(3):
                    client.get(page_path).raise_for_status()
                server = []
                for _ in range(args.rounds):
                    began = time.perf_counter()
                    answer = client.get(page_path)
                    server.append((time.perf_counter() - began) * 1000)
                    answer.raise_for_status()
                assert answer.text.count("<tr data-step=") == STEPS
                size = len(answer.content)
                if args.screenshot:
                    load_demo_instance(client, "order-1042")
            with chromium_browser() as browser:
                page = browser.new_page(base_url=base, viewport={"width": 1100, "height": 800})
                page.goto(page_path)
                loads, served = [], []
                for _ in range(args.rounds):
                    page.goto("about:blank")  # no previous page to unload in the figure
                    page.goto(page_path, wait_until="load")
                    timing = page.evaluate(
                        "(({responseEnd, loadEventEnd}) => [responseEnd, loadEventEnd])"
                        "(performance.getEntriesByType('navigation')[0])"
                    )
                    served.append(timing[0])
                    loads.append(timing[1])
                assert page.locator("rect.bar").count() >= STEPS
                if args.screenshot:
                    page.set_viewport_size({"width": 1000, "height": 600})
                    page.goto("/ui/instances/order-1042", wait_until="load")
                    page.wait_for_timeout(300)
                    page.screenshot(path=str(args.screenshot), full_page=True)
        finally:
            stop(proc)
    print(f"instance page, {STEPS} steps, {size // 1024} KiB of HTML, {args.rounds} rounds")
    print(
        f"  server render (HTTP, full answer): median {statistics.median(server):.1f} ms,"
        f" p95 {percentile(server, 0.95):.1f} ms"
    )
    print(
        f"  browser load (navigation to load event): median {statistics.median(loads):.0f} ms,"
        f" p95 {percentile(loads, 0.95):.0f} ms"
    )
    browser_only = [load - end for load, end in zip(loads, served, strict=True)]
    print(
        f"    of which after the last byte (parse, style, layout, script):"
        f" median {statistics.median(browser_only):.0f} ms"
    )


if __name__ == "__main__":
    main()
