"""What several data modules share: the record's columns and the refusal of a write."""

import re
from typing import Any

import psycopg

from ..core.domain import ConstraintViolation
from ..core.record import columns
from ..core.tables import metadata

# The record's columns as the API shows them (the output as JSON text), from an alias `{r}`
# (a format string: `RECORD.format(r="r")`).
RECORD = columns("{r}")


def with_key(row: dict[str, Any], instance_key: str) -> dict[str, Any]:
    """A record row with its instance's key, as the API shows records."""
    row["instance_key"] = instance_key
    return row


def violation(exc: psycopg.errors.IntegrityError) -> ConstraintViolation:
    """The refused write, named by the constraint (or trigger) that refused it."""
    name = constraint_name(exc) or "unknown"
    unique = isinstance(exc, psycopg.errors.UniqueViolation)
    return ConstraintViolation(name, unique, exc.diag.message_primary or str(exc))


# On Citus a refusal raised on a worker reaches the coordinator's client with its SQLSTATE and
# message but without the constraint's name, and a constraint is the shard's copy, named
# `<name>_<shard id>` (also in the name a worker's own session reports, when the service
# calls the worker directly). The name is in PostgreSQL's own message
# (`... constraint "<name>"`), and in the guards' (app/sql/record_guard.sql,
# attempt_history.sql, repair_log.sql), which say it the same way.
# A name too long for its shard's suffix Citus shortens first: a prefix of it, then a hash
# (`<prefix>_<8 hex digits>_<shard id>`); the key is the schema's one that begins so.
_NAMED = re.compile(r'constraint "([^"]+)"')
_SHARD_SUFFIX = re.compile(r"^((?:pk|uq|fk|ck)_\w+?)_[0-9]+$")
_SHORTENED = re.compile(r"^((?:pk|uq|fk)_\w+)_[0-9a-f]{8}_[0-9]+$")
_KEYS = sorted(
    str(constraint.name)
    for table in metadata.tables.values()
    for constraint in table.constraints
    if isinstance(constraint.name, str) and constraint.name.startswith(("pk_", "uq_", "fk_"))
)


def constraint_name(exc: psycopg.Error) -> str | None:
    """The name of the constraint (or guard trigger) that refused a write, as on one node."""
    message = exc.diag.message_primary or ""
    named = _NAMED.search(message)
    name = exc.diag.constraint_name or (named[1] if named else None)
    if name:
        shortened = _SHORTENED.match(name)
        if shortened:
            key = next((key for key in _KEYS if key.startswith(shortened[1])), None)
            if key is not None:
                return key
        shard = _SHARD_SUFFIX.match(name)
        return shard[1] if shard else name
    return None
