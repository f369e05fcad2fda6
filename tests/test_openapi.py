"""The checked-in OpenAPI document matches the app, and the live app honours it."""

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import schemathesis
from hypothesis import HealthCheck, settings

from app.cli import openapi_json

DOCUMENT = Path(__file__).resolve().parent.parent / "openapi" / "openapi.json"
# A stream never ends by itself, so a generated call would wait forever on an instance that
# exists; its answers are checked in tests/test_stream.py.
schema = schemathesis.openapi.from_path(str(DOCUMENT)).exclude(
    path="/v1/instances/{instance_key}/stream"
)

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


@schema.parametrize()
@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
def test_the_live_app_never_answers_5xx_and_matches_its_schema(case: Any, server_url: str) -> None:
    case.call_and_validate(base_url=server_url, checks=CHECKS)
