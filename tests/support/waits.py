"""Waiting until a condition holds: the one polling loop of the tests."""

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def eventually(
    check: Callable[[], bool], seconds: float = 15, interval: float = 0.05, what: str = ""
) -> float:
    """Poll `check` until it holds; the seconds that took. Fails after `seconds`."""
    began = time.monotonic()
    while not check():
        waited = time.monotonic() - began
        assert waited < seconds, f"timed out after {seconds} s waiting for {what or 'it'}"
        time.sleep(interval)
    return time.monotonic() - began


def wait_for(
    what: str, probe: Callable[[], T | None], seconds: float = 15, interval: float = 0.05
) -> T:
    """Poll `probe` every `interval` until it gives something truthy, and return that. Fails
    after `seconds`."""
    found: list[T | None] = [None]

    def check() -> bool:
        found[0] = probe()
        return bool(found[0])

    eventually(check, seconds, interval, what=what)
    assert found[0] is not None
    return found[0]
