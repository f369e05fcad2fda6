"""Bearer tokens: a per-worker cache of the token table, and the check in front of the routes.

Each worker reloads the tokens every few seconds, so a check costs no database round trip,
and a new or revoked token takes effect on every worker within that time. Only SHA-256
digests are held; a presented token is hashed and looked up by digest.
"""

import asyncio
import hashlib
import hmac
import logging
import secrets
from dataclasses import dataclass

from starlette.types import ASGIApp, Receive, Scope, Send

from app import docs, steps
from app.db import DatabaseUnavailable, Pool
from app.errors import Problem, problem_response

log = logging.getLogger("steprecord.access")
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/openapi.json", *docs.OPEN_PATHS})
SCOPES = ("read", "write")


def new_token() -> tuple[str, bytes]:
    """A fresh random token and the digest to store."""
    token = "sr_" + secrets.token_urlsafe(32)
    return token, digest(token)


def digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


@dataclass(frozen=True, slots=True)
class Grant:
    token_id: int
    scope: str
    digest: bytes


class Tokens:
    def __init__(self, pool: Pool, *, anonymous_without_tokens: bool, refresh: float) -> None:
        self._pool = pool
        self._anonymous_without_tokens = anonymous_without_tokens
        self._refresh = refresh
        self._grants: dict[bytes, Grant] | None = None  # None until first loaded
        self._used: set[int] = set()

    async def load(self) -> None:
        async with self._pool.connection() as conn:
            if self._used:
                used, self._used = self._used, set()
                await steps.touch_tokens(conn, sorted(used))
            rows = await steps.active_tokens(conn)
        self._grants = {
            bytes(r["token_sha256"]): Grant(r["id"], r["scope"], bytes(r["token_sha256"]))
            for r in rows
        }

    async def keep_loading(self) -> None:
        while True:
            await asyncio.sleep(self._refresh)
            try:
                await self.load()
            except (DatabaseUnavailable, steps.SchemaMissing) as exc:
                log.warning("tokens not reloaded: %s", exc)

    def check(self, authorization: str | None, needed: str) -> Problem | None:
        """None when the request may proceed, else the problem to answer with."""
        grants = self._grants
        if grants is None:
            return Problem(503, "unavailable", "access tokens are not loaded yet")
        if authorization is None:
            if not grants and self._anonymous_without_tokens:
                return None
            return Problem(401, "unauthorized", "send Authorization: Bearer <token>")
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return Problem(401, "unauthorized", "the Authorization header is not a bearer token")
        presented = digest(token.strip())
        grant = grants.get(presented)
        if grant is None or not hmac.compare_digest(grant.digest, presented):
            return Problem(401, "unauthorized", "unknown or revoked token")
        if needed == "write" and grant.scope != "write":
            return Problem(403, "forbidden", "this token may only read")
        self._used.add(grant.token_id)
        return None


class AccessControl:
    """ASGI middleware: POST needs a write token, anything else a read token."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        tokens: Tokens = scope["app"].state.tokens
        authorization = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                authorization = value.decode("latin-1")
                break
        needed = "write" if scope["method"] == "POST" else "read"
        problem = tokens.check(authorization, needed)
        if problem is None:
            await self.app(scope, receive, send)
            return
        response = problem_response(problem)
        if problem.status == 401:
            response.headers["WWW-Authenticate"] = 'Bearer realm="steprecord"'
        await response(scope, receive, send)
