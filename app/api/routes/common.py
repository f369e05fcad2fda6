"""What every route module shares: the route class, parameter types, pools, bodies, answers."""

from collections.abc import Awaitable, Callable, Coroutine
from typing import Annotated, Any, Literal, TypeVar

from fastapi import Path, Query, Request
from fastapi.dependencies.models import Dependant
from fastapi.responses import Response
from fastapi.routing import APIRoute
from pydantic import AwareDatetime, BeforeValidator, StringConstraints

from ...core.db import AsyncConn, Pool
from ...core.limits import KEY_PATTERN, MAX_OUTPUT_BYTES, NAME_PATTERN
from ...core.problems import Problem, validation_problem
from ...core.serialize import (
    MAX_DEPTH,
    MAX_PAGE_BYTES,
    BadJSON,
    UnacceptableJSON,
    dumps,
    loads,
    parse_timestamp,
)
from ...core.tables import STATUSES
from ...ops.nodes import Nodes
from ...ops.replica import ReadPool

MAX_BODY_BYTES = 2 * 1024 * 1024
MAX_BATCH_BYTES = 16 * 1024 * 1024
# What makes a body too large, by its limit: an event's output, or a batch's many events.
OUTPUT_ADVICE = "store a large output elsewhere and send its URL as external_output_url"
TOO_LARGE_ADVICE = {
    MAX_BODY_BYTES: f"{OUTPUT_ADVICE} (inline, {MAX_OUTPUT_BYTES >> 20} MiB at most)",
    MAX_BATCH_BYTES: f"split the batch into requests sent one after another; {OUTPUT_ADVICE}",
}
# `{"events": [...]}` holds each event two levels down; it may nest as deep as at its endpoint.
MAX_BATCH_DEPTH = MAX_DEPTH + 2


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


# An instance key: a name that may also hold `+` and `~` (an Airflow run id).
InstanceKey = Annotated[str, Path(pattern=KEY_PATTERN, max_length=200)]
MAX_LIMIT = 1000
# How many items a list answers at most.
Limit = Annotated[int, Query(ge=1, le=MAX_LIMIT)]
# ... on a page, which stops early rather than pass MAX_PAGE_BYTES.
PageLimit = Annotated[
    int,
    Query(
        ge=1,
        le=MAX_LIMIT,
        description=f"At most this many items. A page may hold fewer: it stops before its body"
        f" would pass {MAX_PAGE_BYTES >> 20} MiB (always holding at least one item); follow"
        " `next_cursor` until it is null to read them all",
    ),
]
Fields = Literal["full", "summary"]
StatusFilter = Annotated[
    str | None, Query(description="Comma-separated statuses, e.g. running,failed")
]
StepSlug = Annotated[str, Path(pattern=NAME_PATTERN, max_length=200)]
# A timestamp in a query, refused with the same message as in a body.
QueryTimestamp = Annotated[AwareDatetime, BeforeValidator(parse_timestamp)]
# The start of instance keys: 1 to 200 characters of the key alphabet.
KeyPrefix = Annotated[str, StringConstraints(pattern=KEY_PATTERN, max_length=200)]
# Instances by their labels: `label=KEY=VALUE`, repeatable, every one must match.
LabelFilter = Annotated[
    list[str] | None,
    Query(
        description="`KEY=VALUE`: only instances with that label; repeat it and every one must"
        " match (`label=env=prod&label=dag=etl_daily`)",
    ),
]


def json_response(body: Any, status: int = 200) -> Response:
    return Response(dumps(body), status_code=status, media_type="application/json")


def primary_pool(request: Request) -> Pool:
    """The primary: writes, heartbeats and the schema check."""
    pool: Pool = request.app.state.pool
    return pool


async def places_for(request: Request, keys: list[str]) -> list[tuple[Pool, int | None]]:
    """The pool for each instance key's writes, on Citus its node's (app/ops/nodes.py), else
    the primary's; and its shard on Citus (None: one node, or not known), whose copy of the
    judge the judge calls on that node (app/data/judge.py)."""
    nodes: Nodes | None = request.app.state.nodes
    if nodes is None:
        return [(primary_pool(request), None)] * len(keys)
    return await nodes.places_of(keys)


async def pools_for(request: Request, keys: list[str]) -> list[Pool]:
    """The pool for each instance key's writes (`places_for`)."""
    return [pool for pool, _ in await places_for(request, keys)]


T = TypeVar("T")


async def read_instance(
    request: Request, instance_key: str, work: Callable[[AsyncConn], Awaitable[T]]
) -> T:
    """A read of one instance: on Citus on the node that holds it (app/ops/nodes.py), else as
    `read_pool` reads."""
    nodes: Nodes | None = request.app.state.nodes
    if nodes is not None:
        (pool,) = await nodes.pools_of([instance_key])
        if pool is not primary_pool(request):
            async with pool.connection(name=work) as conn:
                return await work(conn)
    return await read_pool(request).run(work)


def read_pool(request: Request) -> ReadPool:
    """The read replica while it is healthy, else the primary: `await read_pool(r).run(work)`."""
    reads: ReadPool = request.app.state.read_pool
    return reads


def _too_large(limit: int) -> Problem:
    advice = TOO_LARGE_ADVICE.get(limit, OUTPUT_ADVICE)
    return Problem(
        413, "payload_too_large", f"the body is over {limit} bytes ({limit >> 20} MiB): {advice}"
    )


async def read_json(request: Request, limit: int, depth: int = MAX_DEPTH) -> Any:
    """The parsed body (None when empty), refusing more than `limit` bytes before parsing."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
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


def statuses(status: str | None) -> list[str] | None:
    if status is None:
        return None
    values = [s.strip() for s in status.split(",") if s.strip()]
    unknown = [s for s in values if s not in STATUSES]
    if unknown or not values:
        raise validation_problem(
            [{"field": "status", "message": f"one or more of {', '.join(STATUSES)}"}]
        )
    return values
