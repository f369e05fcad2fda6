"""The built-in dashboard at `/ui`: read-only pages rendered on the server from the data module.

The pages are here; what they show in words is `formatting`, the templates' environment and
the render `rendering`, the sign-in `signin`. The stylesheet and the small live-update script
are served by the service itself.
"""

import asyncio
import math
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import quote

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import HTMLResponse, Response
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..access import tenancy
from ..api.bodies import label_filter
from ..core import cursors, domain, static
from ..core.db import AsyncConn
from ..core.limits import KEY_PREFIX_RE, KEY_RE, NAME_RE
from ..core.problems import Problem
from ..data import dashboard, reads, repairs, running, stats
from ..ops.replica import ReadPool
from . import signin
from . import timeline as timescale
from .formatting import (
    iso,
    label,
    mark,
    millis,
    path,
    pretty,
    pretty_head,
    reason_after,
    step_label,
    tip,
    took,
    unleased_for,
    utc,
)
from .rendering import (
    ASSETS,
    GLYPHS,
    RENDERS_AT_ONCE,
    not_found,
    render,
    render_aside,
)
from .timeline import duration

PAGE_SIZE = 50
MAX_STEPS = 1000  # the most steps an instance page shows; the API lists any number
LIST_SIZE = 100
STATS_SIZE = 100  # step names on the statistics page, most attempts first
# The timeline's lanes and axis, in pixels (its scale: app/dashboard/timeline.py).
LANE, AXIS = 18, 34
# A lane's label, in characters: what fits its share of the timeline (`timeline.LABEL`) on a
# wide page, and on a narrow one (ui.css shows the narrow label below 1,000 px).
LANE_CHARS, NARROW_LANE_CHARS = 28, 20
# Long pages are drawn in chunks of steps that the browser lays out only once scrolled into
# view (`content-visibility: auto`); ROW_HEIGHT is a table row's estimated height in pixels.
CHUNK = 100
ROW_HEIGHT = 27
router = APIRouter(include_in_schema=False)


def read_connection(request: Request) -> AbstractAsyncContextManager[AsyncConn]:
    """The connection every page reads from: the one place that chooses the database (the
    read replica while it is healthy, else the primary; see app/ops/replica.py)."""
    reads: ReadPool = request.app.state.read_pool
    return reads.connection()


def shown_attempt(attempt: dict[str, Any], api: str) -> dict[str, Any]:
    """An attempt as the step page shows it: an output within `OUTPUT_HEAD` bytes whole and
    pretty-printed, a larger one's first `OUTPUT_HEAD` bytes indented the same way up to the
    cut (`pretty_head`), with a link to the attempt in the API (`api`: the step's URL there)."""
    size = attempt["output_bytes"]
    if size is not None and size > dashboard.OUTPUT_HEAD:
        head = attempt["output"].encode()[: dashboard.OUTPUT_HEAD].decode(errors="ignore")
        after = (
            ""
            if attempt["attempt"] == 1
            else "&cursor=" + cursors.attempts_cursor({"attempt": attempt["attempt"] - 1})
        )
        attempt["output"] = pretty_head(head) + "\n…"
        attempt["output_href"] = f"{api}/attempts?limit=1{after}"
    else:
        attempt["output"] = None if size is None else pretty(attempt["output"])
    return attempt


# --- the timeline ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Bar:
    """An attempt's bar on its lane: placed in percent of the timeline's width, with the
    words a person reads on hover or keyboard focus (and a screen reader as its label)."""

    mark: str
    x: float
    width: float
    attempt: int
    start_ms: str
    end_ms: str
    tip: str


@dataclass(frozen=True, slots=True)
class Row:
    """A step as the instance page shows it, in its table row and its timeline lane."""

    slug: str
    short: str  # the lane's label on a wide page
    narrow: str  # the lane's label on a narrow one (CSS shows one of the two)
    href: str
    y: int
    bars: list[Bar]
    ordinal: int
    status: str
    mark: str
    glyph: str
    label: str
    attempts: int
    started: str
    start_ms: str
    end_ms: str
    took: str
    error: str
    error_line: str
    updated: str
    unleased: str = ""  # running without a lease past STEPRECORD_LONG_RUNNING_AFTER: for how long


def timeline(
    instance_key: str,
    records: list[dict[str, Any]],
    now: datetime,
    long_running_after: timedelta | None = None,
) -> dict[str, Any]:
    """The instance page's rows: the steps table and the timeline's lanes, with every text
    formatted here (the template only places and escapes them; it renders 1,000 steps fast).
    The page's script draws nothing itself: it asks for this again (`/ui/instances/{key}/
    parts`) when the stream says a step changed, and only stretches running bars to now.
    A running step without a lease past `long_running_after` is flagged (`Row.unleased`)."""
    attempts = [a for r in records for a in r["attempts"]]
    runs = any(a["completed_at"] is None for a in attempts)
    scale = timescale.scale(
        [(a["started_at"], a["completed_at"] or now) for a in attempts], running=runs, now=now
    )
    rows = []
    steps_path = path("instances", instance_key, "steps") + "/"
    for index, record in enumerate(records):
        bars: list[Bar] = []
        if scale is not None:
            # Each attempt at least its minimum width and apart from the one before it by a
            # gap, so two short attempts never read as one (timeline.separate).
            attempts = record["attempts"]
            places = timescale.separate(
                [scale.bar(a["started_at"], a["completed_at"] or now) for a in attempts]
            )
            bars = [
                Bar(
                    mark=mark(attempt["status"], attempt["error_code"]),
                    x=x,
                    width=width,
                    attempt=attempt["attempt"],
                    start_ms=millis(attempt["started_at"]),
                    end_ms=millis(attempt["completed_at"]),
                    tip=tip(record["step_slug"], attempt, scale, now),
                )
                for attempt, (x, width) in zip(attempts, places, strict=True)
            ]
        status, code = record["status"], record["error_code"]
        rows.append(
            Row(
                slug=record["step_slug"],
                short=step_label(record["step_slug"], LANE_CHARS),
                narrow=step_label(record["step_slug"], NARROW_LANE_CHARS),
                href=steps_path + quote(record["step_slug"], safe=""),
                y=(index % CHUNK) * LANE,
                bars=bars,
                ordinal=record["ordinal"],
                status=status,
                mark=mark(status, code),
                glyph=GLYPHS[mark(status, code)],
                label=label(status, code),
                attempts=record["attempt_count"],
                started=utc(record["started_at"]),
                start_ms=millis(record["started_at"]),
                end_ms=millis(record["completed_at"]),
                took=took(record["started_at"], record["completed_at"], now),
                error=code or "",
                error_line=reason_after(code, record["error_line"]),
                updated=iso(record["updated_at"]),
                unleased=unleased_for(record, now, long_running_after),
            )
        )
    chunks = [rows[i : i + CHUNK] for i in range(0, len(rows), CHUNK)] or [[]]
    last = scale.segments[-1] if scale else None
    return {
        "chunks": chunks,
        "scale": scale,
        "first": utc(scale.first) if scale else "",
        "first_ms": millis(scale.first) if scale else "",
        # How the script stretches running bars: the last segment is linear, and every
        # running attempt lies in it (no gap is compressed while something runs).
        "end_ms": f"{last.end:.0f}" if last else "",
        "pct_per_ms": f"{last.pct_per_ms:.9g}" if last else "",
        "now_ms": millis(now),
        "min_bar": timescale.MIN_BAR,
        "label": timescale.LABEL,
        "area": timescale.AREA,
        "lane": LANE,
        "axis": AXIS,
        "row_height": ROW_HEIGHT,
    }


# --- pages -----------------------------------------------------------------------------


def labels_asked(query: Any) -> tuple[dict[str, str] | None, str, list[str]]:
    """The labels a page filters by (`labels=env=prod dag=etl`, as typed in its form): the
    labels, the text as typed, and what is wrong with it."""
    text = (query.get("labels") or "").strip()
    try:
        return label_filter(text.split()), text, []
    except Problem as exc:
        return None, text, [f"Labels are KEY=VALUE pairs separated by spaces: {exc.detail}"]


@router.get("/ui")
async def instances_page(request: Request) -> Response:
    query = request.query_params
    status = query.get("status") or None
    has: reads.Trouble | None = "failed" if status == "failed" else None
    if status == "running":
        has = "running"
    prefix = (query.get("prefix") or "").strip() or None
    labels, labels_text, errors = labels_asked(query)
    if status not in (None, "failed", "running"):
        errors.append('The status filter is "has failed steps" or "has running steps".')
    if prefix is not None and not KEY_PREFIX_RE.fullmatch(prefix):
        errors.append(
            "A key prefix is 1 to 200 characters of letters, digits and . _ : - + ~ (as keys are)."
        )
    before = None
    if query.get("cursor"):
        try:
            before = cursors.instances_position(query["cursor"])
        except Problem:
            errors.append("That page link is no longer valid: start from the first page.")
    items: list[dict[str, Any]] = []
    summaries: dict[int, dict[str, Any]] = {}
    last = None
    # A token with a key prefix sees its instances only, whatever the filter asks.
    reachable, within = tenancy.narrow(tenancy.prefix_of(request.scope), prefix)
    if reachable and not errors:
        async with read_connection(request) as conn:
            items, last = await reads.list_instances(
                conn, prefix=within, has=has, labels=labels, before=before, limit=PAGE_SIZE
            )
            summaries = await dashboard.instance_summaries(conn, [i["id"] for i in items])
    now = datetime.now(UTC)
    for item in items:
        summary = summaries.get(item["id"])
        item["failing_step"] = summary["failing_step"] if summary else None
        item["last_activity"] = summary["last_activity"] if summary else None
        item["took"] = ""
        if summary and summary["first_start"] is not None:
            end = None if summary["running"] else summary["last_end"] or summary["first_start"]
            item["took"] = took(summary["first_start"], end, now) + (" so far" if not end else "")
    next_query = None
    if last is not None:
        params = {
            "status": status or "",
            "prefix": prefix or "",
            "labels": labels_text,
            "cursor": cursors.instances_cursor(last),
        }
        next_query = "&".join(f"{k}={quote(v)}" for k, v in params.items() if v)
    return render(
        request,
        "instances.html",
        422 if errors else 200,
        title="Instances",
        items=items,
        status=status or "",
        prefix=prefix or "",
        labels=labels_text,
        errors=errors,
        filtered=bool(status or prefix or labels_text or before),
        next_query=next_query,
        base_url=str(request.base_url).rstrip("/"),
    )


async def _instance(
    request: Request, instance_key: str
) -> tuple[dict[str, Any], list[dict[str, Any]], int, int] | HTMLResponse:
    """An instance with its first `MAX_STEPS` steps, how many it has in all, and how many
    attempts a lane shows at most; or the 404 page."""
    if not KEY_RE.fullmatch(instance_key):
        return not_found(request, "No instance has that key.")
    async with read_connection(request) as conn:
        try:
            tenancy.check_read(request.scope, instance_key)
            instance = await reads.get_instance(conn, instance_key)
        except domain.InstanceNotFound:
            return not_found(request, f"No instance has the key {instance_key!r}.")
        records, total, lane = await dashboard.instance_steps(conn, instance["id"], limit=MAX_STEPS)
    return instance, records, total, lane


@router.get("/ui/instances/{instance_key}")
async def instance_page(request: Request, instance_key: str) -> Response:
    found = await _instance(request, instance_key)
    if isinstance(found, HTMLResponse):
        return found
    instance, records, total, lane = found
    after: timedelta = request.app.state.long_running_after

    def build() -> dict[str, Any]:
        lanes = timeline(instance_key, records, datetime.now(UTC), after)
        return {
            "title": instance_key,
            "instance": instance,
            "records": records,
            "total_steps": total,
            "steps_api": "/v1" + path("instances", instance_key, "steps").removeprefix("/ui"),
            # Steps retried more often than a lane draws: their newest attempts only.
            "cut": sum(r["attempt_count"] > len(r["attempts"]) == lane for r in records),
            "lane_attempts": lane,
            "timeline": lanes,
            "unleased": [r for chunk in lanes["chunks"] for r in chunk if r.unleased],
            "long_running_after": duration(after.total_seconds()),
            "stream": f"/v1/instances/{quote(instance_key, safe='')}/stream",
            "parts": path("instances", instance_key, "parts"),
        }

    return await render_aside(request, build, "instance.html")


@router.get("/ui/instances/{instance_key}/parts")
async def instance_parts(request: Request, instance_key: str) -> Response:
    """The parts of the instance page that change with its steps (counts, timeline, steps
    table), as the page renders them: its script swaps them in when the stream says a step
    changed, so rows added live are drawn by the same code as the rest."""
    found = await _instance(request, instance_key)
    if isinstance(found, HTMLResponse):
        return found
    instance, records, _, _ = found
    after: timedelta = request.app.state.long_running_after

    def build() -> dict[str, Any]:
        return {
            "instance": instance,
            "timeline": timeline(instance_key, records, datetime.now(UTC), after),
        }

    return await render_aside(request, build, "parts.html")


@router.get("/ui/instances/{instance_key}/steps/{step_slug}")
async def step_page(request: Request, instance_key: str, step_slug: str) -> Response:
    if not (KEY_RE.fullmatch(instance_key) and NAME_RE.fullmatch(step_slug)):
        return not_found(request, "No step has that name.")
    api = "/v1" + path("instances", instance_key, "steps", step_slug).removeprefix("/ui")
    async with read_connection(request) as conn:
        try:
            tenancy.check_read(request.scope, instance_key)
            record = await reads.get_step(conn, instance_key, step_slug)
            attempts, total = await dashboard.step_attempts(
                conn, instance_key, record["id"], limit=MAX_STEPS
            )
            repaired = await repairs.list_repairs(
                conn, instance_key, before=None, limit=MAX_STEPS, step_slug=step_slug
            )
        except domain.InstanceNotFound:
            return not_found(request, f"No instance has the key {instance_key!r}.")
        except domain.StepNotFound:
            return not_found(request, f"Instance {instance_key!r} has no step {step_slug!r}.")

    def build() -> dict[str, Any]:
        return {
            "title": f"{step_slug} · {instance_key}",
            "record": record,
            "attempts": [shown_attempt(a, api) for a in attempts],
            "older": total - len(attempts),
            "repairs": repaired.items,
            "more_repairs": repaired.last is not None,
            "api": api,
            "trace_url": request.app.state.trace_url,
        }

    return await render_aside(request, build, "step.html")


async def _across(
    request: Request, *, failed: bool, labels: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    async with read_connection(request) as conn:
        page = await reads.list_recent(
            conn,
            prefix=tenancy.prefix_of(request.scope),
            labels=labels,
            statuses=["failed"] if failed else ["running"],
            updated_after=None,
            lease_expired=not failed,
            before=None,
            limit=LIST_SIZE,
        )
    return page.items


@dataclass(frozen=True, slots=True)
class Spark:
    """Failures per hour as a small SVG: one bar an hour, oldest first."""

    bars: list[tuple[float, float, float, str]]  # x, y, height, its words
    width: int
    height: int
    total: int
    peak: int
    label: str


SPARK_HOUR, SPARK_HEIGHT = 8, 36


def sparkline(hours: list[tuple[datetime, int]], step: str | None = None) -> Spark:
    peak = max((count for _, count in hours), default=0)
    bars = []
    for index, (hour, count) in enumerate(hours):
        height = 0.0 if count == 0 else max(count / peak * SPARK_HEIGHT, 2.0)
        words = f"{hour.astimezone(UTC):%H}:00 UTC: {count} failed"
        bars.append((index * SPARK_HOUR + 1.0, SPARK_HEIGHT - height, height, words))
    total = sum(count for _, count in hours)
    of = "" if step is None else f" of step {step}"
    label = f"Failed attempts{of} per hour, last 24 hours: {total} in all"
    if peak:
        busiest = max(hours, key=lambda item: item[1])[0].astimezone(UTC)
        label += f", at most {peak} an hour (from {busiest:%H}:00 UTC)"
    return Spark(bars, len(hours) * SPARK_HOUR, SPARK_HEIGHT, total, peak, label)


def failed_at(record: dict[str, Any]) -> tuple[datetime, int]:
    """A failed record's failure time (its `completed_at`), then its id, for ordering."""
    return record["completed_at"] or record["updated_at"], record["id"]


@router.get("/ui/failing")
async def failing_page(request: Request) -> Response:
    step = (request.query_params.get("step") or "").strip() or None
    if step is not None and not NAME_RE.fullmatch(step):
        return not_found(request, "No step has that name.")
    now = datetime.now(UTC)
    prefix = tenancy.prefix_of(request.scope)
    labels, labels_text, errors = labels_asked(request.query_params)
    since = now - timedelta(hours=24)
    items: list[dict[str, Any]] = []
    hours: list[tuple[datetime, int]] = []
    if not errors:
        async with read_connection(request) as conn:
            if step is None:
                hours = await stats.failures_per_hour(
                    conn, since=since, until=now, prefix=prefix, labels=labels
                )
            else:
                hours = await stats.failures_per_hour_of_step(
                    conn, step, since=since, until=now, prefix=prefix, labels=labels
                )
                items = await dashboard.failed_of_step(
                    conn, step, prefix=prefix, labels=labels, limit=LIST_SIZE
                )
        if step is None:
            items = await _across(request, failed=True, labels=labels)
    # The most recently written failures, shown by when they failed (what the page shows):
    # a late report or a swept lease fails at an earlier time than it was written.
    items.sort(key=failed_at, reverse=True)
    return render(
        request,
        "across.html",
        422 if errors else 200,
        title="Failing now",
        view="failing",
        items=items,
        step=step,
        labels=labels_text,
        errors=errors,
        spark=sparkline(hours, step),
    )


@router.get("/ui/stuck")
async def stuck_page(request: Request) -> Response:
    """Running steps whose lease expired, then running steps without a lease that have run
    longer than STEPRECORD_LONG_RUNNING_AFTER (the sweeper never fails those)."""
    items = await _across(request, failed=False)
    after: timedelta = request.app.state.long_running_after
    async with read_connection(request) as conn:
        unleased = await running.list_long_running(
            conn,
            older_than=after.total_seconds(),
            prefix=tenancy.prefix_of(request.scope),
            no_lease=True,
            after=None,
            limit=LIST_SIZE,
        )
    return render(
        request,
        "across.html",
        title="Stuck",
        view="stuck",
        items=items,
        unleased=unleased.items,
        long_running_after=duration(after.total_seconds()),
    )


WINDOWS = {"1h": timedelta(hours=1), "24h": timedelta(hours=24), "7d": timedelta(days=7)}


@router.get("/ui/stats")
async def stats_page(request: Request) -> Response:
    """Per step name over a window: attempts, failure rate, and a bar of its p95 duration,
    from the function behind `GET /v1/stats/steps`, within the token's prefix as it is."""
    window = request.query_params.get("window") or "24h"
    prefix = (request.query_params.get("prefix") or "").strip() or None
    labels, labels_text, errors = labels_asked(request.query_params)
    if window not in WINDOWS:
        errors.append("The window is 1h, 24h or 7d.")
        window = "24h"
    if prefix is not None and not KEY_PREFIX_RE.fullmatch(prefix):
        errors.append(
            "A key prefix is 1 to 200 characters of letters, digits and . _ : - + ~ (as keys are)."
        )
    until = datetime.now(UTC)
    since = until - WINDOWS[window]
    items: list[dict[str, Any]] = []
    reachable, within = tenancy.narrow(tenancy.prefix_of(request.scope), prefix)
    if reachable and not errors:
        async with read_connection(request) as conn:
            items = await stats.step_stats(
                conn, since=since, until=until, prefix=within, limit=STATS_SIZE, labels=labels
            )
    slowest = max((i["duration_ms"]["p95"] or 0.0 for i in items), default=0.0)
    rows = [
        {
            **item,
            "total": sum(item["attempts"].values()),
            "p95": _ms_words(item["duration_ms"]["p95"]),
            "p50": _ms_words(item["duration_ms"]["p50"]),
            "max": _ms_words(item["duration_ms"]["max"]),
            "bar": log_bar(item["duration_ms"]["p95"], slowest),
            "rate": "" if item["failure_rate"] is None else f"{item['failure_rate']:.1%}",
            "failing": "/ui/failing?step=" + quote(item["name"], safe=""),
        }
        for item in items
    ]
    return render(
        request,
        "stats.html",
        422 if errors else 200,
        title="Statistics",
        rows=rows,
        window=window,
        windows=list(WINDOWS),
        prefix=prefix or "",
        labels=labels_text,
        errors=errors,
        since=since,
        until=until,
    )


def log_bar(ms: float | None, slowest: float) -> float:
    """A p95's bar, in percent of its room, on a log scale from 1 ms to the slowest p95 (at
    least 10 ms): next to a 2-hour step, a 50 ms one still has a bar a quarter as long, and a
    duration ten times as long is always the same step longer. At least 1 %, so none is lost."""
    if not ms:
        return 0.0
    return max(math.log10(max(ms, 1.0)) / math.log10(max(slowest, 10.0)) * 100, 1.0)


def _ms_words(value: float | None) -> str:
    return "" if value is None else duration(value / 1000)


# Sent with every dashboard page (the sign-in form and refusals included): no other site may
# frame it (clickjacking), it loads and sends nothing but this service's own files and forms,
# and neither the browser nor a proxy keeps a copy of a page.
PAGE_HEADERS = {
    "x-frame-options": "DENY",
    "content-security-policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; style-src-attr 'unsafe-inline';"
        " img-src 'self' data:; connect-src 'self'; form-action 'self'; base-uri 'none';"
        " frame-ancestors 'none'"
    ),
    "cache-control": "no-store",
    "x-content-type-options": "nosniff",
    "referrer-policy": "same-origin",
}


class DashboardHeaders:
    """ASGI middleware adding `PAGE_HEADERS` to every response under `/ui`."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path_ = scope.get("path", "")
        if scope["type"] != "http" or not (path_ == "/ui" or path_.startswith("/ui/")):
            await self.app(scope, receive, send)
            return

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in PAGE_HEADERS.items():
                    headers[name] = value
            await send(message)

        await self.app(scope, receive, sending)


def install(app: FastAPI) -> None:
    static.mount(app, "ui", ASSETS)
    app.state.rendering = asyncio.Semaphore(RENDERS_AT_ONCE)
    # The routes themselves, not an included router: every route of the app is then one entry
    # of `app.routes` (the unknown-route advice in app/core/problems.py reads them).
    app.router.routes.extend([*router.routes, *signin.router.routes])
