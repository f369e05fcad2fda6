"""The repair routes: an operator's reopen of a finished step (admin scope), and the repair
log that keeps every repair of an instance."""

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from ...access import tenancy, tokens
from ...core import cursors
from ...core.problems import Problem
from ...core.serialize import record_json
from ...data import repairs as data
from ...ops import observe
from .. import spec
from ..bodies import ReopenBody, parse_reopen
from .common import (
    MAX_BODY_BYTES,
    InstanceKey,
    KnownQuery,
    PageLimit,
    StepSlug,
    json_response,
    primary_pool,
    read_instance,
    read_json,
)

router = APIRouter(route_class=KnownQuery)


@router.post(
    "/v1/instances/{instance_key}/steps/{step_slug}/reopen",
    tags=["repairs"],
    summary="Reopen a finished step at its next attempt (admin)",
    responses=spec.reopen_responses(),
    openapi_extra=spec.request_body(ReopenBody, required=True),
)
async def reopen_step(request: Request, instance_key: InstanceKey, step_slug: StepSlug) -> Response:
    tenancy.check_write(request.scope, [instance_key])
    body = parse_reopen(instance_key, step_slug, await read_json(request, MAX_BODY_BYTES))
    by = tokens.admission_of(request.scope).writer
    async with primary_pool(request).connection(name="reopen") as conn:
        reopened = await data.reopen(
            conn, instance_key, step_slug, attempt=body.attempt, reason=body.reason, by=by
        )
    record = record_json(reopened.record)
    if reopened.outcome == "reopened":
        observe.count_repair("reopen")
        return json_response(record)
    attempt, status = record["attempt_count"], record["status"]
    if reopened.outcome == "not_finished":
        raise Problem(
            409,
            "not_finished",
            f"step {step_slug!r} is {status} at attempt {attempt}: only a completed or failed"
            " step is reopened; let it finish (or fail) first",
            current=record,
        )
    if reopened.outcome == "stale_attempt":
        raise Problem(
            409,
            "stale_attempt",
            f"you asked to reopen attempt {body.attempt}, but the step is at attempt {attempt}"
            f" ({status}): someone reopened or ran it since; look at current and the repair"
            " log, then send the attempt you mean",
            current=record,
        )
    raise Problem(
        409,
        "conflict",
        f"step {step_slug!r} is at attempt {attempt}, the last there is: it cannot be reopened",
        current=record,
    )


def _repair_json(repair: dict[str, Any]) -> dict[str, Any]:
    """A repair as the log shows it (its `at` rendered by `dumps`, in UTC with a `Z`)."""
    return {name: repair[name] for name in REPAIR_KEYS}


REPAIR_KEYS = ("step_slug", "action", "attempt", "reason", "by", "at")


@router.get(
    "/v1/instances/{instance_key}/repairs",
    tags=["repairs"],
    summary="An instance's repair log, newest first",
    responses=spec.read_responses(spec.RepairPage),
)
async def list_repairs(
    request: Request,
    instance_key: InstanceKey,
    limit: PageLimit = 100,
    cursor: str | None = None,
) -> Response:
    tenancy.check_read(request.scope, instance_key)
    before = None if cursor is None else cursors.repairs_position(cursor)
    page = await read_instance(
        request,
        instance_key,
        lambda conn: data.list_repairs(conn, instance_key, before=before, limit=limit),
    )
    # A page never nears MAX_PAGE_BYTES: 1000 entries of at most 900 characters each.
    next_cursor = None if page.last is None else cursors.repairs_cursor(page.last)
    return json_response(
        {"items": [_repair_json(item) for item in page.items], "next_cursor": next_cursor}
    )
