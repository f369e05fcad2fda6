"""The runtime role: what a role the service runs as, other than the database's owner, is
granted (`steprecord grant ROLE`), and nothing more.

It reads every table of the schema and writes none of the records: the judge, the sweeper,
a repair and a deletion are calls of the functions that run with their owner's rights
(app/sql/owner_rights.sql). Of the tokens it may note the last use, nothing else: tokens
are made and revoked by the owner (`steprecord token`).
"""

from psycopg import sql

from app.db import AsyncConn

# Every table the service reads.
READ = (
    "process_instance",
    "workflow_step_record",
    "workflow_step_attempt",
    "workflow_step_repair",
    "api_token",
    "access_policy",
    "alembic_version",
)
# The functions that write (SECURITY DEFINER, revoked from PUBLIC by their files).
CALL = (
    "steprecord_apply_event",
    "steprecord_apply_events",
    "steprecord_heartbeat",
    "steprecord_reopen",
    "steprecord_sweep_instance",
    "steprecord_delete_instance",
    "steprecord_prune_lock",
    "steprecord_prune_due",
    "steprecord_prune_delete",
    "steprecord_patch_labels",
)


def grants(role: str) -> list[sql.Composed]:
    """The statements that give `role` what the service needs (each idempotent)."""
    to = sql.Identifier(role)
    return [
        sql.SQL("GRANT USAGE ON SCHEMA public TO {}").format(to),
        sql.SQL("GRANT SELECT ON {} TO {}").format(
            sql.SQL(", ").join(map(sql.Identifier, READ)), to
        ),
        sql.SQL("GRANT UPDATE (last_used_at) ON api_token TO {}").format(to),
        sql.SQL("GRANT EXECUTE ON FUNCTION {} TO {}").format(
            sql.SQL(", ").join(map(sql.Identifier, CALL)), to
        ),
    ]


async def grant(conn: AsyncConn, role: str) -> None:
    """Give `role` the runtime role's rights, in one transaction."""
    async with conn.transaction():
        for statement in grants(role):
            await conn.execute(statement)
