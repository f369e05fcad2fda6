"""The API docs: Swagger UI at `/docs` and ReDoc at `/redoc`, with their assets served locally."""

from fastapi import FastAPI
from fastapi.openapi.docs import (
    get_redoc_html,
    get_swagger_ui_html,
    get_swagger_ui_oauth2_redirect_html,
)
from fastapi.responses import HTMLResponse
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..core import static

SWAGGER_JS = static.url("docs", "swagger-ui-bundle.js")
SWAGGER_CSS = static.url("docs", "swagger-ui.css")
REDOC_JS = static.url("docs", "redoc.standalone.js")
FAVICON = static.url("docs", "favicon.png")
OAUTH2_REDIRECT = "/docs/oauth2-redirect"
# The pages and their assets, open like the OpenAPI document they render.
OPEN_PATHS = frozenset(
    {"/docs", OAUTH2_REDIRECT, "/redoc", SWAGGER_JS, SWAGGER_CSS, REDOC_JS, FAVICON}
)


# The pages themselves (not their scripts): no other site may frame them (clickjacking a
# "Try it out" with the visitor's token). Only framing is forbidden: Swagger UI and ReDoc run
# inline scripts that a stricter policy would stop.
PAGES = frozenset({"/docs", OAUTH2_REDIRECT, "/redoc"})
NO_FRAMING = {"x-frame-options": "DENY", "content-security-policy": "frame-ancestors 'none'"}


class NoFraming:
    """ASGI middleware adding `NO_FRAMING` to the docs pages' answers."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in PAGES:
            await self.app(scope, receive, send)
            return

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in NO_FRAMING.items():
                    headers[name] = value
            await send(message)

        await self.app(scope, receive, sending)


def install(app: FastAPI) -> None:
    """Add the docs pages to an app created with `docs_url=None, redoc_url=None`."""
    static.mount(app, "docs", static.DOCS_ASSETS)
    app.add_middleware(NoFraming)
    openapi_url = app.openapi_url or "/openapi.json"

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=openapi_url,
            title=f"{app.title} - Swagger UI",
            swagger_js_url=SWAGGER_JS,
            swagger_css_url=SWAGGER_CSS,
            swagger_favicon_url=FAVICON,
            oauth2_redirect_url=OAUTH2_REDIRECT,
        )

    @app.get(OAUTH2_REDIRECT, include_in_schema=False)
    async def swagger_ui_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    @app.get("/redoc", include_in_schema=False)
    async def redoc() -> HTMLResponse:
        return get_redoc_html(
            openapi_url=openapi_url,
            title=f"{app.title} - ReDoc",
            redoc_js_url=REDOC_JS,
            redoc_favicon_url=FAVICON,
            with_google_fonts=False,
        )
