"""What several data modules share: the record's columns and the refusal of a write."""

from typing import Any

import psycopg

from app.domain import ConstraintViolation
from app.record import columns

# The record's columns as the API shows them (the output as JSON text), from an alias `{r}`
# (a format string: `RECORD.format(r="r")`).
RECORD = columns("{r}")


def with_key(row: dict[str, Any], instance_key: str) -> dict[str, Any]:
    """A record row with its instance's key, as the API shows records."""
    row["instance_key"] = instance_key
    return row


def violation(exc: psycopg.errors.IntegrityError) -> ConstraintViolation:
    """The refused write, named by the constraint (or trigger) that refused it."""
    name = exc.diag.constraint_name or "unknown"
    unique = isinstance(exc, psycopg.errors.UniqueViolation)
    return ConstraintViolation(name, unique, exc.diag.message_primary or str(exc))
