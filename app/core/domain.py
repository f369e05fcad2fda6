"""The service's domain types: events, outcomes, and what a data call can answer or refuse.

Nothing here touches the database or the web framework; the data modules (`app/data/`) take
and return these, and the HTTP layer shapes them.
"""

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

Kind = Literal["declare", "start", "complete", "fail", "heartbeat"]
Outcome = Literal[
    "created",
    "applied",
    "replay",
    "conflict",
    "stale_attempt",
    "not_started",
    "not_running",
    "ordinal_taken",
    "instance_key_collision",
]
Order = Literal["ordinal", "started_at"]


@dataclass(frozen=True, slots=True)
class Event:
    instance_key: str
    step_slug: str
    kind: Kind
    attempt: int | None = None
    started_at: datetime | None = None
    completed_at: datetime | None = None
    output: str | None = None  # JSON text
    external_output_url: str | None = None
    error_code: str | None = None
    error_message: str | None = None
    ordinal: int | None = None
    lease_seconds: int | None = None
    labels: str | None = None  # JSON text: an object of strings, merged into the instance's


@dataclass(frozen=True, slots=True)
class Result:
    outcome: Outcome
    record: dict[str, Any] | None  # the record after the event, or as it stands when refused
    # A late complete/fail of an older attempt (stale_attempt) that the history now holds.
    recorded: bool = False


class ConstraintViolation(Exception):
    """The database refused a write; `constraint` names the constraint or trigger."""

    def __init__(self, constraint: str, unique: bool, message: str) -> None:
        super().__init__(message)
        self.constraint = constraint
        self.unique = unique


class InvalidData(Exception):
    """The database could not take a value (out of range, untranslatable)."""


class Contention(Exception):
    """An event kept racing with concurrent creators; it wrote nothing."""


class OutputTooLarge(Exception):
    """The database refused an inline output over its cap; `size` is what it measured."""

    def __init__(self, size: int) -> None:
        super().__init__(f"the output is {size} bytes")
        self.size = size


class InstanceNotFound(Exception):
    pass


class StepNotFound(Exception):
    pass


class InstanceNotReplayed(InstanceNotFound):
    """No such instance on a standby: the primary may have it, not replayed there yet."""


class SchemaMissing(Exception):
    """The database has not been migrated far enough for this query."""


@dataclass(frozen=True, slots=True)
class Page:
    items: list[dict[str, Any]]
    last: dict[str, Any] | None  # the last item when another page follows
