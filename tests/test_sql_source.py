"""The database functions are source: `app/sql/` holds exactly what a database at head runs.

A change to the judge is made in `app/sql/` and shipped by a migration that installs a frozen
copy; these tests fail until the two agree, and when a migration reaches for another's text.
"""

import re
from pathlib import Path

import psycopg

from app.cli import migrate

ROOT = Path(__file__).resolve().parent.parent
SOURCE = sorted((ROOT / "app" / "sql").glob("*.sql"))
VERSIONS = ROOT / "migrations" / "versions"

# Every function and trigger of the public schema, by name, as PostgreSQL renders it.
CATALOG = """
SELECT 'function ' || p.oid::regprocedure::text, pg_get_functiondef(p.oid)
FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
WHERE n.nspname = 'public'
UNION ALL
SELECT 'trigger ' || t.tgname || ' on ' || c.relname, pg_get_triggerdef(t.oid)
FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = 'public' AND NOT t.tgisinternal
"""


def catalog(conn: psycopg.Connection[tuple[object, ...]]) -> dict[str, str]:
    return {str(name): str(text) for name, text in conn.execute(CATALOG).fetchall()}


def test_the_database_at_head_holds_exactly_the_functions_and_triggers_of_app_sql(
    scratch_database: str,
) -> None:
    """Migrate an empty database to head; then drop every function (and so every trigger)
    and install `app/sql/` alone: the catalog must come back exactly as it was, so nothing
    in the database is missing from the source and nothing in the source is missing from
    the database, and each function is byte for byte the same."""
    migrate(scratch_database)
    with psycopg.connect(scratch_database) as conn:
        at_head = catalog(conn)
        assert any(name.startswith("function steprecord_apply_event(") for name in at_head)
        for name in at_head:
            if name.startswith("function "):
                conn.execute(f"DROP FUNCTION {name.removeprefix('function ')} CASCADE")
        assert catalog(conn) == {}
        for path in SOURCE:
            conn.execute(path.read_text())
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
