"""Paging by `started_at` while steps restart between page reads (see docs/api.md, Reads)."""

from collections import Counter
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest

from tests.support.http import post

STEPS = "/v1/instances/order-1/steps"
BASE = datetime(2026, 12, 2, 10, 0, 0, 100, tzinfo=UTC)


def at(seconds: float) -> str:
    return (BASE + timedelta(seconds=seconds)).isoformat().replace("+00:00", "Z")


@pytest.mark.parametrize("limit", [1, 2, 3])
def test_step_that_did_not_change_between_page_reads_appears_exactly_once(
    client: httpx.Client, limit: int
) -> None:
    attempts: dict[str, int] = {}
    started = [f"s{i}" for i in range(10)]
    offsets = [0, 1, 2, 2, 4, 5, 6, 6, 8, 9]  # s2/s3 and s6/s7 tie: broken by id
    for slug, seconds in zip(started, offsets, strict=True):
        body = {"attempt": 1, "started_at": at(seconds)}
        assert post(client, "start", body, step=slug).status_code == 201
        attempts[slug] = 1
    never = [f"u{i}" for i in range(4)]
    for slug in never:
        assert post(client, "declare", step=slug).status_code == 201
        attempts[slug] = 0

    def restart(slug: str, seconds: float) -> None:
        attempts[slug] += 1
        body = {"attempt": max(attempts[slug], 1), "started_at": at(seconds)}
        assert post(client, "start", body, step=slug).status_code == 200
        changed.add(slug)

    changed: set[str] = set()
    seen: list[str] = []
    cursor = None
    for turn in range(50):
        params: dict[str, Any] = {"order": "started_at", "limit": limit}
        body = client.get(STEPS, params={**params, **({"cursor": cursor} if cursor else {})}).json()
        page = [item["step_slug"] for item in body["items"]]
        seen.extend(page)
        cursor = body["next_cursor"]
        if cursor is None:
            break
        if turn >= 3:
            continue
        # Between two reads: the step the cursor points at moves past the rest, a step not
        # read yet moves before the cursor, and a never-started step starts.
        restart(page[-1], 100 + turn)
        ahead = [s for s in started if s not in seen and s not in changed]
        if ahead:
            restart(ahead[-1], -100 - turn)
        waiting = [s for s in never if s not in seen and s not in changed]
        if waiting:
            restart(waiting[0], 50 + turn)
    assert cursor is None
    unchanged = [slug for slug in started + never if slug not in changed]
    assert len(unchanged) >= 4
    counts = Counter(seen)
    assert {slug: counts[slug] for slug in unchanged} == dict.fromkeys(unchanged, 1)
    assert [s for s in seen if s in unchanged] == unchanged  # in (started_at, id) order
