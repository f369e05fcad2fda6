"""The checked-in OpenAPI document matches the app, and the live app honours it."""

import copy
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from app.cli.openapi import openapi_json
from tests.support.http import T1, T2, post
from tests.support.metrics import metric, metrics
from tests.support.streams import WAIT

# The document, and the live app answering as it says: the same on any database.
pytestmark = pytest.mark.same_on_any_database

DOCUMENT = Path(__file__).resolve().parent.parent / "openapi" / "openapi.json"
# Generated calls include the stream: schemathesis reads an event stream until it has sent 20
# events or the call's timeout passed, and generated keys name no instance (the tables start
# empty). A stream of a real instance is checked in
# test_the_streams_events_match_their_documented_schema.
schema = schemathesis.openapi.from_path(str(DOCUMENT))
STREAM = "/v1/instances/{instance_key}/stream"

CHECKS = [
    schemathesis.checks.not_a_server_error,
    schemathesis.checks.status_code_conformance,
    schemathesis.checks.content_type_conformance,
    schemathesis.checks.response_schema_conformance,
]


def test_checked_in_document_matches_the_app() -> None:
    assert DOCUMENT.read_text().strip() == openapi_json().strip(), (
        "openapi/openapi.json drifted: regenerate it with `steprecord openapi >"
        " openapi/openapi.json`"
    )


def _walk(node: Any, where: str = "#") -> Iterator[tuple[str, str, Any]]:
    """Every (location, key, value) of the document's objects."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield where, key, value
            yield from _walk(value, f"{where}/{key}")
    elif isinstance(node, list):
        for index, item in enumerate(node):
            yield from _walk(item, f"{where}/{index}")


def _resolve(document: Any, ref: str) -> bool:
    node = document
    for part in ref.removeprefix("#/").split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def test_every_ref_resolves_into_the_components_and_no_defs_are_left() -> None:
    """Generators resolve `$ref`s against the document: `#/$defs/...` makes them drop or refuse."""
    document = json.loads(DOCUMENT.read_text())
    bad = [
        f"{where}: {key} {value if key == '$ref' else ''}"
        for where, key, value in _walk(document)
        if key == "$defs"
        or (
            key == "$ref"
            and not (
                isinstance(value, str)
                and value.startswith("#/components/schemas/")
                and _resolve(document, value)
            )
        )
    ]
    assert not bad, "\n".join(bad)


def test_swagger_ui_is_served(client: httpx.Client) -> None:
    response = client.get("/docs")
    assert response.status_code == 200
    assert "swagger" in response.text.lower()


@pytest.mark.parametrize("path", ["/docs", "/redoc", "/docs/oauth2-redirect"])
def test_the_docs_pages_may_not_be_framed_by_another_site(client: httpx.Client, path: str) -> None:
    response = client.get(path)
    assert response.status_code == 200
    assert response.headers["x-frame-options"] == "DENY"
    assert response.headers["content-security-policy"] == "frame-ancestors 'none'"


@schema.parametrize()
@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
def test_the_live_app_never_answers_5xx_and_matches_its_schema(case: Any, server_url: str) -> None:
    case.call_and_validate(base_url=server_url, checks=CHECKS)


# Records of every shape a stream sends: each status, an output, an external output, an error.
SEEDS: list[tuple[str, str, dict[str, Any] | None]] = [
    ("declared", "declare", None),
    ("running", "start", {"attempt": 1, "started_at": T1, "lease_seconds": 600}),
    ("completed", "complete", {"attempt": 1, "started_at": T1, "output": {"ü": [1, None]}}),
    ("external", "complete", {"started_at": T1, "external_output_url": "s3://b/k"}),
    ("failed", "fail", {"attempt": 2, "started_at": T2, "error_code": "E", "error_message": "x"}),
]
LIVE_WRITES = 20  # with the seeds, more than the 20 events after which schemathesis stops


def _stream_of(document: schemathesis.BaseSchema, instance: str) -> Any:
    return document[STREAM]["GET"].Case(path_parameters={"instance_key": instance})


def test_the_streams_events_match_their_documented_schema(
    client: httpx.Client, server_url: str
) -> None:
    """Each event of a real stream, the records as they stand and then live writes, against
    the checked-in document: `event`, `id` and `data`, the record's JSON (`contentSchema`)."""
    for step, kind, body in SEEDS:
        assert post(client, kind, body, step=step).status_code in (200, 201)
    stop = threading.Event()

    def write_while_streaming() -> None:
        # Once the stream is open, so that its events are live ones, not the first read.
        while not stop.is_set() and not metric(metrics(server_url), "steprecord_streams_open"):
            stop.wait(0.05)
        for n in range(LIVE_WRITES):
            if stop.is_set():
                return
            post(client, "start", {"attempt": 1, "started_at": T1}, step=f"live-{n}")

    writer = threading.Thread(target=write_while_streaming)
    writer.start()
    try:
        response = _stream_of(schema, "order-1").call_and_validate(
            base_url=server_url, checks=CHECKS, timeout=WAIT
        )
    finally:
        stop.set()
        writer.join()
    assert response.status_code == 200
    slugs = [json.loads(e["data"])["step_slug"] for e in _events(response.content)]
    assert len(slugs) == 20, slugs  # cut short by schemathesis, not by its timeout
    assert {step for step, _, _ in SEEDS} <= set(slugs)
    assert any(slug.startswith("live-") for slug in slugs)


def _events(content: bytes) -> list[dict[str, str]]:
    """The stream's events, each field as SSE parses it (comments are none)."""
    events = []
    for block in content.decode().split("\n\n"):
        fields = [line.partition(": ") for line in block.splitlines() if line[:1] != ":"]
        if fields:
            events.append({name: value for name, _, value in fields})
    return events


def _misdescribed(change: str) -> schemathesis.BaseSchema:
    document = json.loads(DOCUMENT.read_text())
    event = document["components"]["schemas"]["RecordEvent"]
    if change == "a string":  # how the stream was documented before
        document["components"]["schemas"]["RecordEvent"] = {"type": "string"}
    else:  # a record key that the record does not have
        content = event["properties"]["data"]["contentSchema"] = copy.deepcopy(
            document["components"]["schemas"]["Record"]
        )
        content["required"].append("no_such_key")
    return schemathesis.openapi.from_dict(document)


@pytest.mark.parametrize(
    ("change", "failure"),
    [
        ("a string", "SSE event violates schema"),
        ("a record with a key too many", "SSE event payload violates content schema"),
    ],
)
def test_schemathesis_refuses_a_stream_whose_events_the_document_misdescribes(
    client: httpx.Client, server_url: str, change: str, failure: str
) -> None:
    """The check above can fail: the events and their `data` are really validated."""
    assert post(client, "start", {"attempt": 1, "started_at": T1}).status_code == 201
    case = _stream_of(_misdescribed(change), "order-1")
    # One record, then only keepalives: the stream is read for a second.
    with pytest.raises(BaseExceptionGroup) as caught:
        case.call_and_validate(base_url=server_url, checks=CHECKS, timeout=1)
    assert [getattr(f, "title", f) for f in caught.value.exceptions] == [failure]
