"""Traces: OpenTelemetry spans over OTLP/HTTP, and the trace id each attempt keeps.

Tracing is on when `OTEL_EXPORTER_OTLP_ENDPOINT` or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` is set
and `OTEL_SDK_DISABLED` is not `true`. The SDK reads every other standard variable itself:
`OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_EXPORTER_OTLP_HEADERS`,
`OTEL_TRACES_SAMPLER`, `OTEL_BSP_SCHEDULE_DELAY`, and the others.

On: the official FastAPI instrumentation makes one server span per request, continuing the
caller's W3C `traceparent`; each database call of a request is a child span of it (see
`database_call`, used by `Pool.connection` in app/core/db.py). Every worker process has its own
provider: `instrument` gives the app its middleware when the app is built, `start` adds the
batch exporter when the worker starts, and `stop` flushes it and shuts it down when the
worker stops.

Off: no middleware, no provider and nothing imported from the SDK. A request that writes
events only looks for a `traceparent` header, so that the attempts it starts keep their
caller's trace id all the same (`trace_id`).

The trace id of a request goes to the judge's functions, which set it as the transaction's
`steprecord.trace_id`: the history's new attempt rows take it as their default
(`workflow_step_attempt.trace_id`, migration 0016), so each attempt keeps the trace of the
event that started it.
"""

import asyncio
import functools
import os
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from psycopg.conninfo import conninfo_to_dict

if TYPE_CHECKING:  # the database spans (app/core/db.py) need neither FastAPI nor the SDK
    from fastapi import FastAPI, Request
    from opentelemetry.sdk.trace import TracerProvider

T = TypeVar("T")
Tracer = trace.Tracer
ENDPOINTS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
# The server span's own `receive`/`send` children say nothing about this service's work.
EXCLUDED_SPANS: list[Literal["receive", "send"]] = ["receive", "send"]
_W3C = TraceContextTextMapPropagator()


def enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this process exports traces: an OTLP endpoint is set and the SDK is not off."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return any(environ.get(name, "").strip() for name in ENDPOINTS)


def instrument(app: "FastAPI") -> "TracerProvider | None":
    """When tracing is on: a provider for this worker (no exporter yet: `start` adds it) and
    the app's server spans through it. Off: None, and the app is left as it is."""
    if not enabled():
        return None
    from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor
    from opentelemetry.sdk.trace import TracerProvider

    provider = TracerProvider()  # resource, sampler and limits from the OTEL_* variables
    FastAPIInstrumentor.instrument_app(app, tracer_provider=provider, exclude_spans=EXCLUDED_SPANS)
    return provider


def start(provider: "TracerProvider") -> trace.Tracer:
    """Export this worker's spans in batches over OTLP/HTTP (endpoint, headers, timeouts and
    batch sizes from the OTEL_* variables); the tracer of the database spans."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return provider.get_tracer("steprecord")


async def stop(provider: "TracerProvider") -> None:
    """Export what is left and stop the exporter (it may wait for the collector: not on the
    event loop)."""
    await asyncio.to_thread(provider.shutdown)


def trace_id(request: "Request") -> str | None:
    """The trace id the attempts a request starts keep: 32 lowercase hex digits, or None.

    On, the current span's (the server span, which continues the caller's `traceparent`).
    Off, or for a request the instrumentation leaves out (OTEL_PYTHON_FASTAPI_EXCLUDED_URLS),
    the caller's `traceparent`, when it is present and valid W3C trace context.
    """
    if request.app.state.tracing is not None:
        context = trace.get_current_span().get_span_context()
        if context.is_valid:
            return format(context.trace_id, "032x")
    if "traceparent" not in request.headers:
        return None
    context = trace.get_current_span(_W3C.extract(request.headers)).get_span_context()
    return format(context.trace_id, "032x") if context.is_valid else None


def name_of(work: Callable[..., Any]) -> str:
    """A low-cardinality span name for `work`: the function that defined it (a route's
    `lambda conn: data.get_step(...)` is named after the route function, `get_step`)."""
    qualname: str = getattr(work, "__qualname__", None) or type(work).__name__
    return qualname.split(".<locals>", 1)[0]


@functools.lru_cache(maxsize=8)
def database_attributes(conninfo: str) -> dict[str, str | int]:
    """The standard attributes of a database span (never a user or a password)."""
    params = conninfo_to_dict(conninfo)
    attributes: dict[str, str | int] = {"db.system": "postgresql", "db.system.name": "postgresql"}
    if params.get("dbname"):
        attributes["db.namespace"] = str(params["dbname"])
    host = str(params.get("host") or "")
    if host and "," not in host and not host.startswith("/"):
        attributes["server.address"] = host
        port = str(params.get("port") or "5432")
        if port.isdigit():
            attributes["server.port"] = int(port)
    elif host.startswith("/"):
        attributes["network.transport"] = "unix"
    return attributes


def database_call(
    tracer: trace.Tracer,
    connection: AbstractAsyncContextManager[T],
    name: str | Callable[..., Any] | None,
    conninfo: str,
    failures: tuple[type[BaseException], ...],
) -> AbstractAsyncContextManager[T]:
    """`connection` (a pool's, waiting for it included) inside a client span named `name`,
    a child of the current span; exceptions of the `failures` types mark it failed (a 404
    raised by a data function is an answer, not a failed call). Work outside a sampled
    request (the sweeper, token reloads) gets no span."""
    if not trace.get_current_span().is_recording():
        return connection
    label = "postgresql" if name is None else name if isinstance(name, str) else name_of(name)
    return _spanned(tracer, connection, label, database_attributes(conninfo), failures)


@asynccontextmanager
async def _spanned(
    tracer: trace.Tracer,
    connection: AbstractAsyncContextManager[T],
    name: str,
    attributes: dict[str, str | int],
    failures: tuple[type[BaseException], ...],
) -> AsyncIterator[T]:
    with tracer.start_as_current_span(
        name,
        kind=trace.SpanKind.CLIENT,
        attributes=attributes,
        record_exception=False,
        set_status_on_exception=False,
    ) as span:
        try:
            async with connection as conn:
                yield conn
        except failures as exc:
            span.record_exception(exc)
            span.set_status(trace.Status(trace.StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
            raise
