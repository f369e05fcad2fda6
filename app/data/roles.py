"""The runtime role: what a role the service runs as, other than the database's owner, is
granted (`steprecord grant ROLE`), and nothing more.

It reads every table of the schema and writes none of the records: the judge, the sweeper,
a repair and a deletion are calls of the functions that run with their owner's rights
(app/sql/owner_rights.sql). Of the tokens it may note the last use, nothing else: tokens
are made and revoked by the owner (`steprecord token`).

A migration keeps what was granted: a revision that drops and creates one of those functions
(its arguments changed) would leave the role unable to call it, so every migrate ends by
granting each role `steprecord grant` made the functions it may not call (`keep_grants`).
"""

from psycopg import sql
from sqlalchemy import Connection

from ..core.db import AsyncConn

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
    "steprecord_shard_judge",
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


# The roles `steprecord grant` made: those granted UPDATE on api_token.last_used_at, which
# nothing else grants.
GRANTED = """
SELECT DISTINCT a.grantee::regrole::text
FROM pg_attribute t, aclexplode(t.attacl) a
WHERE t.attrelid = to_regclass('api_token') AND t.attname = 'last_used_at'
  AND a.privilege_type = 'UPDATE' AND a.grantee <> 0
"""
# Of the functions in `CALL` that the schema's revision has, those the role may not call.
UNCALLABLE = """
SELECT f FROM unnest(%s::text[]) f
WHERE to_regproc(f) IS NOT NULL
  AND NOT has_function_privilege(%s::regrole, to_regproc(f)::oid, 'EXECUTE')
"""


def keep_grants(connection: Connection) -> None:
    """After a migration, in its transaction: each role `steprecord grant` made may call every
    function of `CALL` again. Nothing when none is missing, so a migrate at head changes
    nothing (on Citus it reaches no worker)."""
    run = connection.exec_driver_sql
    for (role,) in run(GRANTED).all():
        for (function,) in run(UNCALLABLE, (list(CALL), role)).all():
            run(f"GRANT EXECUTE ON FUNCTION {function} TO {role}")
