"""One error shape: RFC 9457 problem+json with a stable `code`; the exception carries its status."""

import difflib
import logging
import re
from collections.abc import Iterable
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.routing import Route, compile_path

from .db import DatabaseUnavailable, TokenBusy
from .domain import (
    ConstraintViolation,
    Contention,
    InstanceNotFound,
    InvalidData,
    OutputTooLarge,
    StepNotFound,
)
from .limits import MAX_OUTPUT_BYTES
from .serialize import dumps

PROBLEM_TYPE = "urn:steprecord:problem:"
RETRY_AFTER_SECONDS = "1"
log = logging.getLogger("steprecord.database")
# What an instance key, step slug or error code may be, in words (the pattern in app.core.tables).
NAME_RULE = (
    "must be 1 to 200 characters: letters, digits, '.', '_', ':' or '-',"
    " starting with a letter or digit"
)
KEY_RULE = (
    "must be 1 to 200 characters: letters, digits, '.', '_', ':', '-', '+' or '~',"
    " starting with a letter or digit"
)

# Every problem's title: a phrase a person reads first (the `code` is for programs).
TITLES = {
    "invalid_json": "Body is not JSON",
    "validation_error": "Invalid request",
    "invalid_timing": "Timestamps out of order",
    "output_conflict": "Both inline and external output",
    "output_too_large": "Output too large",
    "payload_too_large": "Request body too large",
    "request_timeout": "Request body too slow",
    "not_found": "No such route",
    "method_not_allowed": "Method not allowed on this route",
    "trailing_slash": "Path ends with a slash",
    "not_started": "Step not started",
    "conflict": "Event conflicts with the record",
    "stale_attempt": "Attempt superseded by a newer one",
    "not_running": "Attempt not running",
    "not_finished": "Step not finished",
    "ordinal_taken": "Ordinal already taken",
    "instance_key_collision": "Instance key collides with another key",
    "instance_active": "Instance has running steps",
    "instance_not_found": "Instance not found",
    "step_not_found": "Step not found",
    "constraint_violation": "Refused by the database",
    "unauthorized": "Token missing or not accepted",
    "forbidden": "Token not allowed to do this",
    "outside_prefix": "Instance outside the token's key prefix",
    "too_many_streams": "Too many open streams for this token",
    "token_busy": "Every database connection of this token's share in use",
    "unavailable": "Database unavailable",
    "internal_error": "Internal error",
}


class Problem(Exception):
    """An error answer. Raise it anywhere below a route; the handler shapes the response."""

    def __init__(self, status: int, code: str, detail: str, **extra: Any) -> None:
        super().__init__(detail)
        self.status = status
        self.code = code
        self.detail = detail
        self.extra = extra

    def body(self) -> dict[str, Any]:
        return {
            "type": PROBLEM_TYPE + self.code,
            "title": TITLES.get(self.code) or HTTPStatus(self.status).phrase,
            "status": self.status,
            "detail": self.detail,
            "code": self.code,
            **self.extra,
        }

    def response(self, headers: dict[str, str] | None = None) -> Response:
        return Response(
            dumps(self.body()),
            status_code=self.status,
            media_type="application/problem+json",
            headers=headers,
        )


def validation_problem(errors: list[dict[str, str]], detail: str | None = None) -> Problem:
    first = errors[0] if errors else {"field": "body", "message": "invalid"}
    text = detail or f"{first['field']}: {first['message']}"
    return Problem(422, "validation_error", text, errors=errors)


# Constraint names with a dedicated code; any other constraint is `constraint_violation`.
CONSTRAINT_CODES = {
    "ck_workflow_step_record_timing": (422, "invalid_timing"),
    "ck_workflow_step_record_output_inline_xor_external": (422, "output_conflict"),
    "ck_workflow_step_record_output_size": (413, "output_too_large"),
    "uq_workflow_step_record_instance_id_ordinal": (409, "ordinal_taken"),
}


# What to do about a constraint whose message alone would not say it.
CONSTRAINT_ADVICE = {
    "ck_process_instance_labels_count": "an instance holds at most 32 labels: remove some"
    ' first (PATCH /v1/instances/{instance_key} with {"labels": {"KEY": null}})',
}


def from_violation(exc: ConstraintViolation) -> Problem:
    status, code = CONSTRAINT_CODES.get(
        exc.constraint, (409 if exc.unique else 422, "constraint_violation")
    )
    advice = CONSTRAINT_ADVICE.get(exc.constraint)
    detail = f"refused by {exc.constraint}: " + (advice or str(exc))
    return Problem(status, code, detail, constraint=exc.constraint)


def to_problem(exc: Exception) -> Problem:
    """Map a known exception from below the routes to its problem; anything else is a 500."""
    if isinstance(exc, Problem):
        return exc
    if isinstance(exc, ConstraintViolation):
        return from_violation(exc)
    if isinstance(exc, OutputTooLarge):
        return Problem(
            413,
            "output_too_large",
            f"the output is {exc.size} bytes as stored (PostgreSQL's jsonb text, which puts a"
            f" space after each ':' and ','), over the limit of {MAX_OUTPUT_BYTES} bytes (1 MiB):"
            " store it elsewhere and send its URL as external_output_url",
            size=exc.size,
            limit=MAX_OUTPUT_BYTES,
        )
    if isinstance(exc, InvalidData):
        return validation_problem([{"field": "body", "message": str(exc)}])
    if isinstance(exc, InstanceNotFound):
        return Problem(404, "instance_not_found", f"no instance {exc.args[0]!r}")
    if isinstance(exc, StepNotFound):
        return Problem(404, "step_not_found", f"no step {exc.args[0]!r} in this instance")
    if isinstance(exc, TokenBusy):  # before its base, DatabaseUnavailable
        return Problem(
            429,
            "token_busy",
            f"{exc}: wait for its other requests to finish (Retry-After), send fewer at once, or"
            " give each client a token of its own",
        )
    if isinstance(exc, DatabaseUnavailable):
        # The driver's text names the database's host, port, user and database: it goes to
        # the log only, where the request id (each log line's) ties it to this answer.
        log.warning("database unavailable: %s", exc)
        return Problem(
            503,
            "unavailable",
            f"{exc.public}: retry after {RETRY_AFTER_SECONDS} s (the service's log has the"
            " cause under this request's X-Request-ID)",
        )
    if isinstance(exc, Contention):
        return Problem(503, "unavailable", str(exc))
    return Problem(500, "internal_error", "an unexpected error occurred")


def problem_response(exc: Exception) -> Response:
    problem = to_problem(exc)
    retry = problem.status in (429, 503)
    headers = {"Retry-After": RETRY_AFTER_SECONDS} if retry else None
    return problem.response(headers)


async def _handle_known(request: Request, exc: Exception) -> Response:
    return problem_response(exc)


async def _handle_http(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 404:
        if b"%2f" in request.scope.get("raw_path", b"").lower():
            message = "instance keys and step slugs may not contain /"
            return validation_problem([{"field": "path", "message": message}]).response()
        slashed = _without_slash(request)
        if slashed is not None:
            detail = (
                f"no route ends with a slash: use {slashed} (this answer redirects there,"
                " with the same method and body)"
            )
            return Problem(307, "trailing_slash", detail, location=slashed).response(
                {"Location": slashed}
            )
        detail = f"no route for {request.url.path}: {nearest_route(request)}"
        return Problem(404, "not_found", detail).response()
    if exc.status_code == 405:
        # Every route of the path, where Starlette names the first one's methods only.
        methods = allowed_methods(request)
        allow = ", ".join(methods) or (exc.headers or {}).get("Allow", "")
        detail = f"{request.method} is not allowed on {request.url.path}"
        shown = _shown(methods)
        if shown:
            detail += f": use {' or '.join(shown)}"
        problem = Problem(405, "method_not_allowed", detail)
        return problem.response({"Allow": allow} if allow else None)
    code = {401: "unauthorized", 403: "forbidden", 413: "payload_too_large"}.get(
        exc.status_code, "error"
    )
    return Problem(exc.status_code, code, str(exc.detail)).response(
        dict(exc.headers) if exc.headers else None
    )


def _without_slash(request: Request) -> str | None:
    """The request's URL without the trailing slash of its path, when a route has that path."""
    path = request.url.path
    if path == "/" or not path.endswith("/"):
        return None
    bare = path.rstrip("/") or "/"
    if not any(compile_path(t)[0].match(bare) for t in route_methods(request.app)):
        return None
    query = request.url.query
    return bare + (f"?{query}" if query else "")


# How much of an unknown path is compared with the routes (difflib takes quadratic time).
MAX_COMPARED = 300
PARAMETER = re.compile(r"\{[^}]*\}")


def route_methods(app: Any) -> dict[str, set[str]]:
    """The app's path templates, each with the methods of its routes (mounts have none)."""
    methods: dict[str, set[str]] = {}
    for route in app.routes:
        if isinstance(route, Route) and route.methods:
            methods.setdefault(route.path, set()).update(route.methods)
    return methods


def _shown(methods: Iterable[str]) -> list[str]:
    """Methods as advice: HEAD goes without saying beside GET."""
    listed = sorted(methods)
    return [m for m in listed if m != "HEAD"] or listed


def allowed_methods(request: Request) -> list[str]:
    """The methods of every route whose template matches the request's path."""
    found: set[str] = set()
    for template, methods in route_methods(request.app).items():
        if compile_path(template)[0].match(request.url.path):
            found |= methods
    return sorted(found)


def nearest_route(request: Request) -> str:
    """The route of the app nearest to an unknown path, as advice: each route's template with
    the path's own segments in place of its parameters, compared with difflib."""
    methods = route_methods(request.app)
    path = request.url.path[:MAX_COMPARED]
    given = path.split("/")
    filled = {
        "/".join(
            given[i] if i < len(given) and PARAMETER.fullmatch(part) else part
            for i, part in enumerate(template.split("/"))
        ): template
        for template in methods
    }
    close = difflib.get_close_matches(path, list(filled), n=1, cutoff=0.6)
    if not close:
        return "see /docs for every route"
    template = filled[close[0]]
    return f"did you mean {' or '.join(_shown(methods[template]))} {template}? (every route: /docs)"


async def _handle_validation(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    errors = [
        {"field": ".".join(str(p) for p in err["loc"][1:]) or "body", "message": _message(err)}
        for err in exc.errors()
    ]
    return validation_problem(errors).response()


def _message(err: Any) -> str:
    # Every path parameter is a name: an instance key or a step slug.
    if err["loc"][0] == "path" and err["type"] in ("string_pattern_mismatch", "string_too_long"):
        return KEY_RULE if err["loc"][1:] == ("instance_key",) else NAME_RULE
    if err["type"] == "value_error":  # our own validators' words, without pydantic's prefix
        return str(err["ctx"]["error"])
    message: str = err["msg"]
    return message


KNOWN = (
    Problem,
    ConstraintViolation,
    InvalidData,
    InstanceNotFound,
    StepNotFound,
    DatabaseUnavailable,
    Contention,
    OutputTooLarge,
)


async def _handle_disconnect(request: Request, exc: Exception) -> Response:
    """The connection ended before the request's body arrived whole: its body deadline passed
    (app/ops/server.py, which answered 408 itself) or the client went away. Nobody reads this
    answer; the request's log line says 408."""
    detail = "the connection ended before the request's body arrived whole"
    return Problem(408, "request_timeout", detail).response()


def install(app: FastAPI) -> None:
    app.add_exception_handler(StarletteHTTPException, _handle_http)
    app.add_exception_handler(ClientDisconnect, _handle_disconnect)
    app.add_exception_handler(RequestValidationError, _handle_validation)
    for cls in (*KNOWN, Exception):
        app.add_exception_handler(cls, _handle_known)
