"""Migrations that would change who reaches what, or lose data, refuse and say why.

Revision 0019 refuses to upgrade while a token's prefix does not end with a separator; the
downgrades that would widen access or drop history refuse unless forced, naming what would go.
"""

import psycopg
import pytest
from alembic import command
from alembic.config import Config

from app.main import alembic_config
from migrations.guard import MigrationRefused


def config_for(url: str) -> Config:
    config = alembic_config()
    config.attributes["database_url"] = url
    return config


def revision_of(url: str) -> str:
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT version_num FROM alembic_version").fetchone()
    assert row is not None
    return str(row[0])


def constraints_of_api_token(url: str) -> set[str]:
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT conname FROM pg_constraint WHERE conrelid = 'api_token'::regclass"
        ).fetchall()
    return {str(r[0]) for r in rows}


def test_0019_refuses_undelimited_prefixes_naming_the_tokens_until_they_are_rescoped(
    scratch_database: str,
) -> None:
    config = config_for(scratch_database)
    command.upgrade(config, "0017")
    with psycopg.connect(scratch_database, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO api_token (name, scope, token_sha256, key_prefix) VALUES"
            " ('acme-ci', 'write', sha256('a'), 'acme'),"
            " ('globex-ci', 'read', sha256('g'), 'globex-'),"
            " ('admin', 'write', sha256('x'), NULL)"
        )
    with pytest.raises(MigrationRefused) as refused:
        command.upgrade(config, "0019")
    message = str(refused.value)
    assert "acme-ci (prefix acme)" in message
    assert "globex-ci" not in message
    assert "admin" not in message
    assert "UPDATE api_token SET key_prefix" in message
    assert "token revoke" in message
    assert revision_of(scratch_database) == "0017"
    assert "ck_api_token_key_prefix_separated" not in constraints_of_api_token(scratch_database)

    with psycopg.connect(scratch_database, autocommit=True) as conn:
        conn.execute("UPDATE api_token SET key_prefix = 'acme-' WHERE name = 'acme-ci'")
    command.upgrade(config, "0019")
    assert "ck_api_token_key_prefix_separated" in constraints_of_api_token(scratch_database)
    command.downgrade(config, "0017")
    assert "ck_api_token_key_prefix_separated" not in constraints_of_api_token(scratch_database)
    command.upgrade(config, "head")
