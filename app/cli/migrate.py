"""`steprecord migrate`: upgrade the database to the migration head; and the database every
one-off command works on (the configured one, else the embedded one), with the refusal of a
command run on a schema that is not at head."""

import sys
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
from alembic import command
from sqlalchemy.exc import DBAPIError

from .. import main as wiring
from ..core.config import Settings
from ..core.db import AsyncConn
from ..data import revision
from ..main import alembic_config, known_revisions, schema_head
from ..ops.embedded import EmbeddedPostgres


def migrate(database_url: str) -> None:
    """Upgrade the database at `database_url` to the migration head."""
    config = alembic_config()
    config.attributes["database_url"] = database_url
    try:
        command.upgrade(config, "head")
    except DBAPIError as exc:
        if isinstance(exc.orig, psycopg.errors.InsufficientPrivilege):
            raise NotOwner(
                f"this role may not change the schema ({exc.orig.diag.message_primary}): the"
                " schema is not at this release's head, and only the database's owner"
                " migrates it. Run `steprecord migrate` with DATABASE_URL naming the owner,"
                " then start again"
            ) from exc
        raise


class NotOwner(Exception):
    """A migration needed a right of the database's owner that the role lacks (a runtime
    role, `steprecord grant`): the text says what to do."""


@contextmanager
def database(settings: Settings, *, notice: bool = False) -> Iterator[str]:
    """The configured database URL, or an embedded PostgreSQL started for the duration (with
    `notice`, saying where its data lives: `serve` does, the one-off commands do not)."""
    if settings.database_url is not None:
        yield settings.database_url.get_secret_value()
        return
    embedded = EmbeddedPostgres(settings.data_dir)
    if notice:
        print(embedded.notice(), file=sys.stderr)
    with embedded:
        yield embedded.url


async def schema_refusal(conn: AsyncConn, command: str) -> str | None:
    """Why `command` must not run on this database's schema (None: it may).

    Only `migrate` and `serve` change the schema: any other command on a database behind
    this release (or never migrated) stops, rather than upgrade a production database unasked.
    A revision ahead that this release is declared compatible with is accepted, as `serve`
    accepts it; one it does not know is refused, as `serve` would fail on it."""
    current = await revision.schema_revision(conn)
    head = schema_head()
    if current == head or current in wiring.COMPATIBLE_AHEAD:
        return None
    changes = f"`steprecord {command}` never changes the schema"
    if current is None:
        return (
            f"the database has no schema yet; this release needs revision {head}:"
            f" run steprecord migrate first ({changes})"
        )
    if current in known_revisions():
        return (
            f"the database's schema is at revision {current}, behind this release's {head}:"
            f" run steprecord migrate first ({changes})"
        )
    return (
        f"the database's schema is at revision {current}, which this release does not know"
        f" (its newest is {head}): use the steprecord release that migrated it"
    )
