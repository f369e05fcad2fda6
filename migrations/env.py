"""Alembic environment: runs migrations on one connection from `app.db.sync_engine`."""

from alembic import context

from app.config import Settings
from app.db import sync_engine
from app.models import metadata

config = context.config


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        context.configure(connection=connection, target_metadata=metadata)
        with context.begin_transaction():
            context.run_migrations()
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
            context.configure(connection=conn, target_metadata=metadata)
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    raise SystemExit("offline (--sql) migrations are not supported; review the versions/ files")
run_migrations_online()
