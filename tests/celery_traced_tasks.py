"""The Celery app of the trace tests (tests/test_tracing.py), imported by the test and by its
worker processes.

In a worker (`STEPRECORD_TEST_SERVICE` set) every task is recorded by `record_celery`; with
`STEPRECORD_TEST_INSTRUMENT=1`, OpenTelemetry's Celery instrumentation, connected first, runs
each task in a span of its own (the SDK's provider: real ids, nothing exported). The queue,
broker and results backend come from `STEPRECORD_TEST_QUEUE`, `STEPRECORD_TEST_BROKER` and
`STEPRECORD_TEST_BACKEND`, as for tests/celery_tasks.py.
"""

from __future__ import annotations

import os

from celery import Celery
from opentelemetry import trace
from steprecord_client.celery import record_celery

BROKER = os.environ.get("STEPRECORD_TEST_BROKER", "amqp://guest:guest@127.0.0.1:5672//")
BACKEND = os.environ.get("STEPRECORD_TEST_BACKEND", "redis://127.0.0.1:6379/7")
QUEUE = os.environ.get("STEPRECORD_TEST_QUEUE", "steprecord-test-traced")

app = Celery("steprecord_test_traced", broker=BROKER, backend=BACKEND)
app.conf.update(
    task_default_queue=QUEUE,
    broker_connection_retry_on_startup=True,
    result_expires=600,
    worker_hijack_root_logger=False,
)

if os.environ.get("STEPRECORD_TEST_SERVICE"):
    if os.environ.get("STEPRECORD_TEST_INSTRUMENT") == "1":
        from opentelemetry.instrumentation.celery import CeleryInstrumentor
        from opentelemetry.sdk.trace import TracerProvider

        # Before record_celery: its signal handlers run first, so the task's span is current
        # when the task's start is reported.
        CeleryInstrumentor().instrument(  # type: ignore[no-untyped-call]
            tracer_provider=TracerProvider()
        )
    record_celery(app, os.environ["STEPRECORD_TEST_SERVICE"], lease_seconds=60)


@app.task
def current_trace() -> str | None:
    """The trace id of the span current while the task runs (None outside any span)."""
    context = trace.get_current_span().get_span_context()
    return format(context.trace_id, "032x") if context.is_valid else None
