"""Step statistics across runs: which step is slow, or failing more than usual."""

from datetime import UTC, datetime, timedelta
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from ...access import tenancy
from ...core.problems import validation_problem
from ...core.serialize import timestamp
from ...data import stats as data
from .. import spec
from ..bodies import label_filter
from .common import (
    KeyPrefix,
    KnownQuery,
    LabelFilter,
    Limit,
    QueryTimestamp,
    json_response,
    read_pool,
)

router = APIRouter(route_class=KnownQuery)
DEFAULT_WINDOW = timedelta(hours=24)
EARLIEST = datetime.min.replace(tzinfo=UTC)


def default_since(until: datetime) -> datetime:
    """`until` - 24 hours, or the earliest time there is when `until` is closer to it."""
    return until - DEFAULT_WINDOW if until - EARLIEST >= DEFAULT_WINDOW else EARLIEST


@router.get(
    "/v1/stats/steps",
    tags=["reads"],
    summary="Per step name: attempts by outcome, failure rate and durations in a window",
    responses=spec.read_responses(spec.StepStats),
)
async def step_stats(
    request: Request,
    since: Annotated[
        QueryTimestamp | None,
        Query(description="Attempts started at or after this time; default until - 24 hours"),
    ] = None,
    until: Annotated[
        QueryTimestamp | None,
        Query(description="Attempts started before this time; default now"),
    ] = None,
    prefix: Annotated[
        KeyPrefix | None, Query(description="Only instances whose key starts with this")
    ] = None,
    label: LabelFilter = None,
    limit: Limit = 100,
) -> Response:
    end = until or datetime.now(UTC)
    start = since or default_since(end)
    if start >= end:
        raise validation_problem(
            [{"field": "since", "message": "must be before until (the window is since to until)"}]
        )
    labels = label_filter(label)
    items: list[dict[str, Any]] = []
    reachable, within = tenancy.narrow(tenancy.prefix_of(request.scope), prefix)
    if reachable:
        items = await read_pool(request).run(
            lambda conn: data.step_stats(
                conn, since=start, until=end, prefix=within, limit=limit, labels=labels
            )
        )
    return json_response({"since": timestamp(start), "until": timestamp(end), "items": items})
