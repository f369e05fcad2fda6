"""The write routes: one event per request, and a batch."""

from collections import Counter
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from ...access import tenancy, tokens
from ...core import tracing
from ...core.db import DatabaseUnavailable, Pool, TokenBusy
from ...core.domain import ConstraintViolation, Event, InvalidData, Kind, Result
from ...core.problems import Problem, to_problem
from ...data import judge
from ...ops import observe
from .. import spec
from ..bodies import BODIES, KINDS, parse_batch_event, parse_envelope, parse_event
from .common import (
    MAX_BATCH_BYTES,
    MAX_BATCH_DEPTH,
    MAX_BODY_BYTES,
    InstanceKey,
    KnownQuery,
    StepSlug,
    json_response,
    places_for,
    read_json,
)
from .refusals import judged

router = APIRouter(route_class=KnownQuery)


def writer_of(request: Request) -> str:
    """Who writes what the request writes: its token's name, or `anonymous`
    (app/access/tokens.py)."""
    return tokens.admission_of(request.scope).writer


SUMMARIES = {
    "declare": "Declare a step (pending)",
    "start": "Report that an attempt started",
    "complete": "Report that an attempt completed",
    "fail": "Report that an attempt failed",
    "heartbeat": "Extend the lease of a running attempt",
}


def _event_route(kind: Kind) -> None:
    async def handler(request: Request, instance_key: InstanceKey, step_slug: StepSlug) -> Response:
        try:
            tenancy.check_write(request.scope, [instance_key])
            body = await read_json(request, MAX_BODY_BYTES)
            event = parse_event(instance_key, step_slug, kind, body)
        except Problem:
            observe.count_event(kind, "refused")
            raise
        trace_id = tracing.trace_id(request)  # the attempt this event starts keeps it
        ((pool, shard),) = await places_for(request, [instance_key])
        async with pool.connection(name="apply_event") as conn:
            try:
                result = await judge.apply_event(
                    conn, event, writer=writer_of(request), trace_id=trace_id, shard=shard
                )
            except (ConstraintViolation, InvalidData):
                observe.count_event(kind, "refused")
                raise
        observe.count_event(kind, result.outcome)
        status, record = judged(result, event)
        return json_response(record, status)

    router.add_api_route(
        f"/v1/instances/{{instance_key}}/steps/{{step_slug}}/{kind}",
        handler,
        methods=["POST"],
        name=f"{kind}_step",
        summary=SUMMARIES[kind],
        tags=["events"],
        responses=spec.event_responses(),
        openapi_extra=spec.request_body(
            BODIES[kind], required=kind in ("complete", "fail", "heartbeat")
        ),
    )


for _kind in KINDS:
    _event_route(_kind)


def _batch_result(
    counts: Counter[tuple[str, str]],
    kind: str,
    outcome: Result | Exception,
    event: Event | None = None,
) -> dict[str, Any]:
    counts[kind, outcome.outcome if isinstance(outcome, Result) else "refused"] += 1
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
    responses=spec.batch_responses(),
    openapi_extra=spec.batch_request_body(),
)
async def post_events(request: Request) -> Response:
    items = parse_envelope(await read_json(request, MAX_BATCH_BYTES, MAX_BATCH_DEPTH))
    tenancy.check_write(request.scope, [key for item in items if (key := _key_of(item))])
    parsed: list[Event | Exception] = []
    for item in items:
        try:
            parsed.append(parse_batch_event(item))
        except Problem as problem:
            parsed.append(problem)
    valid = [event for event in parsed if isinstance(event, Event)]
    trace_id = tracing.trace_id(request)  # one request: the attempts it starts share its trace
    applied = iter(await _apply(request, valid, trace_id))
    results = []
    counts: Counter[tuple[str, str]] = Counter()
    for item, event in zip(items, parsed, strict=True):
        if isinstance(event, Event):
            results.append(_batch_result(counts, event.kind, next(applied), event))
        else:
            results.append(_batch_result(counts, _kind_of(item), event))
    for (kind, outcome), amount in counts.items():
        observe.count_event(kind, outcome, amount)
    return json_response({"results": results})


async def _apply(
    request: Request, events: list[Event], trace_id: str | None
) -> list[Result | Exception]:
    """Judge the events, each instance's on its node's pool (on one node, all on the primary);
    a node that cannot be reached answers its events 503 when others could."""
    by_pool: dict[Pool, list[int]] = {}
    places = await places_for(request, [e.instance_key for e in events])
    for index, (pool, _) in enumerate(places):
        by_pool.setdefault(pool, []).append(index)
    outcomes: list[Result | Exception | None] = [None] * len(events)
    for pool, indexes in by_pool.items():
        subset = [events[index] for index in indexes]
        shards = [places[index][1] for index in indexes]
        try:
            async with pool.connection(name="apply_events") as conn:
                answers = await judge.apply_events(
                    conn, subset, writer=writer_of(request), trace_id=trace_id, shards=shards
                )
        except DatabaseUnavailable as exc:
            if len(by_pool) == 1 or isinstance(exc, TokenBusy):
                raise
            answers = [exc] * len(subset)
        for index, answer in zip(indexes, answers, strict=True):
            outcomes[index] = answer
    return [outcome for outcome in outcomes if outcome is not None]


def _key_of(item: Any) -> str | None:
    """The instance key an item names, valid or not (a batch's reach is checked first)."""
    key = item.get("instance_key") if isinstance(item, dict) else None
    return key if isinstance(key, str) else None


def _kind_of(item: Any) -> str:
    kind = item.get("kind") if isinstance(item, dict) else None
    return kind if kind in KINDS else "unknown"
