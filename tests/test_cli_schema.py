"""Only `steprecord migrate` and `serve` change the schema: every other command that uses the
database (`token`, `prune`) stops on a schema behind this release's head (or none), saying
which revision is there, which is needed and to run `steprecord migrate`, and writes nothing.
"""

import os
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest
from alembic import command
from alembic.script import ScriptDirectory

import app.main
from app.cli import main
from app.cli.migrate import migrate
from app.main import alembic_config, schema_head
from tests.support.databases import revision_of
from tests.support.servers import steprecord

# The commands' check of the schema's revision, read where the service reads it: the same on any
# database.
pytestmark = pytest.mark.same_on_any_database

# Every command but `migrate`, `serve` and `openapi`, each with what it would write.
COMMANDS = [
    ("token", "create", "ci", "--scope", "write"),
    ("token", "list"),
    ("token", "revoke", "ci"),
    ("token", "allow-anonymous"),
    ("prune", "--older-than", "1d", "--include-unfinished"),
]


def previous_revision() -> str:
    """The revision just before this release's head."""
    script = ScriptDirectory.from_config(alembic_config())
    down = script.get_revision(schema_head()).down_revision
    assert isinstance(down, str)
    return down


def tables(url: str) -> set[str]:
    with psycopg.connect(url) as conn:
        rows = conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
        return {str(row[0]) for row in rows}


def refused(url: str, args: tuple[str, ...], archive: Path) -> str:
    """Run a command that must refuse: exit 1, nothing on stdout; its message."""
    if args[0] == "prune":
        args = (*args, "--archive", str(archive))
    done = steprecord(url, *args)
    assert done.returncode == 1, (args, done.stdout, done.stderr)
    assert done.stdout == ""
    assert "Traceback" not in done.stderr
    assert not archive.exists(), "the refused prune wrote its archive"
    return done.stderr


@pytest.mark.parametrize("args", COMMANDS, ids=" ".join)
def test_a_command_on_an_empty_database_says_to_migrate_and_creates_nothing(
    scratch_database: str, args: tuple[str, ...], tmp_path: Path
) -> None:
    message = refused(scratch_database, args, tmp_path / "archive.jsonl")
    assert "no schema yet" in message
    assert f"needs revision {schema_head()}" in message
    assert "run steprecord migrate" in message
    assert tables(scratch_database) == set()


@pytest.mark.parametrize("args", COMMANDS, ids=" ".join)
def test_a_command_on_an_older_schema_says_to_migrate_and_changes_nothing(
    scratch_database: str, args: tuple[str, ...], tmp_path: Path
) -> None:
    migrate(scratch_database)
    with psycopg.connect(scratch_database, autocommit=True) as conn:
        # A token to revoke, an instance to prune: what the commands would change.
        conn.execute(
            "INSERT INTO api_token (name, scope, token_sha256) VALUES ('ci', 'write', sha256('t'))"
        )
        conn.execute(
            "INSERT INTO process_instance (id, instance_key, created_at)"
            " VALUES (steprecord_instance_id('old'), 'old', now() - interval '3 days')"
        )
    config = alembic_config()
    config.attributes["database_url"] = scratch_database
    older = previous_revision()
    command.downgrade(config, older)
    message = refused(scratch_database, args, tmp_path / "archive.jsonl")
    assert f"at revision {older}, behind this release's {schema_head()}" in message
    assert "run steprecord migrate" in message
    assert revision_of(scratch_database) == older
    with psycopg.connect(scratch_database) as conn:
        assert conn.execute("SELECT name FROM api_token").fetchall() == [("ci",)]
        assert conn.execute("SELECT instance_key FROM process_instance").fetchall() == [("old",)]
        assert conn.execute("SELECT tokens_required FROM access_policy").fetchall() == [(True,)]


def test_a_command_on_an_unknown_newer_schema_names_it_and_changes_nothing(
    scratch_database: str, tmp_path: Path
) -> None:
    migrate(scratch_database)
    with psycopg.connect(scratch_database, autocommit=True) as conn:
        conn.execute("UPDATE alembic_version SET version_num = '0999_future'")
    message = refused(scratch_database, COMMANDS[0], tmp_path / "archive.jsonl")
    assert "at revision 0999_future, which this release does not know" in message
    assert revision_of(scratch_database) == "0999_future"
    with psycopg.connect(scratch_database) as conn:
        assert conn.execute("SELECT count(*) FROM api_token").fetchone() == (0,)


def test_commands_run_on_the_head_and_on_a_compatible_newer_schema(
    scratch_database: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    migrate(scratch_database)
    created = steprecord(scratch_database, "token", "create", "ci", "--scope", "write")
    assert created.returncode == 0, created.stderr
    pruned = steprecord(scratch_database, "prune", "--older-than", "1d")
    assert pruned.returncode == 0, pruned.stderr
    assert pruned.stdout.startswith("deleted 0 instances")
    # A later release's revision declared compatible: run as `serve` would, left as it is.
    with psycopg.connect(scratch_database, autocommit=True) as conn:
        conn.execute("UPDATE alembic_version SET version_num = '0999_future'")
    monkeypatch.setenv("DATABASE_URL", scratch_database)
    monkeypatch.setattr(app.main, "COMPATIBLE_AHEAD", frozenset({"0999_future"}))
    assert main(["token", "list"]) == 0
    assert capsys.readouterr().out.startswith("ci\twrite")
    assert revision_of(scratch_database) == "0999_future"


def test_alembic_s_own_current_command_names_the_revision_and_changes_nothing(
    scratch_database: str,
) -> None:
    """`alembic current` in a clone (docs/operations.md runs alembic's downgrades there) reads
    the revision: it names no target, and the migration environment migrates nothing for it."""
    migrate(scratch_database)
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [sys.executable, "-m", "alembic", "current"],
        cwd=root,
        env={**os.environ, "DATABASE_URL": scratch_database},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert f"{schema_head()} (head)" in done.stdout
    assert revision_of(scratch_database) == schema_head()
