"""The API docs render in a real browser that can reach nothing but the service.

The service has an active token, so the pages also prove that the docs and their assets
need none (docs/operations.md, "Security"). The browser is Debian's chromium, never a
downloaded one.
"""

import uuid
from collections.abc import Iterator

import psycopg
import pytest
from playwright.sync_api import Browser, Page, Route

from app.access.tokens import new_token
from app.cli.migrate import migrate
from tests.support.databases import create_database, drop_database
from tests.support.servers import start_server, stop


@pytest.fixture(scope="module")
def guarded_server(server_dsn: str) -> Iterator[str]:
    """A server of this module's own whose database holds one active token."""
    name = "steprecord_docs_" + uuid.uuid4().hex[:8]
    database_url = create_database(server_dsn, name)
    try:
        migrate(database_url)
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(
                "INSERT INTO api_token (name, scope, token_sha256) VALUES ('docs', 'read', %s)",
                (new_token()[1],),
            )
        url, proc = start_server(database_url)
        try:
            yield url
        finally:
            stop(proc)
    finally:
        drop_database(server_dsn, name)


@pytest.fixture
def offline_page(browser: Browser, guarded_server: str) -> Iterator[tuple[Page, list[str]]]:
    """A page whose requests to anywhere but the service are aborted (and listed)."""
    blocked: list[str] = []

    def only_the_service(route: Route) -> None:
        if route.request.url.startswith(guarded_server + "/"):
            route.continue_()
        else:
            blocked.append(route.request.url)
            route.abort()

    context = browser.new_context(base_url=guarded_server)
    try:
        page = context.new_page()
        page.route("**/*", only_the_service)
        yield page, blocked
    finally:
        context.close()


def test_swagger_ui_lists_the_operations_offline_without_a_token(
    offline_page: tuple[Page, list[str]],
) -> None:
    page, blocked = offline_page
    response = page.goto("/docs")
    assert response is not None
    assert response.status == 200
    page.wait_for_selector(".opblock", timeout=20_000)
    assert page.locator(".opblock").count() >= 10
    assert page.get_by_text("/v1/events").count() >= 1
    assert blocked == []


def test_redoc_renders_the_api_offline_without_a_token(
    offline_page: tuple[Page, list[str]],
) -> None:
    page, blocked = offline_page
    response = page.goto("/redoc")
    assert response is not None
    assert response.status == 200
    heading = page.locator(".api-content h2", has_text="Report many events at once")
    heading.wait_for(timeout=20_000)
    assert page.locator(".api-content h2", has_text="One step record").count() == 1
    # ReDoc's footer logo is the one thing it fetches from outside; it hides it when that fails.
    assert [url for url in blocked if not url.endswith("/logo-mini.svg")] == []
