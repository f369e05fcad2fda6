"""The Celery app of tests/test_celery.py, imported by the test and by its worker processes.

Configured by environment variables, so every worker a test starts can get its own queue,
service and lease: `STEPRECORD_TEST_BROKER`, `STEPRECORD_TEST_BACKEND`,
`STEPRECORD_TEST_QUEUE`, `STEPRECORD_TEST_SERVICE` (unset: the tasks are not recorded, as in
the test process, which only sends them) and `STEPRECORD_TEST_LEASE` (seconds).
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery import Celery, Task
from steprecord_client.celery import record_celery

BROKER = os.environ.get("STEPRECORD_TEST_BROKER", "amqp://guest:guest@127.0.0.1:5672//")
BACKEND = os.environ.get("STEPRECORD_TEST_BACKEND", "redis://127.0.0.1:6379/7")
QUEUE = os.environ.get("STEPRECORD_TEST_QUEUE", "steprecord-test")

app = Celery("steprecord_test", broker=BROKER, backend=BACKEND)
app.conf.update(
    task_default_queue=QUEUE,
    task_acks_late=True,  # a message stays in the broker until its task has finished ...
    task_reject_on_worker_lost=True,  # ... and goes back to it when the worker dies
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    result_expires=600,
    worker_hijack_root_logger=False,
)

if os.environ.get("STEPRECORD_TEST_SERVICE"):
    record_celery(
        app,
        os.environ["STEPRECORD_TEST_SERVICE"],
        lease_seconds=int(os.environ.get("STEPRECORD_TEST_LEASE", "60")),
    )

# A second app of the same process, never recorded.
other = Celery("steprecord_test_other", broker=BROKER, backend=BACKEND)


class Flaky(Exception):
    """What `flaky` raises before it succeeds."""


@app.task
def add(x: int, y: int) -> int:
    return x + y


@app.task(bind=True, max_retries=5)
def flaky(self: Task[Any, Any], value: int, failures: int = 2) -> int:
    """Fails `failures` times (asking Celery for a retry each time), then returns `value`."""
    try:
        if self.request.retries < failures:
            raise Flaky(f"flaky try {self.request.retries + 1}")
    except Flaky as exc:  # as Celery's documentation retries: from the except block
        raise self.retry(exc=exc, countdown=0) from exc
    return value


@app.task
def boom(value: int) -> int:
    raise ValueError(f"boom at {value}")


@app.task
def deep_failure(depth: int) -> int:
    """Fails with a message of a deep traceback's shape: `depth` frames, then its exception."""
    frames = "".join(
        f'  File "shop.py", line {n}, in step_{n}\n    step_{n + 1}()\n' for n in range(depth)
    )
    raise RuntimeError(f"Traceback (most recent call last):\n{frames}KeyError: 'sku-{depth}'")


@app.task
def sleepy(seconds: float, value: Any = None) -> Any:
    time.sleep(seconds)
    return value


@app.task(bind=True)
def stall_unless_redelivered(self: Task[Any, Any]) -> str:
    """Stalls for a minute on its first delivery (the test kills the worker meanwhile);
    returns at once when the broker delivers it again."""
    if self.request.delivery_info and self.request.delivery_info.get("redelivered"):
        return "redelivered"
    time.sleep(60)
    return "not killed"


@app.task
def calls_other_app(value: int) -> int:
    """Runs a task of the unrecorded second app in this worker process."""
    result = other_double.apply(args=(value,)).result  # ran eagerly, right here
    assert isinstance(result, int)
    return result


@other.task
def other_double(value: int) -> int:
    return value * 2
