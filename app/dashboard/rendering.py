"""The dashboard's rendering: the Jinja2 environment of its templates (with autoescaping, so
a step's output, error or key is always text, never markup), the stylesheet and script every
page links, and the render of a page, large ones in a thread."""

import asyncio
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import HTMLResponse
from jinja2 import Environment, FileSystemLoader
from starlette.concurrency import run_in_threadpool

from ..access.sessions import cookie_name
from ..core import static
from ..core.shown import shown
from .formatting import (
    ago,
    error_reason,
    iso,
    link_url,
    mark,
    millis,
    path,
    pretty,
    slug_parts,
    step_label,
    took,
    trace_link,
    utc,
)

HERE = Path(__file__).resolve().parent
ASSETS = HERE / "assets"
CSS = static.url("ui", "ui.css")
JS = static.url("ui", "ui.js")
LOGIN = "/ui/login"
LOGOUT = "/ui/logout"
GLYPHS = {
    "pending": "○",
    "running": "▶",
    "completed": "✓",
    "failed": "✗",
    "superseded": "↷",
    "swept": "⊘",
}


def _finalize(value: Any) -> Any:
    """Every value a template prints, before it is escaped: client text with its terminal
    escapes and bidirectional controls shown, never acted on (app/core/shown.py)."""
    if type(value) is str:  # not Markup: what the templates themselves made
        return shown(value)
    return value


ENV = Environment(
    loader=FileSystemLoader(HERE / "templates"),
    autoescape=True,
    trim_blocks=True,
    lstrip_blocks=True,
    finalize=_finalize,
)
ENV.filters.update(
    utc=utc, iso=iso, millis=millis, pretty=pretty, step_label=lambda s: step_label(s)
)
ENV.globals.update(
    CSS=CSS, JS=JS, LOGOUT=LOGOUT, LOGIN=LOGIN, GLYPHS=GLYPHS, link_url=link_url, mark=mark,
    path=path, took=took, ago=ago, trace_link=trace_link,
)  # fmt: skip
ENV.filters["step_label"] = step_label
ENV.globals["slug_parts"] = slug_parts
ENV.filters["reason"] = error_reason


def render(
    request: Request | None, template: str, http_status: int = 200, **context: Any
) -> HTMLResponse:
    signed_in = (
        request is not None and cookie_name(request.url.scheme == "https") in request.cookies
    )
    html = ENV.get_template(template).render(now=datetime.now(UTC), signed_in=signed_in, **context)
    return HTMLResponse(html, status_code=http_status)


# Large pages (an instance's timeline, a step's attempts) are built and rendered in a thread,
# this many at a time per worker: the event loop goes on serving other requests meanwhile
# (the thread hands it the interpreter back within `SWITCH_SECONDS`), and three large pages
# asked at once take turns rather than three threads' worth of the loop's time.
RENDERS_AT_ONCE = 1
SWITCH_SECONDS = 0.001  # the worker's interpreter switch interval (app/main.py)


async def render_aside(
    request: Request, build: Callable[[], dict[str, Any]], template: str
) -> HTMLResponse:
    """`template` rendered with what `build()` returns, both in a thread (see above)."""
    gate: asyncio.Semaphore = request.app.state.rendering
    async with gate:
        return await run_in_threadpool(lambda: render(request, template, **build()))


def not_found(request: Request, what: str) -> HTMLResponse:
    return render(request, "message.html", 404, title="Not found", message=what)
