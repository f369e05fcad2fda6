"""Opaque keyset cursors: the position of the last item of a page, as URL-safe base64 JSON."""

import base64
import binascii
from datetime import datetime
from typing import Any

import orjson

from .domain import Order
from .problems import validation_problem

# What each kind of cursor pages through, as a person would ask for it.
LISTINGS = {
    "o": "order=ordinal",
    "s": "order=started_at",
    "i": "the instance list",
    "u": "the steps across instances",
    "a": "a step's attempts",
    "l": "running_longer_than",
    "r": "an instance's repairs",
}
NOT_A_CURSOR = "not a valid cursor: pass the next_cursor of the previous page unchanged"


def _encode(kind: str, *position: Any) -> str:
    values = [v.isoformat() if isinstance(v, datetime) else v for v in position]
    return base64.urlsafe_b64encode(orjson.dumps([kind, *values])).decode().rstrip("=")


def _decode(cursor: str, kind: str, arity: int) -> list[Any]:
    try:
        value = orjson.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
    except (binascii.Error, ValueError):
        value = None
    if not (isinstance(value, list) and len(value) == arity + 1 and value[0] == kind):
        found = value[0] if isinstance(value, list) and value else None
        if isinstance(found, str) and found in LISTINGS and found != kind:
            raise _garbled(f"a cursor of {LISTINGS[found]}, not of {LISTINGS[kind]}")
        raise _garbled()
    return value[1:]


def _garbled(message: str = NOT_A_CURSOR) -> Exception:
    return validation_problem([{"field": "cursor", "message": message}])


INT4, INT8 = 2**31, 2**63  # ordinals are PostgreSQL integers, ids bigints


def _int(value: Any, bound: int = INT8) -> int:
    """An integer the column can hold: a position outside its range was never issued."""
    if type(value) is not int or not -bound <= value < bound:
        raise _garbled()
    return value


def _timestamp(value: Any, nullable: bool) -> datetime | None:
    if value is None and nullable:
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except (TypeError, ValueError):
        raise _garbled() from None
    if parsed.tzinfo is None:
        raise _garbled()
    return parsed


def steps_cursor(order: Order, last: dict[str, Any]) -> str:
    if order == "ordinal":
        return _encode("o", last["ordinal"])
    return _encode("s", last["started_at"], last["id"])


def steps_position(order: Order, cursor: str) -> list[Any]:
    """`(ordinal,)` or `(started_at or None, id)`: where the next page of steps starts."""
    if order == "ordinal":
        return [_int(_decode(cursor, "o", 1)[0], INT4)]
    started_at, last_id = _decode(cursor, "s", 2)
    return [_timestamp(started_at, nullable=True), _int(last_id)]


def instances_cursor(last: dict[str, Any]) -> str:
    return _encode("i", last["created_at"], last["id"])


def instances_position(cursor: str) -> list[Any]:
    created_at, last_id = _decode(cursor, "i", 2)
    return [_timestamp(created_at, nullable=False), _int(last_id)]


def recent_cursor(last: dict[str, Any]) -> str:
    return _encode("u", last["updated_at"], last["id"])


def recent_position(cursor: str) -> list[Any]:
    """`(updated_at, id)` of the last record seen, across instances."""
    updated_at, last_id = _decode(cursor, "u", 2)
    return [_timestamp(updated_at, nullable=False), _int(last_id)]


def attempts_cursor(last: dict[str, Any]) -> str:
    return _encode("a", last["attempt"])


def attempts_position(cursor: str) -> int:
    return _int(_decode(cursor, "a", 1)[0])


def long_running_cursor(last: dict[str, Any]) -> str:
    return _encode("l", last["started_at"], last["id"])


def long_running_position(cursor: str) -> list[Any]:
    """`(started_at, id)` of the last long-running record seen."""
    started_at, last_id = _decode(cursor, "l", 2)
    return [_timestamp(started_at, nullable=False), _int(last_id)]


def repairs_cursor(last: dict[str, Any]) -> str:
    return _encode("r", last["at"], last["id"])


def repairs_position(cursor: str) -> tuple[datetime, int]:
    """`(at, id)` of the last repair seen: the next page holds older ones."""
    at, last_id = _decode(cursor, "r", 2)
    moment = _timestamp(at, nullable=False)
    assert moment is not None
    return moment, _int(last_id)
