"""Wiring: settings, the connection pool, error handlers and routes."""

import asyncio
import contextlib
import functools
import secrets
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import psycopg
from alembic.config import Config
from alembic.runtime.environment import EnvironmentContext
from alembic.script import ScriptDirectory
from fastapi import FastAPI
from psycopg.conninfo import make_conninfo
from sqlalchemy import Connection

from . import MIGRATIONS, __version__, gate, live
from .access.tokens import Tokens
from .api import docs, routes, spec
from .core import problems, shares, tracing
from .core.config import Settings
from .core.db import DatabaseUnavailable, Pool, sync_engine
from .core.domain import SchemaMissing
from .core.tables import metadata
from .dashboard import pages, rendering
from .data import migrating, placement  # noqa: F401 (registers the migrations' operations)
from .data.revision import MIGRATION_LOCK
from .data.roles import keep_grants
from .ops import observe, pruning, readiness, replica, server, sweeper
from .ops.distribution import distribute, drop_shard_judges, has_citus, reaching_workers
from .ops.nodes import Nodes
from .ops.observe import Observe


def alembic_config() -> Config:
    """Alembic's config for this code's migrations; it hands `migrations/env.py` the migration
    environment (`migration_environment`)."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.attributes["environment"] = migration_environment
    return config


def schema_head() -> str:
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None
    return head


# Revisions newer than this code's head that it is known to run against: a later release's
# migrations that only add what this code never reads or writes. During a rolling deploy the
# new release migrates ahead while this one still serves: /readyz stays 200 on them, and
# `migrate` leaves such a database as it is. Any other revision ahead is 503.
COMPATIBLE_AHEAD: frozenset[str] = frozenset()


def migration_environment(context: EnvironmentContext) -> None:
    """Alembic's environment (`migrations/env.py` calls it): runs the migrations on one
    connection from `sync_engine`, with the operations they use beyond alembic's own
    registered (`app/data/migrating.py`)."""
    if context.is_offline_mode():
        raise SystemExit("offline (--sql) migrations are not supported; review the versions/ files")
    config = context.config
    connection = config.attributes.get("connection")
    if connection is not None:
        _upgrade_on(context, connection)
        return
    url = config.attributes.get("database_url")
    if url is None:
        configured = Settings().database_url
        if configured is None:
            raise SystemExit("set DATABASE_URL, or run `steprecord migrate`")
        url = configured.get_secret_value()
    engine = sync_engine(url)
    try:
        with engine.connect() as conn:
            _upgrade_on(context, conn)
    finally:
        engine.dispose()


def _upgrade_on(context: EnvironmentContext, connection: Connection) -> None:
    context.configure(connection=connection, target_metadata=metadata)
    with context.begin_transaction():
        connection.exec_driver_sql(MIGRATION_LOCK)
        current = context.get_context().get_current_revision()
        if current in COMPATIBLE_AHEAD:
            print(
                f"the database is at {current}, ahead of this code and compatible with it:"
                " left as it is",
                file=sys.stderr,
            )
            return
        if has_citus(connection):
            # One connection per worker for the whole run: a migration that reads or writes
            # the distributed tables (a downgrade's guard counts what it would lose) and then
            # drops or creates a distributed function is refused otherwise.
            connection.exec_driver_sql("SET LOCAL citus.multi_shard_modify_mode = 'sequential'")
        # On Citus a migration (and distribution) changes the workers too: one that cannot be
        # reached stops it with words that name it (`WorkerUnreachable`), nothing changed.
        try:
            target = context.get_revision_argument()
        except KeyError:  # `alembic current` and the like name no revision: they only read
            context.run_migrations()
            return
        if target == "head":
            target = context.script.get_current_head()
        at = f"at revision {current}" if current else "never migrated"
        if current != target:  # the judge's copies on the shards' nodes go first
            drop_shard_judges(connection)
        with reaching_workers(f"migrate the database ({at}) to revision {target}"):
            context.run_migrations()
        # On Citus, distribute what is not distributed yet (app/ops/distribution.py); nothing
        # on one node. In the same transaction, under the same lock.
        with reaching_workers("distribute the schema on the Citus cluster"):
            distribute(connection)
        # A runtime role keeps the rights `steprecord grant` gave it (app/data/roles.py).
        with reaching_workers("grant the runtime roles the functions the migration made"):
            keep_grants(connection)


def known_revisions() -> frozenset[str]:
    """Every revision in this code's migrations (those it could upgrade from)."""
    script = ScriptDirectory.from_config(alembic_config())
    return frozenset(revision.revision for revision in script.walk_revisions())


async def _nodes(
    settings: Settings, primary: Pool, make_pool: Callable[[str, str], Pool]
) -> Nodes | None:
    """On Citus (unless `STEPRECORD_CITUS_DIRECT=false`), where each instance lives; None otherwise,
    or when the database cannot be asked now (every call goes to the primary)."""
    if not settings.citus_direct:
        return None
    try:
        async with primary.connection(name="has_citus") as conn:
            if not await placement.has_citus(conn):
                return None
        nodes = Nodes(primary, make_pool, settings.shard_map_seconds)
        await nodes.load()
    except (DatabaseUnavailable, psycopg.errors.UndefinedFunction, psycopg.errors.UndefinedTable):
        return None
    return nodes


async def _schema_pool(primary: Pool, url: str, make_pool: Callable[[str, str], Pool]) -> Pool:
    """The pool of the node holding the schema's own tables (its revision, the tokens): the
    primary's, or the Citus coordinator's when the primary is a worker (`serve` pointed at a
    worker judges and reads there)."""
    try:
        async with primary.connection(name="coordinator") as conn:
            found = await placement.coordinator(conn)
    except DatabaseUnavailable:
        return primary
    if found is None:
        return primary
    host, port = found
    schema = make_pool(make_conninfo(url, host=host, port=port), "coordinator")
    schema.unreachable = (
        "the Citus coordinator, which holds the access tokens and the schema's revision,"
        " cannot be reached"
    )
    return schema


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if settings.database_url is None:
            raise RuntimeError("DATABASE_URL is not set (`steprecord serve` sets it for you)")
        primary_url = settings.database_url.get_secret_value()
        # A page rendered in a thread (app/dashboard/rendering.py) gives the event loop the
        # interpreter back within a millisecond, not Python's default 5: each request the loop
        # serves meanwhile waits for it several times (accepting, reading, each query, answering).
        sys.setswitchinterval(rendering.SWITCH_SECONDS)
        # Tracing on: this worker exports its spans from now until it stops (app/core/tracing.py).
        tracer = None if provider is None else tracing.start(provider)

        share = settings.pool_share_per_token or shares.default_share(settings.pool_size)
        reserve = settings.pool_reserve
        if reserve is None:
            reserve = shares.default_reserve(settings.pool_size)

        def pool(conninfo: str, name: str) -> Pool:
            return Pool(
                conninfo,
                size=settings.pool_size,
                timeout=settings.db_timeout,
                statement_timeout=settings.statement_timeout,
                prepare_threshold=settings.prepare_threshold,
                on_change=functools.partial(observe.pool_changed, name),
                tracer=tracer,
                share=share,
                tenant_share=settings.pool_share_per_tenant or share,
                reserve=reserve,
                configure=placement.configure,
            )

        primary = pool(primary_url, "primary")
        read_url = settings.read_database_url
        reads = replica.ReadPool(
            primary, None if read_url is None else pool(read_url.get_secret_value(), "replica")
        )
        schema = await _schema_pool(primary, primary_url, pool)
        tokens = Tokens(
            schema,
            insecure_no_auth=settings.insecure_no_auth,
            refresh=settings.token_refresh_seconds,
        )
        app.state.pool, app.state.tokens, app.state.schema_head = primary, tokens, schema_head()
        app.state.readiness = readiness.Readiness(schema)  # one check per second for /readyz
        # Every read path takes its connection here: `await app.state.read_pool.run(work)`.
        app.state.read_pool = reads
        app.state.hub, app.state.stream_heartbeat = live.Hub(), settings.stream_heartbeat_seconds
        app.state.stream_max_seconds = settings.stream_max_seconds
        app.state.streams_per_token = settings.streams_per_token
        tokens.on_change = app.state.hub.access_changed  # revoked tokens' streams end
        app.state.schema_known = known_revisions()
        app.state.schema_accepted = frozenset({app.state.schema_head, *COMPATIBLE_AHEAD})
        with contextlib.suppress(DatabaseUnavailable, SchemaMissing):
            await tokens.load()
        app.state.nodes = await _nodes(settings, primary, pool)
        listen_url = settings.listen_url or settings.database_url
        tasks = [
            asyncio.create_task(tokens.keep_loading()),
            asyncio.create_task(
                live.keep_listening(
                    listen_url.get_secret_value(), app.state.hub, positions=read_url is not None
                )
            ),
        ]
        if app.state.nodes is not None:
            tasks.append(asyncio.create_task(app.state.nodes.keep_loading()))
        if settings.sweep_seconds > 0:
            tasks.append(
                asyncio.create_task(sweeper.keep_sweeping(primary, settings.sweep_seconds))
            )
        if settings.retention is not None:
            # At the sweeper's cadence (its default, when the sweeper is off).
            every = settings.sweep_seconds or Settings.model_fields["sweep_seconds"].default
            keep = pruning.keep_pruning(primary, every, settings.retention)
            tasks.append(asyncio.create_task(keep))
        if read_url is not None:
            check = replica.keep_checking(
                reads,
                primary_url,
                read_url.get_secret_value(),
                max_lag=settings.read_max_lag_seconds,
                answer_within=settings.db_timeout,
            )
            tasks.append(asyncio.create_task(check))
        try:
            with live.closed_on_exit_signal(app.state.hub):
                yield
        finally:
            app.state.hub.close()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await reads.close()
            if app.state.nodes is not None:
                await app.state.nodes.close()
            await primary.close()
            if schema is not primary:
                await schema.close()
            if provider is not None:
                await tracing.stop(provider)

    app = FastAPI(
        title="steprecord",
        version=__version__,
        description="One durable, database-guarded record per step of a process instance.",
        lifespan=lifespan,
        routes=routes.ROUTES,
        docs_url=None,
        redoc_url=None,
        # A trailing slash answers 307 with a problem naming the right URL (app/core/problems.py).
        redirect_slashes=False,
    )
    docs.install(app)
    pages.install(app)
    app.state.trace_url = settings.trace_url  # the dashboard's links to traces
    app.state.long_running_after = settings.long_running_after
    # The dashboard's sessions: signed with the configured secret, or one of this process.
    secret = settings.session_secret
    app.state.session_secret = (
        secrets.token_bytes(32) if secret is None else secret.get_secret_value().encode()
    )
    app.state.session_seconds = settings.session_seconds
    problems.install(app)
    # Streams opening at once wait their turn, per token: inside the access check, so a
    # request without a valid token never waits there, and one token delays only its own.
    app.add_middleware(live.Openings)
    app.add_middleware(gate.AccessControl)
    app.add_middleware(pages.DashboardHeaders)  # outside the access check: its 401 page too
    app.add_middleware(Observe)
    # An answer before the body was read ends its connection (app/ops/server.py), whoever answers.
    app.add_middleware(server.CloseAfterEarlyAnswer)
    # Server spans, outside every other middleware, only when tracing is on.
    app.state.tracing = provider = tracing.instrument(app)
    observe.configure_logging()

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = spec.with_security(
                spec.problem_media_types(spec.hoist_defs(FastAPI.openapi(app)))
            )
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app
