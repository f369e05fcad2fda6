"""Alembic environment: runs migrations on one connection from `app.core.db.sync_engine`."""

import sys

from alembic import context
from sqlalchemy import Connection

from app.core.config import Settings
from app.core.db import sync_engine
from app.core.tables import metadata
from app.data.revision import MIGRATION_LOCK
from app.data.roles import keep_grants
from app.main import COMPATIBLE_AHEAD
from app.ops.distribution import distribute, has_citus, reaching_workers

config = context.config


def upgrade_on(connection: Connection) -> None:
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
        target = context.get_revision_argument()
        if target == "head":
            target = context.script.get_current_head()
        at = f"at revision {current}" if current else "never migrated"
        with reaching_workers(f"migrate the database ({at}) to revision {target}"):
            context.run_migrations()
        # On Citus, distribute what is not distributed yet (app/ops/distribution.py); nothing
        # on one node. In the same transaction, under the same lock.
        with reaching_workers("distribute the schema on the Citus cluster"):
            distribute(connection)
        # A runtime role keeps the rights `steprecord grant` gave it (app/data/roles.py).
        with reaching_workers("grant the runtime roles the functions the migration made"):
            keep_grants(connection)


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        upgrade_on(connection)
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
            upgrade_on(conn)
    finally:
        engine.dispose()


if context.is_offline_mode():
    raise SystemExit("offline (--sql) migrations are not supported; review the versions/ files")
run_migrations_online()
