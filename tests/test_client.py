"""The Python client (clients/python; its README) against the live service.

Each test starts with empty tables (see conftest.py). Failures of the network are simulated
with a small HTTP proxy on 127.0.0.1 that the test starts and stops itself.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import socketserver
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, TypedDict, cast

import httpx
import pytest
from steprecord_client import (
    AsyncRecorder,
    NoInstance,
    Recorder,
    StaleAttempt,
    StepRecordError,
    current_instance,
    fit_message,
)

from tests.support.waits import eventually

# The Python client's own behaviour against the live service: the same on any database.
pytestmark = pytest.mark.same_on_any_database


class _Fast(TypedDict):
    backoff: float
    max_backoff: float
    retry_backoff: float


FAST: _Fast = {"backoff": 0.01, "max_backoff": 0.05, "retry_backoff": 0.0}


LONG_AGO = "2000-01-01T00:00:00Z"


@pytest.fixture
def rec(server_url: str) -> Iterator[Recorder]:
    with Recorder(server_url, **FAST) as recorder:
        yield recorder


@pytest.fixture
def raw(server_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server_url, timeout=10) as client:
        yield client


def get_record(raw: httpx.Client, key: str, slug: str) -> dict[str, Any] | None:
    response = raw.get(f"/v1/instances/{key}/steps/{slug}")
    if response.status_code == 404:
        return None
    response.raise_for_status()
    record: dict[str, Any] = response.json()
    return record


def must_get(raw: httpx.Client, key: str, slug: str) -> dict[str, Any]:
    record = get_record(raw, key, slug)
    assert record is not None, f"no record for {key}/{slug}"
    return record


def post(raw: httpx.Client, key: str, slug: str, kind: str, **body: Any) -> httpx.Response:
    return raw.post(f"/v1/instances/{key}/steps/{slug}/{kind}", json=body)


# --------------------------------------------------------------------------- a test proxy

Plan = Callable[[str, str], str]
"""Decides per request (method, path): "forward", "drop" (forward, then close the
connection without answering), "503" or "429" (answer that without forwarding)."""
# The answers a plan can simulate: a database outage, and a token whose connections are busy.
SIMULATED = {"503": (503, "unavailable"), "429": (429, "token_busy")}


class _ProxyHandler(socketserver.StreamRequestHandler):
    server: _ProxyServer

    def handle(self) -> None:
        proxy = self.server
        while True:
            line = self.rfile.readline(65537)
            if not line.strip():
                return
            method, target, _ = line.decode("latin-1").split(" ", 2)
            headers: dict[str, str] = {}
            while (header := self.rfile.readline(65537)).strip():
                name, value = header.decode("latin-1").split(":", 1)
                headers[name.strip().lower()] = value.strip()
            body = self.rfile.read(int(headers.get("content-length", "0")))
            with proxy.lock:
                proxy.log.append((method, target, headers))
                action = proxy.plan(method, target)
            if action in SIMULATED:
                status, code = SIMULATED[action]
                self._answer(
                    status,
                    {"Content-Type": "application/problem+json", "Retry-After": "0"},
                    b'{"type":"about:blank","title":"Simulated","status":%d,'
                    b'"code":"%s","detail":"simulated"}' % (status, code.encode()),
                )
                continue
            forward = {k: v for k, v in headers.items() if k in ("content-type", "accept")}
            upstream = proxy.upstream.request(method, target, content=body, headers=forward)
            if action == "drop":
                return  # the server applied the request; the client never hears of it
            content_type = upstream.headers.get("content-type", "application/json")
            self._answer(upstream.status_code, {"Content-Type": content_type}, upstream.content)

    def _answer(self, status: int, headers: dict[str, str], body: bytes) -> None:
        lines = [f"HTTP/1.1 {status} X", f"Content-Length: {len(body)}"]
        lines += [f"{name}: {value}" for name, value in headers.items()]
        self.wfile.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
        self.wfile.flush()


class _ProxyServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, upstream: str, plan: Plan) -> None:
        super().__init__(("127.0.0.1", 0), _ProxyHandler)
        self.upstream = httpx.Client(base_url=upstream, timeout=10)
        self.plan = plan
        self.lock = threading.Lock()
        self.log: list[tuple[str, str, dict[str, str]]] = []

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host!s}:{port}"

    def requests(self, method: str, suffix: str) -> int:
        return sum(1 for m, path, _ in self.log if m == method and path.endswith(suffix))


@contextmanager
def proxy(upstream: str, plan: Plan) -> Iterator[_ProxyServer]:
    """A forwarding proxy on 127.0.0.1, stopped on exit (also when the test fails)."""
    server = _ProxyServer(upstream, plan)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        server.upstream.close()
        thread.join(5)


def first_time(method: str, suffix: str, action: str) -> Plan:
    """A plan that takes ``action`` on the first matching request and forwards the rest."""
    done = False

    def plan(m: str, path: str) -> str:
        nonlocal done
        if not done and m == method and path.endswith(suffix):
            done = True
            return action
        return "forward"

    return plan


# --------------------------------------------------------------------------- running steps


def test_sync_step_runs_once_and_records_completed_output(rec: Recorder, raw: httpx.Client) -> None:
    calls: list[int] = []

    @rec.step("charge")
    def charge(amount: int) -> dict[str, Any]:
        calls.append(amount)
        return {"charge_id": "ch_1", "amount": amount}

    with rec.instance("order-1"):
        assert charge(10) == {"charge_id": "ch_1", "amount": 10}

    record = must_get(raw, "order-1", "charge")
    assert calls == [10]
    assert record["status"] == "completed"
    assert record["attempt_count"] == 1
    assert record["output"] == {"charge_id": "ch_1", "amount": 10}
    assert record["external_output_url"] is None
    assert record["started_at"].endswith("Z")
    assert record["started_at"] <= record["completed_at"]


def test_async_step_on_async_recorder_records_completed_output(
    server_url: str, raw: httpx.Client
) -> None:
    async def main() -> list[int]:
        async with AsyncRecorder(server_url, **FAST) as arec:

            @arec.step("fetch")
            async def fetch(n: int) -> list[int]:
                await asyncio.sleep(0)
                return list(range(n))

            async with arec.instance("order-2"):
                return await fetch(3)

    assert asyncio.run(main()) == [0, 1, 2]
    record = must_get(raw, "order-2", "fetch")
    assert (record["status"], record["attempt_count"], record["output"]) == (
        "completed",
        1,
        [0, 1, 2],
    )


def test_async_def_on_sync_recorder_is_awaited_and_recorded(
    rec: Recorder, raw: httpx.Client
) -> None:
    @rec.step("notify")
    async def notify() -> str:
        await asyncio.sleep(0)
        return "sent"

    async def main() -> str:
        with rec.instance("order-3"):
            return await notify()

    assert asyncio.run(main()) == "sent"
    assert must_get(raw, "order-3", "notify")["output"] == "sent"


def test_plain_def_on_async_recorder_runs_in_a_thread_and_is_recorded(
    server_url: str, raw: httpx.Client
) -> None:
    seen: list[str | None] = []

    async def main() -> int:
        async with AsyncRecorder(server_url, **FAST) as arec:

            @arec.step("compute")
            def compute(x: int) -> int:
                seen.append(current_instance())
                return x * 2

            with arec.instance("order-4"):
                return await compute(21)

    assert asyncio.run(main()) == 42
    assert seen == ["order-4"]
    assert must_get(raw, "order-4", "compute")["output"] == 42


def test_failing_step_records_fail_and_reraises_the_identical_exception(
    rec: Recorder, raw: httpx.Client
) -> None:
    class CardDeclined(Exception):
        pass

    original = CardDeclined("card declined: insufficient funds")

    @rec.step("charge")
    def charge() -> None:
        raise original

    with rec.instance("order-5"), pytest.raises(CardDeclined) as caught:
        charge()

    assert caught.value is original
    assert caught.value.args == ("card declined: insufficient funds",)
    record = must_get(raw, "order-5", "charge")
    assert record["status"] == "failed"
    assert record["attempt_count"] == 1
    assert record["error_code"] == "CardDeclined"
    assert record["error_message"] == "card declined: insufficient funds"
    assert record["output"] is None


def test_failing_async_step_records_fail_and_reraises_the_identical_exception(
    server_url: str, raw: httpx.Client
) -> None:
    original = LookupError("no such sku")

    async def main() -> None:
        async with AsyncRecorder(server_url, **FAST) as arec:

            @arec.step("reserve")
            async def reserve() -> None:
                raise original

            async with arec.instance("order-6"):
                await reserve()

    with pytest.raises(LookupError) as caught:
        asyncio.run(main())
    assert caught.value is original
    record = must_get(raw, "order-6", "reserve")
    assert (record["status"], record["error_code"]) == ("failed", "LookupError")


def test_error_code_and_message_are_made_acceptable_to_the_service(
    rec: Recorder, raw: httpx.Client
) -> None:
    class _Odd_Errör(Exception):
        pass

    message = "nul\x00here " + "é" * 40000  # 80000+ bytes of UTF-8

    @rec.step("odd")
    def odd() -> None:
        raise _Odd_Errör(message)

    with rec.instance("order-7"), pytest.raises(_Odd_Errör):
        odd()

    record = must_get(raw, "order-7", "odd")
    assert record["error_code"] == "Odd_Err-r"  # leading "_" stripped, "ö" replaced
    stored = record["error_message"]
    assert "\x00" not in stored
    assert stored.startswith("nul\ufffdhere é")
    assert len(stored.encode("utf-8")) <= 65536
    head, marker, tail = stored.partition("\n[... ")
    sent = message.replace("\x00", "\ufffd")
    assert marker
    assert sent.startswith(head)
    assert sent.endswith(tail.partition(" ...]\n")[2])


def test_a_traceback_over_the_limit_keeps_its_head_and_its_exception_line_and_says_what_was_cut(
    rec: Recorder, raw: httpx.Client
) -> None:
    frames = "".join(f'  File "app.py", line {n}, in f{n}\n    f{n + 1}()\n' for n in range(4000))
    traceback = f"Traceback (most recent call last):\n{frames}ZeroDivisionError: division by zero"
    assert len(traceback.encode()) > 2 * 65536

    @rec.step("deep")
    def deep() -> None:
        raise RuntimeError(traceback)

    with rec.instance("order-8"), pytest.raises(RuntimeError):
        deep()

    stored = must_get(raw, "order-8", "deep")["error_message"]
    assert 65000 < len(stored.encode("utf-8")) <= 65536
    assert stored.startswith('Traceback (most recent call last):\n  File "app.py", line 0, in f0')
    assert stored.endswith("\nZeroDivisionError: division by zero")
    head, _marker, tail = stored.partition("\n[... ")
    cut = int(tail.split(" ", 1)[0])
    assert tail.split(" ", 1)[1].startswith("bytes cut by steprecord_client")
    assert traceback.startswith(head)
    assert traceback.endswith(tail.partition(" ...]\n")[2])
    assert len(head.encode()) + cut + len(tail.partition(" ...]\n")[2].encode()) == len(
        traceback.encode()
    )


def test_fit_message_keeps_a_message_within_the_limit_as_it_is_and_cuts_on_characters() -> None:
    assert fit_message("é" * 32768) == "é" * 32768  # 65536 bytes: fits
    for char in ("é", "€", "😀"):
        fitted = fit_message(char * 70000)
        assert len(fitted.encode("utf-8")) <= 65536  # encodes: no broken character
        head, _, rest = fitted.partition("\n[... ")
        assert set(head) == {char}
        assert set(rest.partition(" ...]\n")[2]) == {char}


def test_retries_take_new_attempts_until_the_step_succeeds(
    rec: Recorder, raw: httpx.Client
) -> None:
    calls: list[int] = []

    @rec.step("flaky", retries=2)
    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise TimeoutError(f"try {len(calls)}")
        return "ok"

    with rec.instance("order-8"):
        assert flaky() == "ok"

    record = must_get(raw, "order-8", "flaky")
    assert len(calls) == 3
    assert (record["status"], record["attempt_count"], record["output"]) == ("completed", 3, "ok")
    assert record["error_code"] is None


def test_retries_exhausted_leave_the_last_attempt_failed(
    server_url: str, raw: httpx.Client
) -> None:
    raised: list[Exception] = []

    async def main() -> None:
        async with AsyncRecorder(server_url, **FAST) as arec:

            @arec.step("doomed", retries=2)
            async def doomed() -> None:
                raised.append(RuntimeError(f"attempt {len(raised) + 1}"))
                raise raised[-1]

            async with arec.instance("order-9"):
                await doomed()

    with pytest.raises(RuntimeError) as caught:
        asyncio.run(main())
    assert len(raised) == 3
    assert caught.value is raised[-1]
    record = must_get(raw, "order-9", "doomed")
    assert (record["status"], record["attempt_count"]) == ("failed", 3)
    assert record["error_message"] == "attempt 3"


# --------------------------------------------------------------------------- re-running an instance


def test_completed_step_is_not_run_again_after_a_crash(server_url: str, raw: httpx.Client) -> None:
    calls: list[str] = []

    def make(recorder: Recorder) -> Callable[[], tuple[int, int]]:
        @recorder.step("expensive")
        def expensive() -> tuple[int, int]:
            calls.append("ran")
            return (1, 2)

        return expensive

    with Recorder(server_url, **FAST) as first, first.instance("order-10"):
        assert make(first)() == (1, 2)  # a fresh run returns the callback's own value
    before = must_get(raw, "order-10", "expensive")

    # The orchestrator "crashes" and a new process re-runs the instance from the top.
    with Recorder(server_url, **FAST) as second, second.instance("order-10"):
        assert cast(object, make(second)()) == [1, 2]  # memoised: the recorded JSON

    assert calls == ["ran"]
    assert must_get(raw, "order-10", "expensive") == before


def test_step_left_running_by_a_crash_is_rerun_with_the_next_attempt(
    rec: Recorder, raw: httpx.Client
) -> None:
    started = post(raw, "order-11", "ship", "start", attempt=1, started_at=LONG_AGO)
    assert started.status_code == 201

    @rec.step("ship")
    def ship() -> str:
        return "shipped"

    with rec.instance("order-11"):
        assert ship() == "shipped"

    record = must_get(raw, "order-11", "ship")
    assert (record["status"], record["attempt_count"]) == ("completed", 2)
    assert record["started_at"] > LONG_AGO


def test_failed_step_is_rerun_with_the_next_attempt_and_pending_one_keeps_its_attempt(
    rec: Recorder, raw: httpx.Client
) -> None:
    post(raw, "order-12", "failed-one", "start", attempt=1, started_at=LONG_AGO)
    failed = post(
        raw,
        "order-12",
        "failed-one",
        "fail",
        attempt=1,
        started_at=LONG_AGO,
        completed_at="2000-01-01T00:00:01Z",
        error_code="Boom",
    )
    assert failed.status_code == 200
    assert post(raw, "order-12", "declared-one", "declare").status_code == 201

    @rec.step("failed-one")
    def failed_one() -> int:
        return 1

    @rec.step("declared-one")
    def declared_one() -> int:
        return 2

    with rec.instance("order-12"):
        assert failed_one() == 1
        assert declared_one() == 2

    assert must_get(raw, "order-12", "failed-one")["attempt_count"] == 2
    assert must_get(raw, "order-12", "declared-one")["attempt_count"] == 1
    assert must_get(raw, "order-12", "declared-one")["status"] == "completed"


# --------------------------------------------------------------------------- the current instance


def test_concurrent_asyncio_tasks_record_to_their_own_instances(
    server_url: str, raw: httpx.Client
) -> None:
    async def main() -> list[str]:
        async with AsyncRecorder(server_url, **FAST) as arec:
            both_inside = asyncio.Barrier(2)

            @arec.step("work")
            async def work() -> str:
                await asyncio.wait_for(both_inside.wait(), 5)  # the two steps overlap
                key = current_instance()
                assert key is not None
                return key

            async def run(key: str) -> str:
                async with arec.instance(key):
                    return await work()

            return list(await asyncio.gather(run("task-a"), run("task-b")))

    assert asyncio.run(main()) == ["task-a", "task-b"]
    assert must_get(raw, "task-a", "work")["output"] == "task-a"
    assert must_get(raw, "task-b", "work")["output"] == "task-b"


def test_threads_started_with_copy_context_record_to_their_own_instances(
    rec: Recorder, raw: httpx.Client
) -> None:
    both_inside = threading.Barrier(2, timeout=5)

    @rec.step("work")
    def work() -> str | None:
        both_inside.wait()
        return current_instance()

    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = []
        for key in ("thread-a", "thread-b"):
            with rec.instance(key):
                context = contextvars.copy_context()
            futures.append(pool.submit(context.run, work))
        assert [future.result(10) for future in futures] == ["thread-a", "thread-b"]

    assert must_get(raw, "thread-a", "work")["output"] == "thread-a"
    assert must_get(raw, "thread-b", "work")["output"] == "thread-b"


def test_each_call_runs_in_its_own_copy_of_the_context(rec: Recorder) -> None:
    marker: contextvars.ContextVar[str] = contextvars.ContextVar("marker", default="caller")

    @rec.step("sets-marker")
    def sets_marker() -> str:
        marker.set("step")
        return marker.get()

    with rec.instance("order-13"):
        assert sets_marker() == "step"
        assert marker.get() == "caller"
        assert current_instance() == "order-13"
    assert current_instance() is None


def test_instance_blocks_nest_and_restore_with_and_async_with(server_url: str) -> None:
    async def main() -> list[str | None]:
        seen: list[str | None] = []
        async with AsyncRecorder(server_url) as arec, arec.instance("outer") as key:
            seen.append(key)
            with arec.instance("inner"):
                seen.append(current_instance())
            seen.append(current_instance())
        seen.append(current_instance())
        return seen

    assert asyncio.run(main()) == ["outer", "inner", "outer", None]


def test_step_called_outside_an_instance_raises_before_any_request(
    rec: Recorder, server_url: str, raw: httpx.Client
) -> None:
    calls: list[int] = []

    @rec.step("orphan")
    def orphan() -> int:
        calls.append(1)
        return 1

    with pytest.raises(NoInstance, match="outside any instance"):
        orphan()

    async def main() -> None:
        async with AsyncRecorder(server_url) as arec:

            @arec.step("orphan")
            async def async_orphan() -> int:
                calls.append(1)
                return 1

            await async_orphan()

    with pytest.raises(NoInstance):
        asyncio.run(main())

    assert calls == []
    assert issubclass(NoInstance, RuntimeError)
    instances = raw.get("/v1/instances")
    assert instances.status_code == 200
    assert instances.json()["items"] == []


def test_invalid_slugs_and_keys_are_refused_before_any_request(rec: Recorder) -> None:
    with pytest.raises(ValueError, match="invalid step slug"):
        rec.step("has space")
    with pytest.raises(ValueError, match="invalid instance key"):
        rec.instance("a/b")


# --------------------------------------------------------------------------- fencing


def test_newer_attempt_started_while_the_callback_runs_makes_complete_raise_stale_attempt(
    rec: Recorder, raw: httpx.Client
) -> None:
    @rec.step("zombie")
    def zombie() -> str:
        # Meanwhile another worker takes over the step with attempt 2.
        taken = post(raw, "order-14", "zombie", "start", attempt=2)
        assert taken.status_code == 200
        return "late"

    with rec.instance("order-14"), pytest.raises(StaleAttempt) as caught:
        zombie()

    assert caught.value.status == 409
    assert caught.value.code == "stale_attempt"
    assert caught.value.current is not None
    assert caught.value.current["attempt_count"] == 2
    assert caught.value.recorded  # the zombie's completion is kept in the history
    record = must_get(raw, "order-14", "zombie")
    assert (record["status"], record["attempt_count"], record["output"]) == ("running", 2, None)
    first = raw.get("/v1/instances/order-14/steps/zombie/attempts").json()["items"][0]
    assert (first["attempt"], first["status"], first["output"]) == (1, "completed", "late")


def test_stale_attempt_answering_start_means_the_callback_is_not_run(
    server_url: str, raw: httpx.Client
) -> None:
    def newer_attempt_first(method: str, path: str) -> str:
        if method == "POST" and path.endswith("/start"):
            # Another worker starts attempt 5 just before this worker's start arrives.
            assert post(raw, "order-15", "late", "start", attempt=5).status_code == 201
        return "forward"

    calls: list[int] = []
    with (
        proxy(server_url, newer_attempt_first) as flaky,
        Recorder(flaky.url, **FAST) as recorder,
    ):

        @recorder.step("late")
        def late() -> int:
            calls.append(1)
            return 1

        with recorder.instance("order-15"), pytest.raises(StaleAttempt) as caught:
            late()

    assert calls == []
    assert caught.value.current is not None
    assert caught.value.current["attempt_count"] == 5
    assert must_get(raw, "order-15", "late")["status"] == "running"


def test_same_attempt_already_started_by_another_worker_is_not_run_twice(
    server_url: str, raw: httpx.Client
) -> None:
    def same_attempt_first(method: str, path: str) -> str:
        if method == "POST" and path.endswith("/start"):
            other = post(raw, "order-16", "dup", "start", attempt=1, started_at=LONG_AGO)
            assert other.status_code == 201
        return "forward"

    calls: list[int] = []
    with proxy(server_url, same_attempt_first) as flaky, Recorder(flaky.url, **FAST) as recorder:

        @recorder.step("dup")
        def dup() -> int:
            calls.append(1)
            return 1

        with recorder.instance("order-16"), pytest.raises(StaleAttempt):
            dup()

    assert calls == []
    record = must_get(raw, "order-16", "dup")
    assert (record["attempt_count"], record["started_at"]) == (1, LONG_AGO)


# --------------------------------------------------------------------------- transport


def test_lost_answer_to_complete_is_resent_and_the_server_sees_a_replay(
    server_url: str, raw: httpx.Client
) -> None:
    calls: list[int] = []
    with (
        proxy(server_url, first_time("POST", "/complete", "drop")) as flaky,
        Recorder(flaky.url, **FAST) as recorder,
    ):

        @recorder.step("pay")
        def pay() -> dict[str, int]:
            calls.append(1)
            return {"paid": 5}

        with recorder.instance("order-17"):
            assert pay() == {"paid": 5}
        assert flaky.requests("POST", "/pay/complete") == 2

    assert calls == [1]
    record = must_get(raw, "order-17", "pay")
    assert (record["status"], record["attempt_count"], record["output"]) == (
        "completed",
        1,
        {"paid": 5},
    )


def test_lost_answer_is_resent_by_the_async_recorder_too(
    server_url: str, raw: httpx.Client
) -> None:
    async def main(url: str) -> str:
        async with AsyncRecorder(url, **FAST) as arec:

            @arec.step("pay")
            async def pay() -> str:
                return "paid"

            async with arec.instance("order-18"):
                return await pay()

    with proxy(server_url, first_time("POST", "/start", "drop")) as flaky:
        assert asyncio.run(main(flaky.url)) == "paid"
        assert flaky.requests("POST", "/pay/start") == 2
    record = must_get(raw, "order-18", "pay")
    assert (record["status"], record["attempt_count"]) == ("completed", 1)


def test_503_answers_are_retried(server_url: str, raw: httpx.Client) -> None:
    with (
        proxy(server_url, first_time("POST", "/start", "503")) as flaky,
        Recorder(flaky.url, **FAST) as recorder,
    ):

        @recorder.step("retry-me")
        def retry_me() -> int:
            return 7

        with recorder.instance("order-19"):
            assert retry_me() == 7
        assert flaky.requests("POST", "/retry-me/start") == 2

    assert must_get(raw, "order-19", "retry-me")["attempt_count"] == 1


def test_429_token_busy_answers_are_retried(server_url: str, raw: httpx.Client) -> None:
    with (
        proxy(server_url, first_time("POST", "/start", "429")) as busy,
        Recorder(busy.url, **FAST) as recorder,
    ):

        @recorder.step("wait-my-turn")
        def wait_my_turn() -> int:
            return 8

        with recorder.instance("order-19b"):
            assert wait_my_turn() == 8
        assert busy.requests("POST", "/wait-my-turn/start") == 2

    assert must_get(raw, "order-19b", "wait-my-turn")["attempt_count"] == 1


def test_503_outlasting_the_retries_raises_step_record_error(server_url: str) -> None:
    with (
        proxy(server_url, lambda method, path: "503") as down,
        Recorder(down.url, max_retries=2, **FAST) as recorder,
    ):

        @recorder.step("never")
        def never() -> int:
            return 1

        with recorder.instance("order-20"), pytest.raises(StepRecordError) as caught:
            never()
        assert len(down.log) == 3  # the first GET and its two retries

    assert (caught.value.status, caught.value.code) == (503, "unavailable")


def test_unreachable_service_raises_the_transport_error_after_the_retries() -> None:
    with socketserver.TCPServer(("127.0.0.1", 0), socketserver.BaseRequestHandler) as closed:
        port = closed.server_address[1]
    with Recorder(f"http://127.0.0.1:{port}", max_retries=1, **FAST) as recorder:

        @recorder.step("nowhere")
        def nowhere() -> int:
            return 1

        with recorder.instance("order-21"), pytest.raises(httpx.TransportError):
            nowhere()


def test_bearer_token_is_sent_in_the_authorization_header(server_url: str) -> None:
    # The spy forwards without the header, so the service itself is not asked to check it.
    with proxy(server_url, lambda method, path: "forward") as spy:
        with Recorder(spy.url, token="s3cret", **FAST) as recorder:
            assert recorder.record("order-22", "any") is None
        with Recorder(spy.url, **FAST) as anonymous:
            assert anonymous.record("order-22", "any") is None
        assert spy.log[0][2]["authorization"] == "Bearer s3cret"
        assert "authorization" not in spy.log[1][2]


def test_token_refused_by_the_service_raises_step_record_error_with_the_problem(
    server_url: str,
) -> None:
    calls: list[int] = []
    with Recorder(server_url, token="matches-nothing", **FAST) as recorder:

        @recorder.step("locked")
        def locked() -> int:
            calls.append(1)
            return 1

        with recorder.instance("order-23"), pytest.raises(StepRecordError) as caught:
            locked()
    assert calls == []
    assert (caught.value.status, caught.value.code) == (401, "unauthorized")
    assert caught.value.problem["status"] == 401


def test_unknown_route_is_an_error_not_a_missing_record(server_url: str) -> None:
    calls: list[int] = []
    with Recorder(f"{server_url}/not-the-api", **FAST) as recorder:

        @recorder.step("misrouted")
        def misrouted() -> int:
            calls.append(1)
            return 1

        with recorder.instance("order-24"), pytest.raises(StepRecordError) as caught:
            misrouted()
    assert calls == []
    assert (caught.value.status, caught.value.code) == (404, "not_found")


# --------------------------------------------------------------------------- outputs


def test_offload_stores_every_output_and_a_memoised_step_returns_the_url(
    server_url: str, raw: httpx.Client
) -> None:
    store: dict[str, Any] = {}

    def offload(value: Any) -> str:
        url = f"mem://k{len(store) + 1}"
        store[url] = value
        return url

    calls: list[int] = []
    with Recorder(server_url, offload=offload, **FAST) as recorder:

        @recorder.step("report")
        def report() -> dict[str, str]:
            calls.append(1)
            return {"rows": "many"}

        with recorder.instance("order-23"):
            assert report() == {"rows": "many"}
            assert cast(object, report()) == "mem://k1"  # memoised: the recorded URL

    assert calls == [1]
    assert store == {"mem://k1": {"rows": "many"}}
    record = must_get(raw, "order-23", "report")
    assert (record["status"], record["external_output_url"], record["output"]) == (
        "completed",
        "mem://k1",
        None,
    )


def test_async_offload_coroutine_is_awaited(server_url: str, raw: httpx.Client) -> None:
    async def offload(value: Any) -> str:
        await asyncio.sleep(0)
        return "mem://async"

    async def main() -> str:
        async with AsyncRecorder(server_url, offload=offload, **FAST) as arec:

            @arec.step("big")
            async def big() -> str:
                return "x" * 2_000_000

            async with arec.instance("order-24"):
                await big()
                memoised = await big()
                assert isinstance(memoised, str)
                return memoised

    assert asyncio.run(main()) == "mem://async"
    assert must_get(raw, "order-24", "big")["external_output_url"] == "mem://async"


def test_output_over_the_cap_without_offload_raises_value_error_and_records_fail(
    rec: Recorder, raw: httpx.Client
) -> None:
    @rec.step("huge", retries=3)
    def huge() -> str:
        return "x" * (1024 * 1024)

    with rec.instance("order-25"), pytest.raises(ValueError, match="inline cap"):
        huge()

    record = must_get(raw, "order-25", "huge")
    assert (record["status"], record["attempt_count"]) == ("failed", 1)  # not retried
    assert record["error_code"] == "ValueError"


def test_output_that_is_not_json_raises_type_error_and_records_fail(
    rec: Recorder, raw: httpx.Client
) -> None:
    @rec.step("setty")
    def setty() -> set[int]:
        return {1, 2}

    with rec.instance("order-26"), pytest.raises(TypeError, match="JSON serializable"):
        setty()
    assert must_get(raw, "order-26", "setty")["error_code"] == "TypeError"


def test_none_output_is_recorded_as_no_output(rec: Recorder, raw: httpx.Client) -> None:
    @rec.step("side-effect")
    def side_effect() -> None:
        return None

    with rec.instance("order-27"):
        assert side_effect() is None
        assert side_effect() is None
    record = must_get(raw, "order-27", "side-effect")
    assert (record["status"], record["output"]) == ("completed", None)


# --------------------------------------------------------------------------- reads


def _run_steps_in_reverse_of_declaration(rec: Recorder, raw: httpx.Client, key: str) -> None:
    slugs = [f"s{i}" for i in range(7)]
    for slug in [*slugs, "never-started"]:
        assert post(raw, key, slug, "declare").status_code == 201
    with rec.instance(key):
        for slug in reversed(slugs):

            def run(slug: str = slug) -> str:
                return slug

            rec.step(slug)(run)()


def test_steps_iterates_across_pages_in_both_orders(rec: Recorder, raw: httpx.Client) -> None:
    _run_steps_in_reverse_of_declaration(rec, raw, "order-28")

    by_ordinal = [r["step_slug"] for r in rec.steps("order-28", page_size=3)]
    by_start = [r["step_slug"] for r in rec.steps("order-28", order="started_at", page_size=3)]

    assert by_ordinal == ["s0", "s1", "s2", "s3", "s4", "s5", "s6", "never-started"]
    assert by_start == ["s6", "s5", "s4", "s3", "s2", "s1", "s0", "never-started"]
    assert [r["step_slug"] for r in rec.steps("order-28", status="pending")] == ["never-started"]
    assert all(isinstance(r, dict) for r in rec.steps("order-28", page_size=1000))


def test_async_steps_iterates_across_pages_in_both_orders(
    rec: Recorder, raw: httpx.Client, server_url: str
) -> None:
    _run_steps_in_reverse_of_declaration(rec, raw, "order-29")

    async def main() -> tuple[list[str], list[str]]:
        async with AsyncRecorder(server_url, **FAST) as arec:
            by_ordinal = [r["step_slug"] async for r in arec.steps("order-29", page_size=2)]
            by_start = [
                r["step_slug"] async for r in arec.steps("order-29", "started_at", page_size=2)
            ]
            return by_ordinal, by_start

    by_ordinal, by_start = asyncio.run(main())
    assert by_ordinal == ["s0", "s1", "s2", "s3", "s4", "s5", "s6", "never-started"]
    assert by_start == ["s6", "s5", "s4", "s3", "s2", "s1", "s0", "never-started"]


def test_steps_of_an_unknown_instance_raise_not_found(rec: Recorder) -> None:
    with pytest.raises(StepRecordError) as caught:
        list(rec.steps("nobody"))
    assert (caught.value.status, caught.value.code) == (404, "instance_not_found")


def test_record_reads_one_record_or_none(rec: Recorder, raw: httpx.Client) -> None:
    assert rec.record("order-30", "x") is None
    post(raw, "order-30", "x", "declare")
    record = rec.record("order-30", "x")
    assert record is not None
    assert (record["status"], record["attempt_count"]) == ("pending", 1)
    assert rec.record("order-30", "y") is None
    assert json.loads(json.dumps(record)) == record


# --------------------------------------------------------------------------- leases


def test_heartbeats_keep_a_long_step_alive(rec: Recorder, raw: httpx.Client) -> None:
    """A 1-second lease on a 3-second step: the sweeper (every 0.2 s) would fail it, but the
    heartbeats keep extending the lease until the step returns."""
    seen: list[dict[str, Any]] = []

    @rec.step("slow", lease_seconds=1)
    def slow() -> str:
        first = must_get(raw, "lease-1", "slow")
        time.sleep(3)  # three leases long
        seen.append(first)
        seen.append(must_get(raw, "lease-1", "slow"))
        return "done"

    with rec.instance("lease-1"):
        assert slow() == "done"
    before, after = seen
    assert (before["status"], after["status"]) == ("running", "running")
    assert after["lease_expires_at"] > before["lease_expires_at"]
    record = must_get(raw, "lease-1", "slow")
    assert (record["status"], record["attempt_count"], record["lease_expires_at"]) == (
        "completed",
        1,
        None,
    )
    history = raw.get("/v1/instances/lease-1/steps/slow/attempts").json()["items"]
    assert [(a["attempt"], a["status"]) for a in history] == [(1, "completed")]


def test_async_heartbeats_keep_a_long_step_alive(server_url: str, raw: httpx.Client) -> None:
    async def main() -> str:
        async with AsyncRecorder(server_url, **FAST) as rec:

            @rec.step("slow", lease_seconds=1)
            async def slow() -> str:
                await asyncio.sleep(2.5)
                return "done"

            async with rec.instance("lease-2"):
                return await slow()

    assert asyncio.run(main()) == "done"
    assert must_get(raw, "lease-2", "slow")["status"] == "completed"


WORKER = """
import sys, time
from steprecord_client import Recorder

rec = Recorder(sys.argv[1])

@rec.step("forever", lease_seconds=1)
def forever():
    print("running", flush=True)
    time.sleep(3600)

with rec.instance("lease-3"):
    forever()
"""


def test_a_killed_workers_step_is_swept(server_url: str, raw: httpx.Client) -> None:
    worker = subprocess.Popen(
        [sys.executable, "-c", WORKER, server_url], stdout=subprocess.PIPE, text=True
    )
    try:
        assert worker.stdout is not None
        assert worker.stdout.readline().strip() == "running"
        time.sleep(1.5)  # longer than the lease: only the heartbeats keep it running
        assert must_get(raw, "lease-3", "forever")["status"] == "running"
        worker.kill()
        worker.wait(10)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    eventually(lambda: must_get(raw, "lease-3", "forever")["status"] == "failed")
    record = must_get(raw, "lease-3", "forever")
    assert (record["error_code"], record["attempt_count"]) == ("lease_expired", 1)


@pytest.mark.parametrize("lease", [0, 86401, True, 1.5, "5"])
def test_a_bad_lease_is_refused_when_the_step_is_declared(rec: Recorder, lease: Any) -> None:
    with pytest.raises(ValueError, match="lease_seconds"):
        rec.step("x", lease_seconds=lease)


def test_a_recorder_s_labels_are_set_on_the_instances_it_records(
    server_url: str, raw: httpx.Client
) -> None:
    with Recorder(server_url, labels={"env": "prod", "team": "billing"}, **FAST) as labelled:

        @labelled.step("charge")
        def charge() -> int:
            return 1

        with labelled.instance("order-labels"):
            charge()

    async def main() -> None:
        async with AsyncRecorder(server_url, labels={"env": "dev"}, **FAST) as arec:

            @arec.step("fetch")
            async def fetch() -> int:
                return 2

            async with arec.instance("order-labels-2"):
                await fetch()

    asyncio.run(main())
    assert raw.get("/v1/instances/order-labels").json()["labels"] == {
        "env": "prod",
        "team": "billing",
    }
    assert raw.get("/v1/instances/order-labels-2").json()["labels"] == {"env": "dev"}
    listed = raw.get("/v1/instances", params={"label": "env=prod"}).json()["items"]
    assert [item["instance_key"] for item in listed] == ["order-labels"]


@pytest.mark.parametrize(
    "labels", [{"a b": "x"}, {"k": "v" * 201}, {f"k{n}": "v" for n in range(33)}, {"k": 1}]
)
def test_labels_beyond_the_service_s_limits_are_refused_by_the_recorder(
    server_url: str, labels: dict[str, Any]
) -> None:
    with pytest.raises(ValueError, match="label"):
        Recorder(server_url, labels=labels)
    with pytest.raises(ValueError, match="label"):
        AsyncRecorder(server_url, labels=labels)
