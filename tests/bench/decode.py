"""What decoding and validating a request body costs on the hot paths, per event.

Run from the repository root: `.venv/bin/python -m tests.bench.decode`.
In one process, no server or database: the bodies `events.lua` and `batch.lua` send, parsed
and checked as the service does (`app.core.serialize.loads`, then `app.api.bodies`), and, for the
single events, by pydantic-core's JSON validation of the same model (`model_validate_json`),
which a service could use instead. Each figure is the best of several repeats, so it is the
cost of the work, not of the machine's other load. Compare with the workers' CPU per event
(`tests.bench.cpu`): what a faster decoder could save is at most what decoding costs.
"""

from __future__ import annotations

import argparse
import sys
import timeit
from collections.abc import Callable
from typing import Any

import orjson

from app.api.bodies import BODIES, parse_batch_event, parse_envelope, parse_event
from app.api.routes.common import MAX_BATCH_DEPTH
from app.core.domain import Kind
from app.core.serialize import loads

STAMP = "2026-12-05T10:00:00Z"
LATER = "2026-12-05T10:00:01Z"
OUTPUT = {"a": 1, "b": "x", "n": 123}  # common.lua's OUTPUT
START = {"attempt": 1, "started_at": STAMP}
COMPLETE = {"attempt": 1, "started_at": STAMP, "completed_at": LATER, "output": OUTPUT}
BATCH_SIZE = 100
SINGLE: tuple[tuple[Kind, dict[str, Any]], ...] = (("start", START), ("complete", COMPLETE))


def batch_body() -> bytes:
    """A batch as batch.lua sends it: half starts of new steps, half completes."""
    half = BATCH_SIZE // 2
    names = [{"instance_key": f"b{g}", "step_slug": f"s1-2-{g}"} for g in range(half)]
    events: list[dict[str, Any]] = [{**n, "kind": "start", **START} for n in names]
    events += [{**n, "kind": "complete", **COMPLETE} for n in names]
    return orjson.dumps({"events": events})


def best_us(work: Callable[[], object], number: int) -> float:
    return min(timeit.repeat(work, number=number, repeat=7)) / number * 1e6


def single(kind: Kind, body: bytes, number: int) -> str:
    model = BODIES[kind]
    service = best_us(lambda: parse_event("e1", "s1-2", kind, loads(body)), number)
    parse = best_us(lambda: loads(body), number)
    rust = best_us(lambda: model.model_validate_json(body), number)
    python = best_us(lambda: model.model_validate(loads(body)), number)
    return (
        f"  {kind:8s} as the service: {service:5.1f} (of which parsing {parse:.1f});"
        f" the body model from parsed JSON {python:.1f}, from bytes by pydantic-core {rust:.1f}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--number", type=int, default=2000, help="calls per repeat (2000)")
    number = parser.parse_args().number
    print("single events: us per event")
    for kind, fields in SINGLE:
        print(single(kind, orjson.dumps(fields), number))
    body = batch_body()

    def batch() -> list[object]:
        return [parse_batch_event(item) for item in parse_envelope(loads(body, MAX_BATCH_DEPTH))]

    spent = best_us(batch, max(1, number // 50))
    parse = best_us(lambda: loads(body, MAX_BATCH_DEPTH), max(1, number // 50))
    print(
        f"batch of {BATCH_SIZE}: {spent:,.0f} us per batch as the service"
        f" (of which parsing {parse:,.0f}), {spent / BATCH_SIZE:.1f} us per event"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
