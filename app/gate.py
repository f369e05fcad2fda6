"""The gate: the access check in front of every route, of the API and of the dashboard alike.

GET, HEAD and OPTIONS need a read token, a repair an admin one, any other method a write one
(the tokens and their scopes: `app.access.tokens`). The paths of the health checks, the
OpenAPI document, the API docs and the dashboard's sign-in stay open.

The dashboard (README, "Dashboard") keeps a session in the cookie `steprecord_ui_token`
(`__Host-steprecord_ui_token` over https, the only one a request over https reads): a
signed, expiring value naming a token, never the token itself (app/access/sessions.py). The
cookie is a credential for GET and HEAD requests only and grants read scope at most, so a
session of a write token can never write, and a request forged by another site cannot either.

Without any token, a request may be anonymous only when it is direct: it reached a loopback
address of this server (the local end of its connection, not the configured host) and
carries no header a proxy adds. A proxy on the same machine connects over loopback for
everyone it serves; its headers are what tells its requests apart.

It sits above the HTTP API and the dashboard (it knows their open paths, and answers a
refused dashboard page with the sign-in form) and below `app.main`, which wires it.
"""

import re

from starlette.types import ASGIApp, Receive, Scope, Send

from .access import tenancy
from .access.tokens import ADMISSION, Admission, Tokens
from .api import docs
from .core import shares
from .core.config import is_loopback
from .core.problems import Problem, problem_response
from .dashboard import signin

OPEN_PATHS = frozenset(
    {"/healthz", "/readyz", "/openapi.json", *docs.OPEN_PATHS, *signin.OPEN_PATHS}
)
COOKIE_METHODS = frozenset({"GET", "HEAD"})
# The repairs (POST .../steps/{step_slug}/reopen) need admin scope.
ADMIN_PATH = re.compile(r"^/v1/instances/[^/]+/steps/[^/]+/reopen$")
READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
PROXY_HEADERS = frozenset(
    {
        b"forwarded",
        b"via",
        b"x-forwarded-for",
        b"x-forwarded-host",
        b"x-forwarded-proto",
        b"x-real-ip",
    }
)


def needed_scope(method: str, path: str) -> str:
    """The scope a request needs: read for GET, HEAD and OPTIONS, admin for a repair, else
    write."""
    if method in READ_METHODS:
        return "read"
    return "admin" if ADMIN_PATH.match(path) else "write"


def _is_direct(scope: Scope, proxied: bool) -> bool:
    server = scope.get("server")  # the local end of the connection; a Unix socket has no port
    return not proxied and server is not None and server[1] is not None and is_loopback(server[0])


class AccessControl:
    """ASGI middleware: GET, HEAD and OPTIONS need a read token, a repair an admin one, any
    other method a write one."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        tokens: Tokens = scope["app"].state.tokens
        authorization = None
        cookie = None
        proxied = False
        secure = scope.get("scheme") == "https"
        for name, value in scope["headers"]:
            if name == b"authorization":
                if authorization is None:
                    authorization = value.decode("latin-1")
            elif name == b"cookie":
                cookie = signin.token_from_cookie(value.decode("latin-1"), secure) or cookie
            elif name in PROXY_HEADERS:
                proxied = True
        needed = needed_scope(scope["method"], scope["path"])
        direct = _is_direct(scope, proxied)
        session = None
        if authorization is None and cookie is not None and scope["method"] in COOKIE_METHODS:
            session = tokens.session(cookie, scope["app"].state.session_secret)
        problem = session or tokens.check(authorization, needed, direct=direct)
        if not isinstance(problem, Problem):
            grant = problem
            scope.setdefault("state", {})[ADMISSION] = Admission(grant, direct)
            if grant is not None and grant.key_prefix is not None:
                tenancy.set_prefix(scope, grant.key_prefix)
            # Its database connections count against its token's share, and its tenant's
            # (a key prefix's) when it has one (app/core/shares.py).
            principal = shares.PRINCIPAL.set(
                shares.principal_of(None, None)
                if grant is None
                else shares.principal_of(grant.token_id, grant.key_prefix)
            )
            try:
                await self.app(scope, receive, send)
            finally:
                shares.PRINCIPAL.reset(principal)
            return
        if problem.status == 401 and signin.asks_for_login(scope):
            await signin.login_page(scope, problem.detail)(scope, receive, send)
            return
        response = problem_response(problem)
        if problem.status == 401:
            response.headers["WWW-Authenticate"] = 'Bearer realm="steprecord"'
        await response(scope, receive, send)
