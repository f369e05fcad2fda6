"""Request ids, one JSON log line per request, and Prometheus metrics.

With several workers, metrics live in `PROMETHEUS_MULTIPROC_DIR` (set by `steprecord serve`)
and `/metrics` sums every worker's.
"""

import json
import logging
import os
import re
import sys
import time
import uuid
from collections.abc import Iterable
from contextvars import ContextVar
from typing import Any, TypeVar

import orjson
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..core.problems import problem_response

REQUEST_SECONDS = Histogram(
    "steprecord_http_request_duration_seconds",
    "HTTP requests by method, route template and status.",
    ["method", "route", "status"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
EVENTS = Counter("steprecord_events_total", "Events by kind and outcome.", ["kind", "outcome"])
POOL = Gauge(
    "steprecord_db_pool_connections",
    "Database connections in use, and requests waiting for one, by pool (primary, replica).",
    ["pool", "state"],
    multiprocess_mode="livesum",
)
READINESS_CHECKS = Counter(
    "steprecord_readiness_checks",
    "Readiness checks run against the primary (each /readyz answers from one at most 1 s old).",
)
READS = Counter("steprecord_reads_total", "Reads by the database that served them.", ["pool"])
PRUNED = Counter(
    "steprecord_pruned_instances",
    "Instances deleted by the background pruner (STEPRECORD_RETENTION).",
)
REPAIRS = Counter(
    "steprecord_repairs",
    "Operators' repairs written to the repair log, by action (reopen).",
    ["action"],
)
REPLICA_LAG = Gauge(
    "steprecord_read_replica_lag_seconds",
    "How far the read replica is behind the primary, as last measured (+Inf: unreachable).",
    multiprocess_mode="livemax",
)
REPLICA_IN_USE = Gauge(
    "steprecord_read_replica_in_use",
    "1 while reads go to the replica, 0 while they go to the primary.",
    multiprocess_mode="livemin",
)
STREAMS_OPEN = Gauge(
    "steprecord_streams_open",
    "Live-update streams open.",
    multiprocess_mode="livesum",
)
M = TypeVar("M", bound=MetricWrapperBase)
OUTCOMES = frozenset({"created", "applied", "replay", "conflict", "stale_attempt", "swept"})

# Each metric's child per label values: prometheus_client's own lookup takes a lock and builds
# the key on every call, and these are updated on every request.
_children: dict[tuple[object, ...], Any] = {}
request_id: ContextVar[str] = ContextVar("request_id", default="-")
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_access = logging.getLogger("steprecord.request")


def count_event(kind: str, outcome: str, amount: int = 1) -> None:
    """Count events; anything that is not one of the outcomes above was refused."""
    _child(EVENTS, kind, outcome if outcome in OUTCOMES else "refused").inc(amount)


def count_repair(action: str) -> None:
    """Count a repair written to the repair log."""
    _child(REPAIRS, action).inc()


def _child(metric: M, *labels: str) -> M:
    child = _children.get((metric, *labels))
    if child is None:
        child = _children[metric, *labels] = metric.labels(*labels)
    return child


def pool_changed(pool: str, state: str, value: int) -> None:
    _child(POOL, pool, state).set(value)


def count_read(pool: str) -> None:
    _child(READS, pool).inc()


def replica_lag(seconds: float) -> None:
    REPLICA_LAG.set(seconds)


def replica_in_use(in_use: bool) -> None:
    REPLICA_IN_USE.set(1 if in_use else 0)


class _With(Collector):
    """Every metric of `source`, then `extra`: figures measured for this scrape alone."""

    def __init__(self, source: Collector, extra: list[Metric]) -> None:
        self.source, self.extra = source, extra

    def collect(self) -> Iterable[Metric]:
        yield from self.source.collect()
        yield from self.extra


def long_running(count: int | None) -> list[Metric]:
    """The gauge of long-running steps, counted in the database for this scrape (None: the
    database did not answer, and the gauge is left out)."""
    if count is None:
        return []
    gauge = GaugeMetricFamily(
        "steprecord_long_running_steps",
        "Running steps without a lease started longer ago than STEPRECORD_LONG_RUNNING_AFTER.",
    )
    gauge.add_metric([], count)
    return [gauge]


def render(extra: list[Metric] | None = None) -> tuple[bytes, str]:
    source: Collector = REGISTRY
    if "PROMETHEUS_MULTIPROC_DIR" in os.environ:
        source = multiprocess.MultiProcessCollector(None)  # type: ignore[no-untyped-call]
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_With(source, extra or []))
    return generate_latest(registry), CONTENT_TYPE_LATEST


class _JSONLines(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = getattr(record, "fields", None) or {
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            "request_id": request_id.get(),
        }
        if record.exc_info:
            line = {**line, "error": self.formatException(record.exc_info)}
        try:
            return orjson.dumps(line, default=str).decode()
        except TypeError:  # text orjson refuses (a lone surrogate): the standard encoder escapes it
            return json.dumps(line, separators=(",", ":"), default=str)


def configure_logging() -> None:
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(_JSONLines())
    root = logging.getLogger("steprecord")
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    root.propagate = False


def _template(scope: Scope) -> str:
    """The route template; requests refused before routing (401, 403, 405) are looked up."""
    route = scope.get("route")
    if route is None:
        for candidate in scope["app"].router.routes:
            if candidate.matches(scope)[0] != Match.NONE:
                route = candidate
                break
    return getattr(route, "path", None) or "unmatched"


class Observe:
    """ASGI middleware: takes or makes the request id, echoes it, logs and times the request."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        began = time.perf_counter()
        rid = ""
        for name, value in scope["headers"]:
            if name == b"x-request-id":
                rid = value.decode("latin-1")
                break
        if not _REQUEST_ID.fullmatch(rid):
            rid = uuid.uuid4().hex
        token = request_id.set(rid)
        status = 500
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                status, started = message["status"], True
                message["headers"] = [*message.get("headers", []), (b"x-request-id", rid.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception as exc:
            # Starlette answers an unhandled error outside this middleware, without the id:
            # answer it here, and re-raise so that the server still logs the traceback.
            if not started:
                await problem_response(exc)(scope, receive, send_with_id)
            raise
        finally:
            seconds = time.perf_counter() - began
            template = _template(scope)
            method = scope["method"]
            _child(REQUEST_SECONDS, method, template, str(status)).observe(seconds)
            _access.info(
                "request",
                extra={
                    "fields": {
                        "method": method,
                        "route": template,
                        "status": status,
                        "duration_ms": round(seconds * 1000, 3),
                        "request_id": rid,
                    }
                },
            )
            request_id.reset(token)
