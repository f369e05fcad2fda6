"""The operations a migration uses beyond alembic's own: `op.run_script`, `op.found`,
`op.refuse_losing` and `op.refuse`, registered on alembic's `op` (alembic's operation plugins).

The revisions (`migrations/versions/`) are loaded by alembic by file path, not as modules of a
package, and the service's package is `app` in a clone and `steprecord` installed: a revision
can name no module of either. It reaches these through `op`, registered here, which the
migration environment (`app.main.migration_environment`) imports before any revision runs.

`op.run_script(text)` runs a migration's SQL text (a frozen `.sql` file, or a script of its
own) one statement at a time. PostgreSQL runs a text of several statements sent at once, but on
Citus the coordinator forwards some of them to the workers as the whole text it received, which
a worker refuses ("cannot insert multiple commands into a prepared statement"): a migration of a
distributed database fails. Sent one by one, each statement reaches the workers alone; on one
node the result is the same, in the same transaction.

Migrations that would change who reaches what, or lose data, refuse and say why. A downgrade
that would widen access (anonymous access back, or a tenant's token reaching every instance) or
drop what was recorded (records, history, trace ids) first asks the database what it would lose
(`op.found`). When that is nothing, it proceeds; otherwise it refuses (`op.refuse_losing`),
naming what would be lost, and the whole run changes nothing (the migrations of one run share
one transaction). Forced, it proceeds and says on stderr what it dropped.

Forcing: `-x force=true` on alembic's command line, or `config.attributes["force"] = True`
when running alembic's `command.downgrade` from Python.
"""

import sys
from typing import Any, NoReturn

from alembic import context
from alembic.operations import MigrateOperation, Operations

_DOLLAR_TAG_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")


def statements(script: str) -> list[str]:
    """The statements of `script`, each without its `;`; pieces holding only comments and
    blanks are left out. A `;` inside a string, a quoted name, a comment or a dollar-quoted
    body (a function's) ends nothing."""
    found: list[str] = []
    start, index, code = 0, 0, False  # code: the piece holds more than comments and blanks
    while index < len(script):
        char, pair = script[index], script[index : index + 2]
        if pair == "--":
            end = script.find("\n", index)
            index = len(script) if end < 0 else end + 1
            continue
        if pair == "/*":
            index = _block_comment_end(script, index)
            continue
        code = code or not char.isspace()
        if char in "'\"":
            index = _quoted_end(script, index, char)
        elif char == "$" and (tag := _dollar_tag(script, index)) is not None:
            end = script.find(tag, index + len(tag))
            index = len(script) if end < 0 else end + len(tag)
        elif char == ";":
            if code:
                found.append(script[start:index].strip())
            start, index, code = index + 1, index + 1, False
        else:
            index += 1
    if code:
        found.append(script[start:].strip())
    return found


def _block_comment_end(script: str, index: int) -> int:
    """The index just past the (possibly nested) block comment opening at `index`."""
    depth = 0
    while index < len(script):
        pair = script[index : index + 2]
        if pair in ("/*", "*/"):
            depth += 1 if pair == "/*" else -1
            index += 2
            if depth == 0:
                return index
        else:
            index += 1
    return index


def _quoted_end(script: str, index: int, quote: str) -> int:
    """The index just past the string or name quoted by `quote` opening at `index` (a doubled
    quote inside it is the quote itself)."""
    index += 1
    while index < len(script):
        if script[index] == quote:
            if script[index + 1 : index + 2] != quote:
                return index + 1
            index += 1
        index += 1
    return index


def _dollar_tag(script: str, index: int) -> str | None:
    """The dollar quote (`$$`, `$fn$`) opening at `index`, or None where `$` opens none (a
    parameter such as `$1`, or a `$` inside a name)."""
    if index > 0 and script[index - 1] in _DOLLAR_TAG_CHARS:
        return None
    end = index + 1
    while end < len(script) and script[end] in _DOLLAR_TAG_CHARS:
        end += 1
    tag = script[index + 1 : end]
    if end == len(script) or script[end] != "$" or tag[:1].isdigit():
        return None
    return script[index : end + 1]


class MigrationRefused(Exception):
    """A migration stopped before changing anything; the message says why and what to do."""


def forced() -> bool:
    if context.config.attributes.get("force") is True:
        return True
    return str(context.get_x_argument(as_dictionary=True).get("force", "")).lower() == "true"


@Operations.register_operation("run_script")
class RunScript(MigrateOperation):
    """`op.run_script(text)`: execute `text` in the migration's transaction, statement by
    statement."""

    def __init__(self, script: str) -> None:
        self.script = script

    @classmethod
    def run_script(cls, operations: Operations, script: str) -> Any:
        return operations.invoke(cls(script))


@Operations.implementation_for(RunScript)
def _run_script(operations: Operations, operation: RunScript) -> None:
    for statement in statements(operation.script):
        operations.execute(statement)


@Operations.register_operation("found")
class Found(MigrateOperation):
    """`op.found(sql)`: what `sql` (one row, one text column, NULL when nothing) finds in the
    database."""

    def __init__(self, sql: str) -> None:
        self.sql = sql

    @classmethod
    def found(cls, operations: Operations, sql: str) -> Any:
        return operations.invoke(cls(sql))


@Operations.implementation_for(Found)
def _found(operations: Operations, operation: Found) -> str | None:
    value = operations.get_bind().exec_driver_sql(operation.sql).scalar()
    return None if value is None else str(value)


@Operations.register_operation("refuse_losing")
class RefuseLosing(MigrateOperation):
    """`op.refuse_losing(revision, loss)`: refuse the downgrade of `revision` when it would lose
    `loss`, unless forced."""

    def __init__(self, revision: str, loss: str | None) -> None:
        self.revision = revision
        self.loss = loss

    @classmethod
    def refuse_losing(cls, operations: Operations, revision: str, loss: str | None) -> Any:
        return operations.invoke(cls(revision, loss))


@Operations.implementation_for(RefuseLosing)
def _refuse_losing(operations: Operations, operation: RefuseLosing) -> None:
    revision, loss = operation.revision, operation.loss
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


@Operations.register_operation("refuse")
class Refuse(MigrateOperation):
    """`op.refuse(message)`: stop the migration, nothing changed, saying `message`
    (`MigrationRefused`)."""

    def __init__(self, message: str) -> None:
        self.message = message

    @classmethod
    def refuse(cls, operations: Operations, message: str) -> Any:
        return operations.invoke(cls(message))


@Operations.implementation_for(Refuse)
def _refuse(operations: Operations, operation: Refuse) -> NoReturn:
    raise MigrationRefused(operation.message)
