"""Event bodies: what each write endpoint accepts, checked before anything reaches the database."""

import re
from datetime import datetime
from typing import Annotated, Any

from pydantic import (
    AwareDatetime,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    JsonValue,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
)

from app.domain import Event, Kind
from app.errors import NAME_RULE, Problem, validation_problem
from app.limits import MAX_INT4, MAX_MESSAGE_BYTES, MAX_URL_CHARS, NAME_PATTERN, URL_PATTERN
from app.serialize import dumps_value

KINDS: tuple[Kind, ...] = ("declare", "start", "complete", "fail", "heartbeat")
MAX_LEASE_SECONDS = 86400
_NAME = re.compile(NAME_PATTERN.removeprefix("^").removesuffix("$"))
_RFC3339 = re.compile(r"\d{4}-\d\d-\d\d[Tt ]\d\d:\d\d:\d\d(\.\d+)?([Zz]|[+-]\d\d:\d\d)")
TIMESTAMP_RULE = "must be an RFC 3339 timestamp with an offset, such as 2026-12-02T10:00:00Z"


def _rfc3339(value: Any) -> Any:
    # One message for an epoch number, a word, a date alone or a missing offset.
    if not isinstance(value, str) or not _RFC3339.fullmatch(value):
        raise ValueError(TIMESTAMP_RULE)
    try:
        return datetime.fromisoformat(value.upper())
    except ValueError:
        raise ValueError(TIMESTAMP_RULE) from None


def _name_format(value: Any) -> Any:
    if isinstance(value, str) and not _NAME.fullmatch(value):
        raise ValueError(NAME_RULE)
    return value


Name = Annotated[
    StrictStr,
    Field(pattern=NAME_PATTERN, min_length=1, max_length=200),
    BeforeValidator(_name_format),
]
Attempt = Annotated[StrictInt, Field(ge=1, le=MAX_INT4)]
Ordinal = Annotated[StrictInt, Field(ge=0, le=MAX_INT4)]
Timestamp = Annotated[AwareDatetime, BeforeValidator(_rfc3339)]
Url = Annotated[StrictStr, Field(pattern=URL_PATTERN, max_length=MAX_URL_CHARS)]
LeaseSeconds = Annotated[StrictInt, Field(ge=1, le=MAX_LEASE_SECONDS)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DeclareBody(_Body):
    ordinal: Ordinal | None = None


class StartBody(_Body):
    attempt: Attempt | None = None
    started_at: Timestamp | None = None
    ordinal: Ordinal | None = None
    lease_seconds: LeaseSeconds | None = None


class HeartbeatBody(_Body):
    attempt: Attempt
    lease_seconds: LeaseSeconds


class _FinishBody(_Body):
    attempt: Attempt | None = None
    started_at: Timestamp | None = None
    completed_at: Timestamp | None = None
    ordinal: Ordinal | None = None


class CompleteBody(_FinishBody):
    output: JsonValue = None
    external_output_url: Url | None = None


class FailBody(_FinishBody):
    error_code: Name
    error_message: StrictStr | None = None

    @field_validator("error_message")
    @classmethod
    def _message_size(cls, value: str | None) -> str | None:
        if value is not None and len(value.encode()) > MAX_MESSAGE_BYTES:
            raise ValueError(f"must be at most {MAX_MESSAGE_BYTES} bytes of UTF-8")
        return value


BODIES: dict[Kind, type[_Body]] = {
    "declare": DeclareBody,
    "start": StartBody,
    "complete": CompleteBody,
    "fail": FailBody,
    "heartbeat": HeartbeatBody,
}


def _errors(exc: ValidationError) -> list[dict[str, str]]:
    return [
        {"field": ".".join(str(p) for p in err["loc"]) or "body", "message": _message(err)}
        for err in exc.errors(include_url=False)
    ]


def _message(err: Any) -> str:
    if err["type"] == "value_error":  # our own validators' words, without pydantic's prefix
        return str(err["ctx"]["error"])
    message: str = err["msg"]
    return message


def check_names(**names: str) -> None:
    """Refuse an instance key or step slug that the format does not allow."""
    bad = [
        {"field": field, "message": NAME_RULE}
        for field, value in names.items()
        if not _NAME.fullmatch(value)
    ]
    if bad:
        raise validation_problem(bad)


def parse_event(instance_key: str, step_slug: str, kind: Kind, body: Any) -> Event:
    """Validate one event; raise a `Problem` naming every bad field, or return the event."""
    check_names(instance_key=instance_key, step_slug=step_slug)
    if body is None:
        body = {}
    if not isinstance(body, dict):
        raise validation_problem([{"field": "body", "message": "must be a JSON object"}])
    try:
        parsed = BODIES[kind].model_validate(body)
    except ValidationError as exc:
        raise validation_problem(_errors(exc)) from None
    fields = parsed.model_dump(exclude_none=True)
    started_at: datetime | None = fields.get("started_at")
    completed_at: datetime | None = fields.get("completed_at")
    if started_at is not None and completed_at is not None and started_at > completed_at:
        raise Problem(422, "invalid_timing", "started_at is after completed_at")
    output = fields.pop("output", None)
    if output is not None and "external_output_url" in fields:
        raise Problem(422, "output_conflict", "give output or external_output_url, not both")
    return Event(
        instance_key=instance_key,
        step_slug=step_slug,
        kind=kind,
        output=None if output is None else dumps_value(output),
        **fields,
    )


MAX_BATCH_EVENTS = 1000


def parse_envelope(payload: Any) -> list[Any]:
    """The list of raw events of a batch; a malformed envelope refuses the whole request."""
    if not isinstance(payload, dict) or set(payload) != {"events"}:
        raise validation_problem([{"field": "body", "message": 'must be {"events": [...]}'}])
    items = payload["events"]
    if not isinstance(items, list) or not 1 <= len(items) <= MAX_BATCH_EVENTS:
        raise validation_problem(
            [{"field": "events", "message": f"must be a list of 1 to {MAX_BATCH_EVENTS} events"}]
        )
    return items


def parse_batch_event(item: Any) -> Event:
    """One event of a batch: its endpoint's body plus `instance_key`, `step_slug`, `kind`."""
    if not isinstance(item, dict):
        raise validation_problem([{"field": "event", "message": "must be a JSON object"}])
    body = dict(item)
    kind = body.pop("kind", None)
    instance_key = body.pop("instance_key", None)
    step_slug = body.pop("step_slug", None)
    errors = [
        {"field": field, "message": "required, a string"}
        for field, value in (("instance_key", instance_key), ("step_slug", step_slug))
        if not isinstance(value, str)
    ]
    if kind not in KINDS:
        errors.append({"field": "kind", "message": f"one of {', '.join(KINDS)}"})
    if errors:
        raise validation_problem(errors)
    return parse_event(instance_key, step_slug, kind, body)
