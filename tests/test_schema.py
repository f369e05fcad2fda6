"""What the database itself refuses (raw SQL), the migrations, and the indexed reads."""

import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import CheckConstraint, ForeignKeyConstraint, UniqueConstraint

from app.cli.migrate import migrate
from app.core.db import sync_engine
from app.core.tables import metadata
from app.data import reads, running, stats
from app.data.common import constraint_name
from app.main import alembic_config
from tests.support.citus import has_citus, node_of, on_citus
from tests.support.databases import migrated_database
from tests.support.http import T1, T2
from tests.support.plans import plan, task_plans
from tests.support.rows import BASE, VALID, Conn, insert, refused


@pytest.mark.parametrize("shape", VALID)
def test_valid_shapes_are_accepted(db: Conn, instance_id: int, shape: str) -> None:
    status = VALID[shape].get("status", "running" if shape == "running" else "pending")
    insert(db, instance_id, **{**VALID[shape], "status": status})


FORBIDDEN: list[tuple[str, str, dict[str, Any]]] = [
    ("status_known", "pending", {"status": "done"}),
    ("attempt_count_positive", "pending", {"attempt_count": 0}),
    ("attempt_count_positive", "running", {"attempt_count": -3}),
    ("output_inline_xor_external", "completed", {"external_output_url": "s3://b/k"}),
    ("timing", "completed", {"started_at": T2, "completed_at": T1}),
    ("pending_content", "pending", {"started_at": T1}),
    ("pending_content", "pending", {"output": "1"}),
    ("pending_content", "pending", {"external_output_url": "s3://b/k"}),
    ("pending_content", "pending", {"error_code": "E"}),
    ("pending_content", "pending", {"error_message": "m"}),
    ("running_content", "running", {"started_at": None}),
    ("running_content", "running", {"completed_at": T2}),
    ("running_content", "running", {"output": "1"}),
    ("running_content", "running", {"external_output_url": "s3://b/k"}),
    ("running_content", "running", {"error_code": "E"}),
    ("completed_content", "completed", {"started_at": None}),
    ("completed_content", "completed", {"completed_at": None}),
    ("completed_content", "completed", {"error_code": "E"}),
    ("completed_content", "completed", {"error_message": "m"}),
    ("failed_content", "failed", {"error_code": None}),
    ("failed_content", "failed", {"completed_at": None}),
    ("failed_content", "failed", {"output": "1"}),
    ("failed_content", "failed", {"external_output_url": "s3://b/k"}),
    ("step_slug_format", "pending", {"step_slug": "has space"}),
    ("step_slug_format", "pending", {"step_slug": "a/b"}),
    ("step_slug_format", "pending", {"step_slug": ""}),
    ("step_slug_format", "pending", {"step_slug": "-leading"}),
    ("step_slug_format", "pending", {"step_slug": "x" * 201}),
    ("error_code_format", "failed", {"error_code": "no spaces"}),
    ("error_message_size", "failed", {"error_message": "é" * 32769}),
    (
        "external_output_url_format",
        "completed",
        {"output": None, "external_output_url": "no-scheme"},
    ),
    (
        "external_output_url_format",
        "completed",
        {"output": None, "external_output_url": "s3://" + "k" * 2044},
    ),
    ("output_size", "completed", {"output": '"' + "x" * 1048575 + '"'}),
    ("ordinal_range", "pending", {"ordinal": -1}),
]


@pytest.mark.parametrize(("constraint", "status", "change"), FORBIDDEN)
def test_forbidden_records_are_refused_by_their_named_constraint(
    db: Conn, instance_id: int, constraint: str, status: str, change: dict[str, Any]
) -> None:
    values = {"step_slug": "s", "ordinal": 0, "attempt_count": 1, **BASE[status], **change}
    columns = ", ".join(["instance_id", *values])
    marks = ", ".join(["%s"] * (len(values) + 1))
    refused(
        db,
        f"ck_workflow_step_record_{constraint}",
        f"INSERT INTO workflow_step_record ({columns}) VALUES ({marks})",
        [instance_id, *values.values()],
    )


def test_boundary_sizes_are_accepted(db: Conn, instance_id: int) -> None:
    insert(
        db,
        instance_id,
        **{**VALID["failed"], "error_message": "é" * 32768, "error_code": "E" * 200},
    )
    insert(db, instance_id, **{**VALID["completed_inline"], "output": '"' + "x" * 1048574 + '"'})
    insert(
        db,
        instance_id,
        **{**VALID["completed_external"], "external_output_url": "s3://" + "k" * 2043},
    )


def test_unique_keys_and_owner_are_enforced(db: Conn, instance_id: int) -> None:
    insert(db, instance_id, step_slug="a", ordinal=1)
    sql = (
        "INSERT INTO workflow_step_record (instance_id, step_slug, ordinal, status,"
        " attempt_count) VALUES (%s, %s, %s, 'pending', 1)"
    )
    refused(db, "uq_workflow_step_record_instance_id_step_slug", sql, (instance_id, "a", 2))
    refused(db, "uq_workflow_step_record_instance_id_ordinal", sql, (instance_id, "b", 1))
    refused(db, "fk_workflow_step_record_instance_id_process_instance", sql, (-1, "c", 3))
    refused(
        db,
        "ck_process_instance_instance_key_format",
        "INSERT INTO process_instance (id, instance_key)"
        " VALUES (steprecord_instance_id('no/slash'), 'no/slash')",
    )
    # A key's id is its own: the same key again is the same id, and another key cannot
    # take an id that is not its own (so two keys never share an instance's rows).
    refused(
        db,
        "pk_process_instance",
        "INSERT INTO process_instance (id, instance_key)"
        " VALUES (steprecord_instance_id('run-1'), 'run-1')",
    )
    refused(
        db,
        "ck_process_instance_id_derived",
        "INSERT INTO process_instance (id, instance_key)"
        " VALUES (steprecord_instance_id('run-1'), 'run-2')",
    )


TRANSITIONS_REFUSED: list[tuple[str, dict[str, Any], str]] = [
    ("completed", {"status": "running", "completed_at": None, "output": None}, "rank back"),
    ("completed", {"output": '{"a": 2}'}, "finished output changed"),
    ("completed", {"completed_at": "2026-12-02T10:00:05Z"}, "finished time changed"),
    ("completed", {"started_at": "2026-12-02T10:00:00Z"}, "finished start changed"),
    ("completed", {"output": None, "external_output_url": "s3://b/k"}, "finished output moved"),
    ("failed", {"error_message": "other"}, "finished error changed"),
    (
        "failed",
        {"status": "completed", "error_code": None, "error_message": None},
        "finished status changed",
    ),
    ("running", {"status": "pending", "started_at": None}, "running back to pending"),
    ("running", {"attempt_count": 0 + 1, "started_at": T2}, "same position is fine"),
    ("pending", {"step_slug": "renamed"}, "slug changed"),
    ("pending", {"ordinal": 99}, "ordinal changed"),
    ("pending", {"created_at": "2000-01-01T00:00:00Z"}, "created_at changed"),
]


@pytest.mark.parametrize(
    ("status", "change", "why"), [t for t in TRANSITIONS_REFUSED if t[2] != "same position is fine"]
)
def test_forbidden_transitions_are_refused_by_the_trigger(
    db: Conn, instance_id: int, status: str, change: dict[str, Any], why: str
) -> None:
    record_id = insert(db, instance_id, **BASE[status])
    sets = ", ".join(f"{column} = %s" for column in change)
    refused(
        db,
        "tr_workflow_step_record_transition",
        f"UPDATE workflow_step_record SET {sets} WHERE id = %s",
        [*change.values(), record_id],
    )


def test_attempt_count_never_decreases(db: Conn, instance_id: int) -> None:
    record_id = insert(db, instance_id, **{**BASE["running"], "attempt_count": 2})
    refused(
        db,
        "tr_workflow_step_record_transition",
        "UPDATE workflow_step_record SET attempt_count = 1 WHERE id = %s",
        (record_id,),
    )


def test_owner_never_changes(db: Conn, instance_id: int) -> None:
    other = db.execute(
        "INSERT INTO process_instance (id, instance_key)"
        " VALUES (steprecord_instance_id('run-2'), 'run-2') RETURNING id"
    )
    other_id = other.fetchone()
    assert other_id is not None
    record_id = insert(db, instance_id)
    change = "UPDATE workflow_step_record SET instance_id = %s WHERE id = %s"
    if on_citus(db):
        # The owner is the distribution column there: Citus refuses to change it before the
        # row reaches a shard and its trigger.
        with pytest.raises(psycopg.errors.FeatureNotSupported), db.transaction():
            db.execute(change, (other_id[0], record_id))
    else:
        refused(db, "tr_workflow_step_record_transition", change, (other_id[0], record_id))
    owner = db.execute("SELECT instance_id FROM workflow_step_record WHERE id = %s", (record_id,))
    assert owner.fetchone() == (instance_id,)


def test_allowed_transitions_pass_the_trigger(db: Conn, instance_id: int) -> None:
    record_id = insert(db, instance_id)
    for change in (
        BASE["running"],
        {**BASE["completed"]},
        {
            "status": "running",
            "attempt_count": 2,
            "started_at": T2,
            "completed_at": None,
            "output": None,
        },
        {"status": "failed", "completed_at": "2026-12-02T10:00:09Z", "error_code": "E"},
    ):
        sets = ", ".join(f"{column} = %s" for column in change)
        db.execute(
            f"UPDATE workflow_step_record SET {sets} WHERE id = %s", [*change.values(), record_id]
        )
    row = db.execute("SELECT status, attempt_count FROM workflow_step_record").fetchone()
    assert row == ("failed", 2)


# --- migrations -----------------------------------------------------------------------

# On Citus `steprecord migrate` drops this key when it distributes process_instance (Citus keeps
# only unique keys that hold the distribution column; the primary key, the id derived from the
# key, keeps keys unique): there the migrated schema lacks it, and nothing else.
DROPPED_BY_DISTRIBUTION = "uq_process_instance_instance_key"


def dropped_by_distribution(url: str) -> set[str]:
    return {DROPPED_BY_DISTRIBUTION} if has_citus(url) else set()


def test_models_and_migrations_agree(database_url: str) -> None:
    engine = sync_engine(database_url)
    try:
        with engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn), metadata)
            names = {
                row[0]
                for row in conn.exec_driver_sql(
                    "SELECT conname FROM pg_constraint c JOIN pg_class t ON t.oid = c.conrelid"
                    " WHERE t.relname = ANY(%s) AND c.contype IN ('c', 'u', 'f')",
                    (list(metadata.tables),),
                )
            }
    finally:
        engine.dispose()
    dropped = dropped_by_distribution(database_url)
    missing = [change for change in diff if change[0] == "add_constraint"]
    assert {str(change[1].name) for change in missing} == dropped
    assert [change for change in diff if change not in missing] == []
    expected = {
        str(constraint.name)
        for table in metadata.tables.values()
        for constraint in table.constraints
        if isinstance(constraint, CheckConstraint | UniqueConstraint | ForeignKeyConstraint)
    }
    assert names == expected - dropped


CATALOG = {
    "constraints": """
        SELECT t.relname, c.conname, pg_get_constraintdef(c.oid)
        FROM pg_constraint c
        JOIN pg_class t ON t.oid = c.conrelid
        JOIN pg_namespace n ON n.oid = t.relnamespace
        WHERE n.nspname = 'public' AND t.relname <> 'alembic_version'
    """,
    "indexes": """
        SELECT tablename, indexname, indexdef FROM pg_indexes
        WHERE schemaname = 'public' AND tablename <> 'alembic_version'
    """,
    "columns": """
        SELECT t.relname, a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull,
               a.attidentity, pg_get_expr(d.adbin, d.adrelid)
        FROM pg_attribute a
        JOIN pg_class t ON t.oid = a.attrelid
        JOIN pg_namespace n ON n.oid = t.relnamespace
        LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
        WHERE n.nspname = 'public' AND t.relkind = 'r' AND t.relname <> 'alembic_version'
          AND a.attnum > 0 AND NOT a.attisdropped
    """,
}


def _catalog(url: str, query: str) -> set[tuple[Any, ...]]:
    with psycopg.connect(url) as conn:
        return {tuple(row) for row in conn.execute(query).fetchall()}


@pytest.mark.parametrize("kind", CATALOG)
def test_models_and_migrations_create_identical_definitions(
    database_url: str, scratch_database: str, kind: str
) -> None:
    """Every table's constraints (CHECK bodies included), indexes and columns, as PostgreSQL
    renders them, are the same whether made by `metadata.create_all` or by the migrations."""
    engine = sync_engine(scratch_database)
    try:
        metadata.create_all(engine)
    finally:
        engine.dispose()
    from_models = _catalog(scratch_database, CATALOG[kind])
    from_migrations = _catalog(database_url, CATALOG[kind])
    assert {row[0] for row in from_models} == set(metadata.tables)
    only_in_models = {row[1] for row in from_models - from_migrations}
    dropped = dropped_by_distribution(database_url) if kind != "columns" else set()
    assert only_in_models == dropped, "in the models only"
    assert from_migrations - from_models == set(), "in the migrations only"


def _tables(url: str) -> set[str]:
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = 'public'"
        ).fetchall()
    return {str(r[0]) for r in rows}


def _functions(url: str) -> set[str]:
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT proname FROM pg_proc WHERE proname LIKE 'steprecord\\_%'"
        ).fetchall()
    return {str(r[0]) for r in rows}


def test_migrations_upgrade_downgrade_and_upgrade_again(scratch_database: str) -> None:
    if has_citus(scratch_database):
        pytest.skip(
            "migrating down is for one server: the downgrade drops tables Citus distributed,"
            " and revisions before 0020 cannot be distributed again"
        )
    migrate(scratch_database)
    assert {"process_instance", "workflow_step_record", "alembic_version"} <= _tables(
        scratch_database
    )
    assert _functions(scratch_database) == {
        "steprecord_apply_event",
        "steprecord_apply_event_text",
        "steprecord_apply_events",
        "steprecord_by_owner",
        "steprecord_delete_instance",
        "steprecord_drop_shard_judges",
        "steprecord_heartbeat",
        "steprecord_instance_id",
        "steprecord_instance_id_key",
        "steprecord_list_page",
        "steprecord_patch_labels",
        "steprecord_prune_delete",
        "steprecord_prune_due",
        "steprecord_prune_lock",
        "steprecord_reopen",
        "steprecord_shard_judge",
        "steprecord_stream_changes",
        "steprecord_sweep_instance",
    }
    config = alembic_config()
    config.attributes["database_url"] = scratch_database
    command.downgrade(config, "base")
    assert _tables(scratch_database) == {"alembic_version"}
    with psycopg.connect(scratch_database) as conn:
        functions = conn.execute(
            "SELECT count(*) FROM pg_proc WHERE proname = 'workflow_step_record_guard_transition'"
        ).fetchone()
    assert functions == (0,)
    assert _functions(scratch_database) == set()
    migrate(scratch_database)
    assert "workflow_step_record" in _tables(scratch_database)


# --- indexed reads --------------------------------------------------------------------


def load_big_table(db: Conn) -> None:
    """10^5 records over 100 instances of 1,000 steps; and instance `run-50` has 10,000 steps
    not yet started more (the case the page function's index is for: with a hundred, sorting
    them is as cheap as reading them in order, and which plan wins then turns on where the
    instance's rows lie in its Citus shard, which the instance id, keyed by each database's
    own secret, makes different on every run)."""
    db.execute("""
        INSERT INTO process_instance (id, instance_key)
        SELECT steprecord_instance_id('run-' || i), 'run-' || i FROM generate_series(1, 100) i
    """)
    db.execute("""
        INSERT INTO workflow_step_record (instance_id, step_slug, ordinal, status, attempt_count,
                                          started_at)
        SELECT p.id, 'step-' || s, s, CASE WHEN s % 10 = 0 THEN 'pending' ELSE 'running' END, 1,
               CASE WHEN s % 10 = 0 THEN NULL
                    ELSE timestamptz '2026-01-01' + (s * 7 % 1000) * interval '1 s' END
        FROM process_instance p, generate_series(0, 999) s
    """)
    db.execute("""
        INSERT INTO workflow_step_record (instance_id, step_slug, ordinal, status, attempt_count)
        SELECT p.id, 'step-' || s, s, 'pending', 1
        FROM process_instance p, generate_series(1000, 10899) s
        WHERE p.id = steprecord_instance_id('run-50')
    """)
    db.execute("ANALYZE process_instance")
    db.execute("ANALYZE workflow_step_record")
    db.execute("ANALYZE workflow_step_attempt")


@pytest.fixture(scope="module")
def big_database(server_dsn: str) -> Iterator[str]:
    """A database of this module's own holding the big table (`load_big_table`), committed
    (on Citus each worker sees it) and loaded once for the plan tests, which only read it."""
    with migrated_database(server_dsn, "steprecord_plans_") as url:
        with psycopg.connect(url, autocommit=True) as conn:
            load_big_table(conn)
        yield url


@pytest.fixture
def big_table(big_database: str) -> Iterator[Conn]:
    """A connection to the big table's database, in a transaction rolled back after the test."""
    with psycopg.connect(big_database) as conn:
        try:
            yield conn
        finally:
            conn.rollback()


def function_plans(db: Conn, sql: str, params: list[Any]) -> str:
    """The plans of the statements a database function runs for `sql` (with `$n`
    placeholders), as auto_explain reports them (to this session, as notices).

    On a Citus worker a statement on a distributed table is Citus's own plan node, which runs
    the shard's statement locally (reported first, as a nested statement) and which
    auto_explain then fails to print ("cache lookup failed for type"): there the shards'
    plans reported before that failure are the answer."""
    notices: list[str] = []
    db.add_notice_handler(lambda diag: notices.append(diag.message_primary or ""))
    db.execute("LOAD 'auto_explain'")
    for setting in ("log_min_duration = 0", "log_nested_statements = on", "log_level = notice"):
        db.execute(f"SET LOCAL auto_explain.{setting}")
    try:
        with psycopg.RawCursor(db) as cur:
            cur.execute(sql, params).fetchall()
    except psycopg.errors.InternalError as exc:
        if not (has_citus(db.info.dsn) and "cache lookup failed for type" in str(exc)):
            raise
    return "\n".join(notices)


@pytest.mark.parametrize(
    ("order", "after_started_at", "index"),
    [
        ("ordinal", "-infinity", "uq_workflow_step_record_instance_id_ordinal"),
        ("started_at", "-infinity", "ix_workflow_step_record_instance_id_started_at_id"),
        ("started_at", None, "ix_workflow_step_record_instance_id_started_at_id"),
    ],
)
def test_the_page_function_reads_its_index_and_sorts_nothing(
    big_database: str, order: str, after_started_at: str | None, index: str
) -> None:
    """The records come from the index, in order, under the page's LIMIT. On Citus, on the
    worker that holds the instance, where the function's statements run on its shards. The
    instance read, `run-50`, holds 10,000 steps not yet started (`load_big_table`)."""
    params = ["run-50", order, 10, after_started_at, 0, None, 51, reads.PAGE_READ_BYTES]
    with psycopg.connect(node_of(big_database, "run-50")) as conn:
        text = function_plans(conn, reads.LIST_PAGE, params)
    lines = text.splitlines()
    limit = next(i for i, line in enumerate(lines) if "->  Limit" in line)
    scan = next(i for i, line in enumerate(lines) if f"Index Scan using {index}" in line)
    assert limit < scan, text
    assert "Sort" not in text, text
    assert "Seq Scan on workflow_step_record" not in text, text


def test_list_instances_reads_the_time_index_without_sorting(db: Conn) -> None:
    db.execute("""
        INSERT INTO process_instance (id, instance_key, created_at)
        SELECT steprecord_instance_id('run-' || i), 'run-' || i,
               timestamptz '2026-01-01' + i * interval '1 s'
        FROM generate_series(1, 100000) i
    """)
    db.execute("ANALYZE process_instance")
    params = {"before_created_at": "2026-01-01T12:00:00Z", "before_id": 0, "limit": 101}
    text = task_plans(plan(db, reads.list_instances_query(prefix=False, has=None), params))
    assert "ix_process_instance_created_at_id" in text, text
    assert "Sort" not in text, text


def test_step_statistics_read_the_window_from_the_attempts_start_index(big_table: Conn) -> None:
    big_table.execute("ANALYZE workflow_step_attempt")
    params = {"since": "2026-01-01T00:01:00Z", "until": "2026-01-01T00:02:00Z", "limit": 100}
    text = plan(big_table, stats.step_stats_query(prefix=False), params)
    assert "ix_workflow_step_attempt_started_at" in text, text
    assert "Seq Scan on workflow_step_attempt" not in text, text
    params |= reads.prefix_params("run-5")
    text = plan(big_table, stats.step_stats_query(prefix=True), params)
    assert "ix_workflow_step_attempt_started_at" in text, text
    assert "Seq Scan on workflow_step_attempt" not in text, text


@pytest.mark.parametrize("no_lease", [False, True])
def test_long_running_steps_read_the_running_index_without_sorting(
    big_table: Conn, no_lease: bool
) -> None:
    params = {"older_than": 3600, "after_started_at": "-infinity", "after_id": 0, "limit": 101}
    query = running.long_running_query(prefix=False, no_lease=no_lease)
    text = task_plans(plan(big_table, query, params))
    assert "ix_workflow_step_record_running_started_at_id" in text, text
    assert "Sort" not in text, text


GUARDED = (
    (
        "UPDATE workflow_step_record SET ordinal = ordinal + 100"
        " WHERE instance_id = steprecord_instance_id(%(key)s)",
        "workflow_step_record",
        "tr_workflow_step_record_transition",
    ),
    (
        "UPDATE workflow_step_attempt SET reported_by = 'by hand'"
        " WHERE instance_id = steprecord_instance_id(%(key)s)",
        "workflow_step_attempt",
        "tr_workflow_step_attempt_guard",
    ),
    (
        "UPDATE workflow_step_repair SET reason = 'by hand'"
        " WHERE instance_id = steprecord_instance_id(%(key)s)",
        "workflow_step_repair",
        "tr_workflow_step_repair_guard",
    ),
)


@pytest.mark.parametrize(("statement", "table", "guard"), GUARDED)
def test_a_guard_s_refusal_reads_as_a_check_s_with_its_name_in_the_message(
    database_url: str, statement: str, table: str, guard: str
) -> None:
    """SQLSTATE 23514 and `<table> ... violates constraint "<guard>"` in the message, as a
    CHECK's refusal: on Citus, which relays a worker's SQLSTATE and message but not the
    constraint field, a hand-written statement still says which guard refused it."""
    key = f"guarded-{uuid.uuid4().hex[:8]}"
    event = (
        "SELECT outcome FROM steprecord_apply_event(steprecord_instance_id(%(key)s), 0, %(key)s,"
        " 's', %(kind)s, 1, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, 'test', NULL)"
    )
    with psycopg.connect(database_url, autocommit=True) as conn:
        for kind in ("start", "complete"):
            conn.execute(event, {"key": key, "kind": kind})
        reopen = (
            "SELECT outcome FROM steprecord_reopen(steprecord_instance_id(%(key)s), %(key)s,"
            " 's', 1, 'to see the guard', 'test')"
        )
        assert conn.execute(reopen, {"key": key}).fetchone() == ("reopened",)
        with pytest.raises(psycopg.errors.CheckViolation) as caught:
            conn.execute(statement, {"key": key})
    message = caught.value.diag.message_primary or ""
    assert message.startswith(table), message
    assert f'violates constraint "{guard}"' in message, message
    assert constraint_name(caught.value) == guard
