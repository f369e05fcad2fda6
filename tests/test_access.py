"""Bearer tokens and anonymous access, on a server and database of these tests' own."""

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import psycopg
import pytest
from alembic import command

from app.access.tokens import new_token
from app.cli.migrate import migrate
from app.main import alembic_config
from tests.support import ROOT
from tests.support.citus import has_citus
from tests.support.databases import migrated_database
from tests.support.servers import (
    free_port,
    logged_server,
    start_server,
    steprecord,
    stop,
    wait_ready,
)
from tests.support.tokens import (
    REFRESH,
    access_loaded,
    bearer,
    create_token,
    insert_token,
    insert_tokens,
)
from tests.support.waits import eventually

# Tokens and the access policy are plain tables on the coordinator, read by the service alone;
# tests/test_citus.py runs the token commands on a distributed database: the same on any database.
pytestmark = pytest.mark.same_on_any_database

START = "/v1/instances/run-1/steps/a/start"


WORKERS = 2
LOGS: dict[str, Path] = {}  # the shared server's stdout, by its URL


def reloaded(url: str, tokens: int, *, anonymous: bool = False) -> None:
    """Wait until every worker of the shared server has loaded `tokens` active tokens and the
    access policy."""
    eventually(lambda: access_loaded(LOGS[url], WORKERS, tokens, anonymous=anonymous))


@pytest.fixture(scope="module")
def shared_server(
    server_dsn: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str]]:
    with migrated_database(server_dsn, "steprecord_access_") as database_url:
        log = tmp_path_factory.mktemp("access") / "stdout.jsonl"
        with logged_server(database_url, log, "--workers", str(WORKERS), env=REFRESH) as url:
            LOGS[url] = log
            yield url, database_url


@pytest.fixture
def server(shared_server: tuple[str, str]) -> Iterator[tuple[str, str]]:
    """The shared server, back to anonymous access (no tokens) after the test."""
    yield shared_server
    url, database_url = shared_server
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("DELETE FROM api_token")
        conn.execute("UPDATE access_policy SET tokens_required = false")
    reloaded(url, 0, anonymous=True)
    assert all(httpx.get(url + "/v1/instances").status_code == 200 for _ in range(6))


def test_first_token_ends_anonymous_access(server: tuple[str, str]) -> None:
    url, database_url = server
    assert httpx.post(url + START).status_code == 201
    token = create_token(database_url, "ci", "write")
    reloaded(url, 1)
    assert all(httpx.get(url + "/v1/instances").status_code == 401 for _ in range(6))
    refused = httpx.post(url + START)
    assert refused.status_code == 401
    assert refused.headers["www-authenticate"].startswith("Bearer")
    assert refused.json()["code"] == "unauthorized"
    assert httpx.post(url + START, headers=bearer(token)).status_code == 200


def test_creating_the_first_token_says_how_to_send_it_from_now_on(
    server: tuple[str, str],
) -> None:
    _, database_url = server
    first = steprecord(database_url, "token", "create", "first", "--scope", "write")
    assert first.returncode == 0, first.stderr
    assert "anonymous access has ended" in first.stderr
    assert "curl -H 'Authorization: Bearer <token>'" in first.stderr
    assert "paste a token on its sign-in page" in first.stderr
    second = steprecord(database_url, "token", "create", "second", "--scope", "read")
    assert second.returncode == 0, second.stderr
    assert "anonymous" not in second.stderr
    for name in ("first", "second"):
        assert steprecord(database_url, "token", "revoke", name).returncode == 0
    third = steprecord(database_url, "token", "create", "third", "--scope", "read")
    assert "anonymous" not in third.stderr  # it had already ended: revoking did not reopen it


@pytest.mark.parametrize("name", ["sweeper", "anonymous", "cli", "cli:root", "Sweeper", "CLI:ops"])
def test_a_token_may_not_take_a_name_the_service_writes_as_itself(
    scratch_database: str, name: str
) -> None:
    migrate(scratch_database)
    refused = steprecord(scratch_database, "token", "create", name, "--scope", "write")
    assert refused.returncode == 1
    assert refused.stdout == ""  # no token printed
    assert f"cannot create token {name!r}: the service writes as {name!r} itself" in refused.stderr
    assert "choose another name" in refused.stderr
    with psycopg.connect(scratch_database) as conn:
        assert conn.execute("SELECT count(*) FROM api_token").fetchone() == (0,)
        with pytest.raises(psycopg.errors.CheckViolation) as by_hand:
            conn.execute(
                "INSERT INTO api_token (name, scope, token_sha256) VALUES (%s, 'write', %s)",
                (name, new_token()[1]),
            )
    assert by_hand.value.diag.constraint_name == "ck_api_token_name_not_reserved"
    for allowed in ("sweeper-ci", "ci:sweeper", "client", "anonymous2"):
        done = steprecord(scratch_database, "token", "create", allowed, "--scope", "read")
        assert done.returncode == 0, done.stderr


def test_the_first_token_s_advice_names_the_configured_address(
    scratch_database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    migrate(scratch_database)
    monkeypatch.setenv("STEPRECORD_HOST", "0.0.0.0")
    monkeypatch.setenv("STEPRECORD_PORT", "9123")
    done = steprecord(scratch_database, "token", "create", "first", "--scope", "write")
    assert done.returncode == 0, done.stderr
    assert "curl -H 'Authorization: Bearer <token>' http://127.0.0.1:9123/v1/instances" in (
        done.stderr
    )
    assert "open http://127.0.0.1:9123/ui" in done.stderr
    assert ":8000" not in done.stderr


def test_scopes_and_unknown_tokens(server: tuple[str, str]) -> None:
    url, database_url = server
    writer, reader = insert_tokens(database_url, ("writer", "write"), ("reader", "read"))
    reloaded(url, 2)
    for _ in range(4):  # both workers
        assert httpx.post(url + START, headers=bearer(writer)).status_code in (200, 201)
        assert httpx.get(url + "/v1/instances", headers=bearer(reader)).status_code == 200
        assert httpx.get(url + "/v1/instances", headers=bearer(writer)).status_code == 200
        forbidden = httpx.post(url + START, headers=bearer(reader))
        assert forbidden.status_code == 403
        assert forbidden.json()["code"] == "forbidden"
        assert "need a token of scope write" in forbidden.json()["detail"]
        batch = httpx.post(
            url + "/v1/events",
            headers=bearer(reader),
            json={"events": [{"instance_key": "r", "step_slug": "s", "kind": "start"}]},
        )
        assert batch.status_code == 403
        for headers in (
            bearer("sr_nothing"),
            {"Authorization": "Basic abc"},
            {"Authorization": "Bearer"},
        ):
            assert httpx.get(url + "/v1/instances", headers=headers).status_code == 401
        assert httpx.get(url + "/metrics", headers=bearer(reader)).status_code == 200
        assert httpx.get(url + "/metrics").status_code == 401
        assert httpx.get(url + "/healthz").status_code == 200
        assert httpx.get(url + "/readyz").status_code == 200


def test_token_that_matches_nothing_is_refused_even_without_tokens(
    server: tuple[str, str],
) -> None:
    url, _ = server
    assert httpx.get(url + "/v1/instances").status_code == 200
    assert httpx.get(url + "/v1/instances", headers=bearer("sr_guess")).status_code == 401


def test_revoked_token_loses_access_on_every_worker(server: tuple[str, str]) -> None:
    url, database_url = server
    token = create_token(database_url, "temp", "write")
    keep = insert_token(database_url, "keep", "read")
    reloaded(url, 2)
    assert httpx.get(url + "/v1/instances", headers=bearer(token)).status_code == 200
    done = steprecord(database_url, "token", "revoke", "temp")
    assert done.returncode == 0, done.stderr
    reloaded(url, 1)
    for _ in range(6):
        assert httpx.get(url + "/v1/instances", headers=bearer(token)).status_code == 401
        assert httpx.get(url + "/v1/instances", headers=bearer(keep)).status_code == 200


def test_token_list_shows_names_and_use_but_never_tokens(server: tuple[str, str]) -> None:
    url, database_url = server
    token = create_token(database_url, "listed", "read")
    reloaded(url, 1)
    first = steprecord(database_url, "token", "list")
    assert first.returncode == 0
    assert "listed\tread" in first.stdout
    assert "last used never" in first.stdout
    assert "records use every 2 s" in first.stderr, first.stderr
    assert httpx.get(url + "/v1/instances", headers=bearer(token)).status_code == 200
    listings: list[subprocess.CompletedProcess[str]] = []

    def use_shown() -> bool:
        listings.append(steprecord(database_url, "token", "list"))
        return "last used never" not in listings[-1].stdout

    eventually(use_shown, seconds=10)
    assert all(token not in done.stdout + done.stderr for done in [first, *listings])
    duplicate = steprecord(database_url, "token", "create", "listed", "--scope", "read")
    assert duplicate.returncode == 1
    assert duplicate.stdout == ""
    assert "a token of that name exists" in duplicate.stderr
    assert "steprecord token revoke listed" in duplicate.stderr
    assert "uq_api_token_name" not in duplicate.stderr
    assert steprecord(database_url, "token", "revoke", "nobody").returncode == 1


def test_public_address_without_tokens_refuses_to_start(scratch_database: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "app.cli", "serve", "--host", "0.0.0.0", "--port", str(free_port())],
        env={**os.environ, "DATABASE_URL": scratch_database},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "steprecord token create" in done.stderr


def test_insecure_no_auth_only_allows_starting_without_tokens(scratch_database: str) -> None:
    url, proc = start_server(
        scratch_database, "--host", "0.0.0.0", "--insecure-no-auth", env=REFRESH
    )
    try:
        assert httpx.post(url + START).status_code == 201
        forwarded = {"X-Forwarded-For": "203.0.113.7"}
        assert httpx.get(url + "/v1/instances", headers=forwarded).status_code == 200
        create_token(scratch_database, "first", "write")
        eventually(lambda: httpx.post(url + START).status_code == 401)
    finally:
        stop(proc)


def test_public_address_with_a_token_starts(scratch_database: str) -> None:
    migrate(scratch_database)
    token = insert_token(scratch_database, "ops", "read")
    url, proc = start_server(scratch_database, "--host", "0.0.0.0")
    try:
        assert httpx.get(url + "/v1/instances").status_code == 401
        assert httpx.get(url + "/v1/instances", headers=bearer(token)).status_code == 200
    finally:
        stop(proc)


def test_a_read_token_may_not_use_any_writing_method(server: tuple[str, str]) -> None:
    url, database_url = server
    reader, writer = insert_tokens(database_url, ("reader", "read"), ("writer", "write"))
    reloaded(url, 2)
    for method in ["DELETE", "PUT", "PATCH"] * 3:  # on both workers
        forbidden = httpx.request(method, url + START, headers=bearer(reader))
        assert forbidden.status_code == 403, forbidden.text
        assert forbidden.json()["code"] == "forbidden"
        assert httpx.request(method, url + START).status_code == 401
        not_allowed = httpx.request(method, url + START, headers=bearer(writer))
        assert not_allowed.status_code == 405
        assert not_allowed.json()["code"] == "method_not_allowed"


def test_a_read_token_may_get_and_head(server: tuple[str, str]) -> None:
    url, database_url = server
    reader = insert_token(database_url, "reader", "read")
    reloaded(url, 1)
    for _ in range(4):
        assert httpx.get(url + "/v1/instances", headers=bearer(reader)).status_code == 200
        assert httpx.head(url + "/v1/instances").status_code == 401
        # The routes answer GET only: past the access check, HEAD is the router's 405.
        assert httpx.head(url + "/v1/instances", headers=bearer(reader)).status_code == 405


PROXY_HEADERS = [
    {"X-Forwarded-For": "203.0.113.7"},
    {"Forwarded": "for=203.0.113.7;proto=https"},
    {"X-Real-IP": "203.0.113.7"},
    {"X-Forwarded-Proto": "https"},
    {"X-Forwarded-Host": "steps.example.com"},
    {"Via": "1.1 proxy"},
]


def test_without_tokens_a_proxied_request_is_not_anonymous(server: tuple[str, str]) -> None:
    url, _ = server
    for headers in PROXY_HEADERS * 2:  # on both workers
        assert httpx.get(url + "/v1/instances").status_code == 200
        refused = httpx.get(url + "/v1/instances", headers=headers)
        assert refused.status_code == 401
        assert refused.json()["code"] == "unauthorized"
        assert "proxy" in refused.json()["detail"]
        assert httpx.post(url + START, headers=headers).status_code == 401


def non_loopback_address() -> str:
    """An address of this machine that is not loopback (the source of its default route)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("203.0.113.1", 9))  # sends nothing: only picks a route
        except OSError:
            pytest.skip("this machine has no route off loopback")
        address: str = probe.getsockname()[0]
    if address.startswith("127."):
        pytest.skip("this machine has no non-loopback address")
    return address


def test_anonymous_access_follows_the_address_a_request_reached(scratch_database: str) -> None:
    """On a wildcard bind with no token, only requests that reached loopback are anonymous."""
    migrate(scratch_database)
    address = non_loopback_address()
    port = free_port()
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "uvicorn", "app.main:create_app", "--factory"),
            *("--host", "0.0.0.0", "--port", str(port), "--log-level", "warning"),
        ],
        env={**os.environ, "DATABASE_URL": scratch_database},
        cwd=ROOT,
    )
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc)
        assert httpx.get(f"http://127.0.0.1:{port}/v1/instances").status_code == 200
        public = httpx.get(f"http://{address}:{port}/v1/instances")
        assert public.status_code == 401
        assert public.json()["code"] == "unauthorized"
    finally:
        stop(proc)


def test_revoking_the_last_token_keeps_anonymous_access_closed(server: tuple[str, str]) -> None:
    url, database_url = server
    create_token(database_url, "first", "write")
    second = create_token(database_url, "second", "read")
    reloaded(url, 2)
    not_last = steprecord(database_url, "token", "revoke", "first")
    assert not_last.returncode == 0, not_last.stderr
    assert "last token" not in not_last.stderr
    last = steprecord(database_url, "token", "revoke", "second")
    assert last.returncode == 0, last.stderr
    assert "that was the last token" in last.stderr
    assert "steprecord token allow-anonymous" in last.stderr
    assert "steprecord token create" in last.stderr
    with psycopg.connect(database_url) as conn:
        assert conn.execute("SELECT count(*) FROM api_token").fetchone() == (0,)
    reloaded(url, 0)
    for _ in range(6):
        assert httpx.get(url + "/v1/instances", headers=bearer(second)).status_code == 401
        refused = httpx.get(url + "/v1/instances")
        assert refused.status_code == 401
        assert "anonymous access stays closed" in refused.json()["detail"]
    allowed = steprecord(database_url, "token", "allow-anonymous")
    assert allowed.returncode == 0, allowed.stderr
    reloaded(url, 0, anonymous=True)
    assert all(httpx.get(url + "/v1/instances").status_code == 200 for _ in range(6))


def test_allowing_anonymous_access_is_refused_while_a_token_exists(
    server: tuple[str, str],
) -> None:
    _, database_url = server
    insert_token(database_url, "ops", "write")
    done = steprecord(database_url, "token", "allow-anonymous")
    assert done.returncode == 1
    assert "revoke them first" in done.stderr
    with psycopg.connect(database_url) as conn:
        assert conn.execute("SELECT tokens_required FROM access_policy").fetchone() == (True,)


def test_a_token_inserted_by_hand_also_closes_anonymous_access(server: tuple[str, str]) -> None:
    _, database_url = server
    with psycopg.connect(database_url, autocommit=True) as conn:
        assert conn.execute("SELECT tokens_required FROM access_policy").fetchone() == (False,)
        insert_token(database_url, "manual", "read")
        conn.execute("DELETE FROM api_token")
        assert conn.execute("SELECT tokens_required FROM access_policy").fetchone() == (True,)


def test_upgrading_a_database_with_tokens_keeps_anonymous_access_closed(
    scratch_database: str,
) -> None:
    if has_citus(scratch_database):
        pytest.skip(
            "starts at revision 0002, which cannot run on Citus: every migration ends by"
            " distributing, and the revisions before 0020 have keys without instance_id"
        )
    config = alembic_config()
    config.attributes["database_url"] = scratch_database
    command.upgrade(config, "0002")
    insert_token(scratch_database, "before", "write")
    migrate(scratch_database)
    with psycopg.connect(scratch_database) as conn:
        assert conn.execute("SELECT tokens_required FROM access_policy").fetchone() == (True,)
