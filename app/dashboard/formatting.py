"""What the dashboard's pages show, in words: times, durations, outputs as indented JSON,
links, statuses, step names (a Celery task's or a mapped task's slug shortened to fit), an
error's line, and an attempt's bar in words."""

import json
import re
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import quote, urlsplit

from ..core.serialize import timestamp
from ..data import dashboard
from .timeline import Scale, duration


def utc(value: datetime | None) -> str:
    if value is None:
        return ""
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def iso(value: datetime | None) -> str:
    return "" if value is None else timestamp(value)


def millis(value: datetime | None) -> str:
    return "" if value is None else str(round(value.timestamp() * 1000))


def took(start: datetime | None, end: datetime | None, now: datetime) -> str:
    """How long an attempt ran (so far, when it is still running)."""
    if start is None:
        return ""
    return duration(((end or now) - start).total_seconds())


def ago(value: datetime | None, now: datetime) -> str:
    return "" if value is None else duration((now - value).total_seconds()) + " ago"


def pretty(output: str | None) -> str:
    """A stored output (JSON text), indented for reading."""
    return "" if output is None else json.dumps(json.loads(output), indent=2, ensure_ascii=False)


# A JSON text's tokens: a string (perhaps cut before its closing quote), a punctuator, or a
# run of anything else (a number, true, false, null); whitespace between them is dropped.
JSON_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*(?:"|\\?$)|[{}\[\],:]|[^\s{}\[\],:"]+')


def pretty_head(text: str) -> str:
    """The first part of a JSON text, cut anywhere, indented as `pretty` indents a whole one:
    a line per member and element, two spaces a level, strings kept as they are."""
    out: list[str] = []
    depth = 0
    tokens = JSON_TOKEN.findall(text)
    for index, token in enumerate(tokens):
        following = tokens[index + 1] if index + 1 < len(tokens) else ""
        if token in ("{", "["):
            depth += 1
            out.append(token if following in ("}", "]") else token + "\n" + "  " * depth)
        elif token in ("}", "]"):
            depth = max(depth - 1, 0)
            empty = index > 0 and tokens[index - 1] in ("{", "[")
            out.append(token if empty else "\n" + "  " * depth + token)
        elif token == ",":
            out.append(",\n" + "  " * depth)
        elif token == ":":
            out.append(": ")
        else:
            out.append(token)
    return "".join(out)


def link_url(url: str | None) -> str | None:
    """`url` when it may be a link (http or https only), else None: it is then shown as text."""
    if url is None:
        return None
    try:
        scheme = urlsplit(url.strip()).scheme.lower()
    except ValueError:
        return None
    return url if scheme in ("http", "https") else None


def mark(status: str, error_code: str | None = None) -> str:
    """The class that styles a status: a swept attempt (its lease expired) is marked apart."""
    return "swept" if status == "failed" and error_code == "lease_expired" else status


def trace_link(template: str | None, trace_id: str) -> str | None:
    """The link to an attempt's trace: STEPRECORD_TRACE_URL with the id in place of
    `{trace_id}` (URL-escaped); None without a template (the id is then shown as text)."""
    return None if template is None else template.replace("{trace_id}", quote(trace_id, safe=""))


def path(*parts: str) -> str:
    return "/ui/" + "/".join(quote(part, safe="") for part in parts)


def label(status: str, error_code: str | None) -> str:
    """A status in words, as a badge shows it after its glyph."""
    return "failed, lease expired" if mark(status, error_code) == "swept" else status


def shorten(name: str, size: int = 28) -> str:
    return name if len(name) <= size else name[: size - 1] + "…"


# A Celery task's slug (steprecord_client.celery): "<task name>:<task id, a UUID>".
CELERY_SLUG = re.compile(
    r"(?P<name>[A-Za-z0-9][A-Za-z0-9._:-]*):"
    r"(?P<id>[0-9A-Fa-f]{8}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{12})"
)
# A mapped task's slug (steprecord_client.airflow): "<task id>:<map index, digits>". Its step
# name (as `/v1/stats/steps` groups it) is the part before the last colon.
MAPPED_SLUG = re.compile(r"(?P<name>[A-Za-z0-9][A-Za-z0-9._:-]*):(?P<index>[0-9]+)")


def slug_parts(slug: str) -> tuple[str, str, str] | None:
    """``("celery", task name, task id)``, ``("mapped", task id, map index)`` or ``None``
    for a slug of neither shape."""
    match = CELERY_SLUG.fullmatch(slug)
    if match is not None:
        return "celery", match["name"], match["id"]
    match = MAPPED_SLUG.fullmatch(slug)
    if match is not None:
        return "mapped", match["name"], match["index"]
    return None


def cut_name(name: str, room: int) -> str:
    """A step name in at most `room` characters: whole when it fits; else its leading dotted
    parts (a module's path) left out first (`…tasks.fetch_order`), then its end cut."""
    if len(name) <= room:
        return name
    parts = name.split(".")
    for start in range(1, len(parts)):
        tail = "…" + ".".join(parts[start:])
        if len(tail) <= room:
            return tail
    return shorten("…" + parts[-1] if len(parts) > 1 else name, max(room, 2))


def step_label(slug: str, size: int | None = None) -> str:
    """A step's name as the dashboard shows it, the name first: a Celery task's slug as its
    task name and the first 8 characters of its id (`shop.charge:1a2b3c4d…`; pages give the
    full slug on hover and on the step page), any other slug as it is. With ``size``,
    shortened to that many characters by cutting what follows the name first: a Celery task's
    id to fewer characters (at least 4: `shop.tasks.fetch_order:0000…`); the name only when it
    alone does not fit (see `cut_name`), and never a mapped task's map index (`load:17`)."""
    parts = slug_parts(slug)
    if parts is None:
        return slug if size is None else shorten(slug, size)
    kind, name, ident = parts
    if kind == "mapped":
        return (
            name + ":" + ident
            if size is None
            else cut_name(name, size - len(ident) - 1) + ":" + ident
        )
    if size is None:
        return f"{name}:{ident[:8]}…"
    name = cut_name(name, size - 6)  # room for ":", 4 characters of the id and "…"
    return f"{name}:{ident[: min(size - len(name) - 2, 8)]}…"


def error_reason(message: str | None) -> str:
    """The line of an error message that says why, for a page that reads whole messages: for a
    Python traceback its last line that is not blank (the exception), else its first line;
    `dashboard.ERROR_LINE` picks the same line in SQL for the instance page."""
    if not message:
        return ""
    if dashboard.TRACEBACK in message:
        return message.rstrip().rpartition("\n")[2].strip()
    return message.partition("\n")[0]


def reason_after(code: str | None, line: str | None) -> str:
    """An error's line as it reads after its code: without the code when it starts with it
    (a Python exception's `ValueError: no rows` after the code `ValueError`)."""
    line = line or ""
    return line[len(code) + 2 :] if code and line.startswith(code + ": ") else line


def tip(slug: str, attempt: dict[str, Any], scale: Scale, now: datetime) -> str:
    """An attempt's bar in words, one fact a line: what, when (after the run's first start,
    and in UTC), how long, and its error's first line."""
    start, end, code = attempt["started_at"], attempt["completed_at"], attempt["error_code"]
    lines = [
        f"{step_label(slug)}, attempt {attempt['attempt']}: {label(attempt['status'], code)}",
        f"started {offset_of(scale, start)} ({utc(start)})",
        (f"ended {offset_of(scale, end)}, took " if end else "running for ")
        + took(start, end, now),
    ]
    if (code and code != "lease_expired") or attempt["error_line"]:
        why = reason_after(code, attempt["error_line"])
        lines.append("error: " + ": ".join(part for part in (code, why) if part))
    return "\n".join(lines)


def offset_of(scale: Scale, moment: datetime) -> str:
    return "+" + duration((moment - scale.first).total_seconds())


def unleased_for(record: dict[str, Any], now: datetime, after: timedelta | None) -> str:
    """How long a step has run without a lease when that is longer than `after`
    (STEPRECORD_LONG_RUNNING_AFTER: nothing fails it if its worker is gone), else ""."""
    started = record["started_at"]
    if after is None or record["status"] != "running" or record["lease_expires_at"] is not None:
        return ""
    if started is None or now - started <= after:
        return ""
    return took(started, None, now)
