"""The instance routes: one instance with its step counts, labels and summary, the list of
instances, setting and removing an instance's labels, and deleting one (its records and their
history go with it; its streams end)."""

from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from ...access import tenancy, tokens
from ...core import cursors
from ...core.problems import Problem
from ...data import labels as label_data
from ...data import reads, retention
from .. import spec
from ..bodies import InstancePatch, label_filter, parse_instance_patch
from .common import (
    MAX_BODY_BYTES,
    InstanceKey,
    KnownQuery,
    LabelFilter,
    PageLimit,
    QueryTimestamp,
    json_response,
    pools_for,
    primary_pool,
    read_instance,
    read_json,
    read_pool,
)

router = APIRouter(route_class=KnownQuery)


@router.get(
    "/v1/instances/{instance_key}",
    tags=["reads"],
    summary="An instance with its step counts, labels and summary",
    responses=spec.read_responses(spec.Instance),
)
async def get_instance(request: Request, instance_key: InstanceKey) -> Response:
    tenancy.check_read(request.scope, instance_key)
    instance = await read_instance(
        request, instance_key, lambda conn: reads.get_instance(conn, instance_key)
    )
    return json_response(instance)


@router.get(
    "/v1/instances",
    tags=["reads"],
    summary="Instances, newest first",
    responses=spec.read_responses(spec.InstancePage),
)
async def list_instances(
    request: Request,
    label: LabelFilter = None,
    status: Annotated[
        Literal["running", "failed"] | None,
        Query(description="`running`: with a running step; `failed`: with a failed step"),
    ] = None,
    created_after: Annotated[
        QueryTimestamp | None, Query(description="Only instances created after this time")
    ] = None,
    limit: PageLimit = 100,
    cursor: str | None = None,
) -> Response:
    before = None if cursor is None else cursors.instances_position(cursor)
    prefix = tenancy.prefix_of(request.scope)  # labels filter within it, never beyond
    labels = label_filter(label)
    items, last = await read_pool(request).run(
        lambda conn: reads.list_instances(
            conn,
            prefix=prefix,
            has=status,
            labels=labels,
            created_after=created_after,
            before=before,
            limit=limit,
        )
    )
    next_cursor = None if last is None else cursors.instances_cursor(last)
    return json_response({"items": items, "next_cursor": next_cursor})


@router.patch(
    "/v1/instances/{instance_key}",
    tags=["events"],
    summary="Set and remove an instance's labels (JSON Merge Patch)",
    description='Write scope. `{"labels": {"env": "prod", "stale": null}}` sets `env` and'
    " removes `stale`; the labels not named stay.",
    responses=spec.patch_responses(),
    openapi_extra=spec.request_body(InstancePatch, required=True),
)
async def patch_instance(request: Request, instance_key: InstanceKey) -> Response:
    tenancy.check_write(request.scope, [instance_key])
    patch = parse_instance_patch(await read_json(request, MAX_BODY_BYTES))
    (pool,) = await pools_for(request, [instance_key])
    async with pool.connection(name="patch_instance") as conn:
        instance = await label_data.patch_labels(conn, instance_key, patch.labels)
    return json_response(instance)


@router.delete(
    "/v1/instances/{instance_key}",
    status_code=204,
    response_class=Response,
    tags=["events"],
    summary="Delete an instance with its records, their history and its repair log",
    description="Write scope; an instance with repairs in its repair log needs admin scope.",
    responses=spec.delete_responses(),
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
    admin = tokens.admission_of(request.scope).allows("admin")
    async with primary_pool(request).connection() as conn:
        deletion = await retention.delete_instance(
            conn, instance_key, force=force == "true", erase_repairs=admin
        )
    if not deletion.deleted and deletion.repairs and not admin:
        repairs = "repair" if deletion.repairs == 1 else "repairs"
        raise Problem(
            403,
            "forbidden",
            f"{instance_key!r} has {deletion.repairs} {repairs} in its repair log, which deleting"
            " it would erase: only a token of scope admin may delete an instance that was"
            " repaired (steprecord token create NAME --scope admin); nothing was deleted",
        )
    if not deletion.deleted:
        steps = "step is" if deletion.running == 1 else "steps are"
        raise Problem(
            409,
            "instance_active",
            f"{deletion.running} {steps} still running in {instance_key!r}: let them finish"
            " (or fail) first, or send DELETE ...?force=true to delete it anyway",
        )
    return Response(status_code=204)
