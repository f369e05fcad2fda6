"""Tokens flooding the pool: a calm token's latency alone and under their floods.

Run from the repository root: `.venv-test/bin/python -m tests.bench.share [--seconds 10]`.
On a fresh database (the server in `DATABASE_URL`, or an embedded PostgreSQL) it creates a
calm write token, two flooding ones, and two flooding ones of one tenant (key prefix
`acme:`), and, for each configuration (the shares of the pool, half of its 10 connections,
with no reserve as before it existed, then with the default reserve of 2; and no share to
speak of, `STEPRECORD_POOL_SHARE_PER_TOKEN=10` and no reserve), starts `steprecord serve` (one
worker) and measures the calm token: one client sending, one after the other, a `start` of a
new step and a read of its instance's first page, for `--seconds`:

- alone: nothing else runs;
- under a flood of blocked writes: one flooding token keeps 40 `complete` requests in flight
  on a record whose row lock this process holds (each waits until the 5 s statement timeout,
  then is sent again), a client taking every connection it is given and holding it;
- two tokens blocked: the two flooding tokens do so at once (40 requests each);
- one tenant blocked: the two flooding tokens of `acme:` do so at once, on a record of theirs;
- under a flood of batches: the flooding token keeps 40 `POST /v1/events` of 200 new steps
  each in flight, sending each again as soon as it is answered.

It reports, per configuration and load, the calm token's requests per second, p50, p99 and
its answers other than 2xx; and how the flooding tokens' requests were answered.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import psycopg  # noqa: E402

from tests.bench.common import scratch_database  # noqa: E402
from tests.support.servers import start_server, steprecord, stop  # noqa: E402

FLOOD = 40
BATCH = 200
# The settings of each configuration (beside a pool of 10).
CONFIGURATIONS: dict[str, dict[str, str]] = {
    "shares 5 of 10, no reserve (before the reserve)": {"STEPRECORD_POOL_RESERVE": "0"},
    "shares 5 of 10, reserve 2 (default)": {},
    "no share (10 of 10), no reserve": {
        "STEPRECORD_POOL_SHARE_PER_TOKEN": "10",
        "STEPRECORD_POOL_RESERVE": "0",
    },
}
LOADS = ("alone", "blocked", "two tokens blocked", "one tenant blocked", "batches")
TENANT = "acme:"


def token(url: str, name: str, prefix: str | None = None) -> str:
    reach = () if prefix is None else ("--prefix", prefix)
    done = steprecord(url, "token", "create", name, "--scope", "write", *reach)
    if done.returncode != 0:
        raise SystemExit(done.stderr)
    return done.stdout.strip()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def calm(base: str, secret: str, seconds: float) -> dict[str, Any]:
    """The calm token's requests, one after the other, for `seconds`."""
    key = "calm-" + uuid.uuid4().hex[:8]
    headers = {"Authorization": f"Bearer {secret}"}
    took: list[float] = []
    answers: Counter[int] = Counter()
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=60) as client:
        ends = time.monotonic() + seconds
        n = 0
        while time.monotonic() < ends:
            n += 1
            for request in (
                client.build_request(
                    "POST", f"/v1/instances/{key}/steps/s{n}/start", json={"attempt": 1}
                ),
                client.build_request("GET", f"/v1/instances/{key}/steps", params={"limit": 10}),
            ):
                began = time.monotonic()
                answer = await client.send(request)
                took.append(time.monotonic() - began)
                answers[answer.status_code] += 1
    return {
        "rate": len(took) / seconds,
        "p50": statistics.median(took) * 1000,
        "p99": percentile(took, 0.99) * 1000,
        "not_2xx": {status: count for status, count in answers.items() if status >= 300},
    }


async def flood(
    base: str, secret: str, kind: str, locked: str, stop_at: asyncio.Event
) -> Counter[int]:
    """The flooding token keeps `FLOOD` requests in flight until `stop_at` is set."""
    headers = {"Authorization": f"Bearer {secret}"}
    answers: Counter[int] = Counter()
    limits = httpx.Limits(max_connections=FLOOD)
    async with httpx.AsyncClient(
        base_url=base, headers=headers, timeout=60, limits=limits
    ) as client:

        async def one(worker: int) -> None:
            round_ = 0
            while not stop_at.is_set():
                round_ += 1
                if kind == "blocked":
                    answer = await client.post(
                        f"/v1/instances/{locked}/steps/a/complete",
                        json={"attempt": 1, "output": {"n": 1}},
                    )
                else:
                    key = f"flood-{worker}-{round_}"
                    events = [
                        {"instance_key": key, "step_slug": f"s{i}", "kind": "start", "attempt": 1}
                        for i in range(BATCH)
                    ]
                    answer = await client.post("/v1/events", json={"events": events})
                answers[answer.status_code] += 1

        await asyncio.gather(*(one(worker) for worker in range(FLOOD)))
    return answers


async def measure(
    base: str, calm_token: str, floods: list[tuple[str, str]], kind: str, seconds: float
) -> str:
    """The calm token's figures while each (token, locked key) of `floods` floods as `kind`
    says (none: alone)."""
    if not floods:
        found = await calm(base, calm_token, seconds)
        flooded: Counter[int] = Counter()
    else:
        stop_at = asyncio.Event()
        flooding = [
            asyncio.create_task(flood(base, secret, kind, locked, stop_at))
            for secret, locked in floods
        ]
        await asyncio.sleep(2)  # the flood under way
        found = await calm(base, calm_token, seconds)
        stop_at.set()
        flooded = sum([await task for task in flooding], Counter())
    return (
        f"| {found['rate']:.0f} | {found['p50']:.1f} | {found['p99']:.1f}"
        f" | {found['not_2xx'] or 'none'} | {dict(sorted(flooded.items())) or '—'} |"
    )


LOCK = (
    "SELECT r.id FROM workflow_step_record r JOIN process_instance p"
    " ON p.id = r.instance_id WHERE p.instance_key = ANY(%s) FOR UPDATE OF r"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    with scratch_database("share") as url:
        calm_token = token(url, "calm")
        flooders = [token(url, "flood"), token(url, "flood-2")]
        tenant = [token(url, "acme-a", TENANT), token(url, "acme-b", TENANT)]
        for name, settings in CONFIGURATIONS.items():
            env = {"STEPRECORD_SWEEP_SECONDS": "0", "STEPRECORD_POOL_SIZE": "10", **settings}
            # Records no earlier flood completed: one for the tokens, one in the tenant's prefix.
            locked = "locked-" + uuid.uuid4().hex[:8]
            tenant_locked = TENANT + locked
            base, proc = start_server(url, env=env)
            try:
                with httpx.Client(base_url=base, timeout=60) as setup:
                    for secret, key in ((flooders[0], locked), (tenant[0], tenant_locked)):
                        setup.post(
                            f"/v1/instances/{key}/steps/a/start",
                            json={"attempt": 1},
                            headers={"Authorization": f"Bearer {secret}"},
                        ).raise_for_status()
                print(f"\n{name}\n")
                print("| load | calm req/s | p50 ms | p99 ms | calm not 2xx | flood answers |")
                print("|---|---|---|---|---|---|")
                for kind in LOADS:
                    floods = {
                        "alone": [],
                        "blocked": [(flooders[0], locked)],
                        "two tokens blocked": [(secret, locked) for secret in flooders],
                        "one tenant blocked": [(secret, tenant_locked) for secret in tenant],
                        "batches": [(flooders[0], locked)],
                    }[kind]
                    flooding = "batches" if kind == "batches" else "blocked"
                    with psycopg.connect(url) as holder:
                        holder.execute(LOCK, ([locked, tenant_locked],))
                        if kind in ("alone", "batches"):
                            holder.rollback()
                        line = asyncio.run(
                            measure(base, calm_token, floods, flooding, args.seconds)
                        )
                        holder.rollback()
                    print(f"| {kind} {line}", flush=True)
            finally:
                stop(proc)


if __name__ == "__main__":
    main()
