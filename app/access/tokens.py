"""Bearer tokens: a per-worker cache of the token table, their scopes, and how a request was
let in (`Admission`). The check in front of the routes that uses them is `app/gate.py`.

Each worker reloads the tokens every few seconds, so a check costs no database round trip,
and a new or revoked token takes effect on every worker within that time. Only SHA-256
digests are held; a presented token is hashed and looked up by digest.
"""

import asyncio
import hashlib
import hmac
import logging
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from starlette.types import Scope

from ..core import domain
from ..core.db import DatabaseUnavailable, Pool
from ..core.problems import Problem
from ..data import tokens
from . import sessions

log = logging.getLogger("steprecord.access")
# Each scope includes the ones before it: `write` reads, `admin` writes and repairs.
SCOPES = ("read", "write", "admin")
RANK = {scope: rank for rank, scope in enumerate(SCOPES)}
MAX_BACKOFF_SECONDS = 30.0


def new_token() -> tuple[str, bytes]:
    """A fresh random token and the digest to store."""
    token = "sr_" + secrets.token_urlsafe(32)
    return token, digest(token)


def digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


@dataclass(frozen=True, slots=True)
class Grant:
    token_id: int
    name: str  # who writes: the records it writes (updated_by) and the repair log name it
    scope: str
    digest: bytes
    key_prefix: str | None  # only instances whose key starts with it exist for this token


@dataclass(frozen=True, slots=True)
class Admission:
    """How a request was let in, kept in its scope's state: a stream asks again later."""

    grant: Grant | None  # None: anonymous
    direct: bool  # it reached a loopback address and names no proxy

    @property
    def holder(self) -> int | None:
        """Whose request it is: its token's id, None for anonymous access."""
        return None if self.grant is None else self.grant.token_id

    def allows(self, scope: str) -> bool:
        """Whether this request's access includes `scope` (anonymous access includes all)."""
        return self.grant is None or RANK[self.grant.scope] >= RANK[scope]

    @property
    def writer(self) -> str:
        """Who writes what this request writes: its token's name, `anonymous` without one.

        The records it writes name it (updated_by), and so does the repair log (repaired_by).
        """
        return ANONYMOUS if self.grant is None else self.grant.name


ANONYMOUS = "anonymous"  # the writer of a request let in without a token
ADMISSION = "admission"  # the key of the request's `Admission` in its scope's state


def admission_of(scope: Scope) -> Admission:
    admission: Admission = scope["state"][ADMISSION]
    return admission


def _log_access(tokens: int, anonymous_allowed: bool) -> None:
    """One line when this worker's view of access changes (and at its first load): when each
    worker took a created or revoked token into account, for an audit and for the tests."""
    anonymous = "anonymous access on loopback" if anonymous_allowed else "no anonymous access"
    message = f"access loaded: {tokens} active token{'s' * (tokens != 1)}, {anonymous}"
    fields = {
        "level": "info",
        "logger": log.name,
        "message": message,
        "worker": os.getpid(),
        "active_tokens": tokens,
        "anonymous_allowed": anonymous_allowed,
    }
    log.info(message, extra={"fields": fields})


class Tokens:
    def __init__(self, pool: Pool, *, insecure_no_auth: bool, refresh: float) -> None:
        self._pool = pool
        self._insecure_no_auth = insecure_no_auth
        self._anonymous_allowed = False  # the database's access policy, loaded with the tokens
        self._refresh = refresh
        self._grants: dict[bytes, Grant] | None = None  # None until first loaded
        self._by_id: dict[int, Grant] = {}  # the same grants, by token id (sessions name it)
        self._used: set[int] = set()
        # Called when the grants or the anonymous policy change (the live hub: its streams
        # check their access again).
        self.on_change: Callable[[], None] | None = None

    async def load(self) -> None:
        async with self._pool.connection() as conn:
            if self._used:
                used, self._used = self._used, set()
                try:
                    await tokens.touch_tokens(conn, sorted(used))
                except BaseException:
                    self._used |= used
                    raise
            rows = await tokens.active_tokens(conn)
            anonymous_allowed = await tokens.anonymous_allowed(conn)
        grants = {
            bytes(r["token_sha256"]): Grant(
                r["id"], r["name"], r["scope"], bytes(r["token_sha256"]), r["key_prefix"]
            )
            for r in rows
        }
        changed = self._grants is None or (
            grants.keys() != self._grants.keys() or anonymous_allowed != self._anonymous_allowed
        )
        revised = grants != self._grants or anonymous_allowed != self._anonymous_allowed
        self._anonymous_allowed, self._grants = anonymous_allowed, grants
        self._by_id = {grant.token_id: grant for grant in grants.values()}
        if changed:
            _log_access(len(grants), anonymous_allowed)
        if revised and self.on_change is not None:
            self.on_change()

    async def keep_loading(self) -> None:
        """Reload for as long as the worker runs: a reload that stopped would keep revoked
        tokens working. An unexpected error is logged with its traceback and backed off."""
        failures = 0
        while True:
            await asyncio.sleep(min(self._refresh * 2**failures, MAX_BACKOFF_SECONDS))
            try:
                await self.load()
                failures = 0
            except (DatabaseUnavailable, domain.SchemaMissing) as exc:
                log.warning("tokens not reloaded: %s", exc)
            except Exception:
                log.exception("tokens not reloaded: unexpected error")
                failures = min(failures + 1, 10)

    def grant_of(self, token: str) -> Grant | None:
        """The grant of an active token, None for an unknown one (or before the first load)."""
        presented = digest(token)
        grant = (self._grants or {}).get(presented)
        if grant is None or not hmac.compare_digest(grant.digest, presented):
            return None
        return grant

    def session(self, value: str, secret: bytes) -> Grant | None:
        """The grant of the token a dashboard session names, when the session is unexpired,
        signed with `secret`, and its token still active; None otherwise."""
        token_id = sessions.token_id_of(value, time.time())
        grant = None if token_id is None else self._by_id.get(token_id)
        if grant is None or not sessions.verify(secret, value, grant.digest):
            return None
        self._used.add(grant.token_id)
        return grant

    def admits(self, admission: Admission) -> bool:
        """Whether a request let in as `admission` would still be let in now (read scope): its
        token still active and unchanged, or anonymous access still open to it."""
        if admission.grant is None:
            return self.check(None, "read", direct=admission.direct) is None
        return (self._grants or {}).get(admission.grant.digest) == admission.grant

    def check(
        self, authorization: str | None, needed: str, *, direct: bool
    ) -> Problem | Grant | None:
        """The grant of the token presented, None for an anonymous request that may proceed,
        or the problem to answer with.

        `direct`: the request reached a loopback address and names no proxy.
        """
        grants = self._grants
        if grants is None:
            return Problem(503, "unavailable", "access tokens are not loaded yet")
        if authorization is None:
            if grants:
                return Problem(401, "unauthorized", "send Authorization: Bearer <token>")
            if not self._anonymous_allowed:
                return Problem(
                    401,
                    "unauthorized",
                    "send Authorization: Bearer <token>; tokens have been configured,"
                    " so anonymous access stays closed after the last one is revoked",
                )
            if direct or self._insecure_no_auth:
                return None
            return Problem(
                401,
                "unauthorized",
                "send Authorization: Bearer <token>; without tokens only direct requests to a"
                " loopback address are anonymous, and this one came through a proxy or a"
                " public address",
            )
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return Problem(401, "unauthorized", "the Authorization header is not a bearer token")
        presented = digest(token.strip())
        grant = grants.get(presented)
        if grant is None or not hmac.compare_digest(grant.digest, presented):
            return Problem(401, "unauthorized", "unknown or revoked token")
        if RANK[grant.scope] < RANK[needed]:
            return Problem(403, "forbidden", FORBIDDEN[grant.scope, needed])
        self._used.add(grant.token_id)
        return grant


FORBIDDEN = {
    ("read", "write"): "this token may only read: writes need a token of scope write (steprecord"
    " token create NAME --scope write)",
    ("read", "admin"): "this token may only read: repairs need a token of scope admin"
    " (steprecord token create NAME --scope admin)",
    ("write", "admin"): "this token may read and write but not repair: repairs need a token of"
    " scope admin (steprecord token create NAME --scope admin)",
}
