"""The schema revision the database is at, and the lock migrations take."""

import psycopg

from ..core.db import AsyncConn


async def schema_revision(conn: AsyncConn) -> str | None:
    """The alembic revision the database is at, or None when it was never migrated."""
    try:
        cur = await conn.execute("SELECT version_num FROM alembic_version")
    except psycopg.errors.UndefinedTable:
        return None
    row = await cur.fetchone()
    return None if row is None else str(row["version_num"])


# Taken first in the migration transaction and held until it ends, so instances that start
# together migrate one after the other and the later ones find the schema at head. A
# transaction-level lock also holds and ends correctly through PgBouncer in transaction mode,
# where a session-level one would stay on whichever server connection took it.
MIGRATION_LOCK = "SELECT pg_advisory_xact_lock(hashtext('steprecord'), hashtext('migrate'))"
