"""API tokens: made by the command or inserted straight, sent, and loaded by every worker."""

import json
from pathlib import Path

import psycopg

from app.access.tokens import new_token
from tests.support.servers import steprecord


def access_loaded(log: Path, workers: int, tokens: int, *, anonymous: bool = False) -> bool:
    """Whether every worker of a server logging to `log` now enforces `tokens` active tokens
    and that anonymous policy: each worker logs a line whenever its view of access changes,
    so its last such line is what it enforces."""
    latest: dict[int, tuple[int, bool]] = {}
    for line in log.read_text().splitlines():
        entry = json.loads(line) if line.startswith("{") else {}
        if "active_tokens" in entry:
            latest[entry["worker"]] = (entry["active_tokens"], entry["anonymous_allowed"])
    return len(latest) == workers and set(latest.values()) == {(tokens, anonymous)}


# Servers that reload their tokens often, so a test waits half a second for a change.
REFRESH = {"STEPRECORD_TOKEN_REFRESH_SECONDS": "0.5"}


def create_token(database_url: str, name: str, scope: str) -> str:
    """A token made by `steprecord token create`, as an operator makes one: what it prints."""
    done = steprecord(database_url, "token", "create", name, "--scope", scope)
    assert done.returncode == 0, done.stderr
    token = done.stdout.strip()
    assert "\n" not in token
    return token


def insert_token(database_url: str, name: str, scope: str, prefix: str | None = None) -> str:
    """A token inserted straight into the table; with `prefix`, a tenant's (the instances whose
    key starts with it)."""
    (token,) = insert_tokens(database_url, (name, scope), prefix=prefix)
    return token


def insert_tokens(
    database_url: str, *names_and_scopes: tuple[str, str], prefix: str | None = None
) -> list[str]:
    """Insert tokens in one transaction, so no worker ever knows some of them but not all."""
    tokens = []
    with psycopg.connect(database_url) as conn:
        for name, scope in names_and_scopes:
            token, digest = new_token()
            if prefix is None:  # no key_prefix: a test may stand at a revision before it
                conn.execute(
                    "INSERT INTO api_token (name, scope, token_sha256) VALUES (%s, %s, %s)",
                    (name, scope, digest),
                )
            else:
                conn.execute(
                    "INSERT INTO api_token (name, scope, token_sha256, key_prefix)"
                    " VALUES (%s, %s, %s, %s)",
                    (name, scope, digest, prefix),
                )
            tokens.append(token)
    return tokens


def bearer(token: str) -> dict[str, str]:
    """The headers that send `token`."""
    return {"Authorization": f"Bearer {token}"}
