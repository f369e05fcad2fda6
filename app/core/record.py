"""The record's shape, written once: each field, in the API's order, with its SQL type and
its type in the OpenAPI document. Everything else follows from `FIELDS`:

- the columns the data modules select (`columns`, in `app.data.common.RECORD`);
- the JSON keys the service renders, in order, and those a summary leaves out
  (`app.core.serialize`);
- the OpenAPI response model (`app.api.spec.Record`);
- the record's columns in the `RETURNS TABLE` of each database function that answers records
  (`app/sql/`), which a test compares with `FIELDS`.
"""

from dataclasses import dataclass
from typing import Any

from pydantic import JsonValue


@dataclass(frozen=True)
class Field:
    key: str  # the JSON key, and the column's name in every answer of the database
    sql: str  # the column's type as a function's RETURNS TABLE declares it
    python: Any  # the field's type in the OpenAPI response model
    summary: bool = True  # False: a summary (`fields=summary`) leaves it out
    stored: str | None = "{r}.{key}"  # the column from the record's alias {r}; None: not stored
    description: str | None = None  # the field's description in the OpenAPI document


FIELDS = (
    Field("id", "bigint", int),
    # The instance's key is the instance's, not a column of the record.
    Field("instance_key", "text", str, stored=None),
    Field("step_slug", "text", str),
    Field("ordinal", "integer", int),
    Field("status", "text", str),
    Field("attempt_count", "integer", int),
    # Stored as jsonb, answered as its text: the service embeds it without parsing it.
    Field("output", "text", JsonValue, summary=False, stored="{r}.output::text AS output"),
    Field("external_output_url", "text", str | None),
    Field("started_at", "timestamptz", str | None),
    Field("completed_at", "timestamptz", str | None),
    Field("lease_expires_at", "timestamptz", str | None),
    Field("error_code", "text", str | None),
    Field("error_message", "text", str | None, summary=False),
    Field("created_at", "timestamptz", str),
    Field("updated_at", "timestamptz", str),
    Field(
        "updated_by",
        "text",
        str | None,
        description="Who last wrote the record: the name of the token whose request did,"
        " `anonymous` without tokens, `sweeper` for a lease the sweeper closed; null when it"
        " was last written before steprecord kept writers",
    ),
)

# The JSON keys of a record, in the API's order.
KEYS = tuple(field.key for field in FIELDS)
# The keys a summary leaves out (the large ones); the response model lets them be absent.
NOT_IN_SUMMARY = tuple(field.key for field in FIELDS if not field.summary)


def columns(alias: str) -> str:
    """The record's stored columns as the API shows them, from the alias `alias`."""
    return ", ".join(
        field.stored.format(r=alias, key=field.key) for field in FIELDS if field.stored
    )
