"""The schema: the owner and the fact, with every invariant as a named constraint.

The database functions and triggers (the judge, transitions, history, live-update
notifications) live in `app/sql/` (SQLAlchemy has no model for them); everything else here is
compared against the migrations by a test. The limits these constraints enforce, which the API
checks first, are in `app.core.limits`.
"""

import secrets
from datetime import datetime
from pathlib import Path

from sqlalchemy import (
    DDL,
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    Connection,
    DateTime,
    ForeignKey,
    ForeignKeyConstraint,
    Identity,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    PrimaryKeyConstraint,
    Text,
    UniqueConstraint,
    event,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.dialects.postgresql.base import ischema_names
from sqlalchemy.types import UserDefinedType
from sqlmodel import Field, SQLModel

from .limits import (
    KEY_PATTERN,
    LABEL_KEY_PATTERN,
    MAX_INT4,
    MAX_LABEL_VALUE_CHARS,
    MAX_LABELS,
    MAX_MESSAGE_BYTES,
    MAX_OUTPUT_BYTES,
    MAX_URL_CHARS,
    NAME_PATTERN,
    PREFIX_DELIMITED_PATTERN,
    PREFIX_PATTERN,
    URL_PATTERN,
)

# Must be assigned before any table is defined: the convention is applied at definition time.
SQLModel.metadata.naming_convention = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}
metadata: MetaData = SQLModel.metadata

STATUSES = ("pending", "running", "completed", "failed")
ATTEMPT_STATUSES = ("running", "completed", "failed", "superseded")
LEASED = "status = 'running' AND lease_expires_at IS NOT NULL"
# An instance's labels: a JSON object of at most MAX_LABELS string values, its keys and values
# in their formats. jsonpath, as a CHECK takes no subquery; `silent` (the last `true`) makes
# a path over something other than an object answer NULL, which `labels_object` refuses.
LABEL_CHECKS = {
    "labels_object": "jsonb_typeof(labels) = 'object'",
    "labels_count": f"jsonb_array_length(jsonb_path_query_array(labels, '$.*')) <= {MAX_LABELS}",
    "labels_key_format": "NOT jsonb_path_exists(labels, 'strict $.keyvalue() ?"
    f' (!(@.key like_regex "{LABEL_KEY_PATTERN}"))'
    "', '{}', true)",
    "labels_value_format": "NOT jsonb_path_exists(labels, 'strict $.* ?"
    f' (@.type() != "string" || !(@ like_regex "^.{{0,{MAX_LABEL_VALUE_CHARS}}}$" flag "s"))'
    "', '{}', true)",
}


class XID8(UserDefinedType[str]):
    """PostgreSQL's 64-bit transaction id (`xid8`), which SQLAlchemy does not know."""

    cache_ok = True

    def get_col_spec(self, **kw: object) -> str:
        return "XID8"


ischema_names["xid8"] = XID8  # so that reflecting the database finds the same type


def _outcome_checks() -> list[CheckConstraint]:
    """The rules on what an attempt produced, shared by the record and its history (fresh
    objects each time: a constraint belongs to one table)."""
    return [
        CheckConstraint(
            "output IS NULL OR external_output_url IS NULL", name="output_inline_xor_external"
        ),
        CheckConstraint(f"octet_length(output::text) <= {MAX_OUTPUT_BYTES}", name="output_size"),
        CheckConstraint(
            f"external_output_url ~ '{URL_PATTERN}'"
            f" AND char_length(external_output_url) <= {MAX_URL_CHARS}",
            name="external_output_url_format",
        ),
        CheckConstraint(f"error_code ~ '{NAME_PATTERN}'", name="error_code_format"),
        CheckConstraint(
            f"octet_length(error_message) <= {MAX_MESSAGE_BYTES}", name="error_message_size"
        ),
        CheckConstraint("started_at <= completed_at", name="timing"),
    ]


def _now() -> Column[datetime]:
    return Column(DateTime(timezone=True), nullable=False, server_default=text("now()"))


class ProcessInstance(SQLModel, table=True):
    __tablename__ = "process_instance"
    __table_args__ = (
        UniqueConstraint("instance_key"),
        # The id is its key's (app/sql/instance_id.sql): two keys never share an instance.
        CheckConstraint("id = steprecord_instance_id(instance_key)", name="id_derived"),
        CheckConstraint(f"instance_key ~ '{KEY_PATTERN}'", name="instance_key_format"),
        CheckConstraint("next_ordinal >= 0", name="next_ordinal_nonnegative"),
        *(CheckConstraint(check, name=name) for name, check in LABEL_CHECKS.items()),
        Index(None, "created_at", "id"),
        # The label filter (`labels @> '{"env": "prod"}'`) reads it.
        Index(
            "ix_process_instance_labels",
            "labels",
            postgresql_using="gin",
            postgresql_ops={"labels": "jsonb_path_ops"},
        ),
        Index(
            "ix_process_instance_instance_key_prefix",
            "instance_key",
            postgresql_ops={"instance_key": "text_pattern_ops"},
        ),
    )

    # steprecord_instance_id(instance_key), given by whoever inserts the row.
    id: int = Field(sa_column=Column(BigInteger, primary_key=True, autoincrement=False))
    instance_key: str = Field(sa_column=Column(Text, nullable=False))
    # The next server-assigned ordinal; its row lock serialises the creation of new steps.
    next_ordinal: int = Field(
        default=0, sa_column=Column(BigInteger, nullable=False, server_default=text("0"))
    )
    created_at: datetime = Field(sa_column=_now())
    # Its labels (string keys and values), merged by events and PATCH.
    labels: dict[str, str] = Field(
        default_factory=dict,
        sa_column=Column(JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    )


class WorkflowStepRecord(SQLModel, table=True):
    __tablename__ = "workflow_step_record"
    __table_args__ = (
        # Every key includes the instance (the distribution column on Citus).
        PrimaryKeyConstraint("instance_id", "id"),
        UniqueConstraint("instance_id", "step_slug"),
        UniqueConstraint("instance_id", "ordinal"),
        Index(None, "instance_id", "started_at", "id"),
        Index(None, "status", "updated_at", "id"),
        Index(None, "instance_id", "changed_xid", "id"),
        Index(
            "ix_workflow_step_record_leased_updated_at_id",
            "updated_at",
            "id",
            postgresql_where=text(LEASED),
        ),
        Index(
            "ix_workflow_step_record_running_failed",
            "instance_id",
            "status",
            postgresql_where=text("status IN ('running', 'failed')"),
        ),
        Index(
            "ix_workflow_step_record_running_started_at_id",
            "started_at",
            "id",
            postgresql_where=text("status = 'running'"),
        ),
        CheckConstraint(f"step_slug ~ '{NAME_PATTERN}'", name="step_slug_format"),
        CheckConstraint(f"ordinal BETWEEN 0 AND {MAX_INT4}", name="ordinal_range"),
        CheckConstraint(
            "status IN (" + ", ".join(f"'{s}'" for s in STATUSES) + ")", name="status_known"
        ),
        CheckConstraint("attempt_count >= 1", name="attempt_count_positive"),
        *_outcome_checks(),
        CheckConstraint(
            "status <> 'pending' OR (started_at IS NULL AND completed_at IS NULL"
            " AND output IS NULL AND external_output_url IS NULL"
            " AND error_code IS NULL AND error_message IS NULL)",
            name="pending_content",
        ),
        CheckConstraint(
            "status <> 'running' OR (started_at IS NOT NULL AND completed_at IS NULL"
            " AND output IS NULL AND external_output_url IS NULL"
            " AND error_code IS NULL AND error_message IS NULL)",
            name="running_content",
        ),
        CheckConstraint(
            "status <> 'completed' OR (started_at IS NOT NULL AND completed_at IS NOT NULL"
            " AND error_code IS NULL AND error_message IS NULL)",
            name="completed_content",
        ),
        CheckConstraint(
            "status <> 'failed' OR (started_at IS NOT NULL AND completed_at IS NOT NULL"
            " AND error_code IS NOT NULL AND output IS NULL AND external_output_url IS NULL)",
            name="failed_content",
        ),
        CheckConstraint(
            "lease_expires_at IS NULL OR status = 'running'", name="lease_only_running"
        ),
        # A token's name, `anonymous` or `sweeper` (all of the names' alphabet).
        CheckConstraint(f"updated_by ~ '{NAME_PATTERN}'", name="updated_by_format"),
    )

    id: int | None = Field(
        default=None, sa_column=Column(BigInteger, Identity(always=True), nullable=False)
    )
    instance_id: int = Field(
        sa_column=Column(BigInteger, ForeignKey("process_instance.id"), nullable=False)
    )
    step_slug: str = Field(sa_column=Column(Text, nullable=False))
    ordinal: int = Field(sa_column=Column(Integer, nullable=False))
    status: str = Field(sa_column=Column(Text, nullable=False))
    attempt_count: int = Field(sa_column=Column(Integer, nullable=False))
    output: object | None = Field(default=None, sa_column=Column(JSONB, nullable=True))
    external_output_url: str | None = Field(default=None, sa_column=Column(Text, nullable=True))
    started_at: datetime | None = Field(
        default=None, sa_column=Column(DateTime(timezone=True), nullable=True)
    )
    completed_at: datetime | None = Field(
        default=None, sa_column=Column(DateTime(timezone=True), nullable=True)
    )
    error_code: str | None = Field(default=None, sa_column=Column(Text, nullable=True))
    error_message: str | None = Field(default=None, sa_column=Column(Text, nullable=True))
    created_at: datetime = Field(sa_column=_now())
    updated_at: datetime = Field(sa_column=_now())
    # Set while a running attempt holds a lease; the sweeper fails it once expired.
    lease_expires_at: datetime | None = Field(
        default=None, sa_column=Column(DateTime(timezone=True), nullable=True)
    )
    # Who last wrote the record: the name of the token whose request did (`anonymous`
    # without tokens, `sweeper` for a swept lease); NULL for a record last written before
    # steprecord kept writers (revision 0025), or by a call of the judge that named none.
    updated_by: str | None = Field(default=None, sa_column=Column(Text, nullable=True))
    # The transaction that last wrote the record, set by a trigger (see the migration): a
    # stream's position. Not part of the record's JSON.
    changed_xid: str | None = Field(default=None, sa_column=Column(XID8, nullable=False))


def _content_checks(states: dict[str, str]) -> list[CheckConstraint]:
    return [
        CheckConstraint(f"status <> '{status}' OR ({rule})", name=f"{status}_content")
        for status, rule in states.items()
    ]


class WorkflowStepAttempt(SQLModel, table=True):
    """One attempt of a record: written by the record's triggers (see the migration), never
    directly; a finished or superseded attempt never changes."""

    __tablename__ = "workflow_step_attempt"
    __table_args__ = (
        ForeignKeyConstraint(
            ["instance_id", "record_id"],
            ["workflow_step_record.instance_id", "workflow_step_record.id"],
            ondelete="CASCADE",
        ),
        PrimaryKeyConstraint("instance_id", "id"),
        UniqueConstraint("instance_id", "record_id", "attempt"),
        # The statistics' window (GET /v1/stats/steps), read from the index alone.
        Index(
            None,
            "started_at",
            postgresql_include=["instance_id", "record_id", "status", "completed_at"],
        ),
        CheckConstraint(
            "status IN (" + ", ".join(f"'{s}'" for s in ATTEMPT_STATUSES) + ")",
            name="status_known",
        ),
        CheckConstraint("attempt >= 1", name="attempt_positive"),
        *_outcome_checks(),
        *_content_checks(
            {
                "running": "started_at IS NOT NULL AND completed_at IS NULL"
                " AND output IS NULL AND external_output_url IS NULL"
                " AND error_code IS NULL AND error_message IS NULL",
                "completed": "started_at IS NOT NULL AND completed_at IS NOT NULL"
                " AND error_code IS NULL AND error_message IS NULL",
                "failed": "started_at IS NOT NULL AND completed_at IS NOT NULL"
                " AND error_code IS NOT NULL AND output IS NULL AND external_output_url IS NULL",
                "superseded": "started_at IS NOT NULL AND completed_at IS NOT NULL"
                " AND output IS NULL AND external_output_url IS NULL"
                " AND error_code IS NULL AND error_message IS NULL",
            }
        ),
        # A W3C trace id: 32 lowercase hex digits, not all zeros (the invalid id).
        CheckConstraint(
            "trace_id ~ '^[0-9a-f]{32}$' AND trace_id <> '00000000000000000000000000000000'",
            name="trace_id_format",
        ),
        CheckConstraint(f"reported_by ~ '{NAME_PATTERN}'", name="reported_by_format"),
    )

    id: int | None = Field(
        default=None, sa_column=Column(BigInteger, Identity(always=True), nullable=False)
    )
    instance_id: int = Field(sa_column=Column(BigInteger, nullable=False))
    record_id: int = Field(sa_column=Column(BigInteger, nullable=False))
    attempt: int = Field(sa_column=Column(Integer, nullable=False))
    status: str = Field(sa_column=Column(Text, nullable=False))
    started_at: datetime | None = Field(
        default=None, sa_column=Column(DateTime(timezone=True), nullable=True)
    )
    completed_at: datetime | None = Field(
        default=None, sa_column=Column(DateTime(timezone=True), nullable=True)
    )
    output: object | None = Field(default=None, sa_column=Column(JSONB, nullable=True))
    external_output_url: str | None = Field(default=None, sa_column=Column(Text, nullable=True))
    error_code: str | None = Field(default=None, sa_column=Column(Text, nullable=True))
    error_message: str | None = Field(default=None, sa_column=Column(Text, nullable=True))
    # The last lease the attempt held (kept once it ended).
    lease_expires_at: datetime | None = Field(
        default=None, sa_column=Column(DateTime(timezone=True), nullable=True)
    )
    created_at: datetime = Field(sa_column=_now())
    updated_at: datetime = Field(sa_column=_now())
    # The W3C trace id of the event that started the attempt: the judge's functions set
    # `steprecord.trace_id` for their call, and the row takes it when first written.
    trace_id: str | None = Field(
        default=None,
        sa_column=Column(
            Text,
            nullable=True,
            server_default=text("nullif(current_setting('steprecord.trace_id', true), '')"),
        ),
    )
    # Who last wrote the entry: its record's writer (`updated_by`) when the record's
    # triggers wrote it, the reporter of a late report; NULL before revision 0025.
    reported_by: str | None = Field(default=None, sa_column=Column(Text, nullable=True))


class WorkflowStepRepair(SQLModel, table=True):
    """The repair log: one row per operator's repair of a record (today: `reopen`), written
    only by steprecord_reopen (app/sql/reopen.sql), never changed, and deleted only with its
    instance (app/sql/repair_log.sql guards it)."""

    __tablename__ = "workflow_step_repair"
    __table_args__ = (
        PrimaryKeyConstraint("instance_id", "id"),
        ForeignKeyConstraint(["instance_id"], ["process_instance.id"], ondelete="CASCADE"),
        ForeignKeyConstraint(
            ["instance_id", "record_id"],
            ["workflow_step_record.instance_id", "workflow_step_record.id"],
            ondelete="CASCADE",
        ),
        # The log's pages, newest first: the index scanned backwards.
        Index(None, "instance_id", "at", "id"),
        CheckConstraint("action = 'reopen'", name="action_known"),
        CheckConstraint("attempt >= 1", name="attempt_positive"),
        CheckConstraint("char_length(reason) BETWEEN 1 AND 500", name="reason_length"),
        CheckConstraint("char_length(repaired_by) BETWEEN 1 AND 200", name="repaired_by_length"),
    )

    instance_id: int = Field(sa_column=Column(BigInteger, nullable=False))
    id: int | None = Field(
        default=None, sa_column=Column(BigInteger, Identity(always=True), nullable=False)
    )
    record_id: int = Field(sa_column=Column(BigInteger, nullable=False))
    step_slug: str = Field(sa_column=Column(Text, nullable=False))
    action: str = Field(sa_column=Column(Text, nullable=False))
    # The attempt that was reopened: the record went on at attempt + 1.
    attempt: int = Field(sa_column=Column(Integer, nullable=False))
    reason: str = Field(sa_column=Column(Text, nullable=False))
    # Who asked: the token's name, `anonymous`, or the CLI's writer name.
    repaired_by: str = Field(sa_column=Column(Text, nullable=False))
    at: datetime = Field(sa_column=_now())


class ApiToken(SQLModel, table=True):
    """An access token; only its SHA-256 is stored, the token itself is shown once."""

    __tablename__ = "api_token"
    __table_args__ = (
        UniqueConstraint("name"),
        UniqueConstraint("token_sha256"),
        CheckConstraint(f"name ~ '{NAME_PATTERN}'", name="name_format"),
        CheckConstraint("scope IN ('read', 'write', 'admin')", name="scope_known"),
        CheckConstraint("octet_length(token_sha256) = 32", name="token_sha256_size"),
        CheckConstraint(f"key_prefix ~ '{PREFIX_PATTERN}'", name="key_prefix_format"),
        CheckConstraint(f"key_prefix ~ '{PREFIX_DELIMITED_PATTERN}'", name="key_prefix_separated"),
        # The names the service writes as itself (revision 0031).
        CheckConstraint(
            "NOT (lower(name) IN ('anonymous', 'sweeper', 'cli')"
            " OR starts_with(lower(name), 'cli:'))",
            name="name_not_reserved",
        ),
    )

    id: int | None = Field(
        default=None, sa_column=Column(BigInteger, Identity(always=True), primary_key=True)
    )
    name: str = Field(sa_column=Column(Text, nullable=False))
    scope: str = Field(sa_column=Column(Text, nullable=False))
    token_sha256: bytes = Field(sa_column=Column(LargeBinary, nullable=False))
    # Only instances whose key starts with it exist for this token; None reaches them all.
    key_prefix: str | None = Field(default=None, sa_column=Column(Text, nullable=True))
    created_at: datetime = Field(sa_column=_now())
    last_used_at: datetime | None = Field(
        default=None, sa_column=Column(DateTime(timezone=True), nullable=True)
    )


class AccessPolicy(SQLModel, table=True):
    """One row: once any token has existed, tokens stay required even when none is left."""

    __tablename__ = "access_policy"
    __table_args__ = (CheckConstraint("id", name="one_row"),)

    id: bool = Field(
        default=True,
        sa_column=Column(Boolean, primary_key=True, server_default=text("true")),
    )
    tokens_required: bool = Field(
        default=False, sa_column=Column(Boolean, nullable=False, server_default=text("false"))
    )
    updated_at: datetime = Field(sa_column=_now())


# The function the CHECK ck_process_instance_id_derived calls, made before the table it
# checks (the migrations install it from the same source), and before it the secret it hashes
# with: a new one for each schema made from these models, as revision 0036 makes one for each
# database (64 random bytes, as the HMAC's two padded keys).
INSTANCE_ID_SQL = (Path(__file__).resolve().parent.parent / "sql" / "instance_id.sql").read_text()


def _create_instance_id_key(_table: object, connection: Connection, **_: object) -> None:
    secret = secrets.token_bytes(64)
    pads = bytes(b ^ 0x36 for b in secret) + bytes(b ^ 0x5C for b in secret)
    connection.exec_driver_sql(
        "CREATE FUNCTION steprecord_instance_id_key() RETURNS bytea"
        f" LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $fn$ SELECT '\\x{pads.hex()}'::bytea $fn$"
    )


event.listen(ProcessInstance.__table__, "before_create", _create_instance_id_key)  # type: ignore[attr-defined]
event.listen(
    ProcessInstance.__table__,  # type: ignore[attr-defined]
    "before_create",
    DDL(INSTANCE_ID_SQL),  # type: ignore[no-untyped-call]
)
