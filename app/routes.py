"""HTTP handlers: parse, call the data module, shape the response."""

import json
import re
from collections import Counter
from collections.abc import Callable, Coroutine
from typing import Annotated, Any, Literal
from urllib.parse import parse_qsl

from fastapi import APIRouter, Header, Path, Query, Request
from fastapi.dependencies.models import Dependant
from fastapi.responses import Response
from fastapi.routing import APIRoute
from pydantic import AwareDatetime
from starlette.types import Receive, Scope, Send

from app import cursors, live, observe, schemas, steps
from app.db import Pool
from app.errors import Problem, to_problem, validation_problem
from app.events import BODIES, KINDS, parse_batch_event, parse_envelope, parse_event
from app.models import NAME_PATTERN, NAME_RE, STATUSES
from app.replica import ReadPool
from app.serialize import (
    MAX_DEPTH,
    BadJSON,
    UnacceptableJSON,
    attempt_json,
    dumps,
    loads,
    page_json,
    record_json,
)

MAX_BODY_BYTES = 2 * 1024 * 1024
MAX_BATCH_BYTES = 16 * 1024 * 1024
# `{"events": [...]}` holds each event two levels down; it may nest as deep as at its endpoint.
MAX_BATCH_DEPTH = MAX_DEPTH + 2
REFUSALS = {
    "conflict": (409, "the event conflicts with what is recorded for this attempt"),
    "stale_attempt": (409, "a newer attempt has superseded this one"),
    "not_started": (409, "the step has no start to complete or fail"),
    "ordinal_taken": (409, "no ordinal is left for a new step of this instance"),
    "not_running": (409, "that attempt is not running: it finished, or has not started"),
}
SUMMARIES = {
    "declare": "Declare a step (pending)",
    "start": "Report that an attempt started",
    "complete": "Report that an attempt completed",
    "fail": "Report that an attempt failed",
    "heartbeat": "Extend the lease of a running attempt",
}


def _query_names(dependant: Dependant) -> set[str]:
    names = {field.alias for field in dependant.query_params}
    for sub in dependant.dependencies:
        names |= _query_names(sub)
    return names


class KnownQuery(APIRoute):
    """A route that refuses query parameters it does not declare, as bodies refuse unknown
    fields: `?limt=2` is a typo to point out, not a filter to ignore."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        known = _query_names(self.dependant)
        takes = f"this endpoint takes {', '.join(sorted(known)) or 'none'}"

        async def checked(request: Request) -> Response:
            if request.scope["query_string"]:
                unknown = [
                    name for name in dict.fromkeys(request.query_params) if name not in known
                ]
                if unknown:
                    message = f"unknown query parameter; {takes}"
                    raise validation_problem(
                        [{"field": name, "message": message} for name in unknown]
                    )
            return await handler(request)

        return checked


router = APIRouter(route_class=KnownQuery)

InstanceKey = Annotated[str, Path(pattern=NAME_PATTERN, max_length=200)]
MAX_LIMIT = 1000
Limit = Annotated[int, Query(ge=1, le=MAX_LIMIT)]
Fields = Literal["full", "summary"]
StatusFilter = Annotated[
    str | None, Query(description="Comma-separated statuses, e.g. running,failed")
]
StepSlug = Annotated[str, Path(pattern=NAME_PATTERN, max_length=200)]


def _json(body: Any, status: int = 200) -> Response:
    return Response(dumps(body), status_code=status, media_type="application/json")


Item = dict[str, Any]


def _page(
    page: steps.Page, render: Callable[[Item], Item], cursor: Callable[[Item], str]
) -> Response:
    """A list answer: the page's items rendered, and the cursor of the next page, if any."""
    next_cursor = None if page.last is None else cursor(page.last)
    return _json({"items": [render(item) for item in page.items], "next_cursor": next_cursor})


def _pool(request: Request) -> Pool:
    """The primary: writes, heartbeats and the schema check."""
    pool: Pool = request.app.state.pool
    return pool


def _reads(request: Request) -> ReadPool:
    """The read replica while it is healthy, else the primary: `await _reads(r).run(work)`."""
    reads: ReadPool = request.app.state.read_pool
    return reads


async def read_json(request: Request, limit: int, depth: int = MAX_DEPTH) -> Any:
    """The parsed body (None when empty), refusing more than `limit` bytes before parsing."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise Problem(413, "payload_too_large", f"the body is over {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise Problem(413, "payload_too_large", f"the body is over {limit} bytes")
        chunks.append(chunk)
    body = b"".join(chunks)
    if not body.strip():
        return None
    try:
        return loads(body, depth)
    except BadJSON as exc:
        raise Problem(400, "invalid_json", f"the body is not JSON: {exc}") from None
    except UnacceptableJSON as exc:
        raise validation_problem([{"field": "body", "message": str(exc)}]) from None


def judged(result: steps.Result, event: steps.Event) -> tuple[int, dict[str, Any]]:
    """201 and the record it created, 200 and the record otherwise; a 409 refusal is raised."""
    if result.outcome in REFUSALS:
        status, detail = REFUSALS[result.outcome]
        current = None if result.record is None else record_json(result.record)
        if result.record is not None:
            detail = _explain(result.outcome, event, result.record) or detail
        raise Problem(status, result.outcome, detail, current=current)
    assert result.record is not None
    return (201 if result.outcome == "created" else 200), record_json(result.record)


CONTENT = ("output", "external_output_url", "error_code", "error_message")


def _explain(outcome: str, event: steps.Event, record: dict[str, Any]) -> str | None:
    """What a refused event got wrong, from the event and the record that refused it."""
    if outcome == "ordinal_taken":
        if event.ordinal is not None:
            return (
                f"ordinal {event.ordinal} is held by step {record['step_slug']!r} of this"
                " instance (see current): send another ordinal, or none to get the next one"
            )
        return (
            f"no ordinal is left for a new step: step {record['step_slug']!r} holds"
            f" {record['ordinal']}, the highest there is (see current)"
        )
    if outcome != "conflict":
        return None
    attempt = record["attempt_count"]
    if event.kind in ("declare", "start"):
        return f"no attempt is left after {attempt}"
    sent = {name: getattr(event, name) for name in CONTENT}
    recorded = {name: record[name] for name in CONTENT}
    for fields in (sent, recorded):  # outputs are JSON text; compare the values
        fields["output"] = None if fields["output"] is None else json.loads(fields["output"])
    differs = [name for name in CONTENT if sent[name] != recorded[name]]
    if record["status"] != {"complete": "completed", "fail": "failed"}[event.kind]:
        differs.insert(0, "status")
    what = f"differs in {', '.join(differs)}" if differs else "differs from it"
    return (
        f"attempt {attempt} is already recorded as {record['status']} and this {event.kind}"
        f" {what}: re-send what was recorded to replay it, or report attempt {attempt + 1}"
        " to run the step again"
    )


def _event_route(kind: steps.Kind) -> None:
    async def handler(request: Request, instance_key: InstanceKey, step_slug: StepSlug) -> Response:
        try:
            body = await read_json(request, MAX_BODY_BYTES)
            event = parse_event(instance_key, step_slug, kind, body)
        except Problem:
            observe.count_event(kind, "refused")
            raise
        async with _pool(request).connection() as conn:
            try:
                result = await steps.apply_event(conn, event)
            except (steps.ConstraintViolation, steps.InvalidData):
                observe.count_event(kind, "refused")
                raise
        observe.count_event(kind, result.outcome)
        status, record = judged(result, event)
        return _json(record, status)

    router.add_api_route(
        f"/v1/instances/{{instance_key}}/steps/{{step_slug}}/{kind}",
        handler,
        methods=["POST"],
        name=f"{kind}_step",
        summary=SUMMARIES[kind],
        tags=["events"],
        responses=schemas.event_responses(),
        openapi_extra=schemas.request_body(
            BODIES[kind], required=kind in ("complete", "fail", "heartbeat")
        ),
    )


for _kind in KINDS:
    _event_route(_kind)


def _batch_result(
    counts: Counter[tuple[str, str]],
    kind: str,
    outcome: steps.Result | Exception,
    event: steps.Event | None = None,
) -> dict[str, Any]:
    counts[kind, outcome.outcome if isinstance(outcome, steps.Result) else "refused"] += 1
    try:
        if isinstance(outcome, Exception):
            raise outcome
        assert event is not None
        status, record = judged(outcome, event)
    except Exception as exc:
        problem = to_problem(exc)
        return {"status": problem.status, "problem": problem.body()}
    return {"status": status, "record": record}


@router.post(
    "/v1/events",
    tags=["events"],
    summary="Report many events at once",
    responses=schemas.batch_responses(),
    openapi_extra=schemas.batch_request_body(),
)
async def post_events(request: Request) -> Response:
    items = parse_envelope(await read_json(request, MAX_BATCH_BYTES, MAX_BATCH_DEPTH))
    parsed: list[steps.Event | Exception] = []
    for item in items:
        try:
            parsed.append(parse_batch_event(item))
        except Problem as problem:
            parsed.append(problem)
    valid = [event for event in parsed if isinstance(event, steps.Event)]
    async with _pool(request).connection() as conn:
        applied = iter(await steps.apply_events(conn, valid))
    results = []
    counts: Counter[tuple[str, str]] = Counter()
    for item, event in zip(items, parsed, strict=True):
        if isinstance(event, steps.Event):
            results.append(_batch_result(counts, event.kind, next(applied), event))
        else:
            results.append(_batch_result(counts, _kind_of(item), event))
    for (kind, outcome), amount in counts.items():
        observe.count_event(kind, outcome, amount)
    return _json({"results": results})


def _kind_of(item: Any) -> str:
    kind = item.get("kind") if isinstance(item, dict) else None
    return kind if kind in KINDS else "unknown"


# --- reads -----------------------------------------------------------------------------


def _statuses(status: str | None) -> list[str] | None:
    if status is None:
        return None
    values = [s.strip() for s in status.split(",") if s.strip()]
    unknown = [s for s in values if s not in STATUSES]
    if unknown or not values:
        raise validation_problem(
            [{"field": "status", "message": f"one or more of {', '.join(STATUSES)}"}]
        )
    return values


async def list_steps(
    request: Request,
    instance_key: InstanceKey,
    order: Literal["ordinal", "started_at"] = "ordinal",
    status: StatusFilter = None,
    limit: Limit = 100,
    cursor: str | None = None,
    fields: Fields = "full",
) -> Response:
    return await _steps_page(_reads(request), instance_key, order, status, limit, cursor, fields)


async def _steps_page(
    reads: ReadPool,
    instance_key: str,
    order: Literal["ordinal", "started_at"],
    status: str | None,
    limit: int,
    cursor: str | None,
    fields: str,
) -> Response:
    statuses = _statuses(status)
    after = None if cursor is None else cursors.steps_position(order, cursor)
    page = await reads.run(
        lambda conn: steps.list_steps(
            conn, instance_key, order=order, after=after, statuses=statuses, limit=limit
        )
    )
    next_cursor = None if page.last is None else cursors.steps_cursor(order, page.last)
    items = page_json(page.items, fields == "summary")
    return _json({"items": items, "next_cursor": next_cursor})


class PageRoute(KnownQuery):
    """The route of `list_steps`, the service's most frequent request.

    FastAPI's work around an endpoint (solving and validating its parameters, its exit
    stacks, its endpoint context) was about a seventh of the workers' CPU for this read
    (README, "Performance"). A GET whose query is plain is answered here, by the
    `_steps_page` the endpoint calls: each parameter at most once, `order` and `fields` one
    of their values, `limit` in digits from 1 to 1000, the key a valid name. Anything else
    (HEAD, a repeated or unknown parameter, `limit=02`, `limit=0`) takes FastAPI's way,
    which accepts or refuses it as for every route. The answers are the same either way:
    `status` and `cursor` go through the same checks, and the endpoint's signature still
    documents the route.
    """

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        query = _plain_page_query(scope)
        if query is None:
            await super().handle(scope, receive, send)
            return
        response = await _steps_page(scope["app"].state.read_pool, **query)
        await response(scope, receive, send)


PAGE_ORDERS = frozenset({"ordinal", "started_at"})
PAGE_FIELDS = frozenset({"full", "summary"})
PAGE_QUERY = frozenset({"order", "status", "limit", "cursor", "fields"})
PLAIN_LIMIT = re.compile(r"[1-9][0-9]{0,3}")


def _plain_page_query(scope: Scope) -> dict[str, Any] | None:
    """`_steps_page`'s arguments when the request is plain (see `PageRoute`), else None."""
    instance_key = scope["path_params"]["instance_key"]
    if scope["method"] != "GET" or NAME_RE.fullmatch(instance_key) is None:
        return None
    # As Starlette reads a query string.
    pairs = parse_qsl(scope["query_string"].decode("latin-1"), keep_blank_values=True)
    query = dict(pairs)
    if len(query) < len(pairs) or not query.keys() <= PAGE_QUERY:
        return None
    order, fields = query.get("order", "ordinal"), query.get("fields", "full")
    limit = query.get("limit", "100")
    if order not in PAGE_ORDERS or fields not in PAGE_FIELDS:
        return None
    if PLAIN_LIMIT.fullmatch(limit) is None or int(limit) > MAX_LIMIT:
        return None
    return {
        "instance_key": instance_key,
        "order": order,
        "status": query.get("status"),
        "limit": int(limit),
        "cursor": query.get("cursor"),
        "fields": fields,
    }


router.add_api_route(
    "/v1/instances/{instance_key}/steps",
    list_steps,
    methods=["GET"],
    route_class_override=PageRoute,
    tags=["reads"],
    summary="List an instance's step records",
    responses=schemas.read_responses(schemas.RecordPage),
)


@router.get(
    "/v1/instances/{instance_key}/steps/{step_slug}",
    tags=["reads"],
    summary="One step record",
    responses=schemas.read_responses(schemas.Record),
)
async def get_step(
    request: Request,
    instance_key: InstanceKey,
    step_slug: StepSlug,
    fields: Fields = "full",
) -> Response:
    record = await _reads(request).run(lambda conn: steps.get_step(conn, instance_key, step_slug))
    return _json(record_json(record, fields == "summary"))


@router.get(
    "/v1/instances/{instance_key}/steps/{step_slug}/attempts",
    tags=["reads"],
    summary="Every attempt of a step, in attempt order",
    responses=schemas.read_responses(schemas.AttemptPage),
)
async def list_attempts(
    request: Request,
    instance_key: InstanceKey,
    step_slug: StepSlug,
    limit: Limit = 100,
    cursor: str | None = None,
    fields: Fields = "full",
) -> Response:
    after = None if cursor is None else cursors.attempts_position(cursor)
    page = await _reads(request).run(
        lambda conn: steps.list_attempts(conn, instance_key, step_slug, after=after, limit=limit)
    )
    return _page(page, lambda a: attempt_json(a, fields == "summary"), cursors.attempts_cursor)


@router.get(
    "/v1/instances/{instance_key}/stream",
    tags=["reads"],
    summary="Live updates of an instance's records (Server-Sent Events)",
    response_class=Response,
    responses=schemas.stream_responses(),
)
async def stream_instance(
    request: Request,
    instance_key: InstanceKey,
    last_event_id: Annotated[
        str | None,
        Query(description="Resume after this event id, for clients that cannot set headers"),
    ] = None,
    last_event_id_header: Annotated[
        str | None,
        Header(
            alias="Last-Event-ID",
            description="Resume after this event id (EventSource sends it when it reconnects)",
        ),
    ] = None,
) -> Response:
    # The header wins: EventSource reconnects to the same URL with a newer id in the header.
    if last_event_id_header is not None:
        after = live.parse_event_id(last_event_id_header, "Last-Event-ID")
    elif last_event_id is not None:
        after = live.parse_event_id(last_event_id, "last_event_id")
    else:
        after = (0, 0)
    reads, state = _reads(request), request.app.state
    first = await live.read_changes(reads, instance_key, after)
    return live.EventStream(
        live.events(reads, state.hub, instance_key, first, state.stream_heartbeat)
    )


@router.get(
    "/v1/steps",
    tags=["reads"],
    summary="Step records across instances, newest updated_at first",
    responses=schemas.read_responses(schemas.RecordPage),
)
async def list_recent_steps(
    request: Request,
    status: StatusFilter = None,
    updated_after: Annotated[
        AwareDatetime | None, Query(description="Only records updated after this time")
    ] = None,
    lease_expired: Annotated[
        Literal["true"] | None,
        Query(description="`true`: only running steps whose lease has expired"),
    ] = None,
    limit: Limit = 100,
    cursor: str | None = None,
    fields: Fields = "full",
) -> Response:
    statuses = _statuses(status) or list(STATUSES)
    before = None if cursor is None else cursors.recent_position(cursor)
    page = await _reads(request).run(
        lambda conn: steps.list_recent(
            conn,
            statuses=statuses,
            updated_after=updated_after,
            lease_expired=lease_expired == "true",
            before=before,
            limit=limit,
        )
    )
    return _page(page, lambda r: record_json(r, fields == "summary"), cursors.recent_cursor)


@router.get(
    "/v1/instances/{instance_key}",
    tags=["reads"],
    summary="An instance with its step counts",
    responses=schemas.read_responses(schemas.Instance),
)
async def get_instance(request: Request, instance_key: InstanceKey) -> Response:
    return _json(await _reads(request).run(lambda conn: steps.get_instance(conn, instance_key)))


@router.get(
    "/v1/instances",
    tags=["reads"],
    summary="Instances, newest first",
    responses=schemas.read_responses(schemas.InstancePage),
)
async def list_instances(
    request: Request,
    limit: Limit = 100,
    cursor: str | None = None,
) -> Response:
    before = None if cursor is None else cursors.instances_position(cursor)
    items, last = await _reads(request).run(
        lambda conn: steps.list_instances(conn, before=before, limit=limit)
    )
    next_cursor = None if last is None else cursors.instances_cursor(last)
    return _json({"items": items, "next_cursor": next_cursor})


@router.get(
    "/metrics",
    tags=["operations"],
    summary="Prometheus metrics of every worker",
    response_class=Response,
    responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text format"}},
)
async def metrics() -> Response:
    body, content_type = observe.render()
    return Response(body, media_type=content_type)


@router.get("/healthz", tags=["operations"], summary="The process is alive")
async def healthz() -> Response:
    return _json({"status": "ok"})


@router.get(
    "/readyz",
    tags=["operations"],
    summary="The database is reachable and at the migration head",
    responses={503: {"model": schemas.ProblemModel}},
)
async def readyz(request: Request) -> Response:
    state = request.app.state
    async with _pool(request).connection() as conn:
        current = await steps.schema_revision(conn)
    if current not in state.schema_accepted:
        detail = _schema_mismatch(current, state.schema_head, state.schema_known)
        raise Problem(503, "unavailable", detail)
    return _json({"status": "ready", "schema": current})


def _schema_mismatch(current: str | None, head: str, known: frozenset[str]) -> str:
    if current is None:
        return f"the database has no schema yet (expected {head}): run `steprecord migrate`"
    if current in known:
        return f"schema at {current}, behind this code's head {head}: run `steprecord migrate`"
    return (
        f"schema at {current}, a revision this code does not know: it is neither one of its"
        f" migrations (head {head}) nor declared compatible with it"
    )
