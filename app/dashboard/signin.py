"""The dashboard's sign-in: the form asking for a read token, the session cookie it sets (named
in `app.access.sessions`), signing out, and the login page a refused dashboard page answers
with (`app.gate` asks for it). Access (README, "Dashboard"): the API's rules, plus a read token
kept in an HttpOnly cookie."""

from datetime import UTC, datetime
from typing import Any
from urllib.parse import parse_qs, urlsplit

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from starlette.types import Scope

from ..access import sessions
from ..access.sessions import cookie_name
from .rendering import CSS, JS, LOGIN, LOGOUT, render

router = APIRouter(include_in_schema=False)
# The login form checks the token itself, so it needs none (nor write scope for its POST);
# signing out only forgets the cookie.
OPEN_PATHS = frozenset({CSS, JS, LOGIN, LOGOUT})
MAX_LOGIN_BYTES = 4096


def asks_for_login(scope: Scope) -> bool:
    """Whether a refused request is a page of the dashboard, answered with the login form."""
    path_ = scope["path"]
    return scope["method"] in ("GET", "HEAD") and (path_ == "/ui" or path_.startswith("/ui/"))


def _safe_next(target: str | None) -> str:
    """Where to go after signing in: a dashboard page of this service, never elsewhere."""
    if not target or "\\" in target or "//" in target or ".." in target:
        return "/ui"
    return target if target == "/ui" or target.startswith(("/ui/", "/ui?")) else "/ui"


def login_page(
    scope: Scope, detail: str | None, status: int = 401, target: str | None = None
) -> HTMLResponse:
    """A dashboard page refused for want of a token: the form asking for one, then back to
    the page. `detail` is the refusal's wording for programs, "what to send; why": the page
    tells a person what to do instead, and shows only the why."""
    if target is None:
        query = scope.get("query_string", b"").decode("latin-1")
        target = scope["path"] + (f"?{query}" if query else "")
    secure = scope.get("scheme") == "https"
    kept = any(
        name == b"cookie" and token_from_cookie(value.decode("latin-1"), secure) is not None
        for name, value in scope["headers"]
    )
    reason = (detail or "").partition("; ")[2]
    message = None
    if kept:
        message = "The token this browser kept is unknown or revoked: paste a current one."
    elif reason:
        message = f"{reason[0].upper()}{reason[1:]}."
    return _login_form(message, status, target)


def _login_form(message: str | None, status: int, target: str | None) -> HTMLResponse:
    """The form asking for a read token; after it, the browser goes to `target`."""
    return render(
        None, "login.html", status, title="Sign in", message=message, next=_safe_next(target)
    )


def token_from_cookie(header: str, secure: bool) -> str | None:
    """The dashboard's session from a `Cookie` header of a request over https (`secure`) or
    plain http, if it carries one under that scheme's name."""
    wanted = cookie_name(secure)
    for part in header.split(";"):
        name, _, value = part.strip().partition("=")
        if name == wanted and value:
            return value
    return None


@router.get(LOGIN)
async def login_form(request: Request) -> Response:
    return _login_form(None, 200, request.query_params.get("next"))


def same_origin(request: Request) -> bool:
    """Whether a form was posted from a page of this service: its `Origin` (or, without one,
    its `Referer`) names the host the request was sent to (`Host`, or `X-Forwarded-Host` as
    a proxy passes it on). A browser always sends one of them with a form's POST, and another
    site's page cannot make it name this service."""
    origin = request.headers.get("origin") or request.headers.get("referer")
    if not origin or origin == "null":
        return False
    netloc = urlsplit(origin).netloc.lower()
    hosts = [request.headers.get("host") or ""]
    hosts += (request.headers.get("x-forwarded-host") or "").split(",")
    return bool(netloc) and netloc in {host.strip().lower() for host in hosts}


CROSS_SITE = (
    "This form was sent from another site, or without saying where from: open the dashboard"
    " itself and sign in there."
)


def _cookie_flags(request: Request) -> dict[str, Any]:
    # `Secure` when the request came over https: directly, or through a proxy the operator
    # trusts (STEPRECORD_TRUSTED_PROXIES; the server takes the scheme from its header).
    return {
        "httponly": True,
        "samesite": "strict",
        "path": "/",
        "secure": request.url.scheme == "https",
    }


@router.post(LOGIN)
async def login(request: Request) -> Response:
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_LOGIN_BYTES:
            return _login_form("That is not a token.", 413, "/ui")
    form = parse_qs(body.decode("utf-8", "replace"))
    target = _safe_next((form.get("next") or [""])[0])
    if not same_origin(request):
        return _login_form(CROSS_SITE, 403, target)
    token = (form.get("token") or [""])[0].strip()
    grant = request.app.state.tokens.grant_of(token) if token else None
    if grant is None:
        return _login_form("That token is unknown or revoked.", 401, target)
    seconds = request.app.state.session_seconds
    expires = int(datetime.now(UTC).timestamp() + seconds)
    session = sessions.sign(request.app.state.session_secret, grant.token_id, grant.digest, expires)
    response = RedirectResponse(target, status_code=303)
    flags = _cookie_flags(request)
    response.set_cookie(cookie_name(flags["secure"]), session, max_age=int(seconds), **flags)
    return response


@router.get(LOGOUT)
async def logout_page(request: Request) -> Response:
    """Signing out is a POST (the Log out button): a link or an image on another site must
    not sign anyone out. A GET only says so."""
    response = render(
        request,
        "message.html",
        405,
        title="Sign out",
        message="Signing out is done with the Log out button at the top of each page.",
    )
    response.headers["Allow"] = "POST"
    return response


@router.post(LOGOUT)
async def logout(request: Request) -> Response:
    if not same_origin(request):
        return render(request, "message.html", 403, title="Sign out", message=CROSS_SITE)
    response = RedirectResponse("/ui", status_code=303)
    flags = _cookie_flags(request)
    response.delete_cookie(cookie_name(flags["secure"]), **flags)
    return response
