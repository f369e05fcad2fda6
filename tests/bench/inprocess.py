"""A worker's CPU per single event without the HTTP server: the app called in-process.

Run from the repository root: `.venv/bin/python -m tests.bench.inprocess [--events N]
[--profile]`. It builds the service's app (as a worker does, on a fresh database), then sends
it `events.lua`'s requests one after another as ASGI calls: the `start` of a new step and
the `complete` of that step, each answered before the next. It prints this process's CPU
time per event: what the app costs a worker, without uvicorn's HTTP parsing and writing
or any other client or process. One event at a time, so there is no queueing and the
figure is steady from run to run; compare two trees or settings with it. With `--profile`,
cProfile's summary of the measured events (which the profiler itself slows about twofold).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

from app.core.config import Settings
from app.main import create_app
from tests.bench import common, run
from tests.bench.decode import COMPLETE, START
from tests.support.http import asgi_scope

WARM_UP = 200


async def _post(app: Any, path: str, body: bytes) -> None:
    messages: list[dict[str, Any]] = []
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:  # the app reads only the body; a disconnect would end its wait
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        messages.append(message)

    await app(asgi_scope("POST", path, body), receive, send)
    if messages[0]["status"] not in (200, 201):
        raise RuntimeError(f"{path} answered {messages[0]['status']}: {messages[1:]}")


async def events(dsn: str, count: int, profile: cProfile.Profile | None) -> float:
    """CPU seconds per event of `count` events (after a warm-up)."""
    app = create_app(Settings(database_url=dsn))
    start, complete = orjson.dumps(START), orjson.dumps(COMPLETE)
    async with app.router.lifespan_context(app):

        async def step(n: int) -> None:
            path = f"/v1/instances/e{n % 500}/steps/s{n}"
            await _post(app, f"{path}/start", start)
            await _post(app, f"{path}/complete", complete)

        for n in range(WARM_UP):
            await step(n)
        began = time.process_time()
        if profile is not None:
            profile.enable()
        for n in range(WARM_UP, WARM_UP + count // 2):
            await step(n)
        if profile is not None:
            profile.disable()
        return (time.process_time() - began) / (count // 2 * 2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=6000, help="events measured (6000)")
    parser.add_argument("--profile", action="store_true", help="print cProfile's summary")
    args = parser.parse_args()
    profile = cProfile.Profile() if args.profile else None
    with (
        tempfile.TemporaryDirectory(prefix="steprecord-bench-") as tmp,
        common.postgres_server(Path(tmp)) as server,
        common.fresh_database(server, run.DB_NAME) as dsn,
        open(os.devnull, "w") as devnull,
    ):
        stdout, sys.stdout = sys.stdout, devnull  # the access log lines
        try:
            seconds = asyncio.run(events(dsn, args.events, profile))
        finally:
            sys.stdout = stdout
    print(f"{seconds * 1e6:.0f} us of CPU per event, {args.events} events, in-process")
    if profile is not None:
        pstats.Stats(profile).sort_stats("cumulative").print_stats(40)
    return 0


if __name__ == "__main__":
    sys.exit(main())
