"""Bearer tokens (contract §8), on a server and database of these tests' own."""

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator

import httpx
import psycopg
import pytest

from app.access import new_token
from app.cli import migrate
from tests.conftest import (
    ROOT,
    create_database,
    drop_database,
    free_port,
    start_server,
    stop,
)

REFRESH = {"STEPRECORD_TOKEN_REFRESH_SECONDS": "0.5"}
START = "/v1/instances/run-1/steps/a/start"


def steprecord(database_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "app.cli", *args],
        env={**os.environ, "DATABASE_URL": database_url},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def create_token(database_url: str, name: str, scope: str) -> str:
    done = steprecord(database_url, "token", "create", name, "--scope", scope)
    assert done.returncode == 0, done.stderr
    token = done.stdout.strip()
    assert "\n" not in token
    return token


def reloaded() -> None:
    """Every worker has reloaded its tokens (they do so every 0.5 s here)."""
    time.sleep(1.5)


def eventually(check: Callable[[], bool], seconds: float = 5) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "did not happen in time"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def shared_server(server_dsn: str) -> Iterator[tuple[str, str]]:
    name = "steprecord_access_" + uuid.uuid4().hex[:8]
    database_url = create_database(server_dsn, name)
    try:
        migrate(database_url)
        url, proc = start_server(database_url, "--workers", "2", env=REFRESH)
        try:
            yield url, database_url
        finally:
            stop(proc)
    finally:
        drop_database(server_dsn, name)


@pytest.fixture
def server(shared_server: tuple[str, str]) -> Iterator[tuple[str, str]]:
    """The shared server, back to anonymous access (no tokens) after the test."""
    yield shared_server
    url, database_url = shared_server
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("DELETE FROM api_token")
    reloaded()
    assert all(httpx.get(url + "/v1/instances").status_code == 200 for _ in range(6))


def insert_token(database_url: str, name: str, scope: str) -> str:
    token, digest = new_token()
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO api_token (name, scope, token_sha256) VALUES (%s, %s, %s)",
            (name, scope, digest),
        )
    return token


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_first_token_ends_anonymous_access(server: tuple[str, str]) -> None:
    url, database_url = server
    assert httpx.post(url + START).status_code == 201
    token = create_token(database_url, "ci", "write")
    reloaded()
    assert all(httpx.get(url + "/v1/instances").status_code == 401 for _ in range(6))
    refused = httpx.post(url + START)
    assert refused.status_code == 401
    assert refused.headers["www-authenticate"].startswith("Bearer")
    assert refused.json()["code"] == "unauthorized"
    assert httpx.post(url + START, headers=bearer(token)).status_code == 200


def test_scopes_and_unknown_tokens(server: tuple[str, str]) -> None:
    url, database_url = server
    writer = insert_token(database_url, "writer", "write")
    reader = insert_token(database_url, "reader", "read")
    reloaded()
    for _ in range(4):  # both workers
        assert httpx.post(url + START, headers=bearer(writer)).status_code in (200, 201)
        assert httpx.get(url + "/v1/instances", headers=bearer(reader)).status_code == 200
        assert httpx.get(url + "/v1/instances", headers=bearer(writer)).status_code == 200
        forbidden = httpx.post(url + START, headers=bearer(reader))
        assert forbidden.status_code == 403
        assert forbidden.json()["code"] == "forbidden"
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
    reloaded()
    assert httpx.get(url + "/v1/instances", headers=bearer(token)).status_code == 200
    done = steprecord(database_url, "token", "revoke", "temp")
    assert done.returncode == 0, done.stderr
    reloaded()
    for _ in range(6):
        assert httpx.get(url + "/v1/instances", headers=bearer(token)).status_code == 401
        assert httpx.get(url + "/v1/instances", headers=bearer(keep)).status_code == 200


def test_token_list_shows_names_and_use_but_never_tokens(server: tuple[str, str]) -> None:
    url, database_url = server
    token = create_token(database_url, "listed", "read")
    reloaded()
    httpx.get(url + "/v1/instances", headers=bearer(token))
    time.sleep(1.2)  # the workers record use when they reload
    listing = steprecord(database_url, "token", "list")
    assert listing.returncode == 0
    assert "listed\tread" in listing.stdout
    assert token not in listing.stdout + listing.stderr
    assert "last used never" not in listing.stdout
    duplicate = steprecord(database_url, "token", "create", "listed", "--scope", "read")
    assert duplicate.returncode == 1
    assert duplicate.stdout == ""
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
