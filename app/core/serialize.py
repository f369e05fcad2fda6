"""JSON in and out: strict parsing of request bodies and fast rendering of records."""

import json
import math
import re
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from operator import itemgetter
from typing import Any

import orjson

from . import record as record_shape

# An escaped NUL (`\u0000`) preceded by an even number of backslashes, i.e. a real escape.
_ESCAPED_NUL = re.compile(rb"(?<!\\)(?:\\\\)*\\u0000")


_ZERO = timedelta(0)


class BadJSON(Exception):
    """Not JSON at all (400 `invalid_json`)."""


class UnacceptableJSON(Exception):
    """JSON the service refuses: NUL, lone surrogates, NaN, Infinity, too deep or long (422)."""


# Well below the limits of everything a body meets: pydantic's recursive validation and orjson's
# serialiser stop near 255 levels, Python's parser and `_check_encodable` near 1,000.
MAX_DEPTH = 128


# Digits become "0", so a run of 19 zeros marks an integer too long for 64 bits, which orjson
# would silently turn into a double. (A scan in C: a regex over a large batch costs more than
# parsing it.)
_DIGITS_TO_ZERO = bytes.maketrans(b"123456789", b"000000000")
_LONG_INTEGER = b"0" * 19
# Python's default limit for converting an integer from text: a longer one is JSON, not ours.
_MAX_INT_DIGITS = 4300


def loads(body: bytes, max_depth: int = MAX_DEPTH) -> Any:
    """A request body, with arrays and objects nested at most `max_depth` levels."""
    if b"\\u0000" in body and _ESCAPED_NUL.search(body):
        raise UnacceptableJSON("strings may not contain NUL (\\u0000)")
    # Brackets inside strings count too, so this only decides whether the walk is needed.
    may_nest = body.count(b"[") + body.count(b"{") > max_depth
    fast_error = None
    if _LONG_INTEGER not in body.translate(_DIGITS_TO_ZERO):
        try:
            value = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            fast_error = str(exc)
        else:
            if may_nest:
                _check_depth(value, max_depth)
            return value
    # The standard parser keeps long integers exact, and tells the JSON orjson refused from
    # what is not JSON for the service (NaN, Infinity, lone surrogates, nesting past its own
    # recursion limit).
    try:
        value = json.loads(
            body, parse_constant=_refuse_constant, parse_float=_finite_float, parse_int=_int
        )
    except UnacceptableJSON:
        raise
    except RecursionError:
        raise _too_deep(max_depth) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadJSON(fast_error or str(exc)) from exc
    if may_nest:
        _check_depth(value, max_depth)
    _check_encodable(value)
    return value


def _too_deep(max_depth: int) -> UnacceptableJSON:
    return UnacceptableJSON(f"nesting deeper than {max_depth} levels of arrays and objects")


def _check_depth(value: Any, max_depth: int) -> None:
    # Level by level, without recursion; the parsers make exact dicts and lists, and `type() is`
    # halves the cost of the walk (about that of orjson's parse, for a batch).
    level = [value] if type(value) is dict or type(value) is list else []
    for _ in range(max_depth):
        level = [
            child
            for node in level
            for child in (node.values() if type(node) is dict else node)
            if type(child) is dict or type(child) is list
        ]
        if not level:
            return
    raise _too_deep(max_depth)


def _int(text: str) -> int:
    if len(text.lstrip("-")) > _MAX_INT_DIGITS:
        raise UnacceptableJSON(f"integers may have at most {_MAX_INT_DIGITS} digits")
    return int(text)


def _refuse_constant(name: str) -> Any:
    raise UnacceptableJSON(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise UnacceptableJSON(f"{text} is out of range for a JSON number")
    return value


def _check_encodable(value: Any) -> None:
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            raise UnacceptableJSON("strings may not contain lone surrogates") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_encodable(key)
            _check_encodable(item)
    elif isinstance(value, list):
        for item in value:
            _check_encodable(item)


def dumps_value(value: Any) -> str:
    """Compact JSON text of a parsed value (falls back for integers orjson cannot hold)."""
    try:
        return orjson.dumps(value).decode()
    except TypeError:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def timestamp(value: datetime) -> str:
    if value.utcoffset() != _ZERO:
        value = value.astimezone(UTC)
    return value.isoformat()[:-6] + "Z"  # a zero offset prints as "+00:00"


_RFC3339 = re.compile(r"\d{4}-\d\d-\d\d[Tt ]\d\d:\d\d:\d\d(\.\d+)?([Zz]|[+-]\d\d:\d\d)")
TIMESTAMP_RULE = "must be an RFC 3339 timestamp with an offset, such as 2026-12-02T10:00:00Z"


def parse_timestamp(value: Any) -> Any:
    """An RFC 3339 timestamp with its offset, in a body or a query: one message for an epoch
    number, a word, a date alone or a missing offset (a pydantic validator's `before`)."""
    if isinstance(value, datetime) and value.tzinfo is not None:
        return value
    if not isinstance(value, str) or not _RFC3339.fullmatch(value):
        raise ValueError(TIMESTAMP_RULE)
    try:
        return datetime.fromisoformat(value.upper())
    except ValueError:
        raise ValueError(TIMESTAMP_RULE) from None


# The record's keys, in the API's order (app/core/record.py).
RECORD_KEYS = record_shape.KEYS
ATTEMPT_KEYS = (
    "attempt",
    "status",
    "started_at",
    "completed_at",
    "lease_expires_at",
    "output",
    "external_output_url",
    "error_code",
    "error_message",
    "trace_id",
    "created_at",
    "updated_at",
    "reported_by",
)


def record_json(
    record: dict[str, Any], summary: bool = False, keys: tuple[str, ...] = RECORD_KEYS
) -> dict[str, Any]:
    """A record as the API shows it, with the stored output embedded without re-parsing."""
    out = {key: record[key] for key in keys}
    if summary:
        for key in record_shape.NOT_IN_SUMMARY:
            del out[key]
    elif out["output"] is not None:
        out["output"] = orjson.Fragment(out["output"])
    return out


def page_json(records: list[dict[str, Any]], summary: bool = False) -> list[dict[str, Any]]:
    """Records that already have the API's keys in its order (as a page read answers them),
    shown as the API shows them: changed in place, without a copy of each."""
    for record in records:
        shown(record, summary)
    return records


def shown(record: dict[str, Any], summary: bool = False) -> dict[str, Any]:
    """One record of `page_json`, changed in place."""
    if summary:
        for key in record_shape.NOT_IN_SUMMARY:
            del record[key]
    elif record["output"] is not None:
        record["output"] = orjson.Fragment(record["output"])
    return record


def attempt_json(attempt: dict[str, Any], summary: bool = False) -> dict[str, Any]:
    """An attempt of a record's history, shaped like a record."""
    return record_json(attempt, summary, ATTEMPT_KEYS)


# A list answer stops before its body would pass this (a client follows `next_cursor`).
MAX_PAGE_BYTES = 16 * 1024 * 1024
# Room kept for the page's frame and its cursor (a few hundred bytes of base64 at most).
_FRAME_BYTES = 1024
# What a string may grow to in JSON: a control character becomes six bytes (`\u001f`).
_ESCAPED = 6
# The values of a record or an attempt that may be long; the rest are bounded: names of 200
# characters of the key alphabet, a trace id, times, numbers, and their keys.
_LONG = tuple(map(itemgetter, ("output", "error_message", "external_output_url")))
_OTHER_BYTES = 2048


def dumps_page(
    rows: list[dict[str, Any]],
    render: Callable[[dict[str, Any]], dict[str, Any]],
    last: dict[str, Any] | None,
    cursor: Callable[[dict[str, Any]], str],
    max_bytes: int = MAX_PAGE_BYTES,
) -> bytes:
    """`{"items": [...], "next_cursor": ...}`: the rows (records or attempts) rendered, `last`
    the row whose cursor follows (None: none follows), cut before the body would pass
    `max_bytes`.

    A page that cannot pass it (its long strings at their widest) is rendered in one call, as
    always; a larger one row by row, each rendered once, ending after the last row that fits
    (always the first, however large) with that row's cursor: paging on reads the rest."""
    # Summed in C: on the pages that fit, nearly all, it costs a sixth of the dump's time.
    widest = sum(sum(map(len, filter(None, map(get, rows)))) for get in _LONG)
    if _ESCAPED * widest + _OTHER_BYTES * len(rows) + _FRAME_BYTES <= max_bytes:
        items = [render(row) for row in rows]
        return dumps({"items": items, "next_cursor": None if last is None else cursor(last)})
    parts: list[bytes] = []
    size = _FRAME_BYTES
    for index, row in enumerate(rows):
        part = dumps(render(row))
        size += len(part) + 1
        if parts and size > max_bytes:
            last = rows[index - 1]
            break
        parts.append(part)
    next_cursor = dumps(None if last is None else cursor(last))
    return b'{"items":[' + b",".join(parts) + b'],"next_cursor":' + next_cursor + b"}"


def dumps(value: Any) -> bytes:
    """JSON bytes; timestamps in UTC with a `Z` (microseconds only when not zero).

    orjson renders a UTC time itself, exactly as `timestamp` does, in a tenth of the time.
    Every time the service answers comes from its database connections, which run in UTC
    (`app.core.db`); a time in another zone would keep its offset.
    """
    return orjson.dumps(value, option=orjson.OPT_UTC_Z)
