"""steprecord_client.celery with real parts: Celery worker processes (prefork, threads and
solo pools) on the RabbitMQ broker at 127.0.0.1:5672 with Redis results at 127.0.0.1:6379,
reporting to the live service. The tasks are in tests/celery_tasks.py.

Without a broker or Redis answering these tests are skipped (and fail with `CI=true`).
Every worker is started in its own process group and stopped by the test that started it,
also when the test fails. Each worker consumes a queue of its own, created empty here and
deleted afterwards, so leftovers of another run cannot interfere.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from celery import Celery, chain
from celery.result import AsyncResult
from kombu import Exchange, Queue
from steprecord_client.celery import record_celery, step_slug_for

from tests import celery_tasks
from tests.celery_tasks import app
from tests.support.brokers import require_celery_services
from tests.support.servers import start_server, stop
from tests.support.waits import wait_for

# The Celery integration's own behaviour against the live service: the same on any database.
pytestmark = pytest.mark.same_on_any_database

BROKER = "amqp://guest:guest@127.0.0.1:5672//"
BACKEND = "redis://127.0.0.1:6379/7"
ROOT = Path(__file__).resolve().parent.parent
T = TypeVar("T")


@pytest.fixture(scope="module", autouse=True)
def _broker() -> None:
    """RabbitMQ and Redis must answer; the test process sends to the broker, reads results."""
    require_celery_services()
    app.conf.update(broker_url=BROKER, result_backend=BACKEND)


@contextmanager
def fresh_queue() -> Iterator[str]:
    """A queue of its own, declared empty (purged) now and deleted afterwards."""
    name = f"steprecord-test-{uuid.uuid4().hex[:10]}"
    queue = Queue(name, Exchange(name, type="direct"), routing_key=name)
    with app.connection_for_write() as conn:
        bound = queue(conn.default_channel)
        bound.declare()
        bound.purge()
    try:
        yield name
    finally:
        with app.connection_for_write() as conn:
            queue(conn.default_channel).delete()


class Worker:
    """A `celery worker` process of its own process group, consuming one queue."""

    def __init__(self, proc: subprocess.Popen[bytes], log: Path, queue: str) -> None:
        self.proc, self.log, self.queue = proc, log, queue

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def kill(self) -> None:
        """`kill -9` the worker and every process of its group (a dead machine)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


@contextmanager
def worker(
    tmp_path: Path,
    service: str,
    queue: str,
    pool: str,
    *,
    lease: int = 60,
    concurrency: int = 2,
) -> Iterator[Worker]:
    name = f"{pool}-{uuid.uuid4().hex[:6]}"
    log = tmp_path / f"worker-{name}.log"
    env = {
        **os.environ,
        "STEPRECORD_TEST_BROKER": BROKER,
        "STEPRECORD_TEST_BACKEND": BACKEND,
        "STEPRECORD_TEST_QUEUE": queue,
        "STEPRECORD_TEST_SERVICE": service,
        "STEPRECORD_TEST_LEASE": str(lease),
    }
    command = [
        sys.executable, "-m", "celery", "-A", "tests.celery_tasks", "worker",
        "--pool", pool, "--concurrency", str(concurrency), "--queues", queue,
        "--hostname", f"{name}@%h", "--without-gossip", "--without-mingle",
        "--without-heartbeat", "--loglevel", "INFO",
    ]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    running = Worker(proc, log, queue)
    try:
        wait_for(
            f"worker {name} to be ready",
            lambda: proc.poll() is not None or " ready." in running.output(),
            seconds=30,
        )
        assert proc.poll() is None, f"worker exited:\n{running.output()[-3000:]}"
        yield running
    except BaseException:
        print(f"--- worker {name} log ---\n{running.output()[-5000:]}")
        raise
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGQUIT)  # a cold shutdown: running tasks are not awaited
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(3)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the pool's children too
        proc.wait()


@pytest.fixture(scope="module")
def module_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("celery")


@pytest.fixture(scope="module")
def prefork(server_url: str, module_tmp: Path) -> Iterator[Worker]:
    """A prefork worker on the app's default queue (chains are routed there)."""
    with fresh_queue() as queue:
        app.conf.task_default_queue = queue
        with worker(module_tmp, server_url, queue, "prefork") as running:
            yield running


@pytest.fixture(scope="module")
def threads(server_url: str, module_tmp: Path) -> Iterator[Worker]:
    """A threads-pool worker with a one-second lease."""
    with fresh_queue() as queue, worker(module_tmp, server_url, queue, "threads", lease=1) as w:
        yield w


@pytest.fixture
def raw(server_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server_url, timeout=10) as client:
        yield client


def root_of(result: AsyncResult[Any]) -> str:
    """The id of a chain's first task: its instance key."""
    node: Any = result
    while node.parent is not None:
        node = node.parent
    return str(node.id)


def records(raw: httpx.Client, key: str) -> list[dict[str, Any]]:
    response = raw.get(f"/v1/instances/{key}/steps")
    if response.status_code == 404:
        return []
    response.raise_for_status()
    items: list[dict[str, Any]] = response.json()["items"]
    return items


def record(raw: httpx.Client, key: str, slug: str) -> dict[str, Any] | None:
    response = raw.get(f"/v1/instances/{key}/steps/{slug}")
    if response.status_code == 404:
        return None
    response.raise_for_status()
    found: dict[str, Any] = response.json()
    return found


def attempts(raw: httpx.Client, key: str, slug: str) -> list[dict[str, Any]]:
    response = raw.get(f"/v1/instances/{key}/steps/{slug}/attempts")
    response.raise_for_status()
    items: list[dict[str, Any]] = response.json()["items"]
    return items


def slug(task: str, task_id: str) -> str:
    return step_slug_for(f"tests.celery_tasks.{task}", task_id)


def settled(raw: httpx.Client, key: str, count: int) -> list[dict[str, Any]] | None:
    """The instance's records once there are ``count`` and none is running."""
    items = records(raw, key)
    if len(items) == count and all(r["status"] in ("completed", "failed") for r in items):
        return items
    return None


# --------------------------------------------------------------------------- chains


def test_a_chain_records_every_attempt_of_a_task_that_fails_twice_then_succeeds(
    prefork: Worker, raw: httpx.Client
) -> None:
    result = chain(celery_tasks.add.s(1, 2), celery_tasks.flaky.s(), celery_tasks.add.s(10))()
    assert result.get(timeout=30) == 13
    key = root_of(result)
    items = wait_for("the chain's records", lambda: settled(raw, key, 3))

    first, second, third = items  # ordinals follow the order in which tasks first started
    assert [r["step_slug"].split(":")[0] for r in items] == [
        "tests.celery_tasks.add",
        "tests.celery_tasks.flaky",
        "tests.celery_tasks.add",
    ]
    assert first["ordinal"] < second["ordinal"] < third["ordinal"]
    assert (first["status"], first["attempt_count"], first["output"]) == ("completed", 1, 3)
    assert (second["status"], second["attempt_count"], second["output"]) == ("completed", 3, 3)
    assert (third["status"], third["output"]) == ("completed", 13)
    history = attempts(raw, key, second["step_slug"])
    assert [(a["attempt"], a["status"], a["error_code"], a["error_message"]) for a in history] == [
        (1, "failed", "Flaky", "flaky try 1"),
        (2, "failed", "Flaky", "flaky try 2"),
        (3, "completed", None, None),
    ]
    assert history[2]["output"] == 3


def test_the_same_task_twice_in_a_chain_is_two_records(prefork: Worker, raw: httpx.Client) -> None:
    result = chain(celery_tasks.add.s(1, 1), celery_tasks.add.s(5))()
    assert result.get(timeout=30) == 7
    key = root_of(result)
    items = wait_for("two records", lambda: settled(raw, key, 2))
    assert [r["step_slug"] for r in items] == [
        slug("add", key),
        slug("add", str(result.id)),
    ]
    assert [r["output"] for r in items] == [2, 7]
    labels = raw.get(f"/v1/instances/{key}").json()["labels"]
    assert labels == {"celery.app": "steprecord_test", "celery.queue": prefork.queue}


def test_a_failing_task_is_recorded_failed_with_its_exception(
    threads: Worker, raw: httpx.Client
) -> None:
    result = celery_tasks.boom.apply_async((7,), queue=threads.queue)
    with pytest.raises(ValueError, match="boom at 7"):
        result.get(timeout=30)
    key = str(result.id)
    (only,) = wait_for("the failure", lambda: settled(raw, key, 1))
    assert only["step_slug"] == slug("boom", key)
    assert (only["status"], only["attempt_count"]) == ("failed", 1)
    assert (only["error_code"], only["error_message"]) == ("ValueError", "boom at 7")


def test_a_failure_over_the_message_limit_is_recorded_with_its_head_and_its_last_line(
    threads: Worker, raw: httpx.Client
) -> None:
    result = celery_tasks.deep_failure.apply_async((3000,), queue=threads.queue)
    with pytest.raises(RuntimeError):
        result.get(timeout=30)
    key = str(result.id)
    (only,) = wait_for("the failure", lambda: settled(raw, key, 1))
    assert (only["status"], only["error_code"]) == ("failed", "RuntimeError")
    message = only["error_message"]
    assert len(message.encode()) <= 65536
    assert message.startswith('Traceback (most recent call last):\n  File "shop.py", line 0')
    assert message.endswith("KeyError: 'sku-3000'")
    assert "bytes cut by steprecord_client to fit the 65536-byte limit" in message


def test_a_revoked_running_task_is_recorded_failed_revoked(
    prefork: Worker, raw: httpx.Client
) -> None:
    result = celery_tasks.sleepy.delay(30)
    key = str(result.id)
    step = slug("sleepy", key)
    wait_for("the task to run", lambda: (record(raw, key, step) or {}).get("status") == "running")
    app.control.revoke(key, terminate=True)
    failed = wait_for(
        "the revoke", lambda: (r := record(raw, key, step)) and r["status"] == "failed" and r
    )
    assert failed["error_code"] == "revoked"
    assert "SIGTERM" in (failed["error_message"] or "")


# --------------------------------------------------------------------------- leases


def test_a_long_task_is_kept_alive_by_heartbeats_past_three_leases(
    threads: Worker, raw: httpx.Client
) -> None:
    result = celery_tasks.sleepy.apply_async((3.5, "done"), queue=threads.queue)
    key = str(result.id)
    step = slug("sleepy", key)
    running = wait_for("the task to run", lambda: record(raw, key, step))
    first_lease = running["lease_expires_at"]
    assert first_lease is not None
    assert result.get(timeout=30) == "done"
    (only,) = wait_for("the completion", lambda: settled(raw, key, 1))
    assert (only["status"], only["attempt_count"], only["output"]) == ("completed", 1, "done")
    # One attempt, completed: the sweeper (every 0.2 s) never found its 1 s lease expired.
    assert [(a["attempt"], a["status"]) for a in attempts(raw, key, step)] == [(1, "completed")]


def test_a_worker_killed_mid_task_is_swept_and_the_redelivery_is_attempt_2(
    server_url: str, raw: httpx.Client, tmp_path: Path
) -> None:
    with fresh_queue() as queue:
        result = celery_tasks.stall_unless_redelivered.apply_async(queue=queue)
        key = str(result.id)
        step = slug("stall_unless_redelivered", key)
        with worker(tmp_path, server_url, queue, "solo", lease=1) as doomed:
            wait_for("the task to run", lambda: record(raw, key, step))
            doomed.kill()  # the broker gets the message back when the connection drops
        swept = wait_for(
            "the sweeper", lambda: (r := record(raw, key, step)) and r["status"] == "failed" and r
        )
        assert (swept["attempt_count"], swept["error_code"]) == (1, "lease_expired")

        with worker(tmp_path, server_url, queue, "solo", lease=1):
            assert result.get(timeout=30) == "redelivered"
            done = wait_for(
                "attempt 2",
                lambda: (r := record(raw, key, step)) and r["status"] == "completed" and r,
            )
    assert (done["attempt_count"], done["output"]) == (2, "redelivered")
    history = attempts(raw, key, step)
    assert [(a["attempt"], a["status"], a["error_code"]) for a in history] == [
        (1, "failed", "lease_expired"),
        (2, "completed", None),
    ]


# --------------------------------------------------------------------------- the service down


def test_tasks_finish_with_their_own_outcome_when_the_service_stops(
    database_url: str, tmp_path: Path
) -> None:
    service, proc = start_server(database_url)
    try:
        with (
            fresh_queue() as queue,
            worker(tmp_path, service, queue, "threads", concurrency=4, lease=2) as running,
            httpx.Client(base_url=service, timeout=10) as own,
        ):
            sleepers = [celery_tasks.sleepy.apply_async((1.5, i), queue=queue) for i in range(3)]
            failing = celery_tasks.boom.apply_async((3,), queue=queue)
            keys = [str(result.id) for result in sleepers]
            wait_for(
                "the tasks to run",
                lambda: all(record(own, key, slug("sleepy", key)) for key in keys),
            )
            stop(proc)
            stopped = time.monotonic()

            assert [r.get(timeout=30) for r in sleepers] == [0, 1, 2]
            with pytest.raises(ValueError, match="boom at 3"):
                failing.get(timeout=30)
            # The reports failed (after bounded retries), the tasks did not wait on them long.
            assert time.monotonic() - stopped < 1.5 + 5
            later = time.monotonic()
            assert celery_tasks.add.apply_async((2, 2), queue=queue).get(timeout=30) == 4
            assert time.monotonic() - later < 5
            assert "not recorded" in running.output()
    finally:
        stop(proc)


# --------------------------------------------------------------------------- other apps


def test_a_task_of_a_second_app_in_the_worker_process_is_not_recorded(
    prefork: Worker, raw: httpx.Client
) -> None:
    result = celery_tasks.calls_other_app.delay(21)
    assert result.get(timeout=30) == 42
    key = str(result.id)
    (only,) = wait_for("the record", lambda: settled(raw, key, 1))
    assert only["step_slug"] == slug("calls_other_app", key)


def test_record_celery_connects_only_the_app_it_is_given(
    server_url: str, raw: httpx.Client
) -> None:
    recorded, untouched = Celery("recorded"), Celery("untouched")
    recorded.conf.task_store_eager_result = False
    untouched.conf.task_store_eager_result = False

    @recorded.task(name="mine.double")
    def mine(value: int) -> int:
        return value * 2

    @untouched.task(name="theirs.double")
    def theirs(value: int) -> int:
        return value * 2

    recording = record_celery(recorded, server_url, lease_seconds=5)
    try:
        theirs_id = str(uuid.uuid4())
        assert theirs.apply((4,), task_id=theirs_id).get() == 8
        mine_id = str(uuid.uuid4())
        assert mine.apply((5,), task_id=mine_id).get() == 10
    finally:
        recording.disconnect()
    assert records(raw, theirs_id) == []
    (only,) = records(raw, mine_id)
    assert (only["step_slug"], only["status"], only["output"]) == (
        f"mine.double:{mine_id}",
        "completed",
        10,
    )
    after = str(uuid.uuid4())
    mine.apply((1,), task_id=after).get()
    assert records(raw, after) == [], "disconnect() stops recording"


def test_slugs_map_task_names_into_the_slug_alphabet_and_fit_200_characters() -> None:
    task_id = "5f0c7d6e-2b1a-4c3d-9e8f-0a1b2c3d4e5f"
    assert step_slug_for("shop.charge", task_id) == f"shop.charge:{task_id}"
    assert step_slug_for("_private/task name!", task_id) == f"private-task-name-:{task_id}"
    long = step_slug_for("x" * 500, task_id)
    assert len(long) == 200
    assert long.endswith(f":{task_id}")


def test_the_shop_example_runs_as_its_docstring_says(
    server_url: str, raw: httpx.Client, tmp_path: Path
) -> None:
    """`celery -A celery_shop worker` in the examples directory, then `python celery_shop.py`:
    the chain runs, and its instance has reserve, charge (three attempts) and ship."""
    examples = ROOT / "clients" / "python" / "examples"
    queue = f"steprecord-shop-{uuid.uuid4().hex[:10]}"
    env = {
        **os.environ,
        "SHOP_BROKER": BROKER,
        "SHOP_BACKEND": BACKEND,
        "SHOP_QUEUE": queue,
        "STEPRECORD_URL": server_url,
    }
    log = tmp_path / "shop-worker.log"
    with log.open("wb") as out:
        worker_proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "celery_shop", "worker", "--pool", "solo",
             "--without-gossip", "--without-mingle", "--without-heartbeat", "--loglevel", "INFO"],
            cwd=examples, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        wait_for(
            "the shop's worker to be ready",
            lambda: worker_proc.poll() is not None or " ready." in log.read_text(errors="replace"),
            seconds=30,
        )
        assert worker_proc.poll() is None, log.read_text(errors="replace")[-3000:]
        sent = subprocess.run(
            [sys.executable, "celery_shop.py"],
            cwd=examples, env=env, capture_output=True, text=True, timeout=90,
        )  # fmt: skip
        assert sent.returncode == 0, sent.stderr[-3000:]
        assert sent.stdout.strip().startswith("parcel for order-123 (ch-order-123)")
        (only,) = raw.get("/v1/instances").json()["items"]  # the shared tables start empty
        steps = wait_for("the shop's three steps", lambda: settled(raw, only["instance_key"], 3))
        assert [(r["step_slug"].split(":")[0], r["attempt_count"]) for r in steps] == [
            ("shop.reserve", 1),
            ("shop.charge", 3),
            ("shop.ship", 1),
        ]
    finally:
        worker_proc.send_signal(signal.SIGQUIT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            worker_proc.wait(5)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(worker_proc.pid, signal.SIGKILL)
        worker_proc.wait()
        with app.connection_for_write() as conn:
            Queue(queue, Exchange(queue, type="direct"), routing_key=queue)(
                conn.default_channel
            ).delete()
