"""What a person with curl meets first: the command's help and errors, and messages that say
what to do."""

import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from fastapi.routing import APIRoute
from pydantic import AliasChoices
from steprecord_client import Recorder, StepRecordError

from app.access.tokens import new_token
from app.cli import main
from app.core.config import Settings
from app.core.problems import TITLES, Problem
from app.main import create_app
from tests.support import ROOT
from tests.support.http import T1, post, problem, step_path
from tests.support.servers import free_port, start_server, stop, wait_ready


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
    words = " ".join(text.split())  # argparse wraps the options' help
    assert "(default: STEPRECORD_HOST, else 127.0.0.1)" in words
    assert "(default: STEPRECORD_PORT, else 8000)" in words
    assert re.search(r"STEPRECORD_PORT +default: 8000\n", text)
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


def test_a_message_over_the_limit_says_the_limit_and_that_the_python_client_fits_it(
    client: httpx.Client,
) -> None:
    message = "Traceback (most recent call last):\n" + "x" * 70000 + "\nKeyError: 'sku'"
    failure = {"started_at": T1, "error_code": "KeyError", "error_message": message}
    found = problem(
        post(client, "fail", failure),
        422,
        "validation_error",
    )
    size = len(message.encode())
    assert found["errors"][0]["field"] == "error_message"
    assert f"is {size} bytes of UTF-8, over the limit of 65536" in found["detail"]
    assert "its head and its tail" in found["detail"]
    assert "steprecord_client.fit_message" in found["detail"]
    assert "Celery integration" in found["detail"]


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
# An instance key may also hold `+` and `~` (an Airflow run id).
KEY_RULE = (
    "must be 1 to 200 characters: letters, digits, '.', '_', ':', '-', '+' or '~',"
    " starting with a letter or digit"
)


def test_a_bad_name_gets_the_same_words_in_the_path_the_batch_and_error_code(
    client: httpx.Client,
) -> None:
    in_path = problem(post(client, "start", instance="-order"), 422, "validation_error")
    assert in_path["errors"] == [{"field": "instance_key", "message": KEY_RULE}]
    event = {"instance_key": "-order", "step_slug": "charge", "kind": "start"}
    assert batch_problem(client, event)["errors"] == in_path["errors"]
    slug_in_path = problem(post(client, "start", step="-charge"), 422, "validation_error")
    assert slug_in_path["errors"] == [{"field": "step_slug", "message": NAME_RULE}]
    event = {"instance_key": "order", "step_slug": "-charge", "kind": "start"}
    assert batch_problem(client, event)["errors"] == slug_in_path["errors"]
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


# --- first use: the next layer ------------------------------------------------------------


@pytest.mark.parametrize("kind", ["complete", "fail"])
def test_not_started_says_to_send_started_at_or_call_start_first(
    client: httpx.Client, kind: str
) -> None:
    post(client, "declare")
    body = {"attempt": 1, "error_code": "E"} if kind == "fail" else {"attempt": 1}
    found = problem(post(client, kind, body), 409, "not_started")
    assert found["detail"] == (
        f"attempt 1 has no start to {kind}: send started_at with this {kind}, or call start first"
    )
    event = {"instance_key": "order-1", "step_slug": "charge", "kind": kind, **body}
    assert batch_problem(client, event)["detail"] == found["detail"]


def test_a_heartbeat_without_a_start_says_to_call_start_first(client: httpx.Client) -> None:
    heartbeat = post(client, "heartbeat", {"attempt": 1, "lease_seconds": 60})
    detail = problem(heartbeat, 409, "not_started")["detail"]
    assert "call start first" in detail
    assert "started_at" not in detail  # a heartbeat carries none


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [
        ("GET", "/v1/events", "POST"),
        ("PUT", "/v1/instances/order-1", "DELETE or GET or PATCH"),
        ("GET", "/v1/instances/order-1/steps/charge/start", "POST"),
    ],
)
def test_method_not_allowed_names_the_allowed_methods(
    client: httpx.Client, method: str, path: str, allowed: str
) -> None:
    response = client.request(method, path)
    found = problem(response, 405, "method_not_allowed")
    assert found["detail"] == f"{method} is not allowed on {path}: use {allowed}"
    assert {m.strip() for m in response.headers["allow"].split(",")} == set(allowed.split(" or "))


def _misspelt(template: str) -> str:
    """The route's path, for order-1 and charge, with its last fixed word misspelt."""
    parts = template.split("/")
    last = max(i for i, part in enumerate(parts) if part and not part.startswith("{"))
    parts[last] += parts[last][-1]
    return "/".join(parts).format(instance_key="order-1", step_slug="charge")


def test_an_unknown_route_suggests_the_nearest_of_the_apps_routes(client: httpx.Client) -> None:
    routes = [r for r in create_app().routes if isinstance(r, APIRoute) and r.include_in_schema]
    methods: dict[str, set[str]] = {}
    for route in routes:
        methods.setdefault(route.path, set()).update(route.methods or ())
    assert len(methods) >= 10
    for template, allowed in methods.items():
        path = _misspelt(template)
        found = problem(client.get(path), 404, "not_found")
        assert found["detail"] == (
            f"no route for {path}: did you mean {' or '.join(sorted(allowed))} {template}?"
            " (every route: /docs)"
        )


@pytest.mark.parametrize(
    ("path", "suggested"),
    [
        ("/v1/instances/order-1/step", "GET /v1/instances/{instance_key}/steps"),
        ("/v1/instance/order-1/steps/charge", "GET /v1/instances/{instance_key}/steps/{step_slug}"),
        ("/v1/event", "POST /v1/events"),
        ("/ui/instance/order-1", "GET /ui/instances/{instance_key}"),
        ("/healtz", "GET /healthz"),
    ],
)
def test_a_typo_in_a_path_gets_the_route_meant(
    client: httpx.Client, path: str, suggested: str
) -> None:
    found = problem(client.get(path), 404, "not_found")
    assert f"did you mean {suggested}?" in found["detail"]


def test_a_path_like_no_route_points_to_the_docs(client: httpx.Client) -> None:
    for path in ("/completely/elsewhere/entirely", "/" + "zq/" * 3000):
        found = problem(client.get(path), 404, "not_found")
        assert found["detail"].endswith(": see /docs for every route")


def test_a_body_too_large_says_what_to_do_for_an_event_and_for_a_batch(
    client: httpx.Client,
) -> None:
    event = b'{"output": "' + b"x" * (2 * 1024 * 1024) + b'"}'
    single = client.post(f"{step_path()}/complete", content=event)
    detail = problem(single, 413, "payload_too_large")["detail"]
    assert detail.startswith("the body is over 2097152 bytes (2 MiB): ")
    assert "send its URL as external_output_url" in detail
    assert "batch" not in detail
    events = b'{"events": ["' + b"x" * (16 * 1024 * 1024) + b'"]}'
    detail = problem(client.post("/v1/events", content=events), 413, "payload_too_large")["detail"]
    assert detail.startswith("the body is over 16777216 bytes (16 MiB): ")
    assert "split the batch into requests sent one after another" in detail
    assert "external_output_url" in detail
    assert client.get("/v1/instances").json()["items"] == []


@pytest.fixture(scope="module")
def guarded(own_database: str) -> Iterator[tuple[str, str]]:
    """A server of this module's own, which a read token guards: (url, token)."""
    token, digest = new_token()
    with psycopg.connect(own_database, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO api_token (name, scope, token_sha256) VALUES ('dashboard', 'read', %s)",
            (digest,),
        )
    url, proc = start_server(own_database)
    try:
        yield url, token
    finally:
        stop(proc)


def test_the_sign_in_page_asks_a_person_to_paste_a_read_token_and_says_where_to_get_one(
    guarded: tuple[str, str],
) -> None:
    url, _ = guarded
    page = httpx.get(f"{url}/ui/failing")
    assert page.status_code == 401
    assert page.headers["content-type"].startswith("text/html")
    text = " ".join(page.text.split())
    assert "Paste it below once" in text
    assert "read token" in text
    assert "Ask whoever runs this service for a read token" in text
    assert "<code>steprecord token create NAME --scope read</code>" in text
    assert "Authorization" not in text
    assert "Bearer" not in text
    assert 'role="alert"' not in text  # a first visit is no error
    # Programs still get the header to send.
    api = httpx.get(f"{url}/v1/instances")
    assert problem(api, 401, "unauthorized")["detail"] == "send Authorization: Bearer <token>"


def test_a_revoked_token_kept_by_the_browser_is_named_on_the_sign_in_page(
    guarded: tuple[str, str],
) -> None:
    url, _ = guarded
    page = httpx.get(f"{url}/ui", cookies={"steprecord_ui_token": "sr_revoked-long-ago"})
    assert page.status_code == 401
    text = " ".join(page.text.split())
    assert "The token this browser kept is unknown or revoked: paste a current one." in text
    assert "Bearer" not in text


def test_the_sign_in_page_says_why_a_proxied_browser_needs_a_token(client: httpx.Client) -> None:
    """No token exists, and the request came through a proxy: the page says why, in words."""
    page = client.get("/ui", headers={"X-Forwarded-For": "203.0.113.9"})
    assert page.status_code == 401
    text = " ".join(page.text.split())
    assert (
        '<p class="error" role="alert">Without tokens only direct requests to a loopback address'
        " are anonymous, and this one came through a proxy or a public address.</p>"
    ) in text
    assert "Ask whoever runs this service for a read token" in text
    assert "Bearer" not in text


def _serve(env: dict[str, str], *extra: str) -> tuple[str, subprocess.Popen[bytes], str]:
    """`steprecord serve` started in a subprocess, once ready: (url, process, its banner)."""
    configured = env.get("STEPRECORD_PORT")
    port = int(configured) if configured else free_port()
    options = () if configured else ("--port", str(port))
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "serve", *options, *extra],
        env=env,
        cwd=ROOT,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    lines: list[str] = []
    try:
        assert proc.stderr is not None
        for raw in proc.stderr:
            lines.append(raw.decode())
            if "API docs:" in lines[-1]:
                break
        wait_ready(url, proc, timeout=60)
    except BaseException:
        stop(proc)
        raise
    return url, proc, "".join(lines)


def _stopped(proc: subprocess.Popen[bytes]) -> str:
    """Stop `serve` as an init system would (SIGTERM); what it said from then on."""
    stop(proc)
    assert proc.stderr is not None
    return proc.stderr.read().decode()


@pytest.mark.parametrize("workers", ["1", "2"])
def test_serve_prints_the_pages_to_open_and_says_when_it_stops(
    own_database: str, workers: str
) -> None:
    env = {**os.environ, "DATABASE_URL": own_database}
    url, proc, banner = _serve(env, "--workers", workers)
    try:
        assert f"steprecord listening on {url} (workers: {workers}), database " in banner
        assert f"  dashboard: {url}/ui\n" in banner
        assert f"  API docs:  {url}/docs\n" in banner
        assert httpx.get(f"{url}/docs").status_code == 200
    finally:
        said = _stopped(proc)
    assert proc.returncode == 0
    assert f"steprecord stopped listening on {url}\n" in said
    assert "embedded" not in said


def test_serve_listens_where_steprecord_host_and_port_say(own_database: str) -> None:
    env = {**os.environ, "DATABASE_URL": own_database, "STEPRECORD_PORT": str(free_port())}
    env["STEPRECORD_HOST"] = "127.0.0.1"
    url, proc, banner = _serve(env)
    try:
        assert f"steprecord listening on {url} (workers: 1)" in banner
        assert httpx.get(f"{url}/healthz").status_code == 200
    finally:
        _stopped(proc)
    assert proc.returncode == 0


def test_only_serve_says_where_the_embedded_database_keeps_its_data(server_dir: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    env["STEPRECORD_DATA_DIR"] = str(server_dir / "data")
    for command in (["migrate"], ["token", "list"]):
        done = subprocess.run(
            [sys.executable, "-m", "app.cli", *command],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        assert "embedded PostgreSQL" not in done.stderr
        assert "its data is in" not in done.stderr


def test_serve_says_the_embedded_database_listens_on_a_unix_socket(server_dir: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    env["STEPRECORD_DATA_DIR"] = str(server_dir / "data")
    url, proc, banner = _serve(env)
    try:
        found = re.search(
            r"the embedded PostgreSQL, listening on a Unix socket in (\S+) \(no TCP", banner
        )
        assert found is not None, banner
        assert (Path(found[1]) / ".s.PGSQL.5432").is_socket()
        assert "port=5432" not in banner
        assert f"its data is in {server_dir / 'data' / 'pgdata'} (STEPRECORD_DATA_DIR)" in banner
        assert '"The embedded database"' in banner
        if os.geteuid() == 0:
            assert "as root, it runs PostgreSQL as the system user steprecord-pg" in banner
        assert f"  dashboard: {url}/ui\n" in banner
    finally:
        said = _stopped(proc)
    assert proc.returncode == 0
    assert f"steprecord stopped listening on {url}; the embedded PostgreSQL has stopped too" in said


@pytest.mark.parametrize(
    ("kind", "typo", "meant"),
    [("start", "atempt", "attempt"), ("fail", "erorr_code", "error_code")],
)
def test_a_misspelt_body_field_gets_the_field_meant(
    client: httpx.Client, kind: str, typo: str, meant: str
) -> None:
    body = {typo: 1, "started_at": T1}
    found = problem(post(client, kind, body), 422, "validation_error")
    assert {"field": typo, "message": f"unknown field: did you mean {meant!r}?"} in found[
        "errors"
    ], found
    in_batch = batch_problem(
        client, {"instance_key": "order-1", "step_slug": "charge", "kind": kind, **body}
    )
    assert f"did you mean {meant!r}" in in_batch["detail"], in_batch


def test_a_misspelt_batch_field_gets_the_field_meant(client: httpx.Client) -> None:
    found = batch_problem(client, {"instnce_key": "order-1", "step_slug": "a", "kind": "start"})
    assert found["errors"][0]["field"] == "instance_key"
    assert "did you mean 'instance_key' where the event says 'instnce_key'?" in found["detail"]


def test_a_field_like_no_other_lists_the_fields_taken(client: httpx.Client) -> None:
    found = problem(post(client, "start", {"zzz": 1}), 422, "validation_error")
    message = found["errors"][0]["message"]
    assert message == (
        "unknown field: this event takes attempt, started_at, ordinal, lease_seconds, labels"
    )


@pytest.mark.parametrize("value", ["2026-12-02", "2026-12-02T10:00:00", "yesterday"])
def test_a_query_timestamp_gets_the_same_message_as_a_body_timestamp(
    client: httpx.Client, value: str
) -> None:
    for url, field in (("/v1/steps", "updated_after"), ("/v1/stats/steps", "since")):
        found = problem(client.get(url, params={field: value}), 422, "validation_error")
        assert found["errors"] == [
            {
                "field": field,
                "message": "must be an RFC 3339 timestamp with an offset,"
                " such as 2026-12-02T10:00:00Z",
            }
        ], found


def test_a_stale_attempt_is_told_it_was_superseded_and_should_stop(client: httpx.Client) -> None:
    post(client, "start", {"attempt": 1, "started_at": T1})
    post(client, "start", {"attempt": 2, "started_at": T1})
    found = problem(post(client, "complete", {"attempt": 1}), 409, "stale_attempt")
    assert found["title"] == "Attempt superseded by a newer one"
    assert found["detail"].startswith(
        "attempt 1 has been superseded by attempt 2: stop working on it; its result is not the"
        " step's"
    ), found


def test_every_problem_title_is_a_phrase_not_its_code() -> None:
    for code, title in TITLES.items():
        assert title != code, code
        assert " " in title, (code, title)
    assert Problem(429, "too_many", "wait").body()["title"] == "Too Many Requests"


@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", "/v1/instances/"), ("POST", f"{step_path()}/start/"), ("GET", "/ui/")],
)
def test_a_trailing_slash_redirects_with_a_body_naming_the_url(
    client: httpx.Client, method: str, path: str
) -> None:
    response = client.request(method, path + "?limit=5" if method == "GET" else path)
    found = problem(response, 307, "trailing_slash")
    bare = path.rstrip("/") + ("?limit=5" if method == "GET" else "")
    assert response.headers["location"] == bare
    assert found["location"] == bare
    assert f"use {bare}" in found["detail"], found
    followed = client.request(method, path, follow_redirects=True)
    assert followed.status_code in (200, 201), followed.text
