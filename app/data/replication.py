"""WAL positions of a primary and a standby: how far a read replica lags."""

from typing import Any

from ..core.db import AsyncConn


async def wal_position(conn: AsyncConn) -> int:
    """The primary's current WAL write position, in bytes: every commit acknowledged so far
    ends at or before it."""
    cur = await conn.execute("SELECT (pg_current_wal_lsn() - '0/0')::bigint AS lsn")
    row = await cur.fetchone()
    assert row is not None
    return int(row["lsn"])


async def replay_position(conn: AsyncConn) -> int | None:
    """How far a standby has replayed the primary's WAL, in bytes; None on a primary (also on
    a promoted one, where the last replayed position stands still)."""
    cur = await conn.execute(
        "SELECT CASE WHEN pg_is_in_recovery()"
        " THEN (pg_last_wal_replay_lsn() - '0/0')::bigint END AS replayed"
    )
    row = await cur.fetchone()
    assert row is not None
    return None if row["replayed"] is None else int(row["replayed"])


async def replay_state(conn: AsyncConn) -> dict[str, Any]:
    """A standby's replay: `in_recovery`, `replayed` (the WAL position replayed, in bytes),
    `caught_up` (it has replayed all it received) and `behind_seconds` (the age of the last
    replayed commit, on the standby's clock)."""
    cur = await conn.execute(
        "SELECT pg_is_in_recovery() AS in_recovery,"
        " (pg_last_wal_replay_lsn() - '0/0')::bigint AS replayed,"
        " pg_last_wal_replay_lsn() >= pg_last_wal_receive_lsn() AS caught_up,"
        " extract(epoch FROM now() - pg_last_xact_replay_timestamp())::float8"
        " AS behind_seconds"
    )
    row = await cur.fetchone()
    assert row is not None
    return row
