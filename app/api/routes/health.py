"""Health and metrics: liveness, readiness, Prometheus metrics (the `operations` tag)."""

from fastapi import APIRouter, Request
from fastapi.responses import Response

from ...access import tenancy
from ...core.db import DatabaseUnavailable
from ...core.problems import Problem
from ...data import running
from ...ops import observe
from .. import spec
from .common import KnownQuery, json_response, primary_pool

router = APIRouter(route_class=KnownQuery)


@router.get(
    "/metrics",
    tags=["operations"],
    summary="Prometheus metrics of every worker",
    response_class=Response,
    responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text format"}},
)
async def metrics(request: Request) -> Response:
    tenancy.check_unscoped(request.scope, "the metrics count the work of every instance")
    older_than = request.app.state.long_running_after.total_seconds()
    # On the primary, uncounted: a scrape is not a read of the API, and the gauge must not
    # lag behind a replica.
    try:
        async with primary_pool(request).connection() as conn:
            count: int | None = await running.count_long_running(conn, older_than)
    except DatabaseUnavailable:
        count = None
    body, content_type = observe.render(observe.long_running(count))
    return Response(body, media_type=content_type)


@router.get("/healthz", tags=["operations"], summary="The process is alive")
async def healthz() -> Response:
    return json_response({"status": "ok"})


@router.get(
    "/readyz",
    tags=["operations"],
    summary="The database is reachable and at the migration head",
    responses={503: {"model": spec.ProblemModel}},
)
async def readyz(request: Request) -> Response:
    state = request.app.state
    current = await state.readiness.schema_revision()  # shared by this second's callers
    if current not in state.schema_accepted:
        detail = _schema_mismatch(current, state.schema_head, state.schema_known)
        raise Problem(503, "unavailable", detail)
    return json_response({"status": "ready", "schema": current})


def _schema_mismatch(current: str | None, head: str, known: frozenset[str]) -> str:
    if current is None:
        return f"the database has no schema yet (expected {head}): run `steprecord migrate`"
    if current in known:
        return f"schema at {current}, behind this code's head {head}: run `steprecord migrate`"
    return (
        f"schema at {current}, a revision this code does not know: it is neither one of its"
        f" migrations (head {head}) nor declared compatible with it"
    )
