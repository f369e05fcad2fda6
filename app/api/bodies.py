"""Request input: what each write endpoint accepts, checked before anything reaches the
database, and the label filter of the lists (the API's and the dashboard's)."""

import difflib
import re
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
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

from ..core.domain import Event, Kind
from ..core.limits import (
    KEY_RE,
    LABEL_KEY_RE,
    MAX_INT4,
    MAX_LABEL_VALUE_CHARS,
    MAX_LABELS,
    MAX_MESSAGE_BYTES,
    MAX_URL_CHARS,
    NAME_PATTERN,
    URL_PATTERN,
)
from ..core.problems import KEY_RULE, NAME_RULE, Problem, validation_problem
from ..core.serialize import dumps_value, parse_timestamp, timestamp

KINDS: tuple[Kind, ...] = ("declare", "start", "complete", "fail", "heartbeat")
MAX_LEASE_SECONDS = 86400
_NAME = re.compile(NAME_PATTERN.removeprefix("^").removesuffix("$"))
# How far ahead of the server's clock an event's time may be: a clock may be off, but a start
# in year 9999 is a bug that would show as "running 0 ms" for ever.
MAX_AHEAD = timedelta(hours=24)


def _not_far_ahead(value: datetime) -> datetime:
    now = datetime.now(UTC)
    if value > now + MAX_AHEAD:
        raise ValueError(
            "is more than 24 hours ahead of the server's clock (now"
            f" {timestamp(now.replace(microsecond=0))}): send the time the event happened, with"
            " its offset; if it is right, the clock of the server or the sender is wrong"
        )
    return value


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
Timestamp = Annotated[
    AwareDatetime, BeforeValidator(parse_timestamp), AfterValidator(_not_far_ahead)
]
Url = Annotated[StrictStr, Field(pattern=URL_PATTERN, max_length=MAX_URL_CHARS)]
LeaseSeconds = Annotated[StrictInt, Field(ge=1, le=MAX_LEASE_SECONDS)]

LABEL_RULE = (
    f"a label key is 1 to 63 characters of [A-Za-z0-9._/-]; a value a string of at most"
    f" {MAX_LABEL_VALUE_CHARS} characters; an instance holds at most {MAX_LABELS} labels"
)


def check_labels(value: dict[str, str | None]) -> dict[str, str | None]:
    """Refuse labels beyond their limits, naming the limit (the table's CHECKs refuse the
    same: `ck_process_instance_labels_*`)."""
    if len(value) > MAX_LABELS:
        raise ValueError(f"holds {len(value)} labels, over the limit of {MAX_LABELS}")
    for key, label in value.items():
        if not LABEL_KEY_RE.fullmatch(key):
            raise ValueError(f"key {key[:80]!r}: must be 1 to 63 characters of [A-Za-z0-9._/-]")
        if label is not None and len(label) > MAX_LABEL_VALUE_CHARS:
            raise ValueError(
                f"value of {key!r} is {len(label)} characters, over the limit of"
                f" {MAX_LABEL_VALUE_CHARS}"
            )
    return value


def label_filter(labels: list[str] | None) -> dict[str, str] | None:
    """The labels a list keeps (`label=KEY=VALUE`, repeated), or None for no filter; a
    malformed one is a 422 naming it. Keys and values have the labels' own limits."""
    if not labels:
        return None
    wanted: dict[str, str] = {}
    for item in labels:
        key, sep, value = item.partition("=")
        message = None
        if not sep:
            message = f"{item[:80]!r}: must be KEY=VALUE, e.g. label=env=prod"
        else:
            try:
                check_labels({key: value})
            except ValueError as exc:
                message = str(exc)
        if message is None and wanted.get(key, value) != value:
            message = f"{key!r} is asked with two values: an instance has one value a key"
        if message is not None:
            raise validation_problem([{"field": "label", "message": message}])
        wanted[key] = value
    if len(wanted) > MAX_LABELS:
        message = f"{len(wanted)} labels, over the limit of {MAX_LABELS}"
        raise validation_problem([{"field": "label", "message": message}])
    return wanted


def _strings_only(value: dict[str, str | None]) -> dict[str, str | None]:
    for key, label in value.items():
        if label is None:
            raise ValueError(
                f"value of {key!r} is null: an event's labels only set; remove a label with"
                ' PATCH /v1/instances/{instance_key} {"labels": {"KEY": null}}'
            )
    return value


# An event's labels: merged into its instance's (a key it omits stays).
Labels = Annotated[
    dict[StrictStr, StrictStr | None],
    AfterValidator(check_labels),
    AfterValidator(_strings_only),
    Field(description=LABEL_RULE + "; merged into the instance's labels (a key omitted stays)"),
]
# A PATCH's labels: JSON Merge Patch (RFC 7396), a null value removes its key.
LabelPatch = Annotated[
    dict[StrictStr, StrictStr | None],
    AfterValidator(check_labels),
    Field(description=LABEL_RULE + "; merged as JSON Merge Patch: a null value removes its key"),
]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DeclareBody(_Body):
    ordinal: Ordinal | None = None
    labels: Labels | None = None


class StartBody(_Body):
    attempt: Attempt | None = None
    started_at: Timestamp | None = None
    ordinal: Ordinal | None = None
    lease_seconds: LeaseSeconds | None = None
    labels: Labels | None = None


class HeartbeatBody(_Body):
    attempt: Attempt
    lease_seconds: LeaseSeconds


class _FinishBody(_Body):
    attempt: Attempt | None = None
    started_at: Timestamp | None = None
    completed_at: Timestamp | None = None
    ordinal: Ordinal | None = None
    labels: Labels | None = None


class CompleteBody(_FinishBody):
    output: JsonValue = None
    external_output_url: Url | None = None


class FailBody(_FinishBody):
    error_code: Name
    error_message: StrictStr | None = None

    @field_validator("error_message")
    @classmethod
    def _message_size(cls, value: str | None) -> str | None:
        size = 0 if value is None else len(value.encode())
        if size > MAX_MESSAGE_BYTES:
            raise ValueError(
                f"is {size} bytes of UTF-8, over the limit of {MAX_MESSAGE_BYTES}:"
                " send its head and its tail with a line in between saying what was cut (the"
                " end of a traceback names the exception); the Python client"
                " (steprecord_client.fit_message) and its Celery integration fit a message so"
                " themselves"
            )
        return value


MAX_REASON_CHARS = 500


def _not_blank(value: str) -> str:
    if not value.strip():
        raise ValueError("must say why, in 1 to 500 characters (not only spaces)")
    return value


class ReopenBody(_Body):
    """An operator's reopen of a finished step (admin scope)."""

    reason: Annotated[
        StrictStr,
        Field(min_length=1, max_length=MAX_REASON_CHARS, description="Why: kept in the repair log"),
        AfterValidator(_not_blank),
    ]
    attempt: Attempt | None = Field(
        default=None,
        description="The attempt the operator saw finished; another one current is a 409"
        " stale_attempt, so two operators never reopen twice",
    )


def parse_reopen(instance_key: str, step_slug: str, body: Any) -> ReopenBody:
    """Validate a reopen's body; raise a `Problem` naming every bad field."""
    check_names(instance_key=instance_key, step_slug=step_slug)
    if not isinstance(body, dict):
        message = "must be a JSON object with a reason" if body is not None else "required"
        raise validation_problem(
            [{"field": "body" if body is not None else "reason", "message": message}]
        )
    try:
        return ReopenBody.model_validate(body)
    except ValidationError as exc:
        raise validation_problem(_errors(exc, list(ReopenBody.model_fields))) from None


BODIES: dict[Kind, type[_Body]] = {
    "declare": DeclareBody,
    "start": StartBody,
    "complete": CompleteBody,
    "fail": FailBody,
    "heartbeat": HeartbeatBody,
}


# What a batch event holds besides its endpoint's body.
BATCH_FIELDS = ("instance_key", "step_slug", "kind")


def _typo_of(field: str, names: Iterable[Any]) -> str:
    """Advice for an event lacking `field`: the name it holds that looks like a typo of it."""
    close = difflib.get_close_matches(field, [str(name) for name in names], n=1, cutoff=0.6)
    return f" (did you mean {field!r} where the event says {close[0]!r}?)" if close else ""


def _errors(exc: ValidationError, known: list[str]) -> list[dict[str, str]]:
    found = exc.errors(include_url=False)
    unknown = [str(e["loc"][-1]) for e in found if e["type"] == "extra_forbidden"]
    return [
        {
            "field": ".".join(str(p) for p in err["loc"]) or "body",
            "message": _message(err, known, unknown),
        }
        for err in found
    ]


def _message(err: Any, known: list[str], unknown: list[str]) -> str:
    if err["type"] == "value_error":  # our own validators' words, without pydantic's prefix
        return str(err["ctx"]["error"])
    if err["type"] == "extra_forbidden":
        return unknown_field(str(err["loc"][-1]), known)
    if err["type"] == "missing":
        return "required" + _typo_of(str(err["loc"][-1]), unknown)
    message: str = err["msg"]
    return message


def unknown_field(name: str, known: list[str]) -> str:
    """An unknown field, with the known one nearest to it as advice."""
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    if close:
        return f"unknown field: did you mean {close[0]!r}?"
    return f"unknown field: this event takes {', '.join(known)}"


def check_names(instance_key: str, step_slug: str) -> None:
    """Refuse an instance key or step slug that its format does not allow (a key may also
    hold `+` and `~`, as an Airflow run id does; a slug may not)."""
    bad = []
    if not KEY_RE.fullmatch(instance_key):
        bad.append({"field": "instance_key", "message": KEY_RULE})
    if not _NAME.fullmatch(step_slug):
        bad.append({"field": "step_slug", "message": NAME_RULE})
    if bad:
        raise validation_problem(bad)


def parse_event(
    instance_key: str, step_slug: str, kind: Kind, body: Any, also: tuple[str, ...] = ()
) -> Event:
    """Validate one event; raise a `Problem` naming every bad field, or return the event.
    `also`: the fields the body held besides its endpoint's (a batch event's), as advice."""
    check_names(instance_key=instance_key, step_slug=step_slug)
    if body is None:
        body = {}
    if not isinstance(body, dict):
        raise validation_problem([{"field": "body", "message": "must be a JSON object"}])
    try:
        parsed = BODIES[kind].model_validate(body)
    except ValidationError as exc:
        known = [*BODIES[kind].model_fields, *also]
        raise validation_problem(_errors(exc, known)) from None
    fields = parsed.model_dump(exclude_none=True)
    started_at: datetime | None = fields.get("started_at")
    completed_at: datetime | None = fields.get("completed_at")
    if started_at is not None and completed_at is not None and started_at > completed_at:
        raise Problem(422, "invalid_timing", "started_at is after completed_at")
    output = fields.pop("output", None)
    labels = fields.pop("labels", None)
    if output is not None and "external_output_url" in fields:
        raise Problem(422, "output_conflict", "give output or external_output_url, not both")
    return Event(
        instance_key=instance_key,
        step_slug=step_slug,
        kind=kind,
        output=None if output is None else dumps_value(output),
        labels=dumps_value(labels) if labels else None,
        **fields,
    )


class InstancePatch(_Body):
    """`PATCH /v1/instances/{instance_key}`: the instance's labels, set and removed."""

    labels: LabelPatch


def parse_instance_patch(body: Any) -> InstancePatch:
    """Validate a PATCH of an instance; raise a `Problem` naming every bad field."""
    if not isinstance(body, dict):
        raise validation_problem([{"field": "body", "message": 'must be {"labels": {...}}'}])
    try:
        return InstancePatch.model_validate(body)
    except ValidationError as exc:
        raise validation_problem(_errors(exc, list(InstancePatch.model_fields))) from None


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
        {"field": field, "message": "required, a string" + _typo_of(field, body)}
        for field, value in (("instance_key", instance_key), ("step_slug", step_slug))
        if not isinstance(value, str)
    ]
    if kind not in KINDS:
        typo = "" if "kind" in item else _typo_of("kind", body)
        errors.append({"field": "kind", "message": f"one of {', '.join(KINDS)}{typo}"})
    if errors:
        raise validation_problem(errors)
    return parse_event(instance_key, step_slug, kind, body, BATCH_FIELDS)
