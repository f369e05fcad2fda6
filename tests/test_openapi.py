"""The checked-in OpenAPI document matches the app, and the live app honours it."""

from pathlib import Path
from typing import Any

import httpx
import schemathesis
from hypothesis import HealthCheck, settings

from app.cli import openapi_json

DOCUMENT = Path(__file__).resolve().parent.parent / "openapi" / "openapi.json"
schema = schemathesis.openapi.from_path(str(DOCUMENT))

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


def test_swagger_ui_is_served(client: httpx.Client) -> None:
    response = client.get("/docs")
    assert response.status_code == 200
    assert "swagger" in response.text.lower()


@schema.parametrize()
@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
def test_the_live_app_never_answers_5xx_and_matches_its_schema(case: Any, server_url: str) -> None:
    case.call_and_validate(base_url=server_url, checks=CHECKS)
