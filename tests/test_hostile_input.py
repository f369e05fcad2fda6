"""No input reaches a 5xx, and every error is problem+json with a `code` (docs/api.md, "Errors").

The routes come from the app's own OpenAPI document, so a route added later is walked too:
hostile whole bodies, a hostile value at every field of each body, hostile path segments and
hostile query strings. Then the nesting limit, one path that parses JSON at a time.
"""

import base64
import json
from collections.abc import Iterator
from itertools import pairwise
from typing import Any
from urllib.parse import quote

import httpx
import pytest

from app.api.routes.common import MAX_BATCH_DEPTH
from app.core.serialize import MAX_DEPTH
from app.main import create_app
from tests.support.http import T1, T2, post, problem, record

DOCUMENT: dict[str, Any] = create_app().openapi()
Operation = tuple[str, str, dict[str, Any]]
OPERATIONS: list[Operation] = [
    (method, path, operation)
    for path, item in sorted(DOCUMENT["paths"].items())
    for method, operation in item.items()
    if method in ("get", "put", "post", "patch", "delete")
]
WITH_BODY = [operation for operation in OPERATIONS if operation[0] != "get"]
BATCH = "/v1/events"


def _id(operation: Operation) -> str:
    return f"{operation[0].upper()} {operation[1]}"


DEEP = 1100  # past orjson's 1,024 levels and Python's recursion limit: a body of 2.2 KB
BIG = str(10**400).encode()
# JSON texts, each put where a value goes.
VALUES: dict[str, bytes] = {
    "null": b"null",
    "true": b"true",
    "zero": b"0",
    "minus one": b"-1",
    "a float": b"1.5",
    "a string": b'"x"',
    "an empty array": b"[]",
    "an empty object": b"{}",
    "an array": b'[1, "x", null]',
    "an object": b'{"a": {"b": 1}}',
    "10^400": BIG,
    "-10^400": b"-" + BIG,
    "2^63": str(2**63).encode(),
    "2^64": str(2**64).encode(),
    "-2^63-1": str(-(2**63) - 1).encode(),
    "an integer of 5,000 digits": b"9" * 5000,
    "1e400": b"1e400",
    "-1e400": b"-1e400",
    "NaN": b"NaN",
    "-Infinity": b"-Infinity",
    "a 1 MB string": b'"' + b"x" * 1_000_000 + b'"',
    "an escaped NUL": b'"a\\u0000b"',
    "a lone high surrogate": b'"\\ud800"',
    "a lone low surrogate": b'"x\\udfffy"',
    "invalid UTF-8": b'"\xff\xfe"',
    "the UTF-8 of a surrogate": b'"\xed\xa0\x80"',
    "a raw NUL": b'"a\x00b"',
    "deep arrays": b"[" * DEEP + b"]" * DEEP,
    "deep objects": b'{"a":' * DEEP + b"1" + b"}" * DEEP,
    "deep arrays around a long integer": b"[" * DEEP + BIG + b"]" * DEEP,
    "arrays as deep as the limit": b"[" * MAX_DEPTH + b"]" * MAX_DEPTH,
}
BODIES: dict[str, bytes] = {
    **VALUES,
    "nothing": b"",
    "whitespace": b" \r\n\t",
    "unclosed deep arrays": b"[" * 100_000,
    "an unclosed object": b'{"a": [',
    "a byte order mark": b"\xef\xbb\xbf{}",
    "two documents": b"{} {}",
    "a bare invalid byte": b"\xff",
    "a bare NUL": b"\x00",
}
# Path segments and query values as they go on the wire.
SEGMENTS = ["x" * 201, "x" * 20_000, "%00", "%FF", "%ED%A0%80", "%2F", "%20", "..", "%C3%A9"]
CURSOR_TEXTS = [
    b'["o", ' + BIG + b"]",
    b'["o", ' + str(2**63).encode() + b"]",
    b'["o", ' + str(2**64).encode() + b"]",
    b'["o", ' + str(-(2**63) - 1).encode() + b"]",
    b'["o", ' + b"9" * 5000 + b"]",
    b'["o", 1e400]',
    b'["o", "\\u0000"]',
    b'["s", null, ' + str(2**63).encode() + b"]",
    b'["s", "\\ud800", 1]',
    b'["s", "9999-12-31T23:59:59-23:59", 1]',
    b'["i", "0001-01-01T00:00:00+23:59", 1]',
    b'["i", "2026-12-02T10:00:00Z", ' + str(2**64).encode() + b"]",
    b"[" * DEEP + b"]" * DEEP,
]
QUERY_VALUES = [
    "",
    "-1",
    "0",
    "1.5",
    "true",
    "null",
    BIG.decode(),
    "9" * 5000,
    str(2**63),
    str(2**64),
    "1e400",
    "NaN",
    "%5B" * DEEP,
    "x" * 20_000,
    "%00",
    "%FF",
    "%ED%A0%80",
    "running,%00",
    *(quote(base64.urlsafe_b64encode(text).decode().rstrip("=")) for text in CURSOR_TEXTS),
]


def resolved(schema: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        node: Any = DOCUMENT
        for part in schema["$ref"].removeprefix("#/").split("/"):
            node = node[part]
        schema = node
    return schema


def minimal(schema: dict[str, Any]) -> Any:
    """A small value of the schema: objects with their required properties only."""
    schema = resolved(schema)
    if "anyOf" in schema:
        return minimal(next(s for s in schema["anyOf"] if resolved(s).get("type") != "null"))
    if "enum" in schema:
        return schema["enum"][0]
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties", {})
        return {name: minimal(props.get(name, {})) for name in schema.get("required", [])}
    if kind == "array":
        return [minimal(schema.get("items", {})) for _ in range(schema.get("minItems", 0))]
    if kind == "string":
        return T1 if schema.get("format") == "date-time" else "x"
    if kind in ("integer", "number"):
        return schema.get("minimum", 1)
    return None


def body_schema(operation: dict[str, Any]) -> dict[str, Any]:
    content = resolved(operation.get("requestBody", {})).get("content", {})
    return resolved(content.get("application/json", {}).get("schema", {}))


def fields(schema: dict[str, Any], at: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Where a value goes in a body of the schema: every property, every array's first item."""
    schema = resolved(schema)
    for name, prop in schema.get("properties", {}).items():
        yield (*at, name)
        yield from fields(prop, (*at, name))
    if "items" in schema:
        yield (*at, 0)
        yield from fields(schema["items"], (*at, 0))


def base(schema: dict[str, Any]) -> Any:
    """A body to put a hostile value in; with a start, so that finishing events get applied."""
    body = minimal(schema)
    if "started_at" in schema.get("properties", {}):
        body["started_at"] = T1
    return body


def hostile_field_cases(path: str, operation: dict[str, Any]) -> list[tuple[Any, tuple[Any, ...]]]:
    """(body, field) pairs: a body of the operation, and where its hostile value goes."""
    schema = body_schema(operation)
    cases = [(base(schema), where) for where in fields(schema)]
    if path == BATCH:  # an event also carries the fields of its kind's own endpoint
        for kind in schema["properties"]["events"]["items"]["properties"]["kind"]["enum"]:
            own_path = f"/v1/instances/{{instance_key}}/steps/{{step_slug}}/{kind}"
            own = body_schema(DOCUMENT["paths"][own_path]["post"])
            event = {"instance_key": "i", "step_slug": "s", "kind": kind, **base(own)}
            cases += [({"events": [event]}, ("events", 0, name)) for name in own["properties"]]
    return cases


SENTINEL = "\N{SNOWMAN} the hostile value \N{SNOWMAN}"


def with_value(body: Any, where: tuple[Any, ...], value: bytes) -> bytes:
    """The body's JSON text with `value` at `where`, containers made on the way if missing."""
    body = json.loads(json.dumps(body))
    node = body
    for step, following in pairwise(where):
        child = _get(node, step)
        if not isinstance(child, dict | list):
            child = [] if isinstance(following, int) else {}
            _set(node, step, child)
        node = child
    _set(node, where[-1], SENTINEL)
    return json.dumps(body).encode().replace(json.dumps(SENTINEL).encode(), value)


def _get(node: Any, key: Any) -> Any:
    if isinstance(node, list):
        return node[key] if key < len(node) else None
    return node.get(key)


def _set(node: Any, key: Any, value: Any) -> None:
    if isinstance(node, list) and key == len(node):
        node.append(value)
    else:
        node[key] = value


def url(path: str, **segments: str) -> str:
    for name, default in (("instance_key", "i"), ("step_slug", "s")):
        path = path.replace(f"{{{name}}}", segments.get(name, default))
    return path


class Verdicts:
    """Sends requests, keeping each answer that is a 5xx or an error without problem+json."""

    def __init__(self, client: httpx.Client) -> None:
        self.client = client
        self.bad: list[str] = []

    def send(self, label: str, method: str, target: str, content: bytes | None = None) -> None:
        headers = {} if content is None else {"content-type": "application/json"}
        try:
            response = self.client.request(method, target, content=content, headers=headers)
        except httpx.TransportError as exc:
            self.bad.append(f"{label}: no answer ({exc!r})")
            return
        status, kind = response.status_code, response.headers.get("content-type", "")
        if status >= 500 or (
            status >= 400
            and not (kind.startswith("application/problem+json") and response.json().get("code"))
        ):
            self.bad.append(f"{label}: {status} {kind} {response.text[:200]}")

    def check(self) -> None:
        assert not self.bad, f"{len(self.bad)} bad answers:\n" + "\n".join(self.bad)


@pytest.fixture
def verdicts(client: httpx.Client) -> Verdicts:
    # A record to read, so that reads reach the database rather than stop at a 404.
    post(client, "complete", {"started_at": T1, "completed_at": T2, "output": {"a": 1}}, "i", "s")
    return Verdicts(client)


@pytest.mark.parametrize("operation", WITH_BODY, ids=_id)
def test_hostile_whole_bodies_never_answer_5xx(verdicts: Verdicts, operation: Operation) -> None:
    method, path, _ = operation
    for label, content in BODIES.items():
        verdicts.send(label, method, url(path), content)
    verdicts.check()


@pytest.mark.parametrize("operation", WITH_BODY, ids=_id)
def test_a_hostile_value_at_every_field_never_answers_5xx(
    verdicts: Verdicts, operation: Operation
) -> None:
    method, path, op = operation
    for body, where in hostile_field_cases(path, op):
        field = ".".join(str(part) for part in where)
        for label, value in VALUES.items():
            verdicts.send(f"{field} = {label}", method, url(path), with_value(body, where, value))
    verdicts.check()


@pytest.mark.parametrize("operation", OPERATIONS, ids=_id)
def test_hostile_path_segments_and_query_strings_never_answer_5xx(
    verdicts: Verdicts, operation: Operation
) -> None:
    method, path, op = operation
    parameters = op.get("parameters", [])
    for name in [p["name"] for p in parameters if p["in"] == "query"] + ["unknown"]:
        for value in QUERY_VALUES:
            verdicts.send(f"?{name}={value[:40]}", method, f"{url(path)}?{name}={value}")
    for name in [p["name"] for p in parameters if p["in"] == "path"]:
        for segment in SEGMENTS:
            verdicts.send(f"{name} = {segment[:40]}", method, url(path, **{name: segment}))
    verdicts.check()


def nested(levels: int) -> Any:
    value: Any = "leaf"
    for _ in range(levels):
        value = [value]
    return value


def too_deep(response: httpx.Response, limit: int) -> None:
    found = problem(response, 422, "validation_error")
    assert f"nesting deeper than {limit} levels" in found["detail"], found


@pytest.mark.parametrize("kind", ["declare", "start", "complete", "fail"])
def test_a_small_body_nested_1100_levels_deep_is_a_validation_error(
    client: httpx.Client, kind: str
) -> None:
    content = b"[" * DEEP + b"]" * DEEP
    response = client.post(f"/v1/instances/i/steps/s/{kind}", content=content)
    too_deep(response, MAX_DEPTH)


def test_a_batch_nested_1100_levels_deep_is_a_validation_error(client: httpx.Client) -> None:
    content = b'{"events": [' + b"[" * DEEP + b"]" * DEEP + b"]}"
    too_deep(client.post(BATCH, content=content), MAX_BATCH_DEPTH)


@pytest.mark.parametrize("levels", [600, DEEP])
def test_deep_nesting_beside_a_long_integer_is_a_validation_error(
    client: httpx.Client, levels: int
) -> None:
    """A long integer sends the body to the standard parser, which has limits of its own."""
    content = b'{"started_at": "%s", "output": ' % T1.encode()
    content += b"[" * levels + BIG + b"]" * levels + b"}"
    too_deep(client.post("/v1/instances/i/steps/s/complete", content=content), MAX_DEPTH)


def test_an_output_as_deep_as_the_limit_is_kept_and_one_level_more_is_refused(
    client: httpx.Client,
) -> None:
    output = nested(MAX_DEPTH - 1)  # the body's own object is the first level
    assert post(client, "complete", {"started_at": T1, "output": output}).status_code == 201
    assert record(client)["output"] == output
    body = {"started_at": T1, "output": nested(MAX_DEPTH)}
    too_deep(post(client, "complete", body, step="deeper"), MAX_DEPTH)


def test_a_batch_event_may_nest_as_deep_as_at_its_own_endpoint(client: httpx.Client) -> None:
    def event(output: Any) -> dict[str, Any]:
        return {
            "instance_key": "i",
            "step_slug": "s",
            "kind": "complete",
            "started_at": T1,
            "output": output,
        }

    response = client.post(BATCH, json={"events": [event(nested(MAX_DEPTH - 1))]})
    assert response.status_code == 200, response.text
    assert response.json()["results"][0]["status"] == 201
    too_deep(client.post(BATCH, json={"events": [event(nested(MAX_DEPTH))]}), MAX_BATCH_DEPTH)


def test_an_integer_longer_than_python_converts_is_a_validation_error(
    client: httpx.Client,
) -> None:
    def complete(digits: int) -> httpx.Response:
        content = b'{"started_at": "%s", "output": %s}' % (T1.encode(), b"9" * digits)
        return client.post("/v1/instances/i/steps/s/complete", content=content)

    found = problem(complete(4301), 422, "validation_error")
    assert "at most 4300 digits" in found["detail"]
    assert complete(4300).status_code == 201
