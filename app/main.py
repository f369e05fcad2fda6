"""Wiring: settings, the connection pool, error handlers and routes."""

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from alembic.config import Config
from alembic.script import ScriptDirectory
from fastapi import FastAPI

from app import docs, errors, observe, routes, schemas
from app.access import AccessControl, Tokens
from app.config import Settings, is_loopback
from app.db import DatabaseUnavailable, Pool
from app.observe import Observe
from app.steps import SchemaMissing

MIGRATIONS = Path(__file__).resolve().parent.parent / "migrations"


def alembic_config() -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    return config


def schema_head() -> str:
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None
    return head


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if settings.database_url is None:
            raise RuntimeError("DATABASE_URL is not set (`steprecord serve` sets it for you)")
        pool = Pool(
            settings.database_url.get_secret_value(),
            size=settings.pool_size,
            timeout=settings.db_timeout,
            prepare_threshold=settings.prepare_threshold,
            on_change=observe.pool_changed,
        )
        tokens = Tokens(
            pool,
            anonymous_without_tokens=settings.insecure_no_auth or is_loopback(settings.host),
            refresh=settings.token_refresh_seconds,
        )
        app.state.pool, app.state.tokens, app.state.schema_head = pool, tokens, schema_head()
        with contextlib.suppress(DatabaseUnavailable, SchemaMissing):
            await tokens.load()
        reloading = asyncio.create_task(tokens.keep_loading())
        try:
            yield
        finally:
            reloading.cancel()
            await pool.close()

    app = FastAPI(
        title="steprecord",
        version="0.1.0",
        description="One durable, database-guarded record per step of a process instance.",
        lifespan=lifespan,
        routes=routes.router.routes,
        docs_url=None,
        redoc_url=None,
    )
    docs.install(app)
    errors.install(app)
    app.add_middleware(AccessControl)
    app.add_middleware(Observe)
    observe.configure_logging()

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = schemas.with_security(
                schemas.problem_media_types(FastAPI.openapi(app))
            )
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app
