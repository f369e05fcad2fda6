"""API tokens (only their SHA-256 is stored) and the access policy."""

from collections.abc import Sequence
from typing import Any

import psycopg

from ..core.db import AsyncConn
from ..core.domain import SchemaMissing
from .common import violation

# `ended_anonymous`: this token is the one that ends anonymous access (the statement's
# snapshot reads the policy as it was before the token's trigger closes it).
CREATE_TOKEN = """
INSERT INTO api_token (name, scope, token_sha256, key_prefix) VALUES (%s, %s, %s, %s)
RETURNING EXISTS (SELECT FROM access_policy WHERE NOT tokens_required) AS ended_anonymous
"""


async def create_token(
    conn: AsyncConn, name: str, scope: str, digest: bytes, key_prefix: str | None = None
) -> bool:
    """Store a token's digest; True when anonymous access was allowed until this token."""
    try:
        cur = await conn.execute(CREATE_TOKEN, (name, scope, digest, key_prefix))
    except psycopg.errors.IntegrityError as exc:
        raise violation(exc) from exc
    row = await cur.fetchone()
    assert row is not None
    return bool(row["ended_anonymous"])


async def list_tokens(conn: AsyncConn) -> list[dict[str, Any]]:
    cur = await conn.execute(
        "SELECT name, scope, key_prefix, created_at, last_used_at FROM api_token ORDER BY name"
    )
    return await cur.fetchall()


REVOKE_TOKEN = """
WITH gone AS (DELETE FROM api_token WHERE name = %s RETURNING id)
SELECT count(*) AS removed, (SELECT count(*) FROM api_token) - count(*) AS remaining FROM gone
"""


async def revoke_token(conn: AsyncConn, name: str) -> int | None:
    """The number of tokens left after revoking `name`, or None when no token has that name."""
    cur = await conn.execute(REVOKE_TOKEN, (name,))
    row = await cur.fetchone()
    assert row is not None
    return None if row["removed"] == 0 else int(row["remaining"])


ALLOW_ANONYMOUS = """
INSERT INTO access_policy (tokens_required)
SELECT false WHERE NOT EXISTS (SELECT FROM api_token)
ON CONFLICT (id) DO UPDATE SET tokens_required = false, updated_at = now()
RETURNING id
"""


async def allow_anonymous(conn: AsyncConn) -> bool:
    """Record that no token is required while none exists; False (nothing done) if any does."""
    cur = await conn.execute(ALLOW_ANONYMOUS)
    return await cur.fetchone() is not None


async def anonymous_allowed(conn: AsyncConn) -> bool:
    """Whether having no token means anonymous access (never, once a token has existed)."""
    try:
        cur = await conn.execute("SELECT tokens_required FROM access_policy")
    except psycopg.errors.UndefinedTable as exc:
        raise SchemaMissing(str(exc)) from exc
    row = await cur.fetchone()
    return row is not None and not row["tokens_required"]


async def active_tokens(conn: AsyncConn) -> list[dict[str, Any]]:
    try:
        cur = await conn.execute("SELECT id, name, scope, token_sha256, key_prefix FROM api_token")
    except psycopg.errors.UndefinedTable as exc:
        raise SchemaMissing(str(exc)) from exc
    return await cur.fetchall()


async def touch_tokens(conn: AsyncConn, ids: Sequence[int]) -> None:
    await conn.execute("UPDATE api_token SET last_used_at = now() WHERE id = ANY(%s)", (list(ids),))
