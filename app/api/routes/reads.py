"""The read routes of step records: one, an instance's page, attempts, the live stream, and
the records across instances."""

from collections.abc import Callable
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import Response

from ... import live
from ...access import tenancy, tokens
from ...core import cursors
from ...core.domain import Page
from ...core.problems import Problem, validation_problem
from ...core.serialize import attempt_json, dumps_page, record_json, shown
from ...core.tables import STATUSES
from ...data import reads as data
from ...data import running
from .. import spec
from ..bodies import label_filter
from .common import (
    Fields,
    InstanceKey,
    KnownQuery,
    LabelFilter,
    PageLimit,
    QueryTimestamp,
    StatusFilter,
    StepSlug,
    json_response,
    read_instance,
    read_pool,
    statuses,
)

router = APIRouter(route_class=KnownQuery)

Item = dict[str, Any]


def _page(page: Page, render: Callable[[Item], Item], cursor: Callable[[Item], str]) -> Response:
    """A list answer: the page's items rendered, and the cursor of the next page, if any; it
    stops early, with the cursor after its last item, rather than pass `MAX_PAGE_BYTES`."""
    body = dumps_page(page.items, render, page.last, cursor)
    return Response(body, media_type="application/json")


@router.get(
    "/v1/instances/{instance_key}/steps",
    tags=["reads"],
    summary="List an instance's step records",
    responses=spec.read_responses(spec.RecordPage),
)
async def list_steps(
    request: Request,
    instance_key: InstanceKey,
    order: Literal["ordinal", "started_at"] = "ordinal",
    status: StatusFilter = None,
    limit: PageLimit = 100,
    cursor: str | None = None,
    fields: Fields = "full",
) -> Response:
    tenancy.check_read(request.scope, instance_key)
    only = statuses(status)
    after = None if cursor is None else cursors.steps_position(order, cursor)
    page = await read_instance(
        request,
        instance_key,
        lambda conn: data.list_steps(
            conn, instance_key, order=order, after=after, statuses=only, limit=limit
        ),
    )
    summary = fields == "summary"
    return _page(page, lambda r: shown(r, summary), lambda r: cursors.steps_cursor(order, r))


@router.get(
    "/v1/instances/{instance_key}/steps/{step_slug}",
    tags=["reads"],
    summary="One step record",
    responses=spec.read_responses(spec.Record),
)
async def get_step(
    request: Request,
    instance_key: InstanceKey,
    step_slug: StepSlug,
    fields: Fields = "full",
) -> Response:
    tenancy.check_read(request.scope, instance_key)
    record = await read_instance(
        request, instance_key, lambda conn: data.get_step(conn, instance_key, step_slug)
    )
    return json_response(record_json(record, fields == "summary"))


@router.get(
    "/v1/instances/{instance_key}/steps/{step_slug}/attempts",
    tags=["reads"],
    summary="Every attempt of a step, in attempt order",
    responses=spec.read_responses(spec.AttemptPage),
)
async def list_attempts(
    request: Request,
    instance_key: InstanceKey,
    step_slug: StepSlug,
    limit: PageLimit = 100,
    cursor: str | None = None,
    fields: Fields = "full",
) -> Response:
    tenancy.check_read(request.scope, instance_key)
    after = None if cursor is None else cursors.attempts_position(cursor)
    page = await read_instance(
        request,
        instance_key,
        lambda conn: data.list_attempts(conn, instance_key, step_slug, after=after, limit=limit),
    )
    return _page(page, lambda a: attempt_json(a, fields == "summary"), cursors.attempts_cursor)


@router.get(
    "/v1/instances/{instance_key}/stream",
    tags=["reads"],
    summary="Live updates of an instance's records (Server-Sent Events)",
    response_class=Response,
    responses=spec.stream_responses(),
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
    tenancy.check_read(request.scope, instance_key)
    # The header wins: EventSource reconnects to the same URL with a newer id in the header.
    if last_event_id_header is not None:
        after = live.parse_event_id(last_event_id_header, "Last-Event-ID")
    elif last_event_id is not None:
        after = live.parse_event_id(last_event_id, "last_event_id")
    else:
        after = (0, 0)
    reads, state = read_pool(request), request.app.state
    admission = tokens.admission_of(request.scope)
    hub: live.Hub = state.hub
    if not hub.admit(admission.holder, state.streams_per_token):
        raise Problem(
            429,
            "too_many_streams",
            f"this token already holds {state.streams_per_token} open streams on this worker"
            " (STEPRECORD_STREAMS_PER_TOKEN): close one, or share one stream per instance",
        )
    try:
        first = await live.read_changes(reads, instance_key, after)
    except BaseException:
        hub.leave(admission.holder)
        raise
    body = live.sse_body(
        reads,
        hub,
        instance_key,
        first,
        heartbeat=state.stream_heartbeat,
        lifetime=state.stream_max_seconds,
        allowed=lambda: state.tokens.admits(admission),
    )
    return live.SSEResponse(body, on_close=lambda: hub.leave(admission.holder))


@router.get(
    "/v1/steps",
    tags=["reads"],
    summary="Step records across instances, newest updated_at first",
    responses=spec.read_responses(spec.RecordPage),
)
async def list_recent_steps(
    request: Request,
    status: StatusFilter = None,
    label: LabelFilter = None,
    updated_after: Annotated[
        QueryTimestamp | None, Query(description="Only records updated after this time")
    ] = None,
    lease_expired: Annotated[
        Literal["true"] | None,
        Query(description="`true`: only running steps whose lease has expired"),
    ] = None,
    running_longer_than: Annotated[
        int | None,
        Query(
            ge=0,
            le=10**9,
            description="Only running steps started more than this many seconds ago,"
            " longest-running first (instead of newest updated_at first)",
        ),
    ] = None,
    limit: PageLimit = 100,
    cursor: str | None = None,
    fields: Fields = "full",
) -> Response:
    labels = label_filter(label)
    if running_longer_than is not None:
        return await _long_running(request, running_longer_than, status, updated_after,
                                   lease_expired, limit, cursor, fields, labels)  # fmt: skip
    only = statuses(status) or list(STATUSES)
    before = None if cursor is None else cursors.recent_position(cursor)
    page = await read_pool(request).run(
        lambda conn: data.list_recent(
            conn,
            prefix=tenancy.prefix_of(request.scope),
            labels=labels,
            statuses=only,
            updated_after=updated_after,
            lease_expired=lease_expired == "true",
            before=before,
            limit=limit,
        )
    )
    return _page(page, lambda r: record_json(r, fields == "summary"), cursors.recent_cursor)


async def _long_running(
    request: Request,
    seconds: int,
    status: str | None,
    updated_after: object,
    lease_expired: str | None,
    limit: int,
    cursor: str | None,
    fields: str,
    labels: dict[str, str] | None,
) -> Response:
    """`running_longer_than`: running records by `started_at`, a listing of its own."""
    others = {"updated_after": updated_after, "lease_expired": lease_expired}
    clash = [name for name, value in others.items() if value is not None]
    if statuses(status) not in (None, ["running"]):
        clash.insert(0, "status")
    if clash:
        message = "lists running steps by how long they have run: leave out " + ", ".join(clash)
        raise validation_problem([{"field": "running_longer_than", "message": message}])
    after = None if cursor is None else cursors.long_running_position(cursor)
    page = await read_pool(request).run(
        lambda conn: running.list_long_running(
            conn,
            older_than=seconds,
            prefix=tenancy.prefix_of(request.scope),
            labels=labels,
            after=after,
            limit=limit,
        )
    )
    return _page(page, lambda r: record_json(r, fields == "summary"), cursors.long_running_cursor)
