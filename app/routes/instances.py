"""Deleting an instance: its records and their history go with it; its streams end."""

from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from app import schemas, tenancy
from app.data import retention
from app.errors import Problem
from app.routes.common import InstanceKey, KnownQuery, primary_pool

router = APIRouter(route_class=KnownQuery)


@router.delete(
    "/v1/instances/{instance_key}",
    status_code=204,
    response_class=Response,
    tags=["events"],
    summary="Delete an instance with its records and their history",
    responses=schemas.delete_responses(),
)
async def delete_instance(
    request: Request,
    instance_key: InstanceKey,
    force: Annotated[
        Literal["true", "false"],
        Query(description="`true`: delete it even while a step is running"),
    ] = "false",
) -> Response:
    tenancy.check_write(request.scope, [instance_key])
    async with primary_pool(request).connection() as conn:
        deletion = await retention.delete_instance(conn, instance_key, force=force == "true")
    if not deletion.deleted:
        steps = "step is" if deletion.running == 1 else "steps are"
        raise Problem(
            409,
            "instance_active",
            f"{deletion.running} {steps} still running in {instance_key!r}: let them finish"
            " (or fail) first, or send DELETE ...?force=true to delete it anyway",
        )
    return Response(status_code=204)
