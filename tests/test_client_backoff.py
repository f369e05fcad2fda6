"""The pause of `@rec.step(retries=N)` between a failed attempt and the next (clients/python):
exponential, capped, with jitter, configurable on the recorder and per step, for `Recorder`
and `AsyncRecorder` alike. The delays here are small, so the tests stay fast."""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

import httpx
import pytest
from steprecord_client import AsyncRecorder, Recorder
from steprecord_client._core import RetryBackoff

# Quick transport retries (not what is tested here).
BACKOFF = 0.01


def record(server_url: str, key: str, slug: str) -> dict[str, Any]:
    response = httpx.get(f"{server_url}/v1/instances/{key}/steps/{slug}", timeout=10)
    response.raise_for_status()
    found: dict[str, Any] = response.json()
    return found


def gaps(moments: list[float]) -> list[float]:
    return [later - earlier for earlier, later in itertools.pairwise(moments)]


def test_the_pause_doubles_from_the_first_and_stops_at_the_cap() -> None:
    steady = RetryBackoff(1.0, 30.0, jitter=False)
    assert [steady.delay(n) for n in range(1, 8)] == [1, 2, 4, 8, 16, 30, 30]
    assert steady.delay(10_000) == 30  # no overflow however many failures


def test_jitter_keeps_each_pause_between_half_and_all_of_it() -> None:
    jittery = RetryBackoff(1.0, 30.0, jitter=True)
    for failure in (1, 3, 9):
        full = min(2.0 ** (failure - 1), 30.0)
        pauses = [jittery.delay(failure) for _ in range(200)]
        assert all(full / 2 <= p <= full for p in pauses)
        assert len(set(pauses)) > 1


def test_a_negative_or_non_numeric_pause_is_refused() -> None:
    with pytest.raises(ValueError, match="retry backoff"):
        Recorder("http://127.0.0.1:9", retry_backoff=-1)
    with pytest.raises(ValueError, match="retry backoff"):
        Recorder("http://127.0.0.1:9").step("x", retries=1, retry_backoff_max=float("nan"))


def test_retries_of_a_sync_step_pause_between_attempts(server_url: str) -> None:
    moments: list[float] = []
    with Recorder(server_url, backoff=BACKOFF) as rec:

        @rec.step("flaky", retries=3, retry_backoff=0.2, retry_backoff_max=0.3, retry_jitter=False)
        def flaky() -> str:
            moments.append(time.monotonic())
            if len(moments) < 4:
                raise TimeoutError(f"try {len(moments)}")
            return "ok"

        with rec.instance("backoff-1"):
            assert flaky() == "ok"

    first, second, third = gaps(moments)
    assert 0.2 <= first < 0.35
    assert 0.3 <= second < 0.45  # 0.4 capped at 0.3
    assert 0.3 <= third < 0.45
    found = record(server_url, "backoff-1", "flaky")
    assert (found["status"], found["attempt_count"]) == ("completed", 4)


def timed_exchanges(client: httpx.Client) -> list[list[float]]:
    """When each request of the client was sent and its answer read, in order."""
    exchanges: list[list[float]] = []

    def answered(response: httpx.Response) -> None:
        response.read()
        exchanges[-1].append(time.monotonic())

    client.event_hooks = {
        "request": [lambda _: exchanges.append([time.monotonic()])],
        "response": [answered],
    }
    return exchanges


def test_the_recorders_default_pause_applies_to_its_steps(server_url: str) -> None:
    moments: list[float] = []
    with Recorder(server_url, retry_backoff=0.25, retry_jitter=False, backoff=BACKOFF) as rec:
        # Between two attempts the client also reports the failure and the next start: their
        # round trips are timed, so that the pause alone is checked however loaded the server.
        exchanges = timed_exchanges(rec._client)

        @rec.step("flaky", retries=1)
        def flaky() -> str:
            moments.append(time.monotonic())
            if len(moments) < 2:
                raise TimeoutError("first try")
            return "ok"

        with rec.instance("backoff-2"):
            assert flaky() == "ok"
    (gap,) = gaps(moments)
    between = [end - sent for sent, end in exchanges if moments[0] <= sent and end <= moments[1]]
    assert len(between) >= 2, "the failure and the next start were not reported in between"
    pause = gap - sum(between)
    assert 0.25 <= pause < 0.4  # the first pause, not the doubled one nor the default 1 s


def test_no_retries_means_no_pause_and_a_zero_pause_retries_at_once(server_url: str) -> None:
    with Recorder(server_url, retry_backoff=30, backoff=BACKOFF) as rec:

        @rec.step("once")
        def once() -> None:
            raise ValueError("no retries")

        started = time.monotonic()
        with rec.instance("backoff-3"), pytest.raises(ValueError, match="no retries"):
            once()
        assert time.monotonic() - started < 5  # failed once, reported, raised: no 30 s pause

        moments: list[float] = []

        @rec.step("eager", retries=2, retry_backoff=0)
        def eager() -> None:
            moments.append(time.monotonic())
            raise ValueError("again")

        with rec.instance("backoff-3"), pytest.raises(ValueError, match="again"):
            eager()
    assert len(moments) == 3
    assert all(gap < 1 for gap in gaps(moments))
    assert record(server_url, "backoff-3", "eager")["attempt_count"] == 3


def test_retries_of_an_async_step_pause_without_blocking_the_loop(server_url: str) -> None:
    moments: list[float] = []
    ticks: list[float] = []

    async def main() -> None:
        async with AsyncRecorder(
            server_url, retry_backoff=0.3, retry_jitter=False, backoff=BACKOFF
        ) as rec:

            @rec.step("flaky", retries=1)
            async def flaky() -> str:
                moments.append(time.monotonic())
                if len(moments) < 2:
                    raise TimeoutError("first try")
                return "ok"

            async def ticker() -> None:
                while True:
                    ticks.append(time.monotonic())
                    await asyncio.sleep(0.02)

            tick = asyncio.create_task(ticker())
            async with rec.instance("backoff-4"):
                assert await flaky() == "ok"
            tick.cancel()

    asyncio.run(main())
    (gap,) = gaps(moments)
    assert 0.3 <= gap < 0.45
    during = [t for t in ticks if moments[0] < t < moments[1]]
    assert len(during) >= 5, "the loop ran other tasks during the pause"
    found = record(server_url, "backoff-4", "flaky")
    assert (found["status"], found["attempt_count"]) == ("completed", 2)
