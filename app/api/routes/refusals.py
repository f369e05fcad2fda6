"""What a judged event answers: the record, or a 409 that says what the client got wrong."""

import json
from typing import Any

from ...core.domain import Event, Result
from ...core.problems import Problem
from ...core.serialize import record_json

REFUSALS = {
    "conflict": (409, "the event conflicts with what is recorded for this attempt"),
    "stale_attempt": (
        409,
        "a newer attempt has superseded this one: stop working on it; its result is not the"
        " step's (see current for the attempt that is)",
    ),
    "not_started": (409, "the step has no start to complete or fail"),
    "ordinal_taken": (409, "no ordinal is left for a new step of this instance"),
    "not_running": (409, "that attempt is not running: it finished, or has not started"),
    "instance_key_collision": (
        409,
        "this instance key's id (derived from the key by the database) is already another key's"
        " instance, and two keys never share rows: use another instance key",
    ),
}


def judged(result: Result, event: Event) -> tuple[int, dict[str, Any]]:
    """201 and the record it created, 200 and the record otherwise; a 409 refusal is raised."""
    if result.outcome in REFUSALS:
        status, detail = REFUSALS[result.outcome]
        current = None if result.record is None else record_json(result.record)
        if result.outcome == "not_started":
            detail = _not_started(event)
        elif result.record is not None:
            detail = _explain(result.outcome, event, result.record) or detail
        if result.outcome != "stale_attempt":
            raise Problem(status, result.outcome, detail, current=current)
        if result.recorded:
            detail += (
                f"; this report of attempt {event.attempt} is kept in the step's history"
                " (see .../attempts), and the record stays with the newer attempt"
            )
        raise Problem(status, result.outcome, detail, current=current, recorded=result.recorded)
    assert result.record is not None
    return (201 if result.outcome == "created" else 200), record_json(result.record)


CONTENT = ("output", "external_output_url", "error_code", "error_message")


def _not_started(event: Event) -> str:
    """What to do about an event that needs a start the record does not have."""
    attempt = "this attempt" if event.attempt is None else f"attempt {event.attempt}"
    if event.kind == "heartbeat":
        return (
            f"{attempt} has not started, so it has no lease to extend: call start first"
            " (with lease_seconds), then send heartbeats"
        )
    return (
        f"{attempt} has no start to {event.kind}: send started_at with this {event.kind},"
        " or call start first"
    )


def _explain(outcome: str, event: Event, record: dict[str, Any]) -> str | None:
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
    if outcome == "stale_attempt" and event.attempt is not None:
        return (
            f"attempt {event.attempt} has been superseded by attempt {record['attempt_count']}:"
            " stop working on it; its result is not the step's (see current)"
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
