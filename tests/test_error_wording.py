"""What a person with curl meets first: the command's help and errors, and messages that say
what to do."""

import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi.routing import APIRoute
from pydantic import AliasChoices
from steprecord_client import Recorder, StepRecordError

from app.cli import main
from app.config import Settings
from app.main import create_app
from tests.helpers import ROOT, T1, post, problem, step_path


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port on which something else already listens."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.mark.parametrize("workers", ["1", "2"])
def test_busy_port_names_the_port_and_never_claims_to_listen(
    busy_port: int, database_url: str, workers: str
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "app.cli", "serve", "--port", str(busy_port), "--workers", workers],
        env={**os.environ, "DATABASE_URL": database_url},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert f"port {busy_port} is already in use" in done.stderr
    assert "--port" in done.stderr
    assert "listening" not in done.stderr


def test_serve_help_shows_the_defaults_and_every_environment_variable(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--help"])
    assert exited.value.code == 0
    text = capsys.readouterr().out
    assert "(default: 127.0.0.1)" in text
    assert "(default: 8000)" in text
    assert "(default: 1)" in text
    for name, field in Settings.model_fields.items():
        alias = field.validation_alias
        variable = alias.choices[0] if isinstance(alias, AliasChoices) else None
        assert str(variable or f"STEPRECORD_{name.upper()}") in text
    assert re.search(r"STEPRECORD_POOL_SIZE +default: 10\n", text)


def batch_problem(client: httpx.Client, event: dict[str, Any]) -> dict[str, Any]:
    response = client.post("/v1/events", json={"events": [event]})
    assert response.status_code == 200, response.text
    (result,) = response.json()["results"]
    assert "problem" in result, result
    found: dict[str, Any] = result["problem"]
    return found


# As PostgreSQL stores it, 1e300 is a 1 and 300 zeros: 4000 of them, with ", " between and
# the brackets, are 1,212,000 bytes, though the JSON sent is a few kilobytes.
LONG_NUMBERS = [1e300] * 4000
LONG_NUMBERS_SIZE = 4000 * 301 + 3999 * 2 + 2


def test_output_too_large_says_its_size_as_stored_and_the_limit(client: httpx.Client) -> None:
    found = problem(
        post(client, "complete", {"started_at": T1, "output": LONG_NUMBERS}),
        413,
        "output_too_large",
    )
    assert f"the output is {LONG_NUMBERS_SIZE} bytes" in found["detail"]
    assert "limit of 1048576 bytes" in found["detail"]
    assert "external_output_url" in found["detail"]
    assert (found["size"], found["limit"]) == (LONG_NUMBERS_SIZE, 1048576)
    event = {
        "instance_key": "order-1",
        "step_slug": "charge",
        "kind": "complete",
        "started_at": T1,
        "output": "x" * (1024 * 1024),
    }
    in_batch = batch_problem(client, event)
    assert (in_batch["status"], in_batch["code"]) == (413, "output_too_large")
    assert "the output is 1048578 bytes" in in_batch["detail"]


def test_client_surfaces_output_too_large_with_its_size(server_url: str) -> None:
    with Recorder(server_url, backoff=0.01, max_backoff=0.05) as rec:

        @rec.step("numbers")
        def numbers() -> list[float]:
            return LONG_NUMBERS

        with rec.instance("order-1"), pytest.raises(StepRecordError) as refused:
            numbers()
    assert (refused.value.status, refused.value.code) == (413, "output_too_large")
    assert f"the output is {LONG_NUMBERS_SIZE} bytes" in str(refused.value)


def test_ordinal_taken_names_the_step_holding_it_and_shows_it(client: httpx.Client) -> None:
    post(client, "declare", {"ordinal": 3}, step="fetch")
    found = problem(post(client, "start", {"ordinal": 3}, step="charge"), 409, "ordinal_taken")
    assert "ordinal 3 is held by step 'fetch'" in found["detail"]
    assert found["current"]["step_slug"] == "fetch"
    event = {"instance_key": "order-1", "step_slug": "charge", "kind": "start", "ordinal": 3}
    in_batch = batch_problem(client, event)
    assert in_batch["code"] == "ordinal_taken"
    assert in_batch["current"]["step_slug"] == "fetch"


def test_no_ordinal_left_shows_the_step_holding_the_last_one(client: httpx.Client) -> None:
    post(client, "declare", {"ordinal": 2147483647}, step="last")
    found = problem(post(client, "start", step="next"), 409, "ordinal_taken")
    assert "step 'last' holds 2147483647" in found["detail"]
    assert found["current"]["step_slug"] == "last"


def test_conflict_names_the_fields_that_differ(client: httpx.Client) -> None:
    post(client, "complete", {"attempt": 1, "started_at": T1, "output": {"n": 1}})
    other = post(client, "complete", {"attempt": 1, "started_at": T1, "output": {"n": 2}})
    found = problem(other, 409, "conflict")
    assert "attempt 1 is already recorded as completed" in found["detail"]
    assert "differs in output:" in found["detail"]
    assert "attempt 2" in found["detail"]
    failed = post(client, "fail", {"attempt": 1, "error_code": "CardDeclined"})
    assert "differs in status, output, error_code:" in problem(failed, 409, "conflict")["detail"]


def test_cursor_errors_tell_garbage_from_a_cursor_of_the_other_order(
    client: httpx.Client,
) -> None:
    for step in ("a", "b"):
        post(client, "start", step=step)
    listing = "/v1/instances/order-1/steps"
    ordinal_cursor = client.get(listing, params={"limit": 1}).json()["next_cursor"]
    other = client.get(listing, params={"order": "started_at", "cursor": ordinal_cursor})
    assert problem(other, 422, "validation_error")["errors"] == [
        {"field": "cursor", "message": "a cursor of order=ordinal, not of order=started_at"}
    ]
    garbage = problem(client.get(listing, params={"cursor": "garbage"}), 422, "validation_error")
    assert garbage["errors"][0]["message"].startswith("not a valid cursor")


@pytest.mark.parametrize(
    "started_at", [1764669600, "1764669600", "yesterday", "2026-12-02", "2026-12-02T10:00:00"]
)
def test_every_unusable_timestamp_gets_one_message_naming_the_form(
    client: httpx.Client, started_at: Any
) -> None:
    found = problem(post(client, "start", {"started_at": started_at}), 422, "validation_error")
    assert found["errors"] == [
        {
            "field": "started_at",
            "message": "must be an RFC 3339 timestamp with an offset, such as 2026-12-02T10:00:00Z",
        }
    ]
    assert client.get(step_path()).status_code == 404


NAME_RULE = (
    "must be 1 to 200 characters: letters, digits, '.', '_', ':' or '-',"
    " starting with a letter or digit"
)


def test_a_bad_name_gets_the_same_words_in_the_path_the_batch_and_error_code(
    client: httpx.Client,
) -> None:
    in_path = problem(post(client, "start", instance="-order"), 422, "validation_error")
    assert in_path["errors"] == [{"field": "instance_key", "message": NAME_RULE}]
    event = {"instance_key": "-order", "step_slug": "charge", "kind": "start"}
    assert batch_problem(client, event)["errors"] == in_path["errors"]
    code = post(client, "fail", {"started_at": T1, "error_code": "card declined"})
    assert problem(code, 422, "validation_error")["errors"] == [
        {"field": "error_code", "message": NAME_RULE}
    ]


@pytest.mark.parametrize("body", [b"[1]", b'"\\u0000"'])
def test_errors_about_the_whole_body_name_the_field_body(client: httpx.Client, body: bytes) -> None:
    response = client.post(f"{step_path()}/start", content=body)
    found = problem(response, 422, "validation_error")
    assert found["errors"][0]["field"] == "body"
    assert found["detail"].startswith("body: ")


def test_a_malformed_batch_envelope_names_the_field_body(client: httpx.Client) -> None:
    found = problem(client.post("/v1/events", json=[]), 422, "validation_error")
    assert found["errors"] == [{"field": "body", "message": 'must be {"events": [...]}'}]


def test_a_misspelt_query_parameter_is_refused_naming_it(client: httpx.Client) -> None:
    post(client, "start", step="a")
    post(client, "start", step="b")
    found = problem(
        client.get("/v1/instances/order-1/steps", params={"limt": 1}), 422, "validation_error"
    )
    assert [e["field"] for e in found["errors"]] == ["limt"]
    assert "takes cursor, fields, limit, order, status" in found["errors"][0]["message"]


def test_every_api_route_refuses_a_query_parameter_it_does_not_declare(
    client: httpx.Client,
) -> None:
    routes = [r for r in create_app().routes if isinstance(r, APIRoute) and r.include_in_schema]
    assert len(routes) >= 10
    for route in routes:
        path = route.path.format(instance_key="order-1", step_slug="charge")
        for method in sorted(route.methods or ()):
            response = client.request(method, path, params={"bogus": "1"})
            found = problem(response, 422, "validation_error")
            assert [e["field"] for e in found["errors"]] == ["bogus"], (method, path)
    assert client.get("/v1/instances").json()["items"] == []
