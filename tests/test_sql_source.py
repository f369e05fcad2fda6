"""The database functions are source: `app/sql/` holds exactly what a database at head runs.

A change to the judge is made in `app/sql/` and shipped by a migration that installs a frozen
copy; these tests fail until the two agree, and when a migration reaches for another's text.
"""

import re
from pathlib import Path

import psycopg
from alembic import command
from alembic.script import ScriptDirectory

from app.cli.migrate import migrate
from app.data.migrating import statements
from app.main import alembic_config
from app.ops.distribution import custom_plan_statements
from app.sql import COMMAND, frozen_as_of, render, revision_number, source
from tests.support.citus import has_citus

ROOT = Path(__file__).resolve().parent.parent
SOURCE = sorted((ROOT / "app" / "sql").glob("*.sql"))
VERSIONS = ROOT / "migrations" / "versions"

# Every function, trigger and composite type (one that is no table's row) of the public
# schema, by name, as PostgreSQL renders it.
CATALOG = """
SELECT 'function ' || p.oid::regprocedure::text, pg_get_functiondef(p.oid)
FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
WHERE n.nspname = 'public'
UNION ALL
SELECT 'type ' || t.oid::regtype::text,
       string_agg(a.attname || ' ' || format_type(a.atttypid, a.atttypmod), ', '
                  ORDER BY a.attnum)
FROM pg_type t JOIN pg_namespace n ON n.oid = t.typnamespace
JOIN pg_class c ON c.oid = t.typrelid AND c.relkind = 'c'
JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
WHERE n.nspname = 'public'
GROUP BY t.oid
UNION ALL
SELECT 'trigger ' || t.tgname || ' on ' || c.relname, pg_get_triggerdef(t.oid)
FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = 'public' AND NOT t.tgisinternal
"""


# This database's secret for instance ids (revision 0036): made at migrate, not source.
SECRET = "function steprecord_instance_id_key()"


def catalog(conn: psycopg.Connection[tuple[object, ...]], query: str = CATALOG) -> dict[str, str]:
    return {str(name): str(text) for name, text in conn.execute(query).fetchall()}


def test_the_database_at_head_holds_exactly_the_functions_and_triggers_of_app_sql(
    scratch_database: str,
) -> None:
    """Migrate an empty database to head; then drop every function (and so every trigger)
    but the database's own secret, and every composite type, and install `app/sql/` alone:
    the catalog must come back exactly as it was, so nothing in the database is missing from
    the source and nothing in the source is missing from the database, and each function and
    type is byte for byte the same."""
    migrate(scratch_database)
    distributed = has_citus(scratch_database)
    with psycopg.connect(scratch_database) as conn:
        at_head = catalog(conn)
        if distributed:
            # The coordinator's catalog alone: the drops and installs below stay on it (Citus
            # would send each to the workers, and refuses a file of several statements).
            conn.execute("SET LOCAL citus.enable_ddl_propagation = off")
        assert any(name.startswith("function steprecord_apply_event(") for name in at_head)
        for name in at_head:
            if name.startswith("function ") and name != SECRET:
                conn.execute(f"DROP FUNCTION {name.removeprefix('function ')} CASCADE")
        for name in at_head:
            if name.startswith("type "):
                conn.execute(f"DROP TYPE {name.removeprefix('type ')}")
        assert catalog(conn).keys() == {SECRET}
        for path in SOURCE:
            conn.execute(path.read_text())
        if distributed:  # what distribution changes in the functions, and nothing else
            for statement in custom_plan_statements():
                conn.execute(statement)
        from_source = catalog(conn)
        conn.rollback()
    assert from_source.keys() == at_head.keys()
    for name, text in at_head.items():
        assert from_source[name] == text, f"{name} differs between app/sql/ and the head"


def test_each_source_file_is_commented() -> None:
    for path in SOURCE:
        text = path.read_text()
        assert text.startswith("-- "), f"{path.name} should open with what it is for"
        assert text.count("\n--") + text.count("\n    --") >= 3, path.name


def test_no_migration_imports_another_or_reads_another_s_text() -> None:
    """Each migration is self-contained: it may read only the frozen `.sql` files named
    after itself, and never imports, loads or edits another migration."""
    migrations = sorted(VERSIONS.glob("[0-9][0-9][0-9][0-9]_*.py"))
    stems = {path.stem for path in migrations}
    for path in migrations:
        text = path.read_text()
        for forbidden in ("importlib", "spec_from_file_location", "exec_module", ".replace("):
            assert forbidden not in text, f"{path.name} uses {forbidden}"
        for other in stems - {path.stem}:
            assert other not in text, f"{path.name} names {other}"
    for frozen in VERSIONS.glob("*.sql"):
        owner = re.sub(r"\.(up|down)\.sql$", "", frozen.name)
        assert owner in stems, f"{frozen.name} belongs to no migration"


def test_the_frozen_files_taken_together_are_app_sql() -> None:
    """Each file's last frozen copy (the revisions' `.up.sql` sections) is the file as it is:
    a change to `app/sql/` that no revision froze fails here, before any database."""
    assert frozen_as_of(9999) == source()


def test_each_revision_made_by_the_freeze_command_holds_what_the_command_makes() -> None:
    """The committed `.up.sql` and `.down.sql` of every revision the command made are byte for
    byte what it makes from the source as of that revision (for the head, `app/sql/` itself,
    by the test above)."""
    made = [
        path.name.removesuffix(".up.sql")
        for path in sorted(VERSIONS.glob("*.up.sql"))
        if f"`{COMMAND} {path.name.removesuffix('.up.sql')}`" in path.read_text()
    ]
    assert "0018_judge_once" in made
    for name in made:
        up, down = render(name, frozen_as_of(revision_number(name)))
        assert (VERSIONS / f"{name}.up.sql").read_text() == up, name
        assert (VERSIONS / f"{name}.down.sql").read_text() == down, name


# What a migration may change and its downgrade must restore: every function, trigger, type,
# constraint and index of the public schema, and every table's columns (alembic's own
# `alembic_version` aside).
SCHEMA = (
    CATALOG
    + """
UNION ALL
SELECT 'constraint ' || c.conname || ' on ' || t.relname, pg_get_constraintdef(c.oid)
FROM pg_constraint c JOIN pg_class t ON t.oid = c.conrelid
JOIN pg_namespace n ON n.oid = t.relnamespace
WHERE n.nspname = 'public'
UNION ALL
SELECT 'index ' || i.relname, pg_get_indexdef(i.oid)
FROM pg_index x JOIN pg_class i ON i.oid = x.indexrelid
JOIN pg_namespace n ON n.oid = i.relnamespace
WHERE n.nspname = 'public'
UNION ALL
SELECT 'column ' || c.table_name || '.' || c.column_name,
       concat_ws(' ', c.data_type, c.is_nullable, c.column_default)
FROM information_schema.columns c
WHERE c.table_schema = 'public'
"""
)


def test_every_revision_s_downgrade_restores_the_schema_its_upgrade_found(
    scratch_database: str,
) -> None:
    """Revision by revision from an empty database: upgrade, downgrade, and the functions,
    triggers, types, constraints, indexes and columns are exactly what they were; then upgrade.
    On Citus from revision 0020 on: every upgrade ends by distributing, which the revisions
    before instance ids were derived cannot be (their unique keys leave out the distribution
    column), and 0020's downgrade refuses on a distributed database (see the test below)."""
    config = alembic_config()
    config.attributes["database_url"] = scratch_database
    revisions = [script.revision for script in ScriptDirectory.from_config(config).walk_revisions()]
    revisions.reverse()
    assert len(revisions) >= 18
    steps = list(zip(["base", *revisions], revisions, strict=False))
    if has_citus(scratch_database):
        command.upgrade(config, "0020")
        steps = steps[revisions.index("0020") + 1 :]
        assert steps[0] == ("0020", "0021")
    for previous, revision in steps:
        with psycopg.connect(scratch_database) as conn:
            before = catalog(conn, SCHEMA)
        command.upgrade(config, revision)
        command.downgrade(config, previous)
        with psycopg.connect(scratch_database) as conn:
            after = catalog(conn, SCHEMA)
        changed = sorted(
            name
            for name in before.keys() | after.keys()
            if before.get(name) != after.get(name) and "alembic_version" not in name
        )
        assert changed == [], f"downgrade of {revision} to {previous} left {changed}"
        command.upgrade(config, revision)


def test_a_changed_type_is_made_again_with_the_functions_that_name_it(
    scratch_database: str,
) -> None:
    """A type has no CREATE OR REPLACE: a revision that changes its file (here only a comment)
    drops the functions whose result names it, then the type, and runs their files again; its
    downgrade does the same the other way. Both run on a database at head."""
    files = source()
    files["answers.sql"] = files["answers.sql"] + "-- One more line.\n"
    up, down = render("9999_retyped", files)
    for text in (up, down):
        assert "DROP FUNCTION steprecord_apply_event(" in text
        assert "DROP FUNCTION steprecord_apply_events(" in text
        assert "DROP FUNCTION steprecord_heartbeat(" not in text
        assert text.index("DROP FUNCTION") < text.index("DROP TYPE steprecord_judged;")
    assert "-- ===== app/sql/apply_event.sql =====" in up
    assert "-- ===== app/sql/apply_events.sql =====" in up
    migrate(scratch_database)
    distributed = has_citus(scratch_database)
    with psycopg.connect(scratch_database) as conn:
        before = catalog(conn)
        if distributed:  # the coordinator's catalog alone, as in the test above
            conn.execute("SET LOCAL citus.enable_ddl_propagation = off")
        for text in (up, down):
            for statement in statements(text):
                conn.execute(statement)
            if distributed:
                for statement in custom_plan_statements():
                    conn.execute(statement)
            assert catalog(conn) == before
        conn.rollback()


def test_the_two_history_triggers_hold_the_same_upsert() -> None:
    """app/sql/attempt_history.sql writes the history's upsert twice, once in each trigger
    function (its comment says why): a change of one is a change of both."""
    text = (ROOT / "app" / "sql" / "attempt_history.sql").read_text()
    upserts = re.findall(
        r"\n    v_id := nextval\('workflow_step_attempt_id_seq'\);\n.*?;\n", text, re.S
    )
    assert len(upserts) == 2
    assert upserts[0] == upserts[1]


# One event as the service sends it (app/data/judge.py, APPLY_EVENT), a start of step `s`.
ONE_EVENT = (
    "SELECT * FROM steprecord_apply_event(steprecord_instance_id(%(key)s), 0, %(key)s, 's',"
    " 'start', NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, 60)"
)


def test_a_statement_prepared_before_revision_0038_runs_after_it(scratch_database: str) -> None:
    """Revision 0038 declares the judge's answer as a composite type with the same columns:
    a running service's prepared statement is planned again, not refused (`cached plan must
    not change result type`), so the release needs no restart of running instances."""
    config = alembic_config()
    config.attributes["database_url"] = scratch_database
    command.upgrade(config, "0037")
    with psycopg.connect(scratch_database, autocommit=True) as conn:
        before = conn.execute(ONE_EVENT, {"key": "prepared-1"}, prepare=True).fetchall()
        columns = [
            column.name
            for column in conn.execute(ONE_EVENT, {"key": "prepared-2"}, prepare=True).description
            or []
        ]
        migrate(scratch_database)
        after = conn.execute(ONE_EVENT, {"key": "prepared-3"}, prepare=True)
        assert [column.name for column in after.description or []] == columns
        assert [row[1] for row in after.fetchall()] == [row[1] for row in before] == ["created"]
