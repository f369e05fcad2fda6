"""The API docs: Swagger UI at `/docs` and ReDoc at `/redoc`, with their assets served locally."""

from fastapi import FastAPI
from fastapi.openapi.docs import (
    get_redoc_html,
    get_swagger_ui_html,
    get_swagger_ui_oauth2_redirect_html,
)
from fastapi.responses import HTMLResponse

from app import static

SWAGGER_JS = static.url("docs", "swagger-ui-bundle.js")
SWAGGER_CSS = static.url("docs", "swagger-ui.css")
REDOC_JS = static.url("docs", "redoc.standalone.js")
FAVICON = static.url("docs", "favicon.png")
OAUTH2_REDIRECT = "/docs/oauth2-redirect"
# The pages and their assets, open like the OpenAPI document they render.
OPEN_PATHS = frozenset(
    {"/docs", OAUTH2_REDIRECT, "/redoc", SWAGGER_JS, SWAGGER_CSS, REDOC_JS, FAVICON}
)


def install(app: FastAPI) -> None:
    """Add the docs pages to an app created with `docs_url=None, redoc_url=None`."""
    static.mount(app, "docs", static.DOCS_ASSETS)
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
