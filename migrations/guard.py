"""Migrations that would change who reaches what, or lose data, refuse and say why.

A downgrade that would widen access (anonymous access back, or a tenant's token reaching
every instance) or drop what was recorded (records, history, trace ids) first asks the
database what it would lose. When that is nothing, it proceeds; otherwise it refuses,
naming what would be lost, and the whole run changes nothing (the migrations of one run share
one transaction). Forced, it proceeds and says on stderr what it dropped.

Forcing: `-x force=true` on alembic's command line, or `config.attributes["force"] = True`
when running alembic's `command.downgrade` from Python.
"""

import sys

from alembic import context, op


class MigrationRefused(Exception):
    """A migration stopped before changing anything; the message says why and what to do."""


def forced() -> bool:
    if context.config.attributes.get("force") is True:
        return True
    return str(context.get_x_argument(as_dictionary=True).get("force", "")).lower() == "true"


def found(sql: str) -> str | None:
    """What `sql` (one row, one text column, NULL when nothing) finds in the database."""
    value = op.get_bind().exec_driver_sql(sql).scalar()
    return None if value is None else str(value)


def refuse_losing(revision: str, loss: str | None) -> None:
    """Refuse the downgrade of `revision` when it would lose `loss`, unless forced."""
    if loss is None:
        return
    if forced():
        print(f"downgrade of {revision}, forced: {loss}", file=sys.stderr)
        return
    raise MigrationRefused(
        f"downgrade of {revision} refused: {loss}. Nothing was changed. To accept that loss,"
        " downgrade again with `-x force=true` (alembic's command line) or"
        ' config.attributes["force"] = True (Python)'
    )
