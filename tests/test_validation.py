"""Every bad input class answers its problem code and writes nothing."""

from typing import Any

import httpx
import psycopg
import pytest

from tests.support.http import T1, T2, post, problem, step_path

# A bad input is refused before the database is asked: the same on any database.
pytestmark = pytest.mark.same_on_any_database


@pytest.fixture
def nothing_written(client: httpx.Client, database_url: str) -> Any:
    yield
    with psycopg.connect(database_url) as conn:
        counts = conn.execute(
            "SELECT (SELECT count(*) FROM process_instance),"
            " (SELECT count(*) FROM workflow_step_record)"
        ).fetchone()
    assert counts == (0, 0)


def raw(client: httpx.Client, kind: str, content: bytes, path: str | None = None) -> httpx.Response:
    return client.post(
        path or f"{step_path()}/{kind}",
        content=content,
        headers={"content-type": "application/json"},
    )


BAD_BODIES: list[tuple[str, Any, str]] = [
    ("start", {"atempt": 1}, "unknown field"),
    ("start", {"attempt": "1"}, "string attempt"),
    ("start", {"attempt": 1.0}, "float attempt"),
    ("start", {"attempt": True}, "boolean attempt"),
    ("start", {"attempt": 0}, "attempt below 1"),
    ("start", {"attempt": 2147483648}, "attempt above int4"),
    ("declare", {"ordinal": -1}, "negative ordinal"),
    ("declare", {"ordinal": "3"}, "string ordinal"),
    ("start", {"started_at": "2026-12-02T10:00:00"}, "naive timestamp"),
    ("start", {"started_at": 1764669600}, "numeric timestamp"),
    ("start", {"started_at": "yesterday"}, "garbage timestamp"),
    ("complete", {"started_at": T1, "external_output_url": "no-scheme"}, "url without scheme"),
    ("complete", {"started_at": T1, "external_output_url": "s3://" + "k" * 2044}, "long url"),
    ("fail", {"started_at": T1}, "missing error_code"),
    ("fail", {"started_at": T1, "error_code": "has space"}, "bad error_code"),
    ("fail", {"started_at": T1, "error_code": "E", "error_message": "é" * 32769}, "long message"),
    ("fail", {"started_at": T1, "error_code": "E", "error_message": 5}, "numeric message"),
    ("start", [1, 2], "array body"),
    ("start", "text", "string body"),
]


@pytest.mark.usefixtures("nothing_written")
@pytest.mark.parametrize(("kind", "body", "why"), BAD_BODIES)
def test_bad_bodies_are_validation_errors(
    client: httpx.Client, kind: str, body: Any, why: str
) -> None:
    found = problem(post(client, kind, body), 422, "validation_error")
    assert found["errors"], found


@pytest.mark.usefixtures("nothing_written")
def test_unknown_field_is_named(client: httpx.Client) -> None:
    found = problem(post(client, "start", {"atempt": 1}), 422, "validation_error")
    assert found["errors"][0]["field"] == "atempt"


@pytest.mark.usefixtures("nothing_written")
@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b'{"output": "a\\u0000b", "started_at": "2026-12-02T10:00:01Z"}', "NUL"),
        (b'{"output": "\\ud800", "started_at": "2026-12-02T10:00:01Z"}', "lone surrogate"),
        (b'{"output": NaN, "started_at": "2026-12-02T10:00:01Z"}', "NaN"),
        (b'{"output": [Infinity], "started_at": "2026-12-02T10:00:01Z"}', "Infinity"),
        (b'{"output": 1e999, "started_at": "2026-12-02T10:00:01Z"}', "overflowing number"),
    ],
)
def test_json_the_database_cannot_hold_is_a_validation_error(
    client: httpx.Client, content: bytes, why: str
) -> None:
    problem(raw(client, "complete", content), 422, "validation_error")


@pytest.mark.usefixtures("nothing_written")
def test_nul_in_error_message_is_a_validation_error(client: httpx.Client) -> None:
    content = (
        b'{"error_code": "E", "error_message": "x\\u0000", "started_at": "2026-12-02T10:00:01Z"}'
    )
    problem(raw(client, "fail", content), 422, "validation_error")


def test_escaped_backslash_before_u0000_is_plain_text(client: httpx.Client) -> None:
    content = b'{"output": "a\\\\u0000b", "started_at": "2026-12-02T10:00:01Z"}'
    response = raw(client, "complete", content)
    assert response.status_code == 201
    assert response.json()["output"] == "a\\u0000b"


@pytest.mark.usefixtures("nothing_written")
@pytest.mark.parametrize("content", [b"{", b"not json", b'{"a": 1,}', b"\xff\xfe"])
def test_malformed_json_is_invalid_json(client: httpx.Client, content: bytes) -> None:
    problem(raw(client, "start", content), 400, "invalid_json")


@pytest.mark.usefixtures("nothing_written")
def test_both_outputs_are_an_output_conflict(client: httpx.Client) -> None:
    body = {"started_at": T1, "output": {"a": 1}, "external_output_url": "s3://b/k"}
    problem(post(client, "complete", body), 422, "output_conflict")


@pytest.mark.usefixtures("nothing_written")
def test_start_after_completion_in_the_body_is_invalid_timing(client: httpx.Client) -> None:
    problem(post(client, "complete", {"started_at": T2, "completed_at": T1}), 422, "invalid_timing")


@pytest.mark.usefixtures("nothing_written")
def test_output_over_one_mebibyte_is_too_large(client: httpx.Client) -> None:
    body = {"started_at": T1, "output": "x" * (1024 * 1024)}
    found = problem(post(client, "complete", body), 413, "output_too_large")
    assert "over the limit of 1048576 bytes" in found["detail"]


def test_output_of_exactly_one_mebibyte_is_accepted(client: httpx.Client) -> None:
    body = {"started_at": T1, "output": "x" * (1024 * 1024 - 2)}
    assert post(client, "complete", body).status_code == 201


@pytest.mark.usefixtures("nothing_written")
def test_body_over_two_mebibytes_is_refused_before_parsing(client: httpx.Client) -> None:
    content = b'{"output": "' + b"x" * (2 * 1024 * 1024) + b'"}'
    problem(raw(client, "complete", content), 413, "payload_too_large")


@pytest.mark.usefixtures("nothing_written")
def test_chunked_body_over_two_mebibytes_is_refused(client: httpx.Client) -> None:
    def chunks() -> Any:
        for _ in range(40):
            yield b"x" * (64 * 1024)

    response = client.post(f"{step_path()}/complete", content=chunks())
    problem(response, 413, "payload_too_large")


@pytest.mark.usefixtures("nothing_written")
@pytest.mark.parametrize(
    ("instance", "step"),
    [("has space", "s"), ("ok", "-dash-first"), ("ok", "x" * 201), ("é", "s"), ("ok", "a%2Fb")],
)
def test_bad_keys_and_slugs_are_validation_errors(
    client: httpx.Client, instance: str, step: str
) -> None:
    response = client.post(f"/v1/instances/{instance}/steps/{step}/start")
    problem(response, 422, "validation_error")


def test_mapped_step_slug_is_accepted(client: httpx.Client) -> None:
    assert post(client, "start", step="fetch:3").status_code == 201
    assert post(client, "start", instance="A.b_c-1:2", step="x").status_code == 201


def test_max_length_slug_is_accepted(client: httpx.Client) -> None:
    assert post(client, "start", step="s" * 200).status_code == 201


def test_unknown_route_is_not_found(client: httpx.Client) -> None:
    problem(client.get("/v2/nothing"), 404, "not_found")


def test_wrong_method_is_method_not_allowed(client: httpx.Client) -> None:
    problem(client.delete(f"{step_path()}/start"), 405, "method_not_allowed")
    problem(client.get(f"{step_path()}/start"), 405, "method_not_allowed")


def test_empty_body_and_form_content_type_work_for_curl(client: httpx.Client) -> None:
    response = client.post(
        f"{step_path()}/start",
        content=b"",
        headers={"content-type": "application/x-www-form-urlencoded"},
    )
    assert response.status_code == 201
    assert post(client, "declare", step="other").status_code == 201
