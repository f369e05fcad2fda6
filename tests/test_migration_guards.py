"""Migrations that would change who reaches what, or lose data, refuse and say why.

Revision 0019 refuses to upgrade while a token's prefix does not end with a separator; the
downgrades that would widen access or drop history refuse unless forced, naming what would go.
"""

import argparse

import psycopg
import pytest
from alembic import command
from alembic.config import Config

from app.data.migrating import MigrationRefused
from app.main import alembic_config
from tests.support.citus import has_citus
from tests.support.databases import revision_of

# Why a test of a revision before 0020 is skipped on Citus.
BEFORE_0020 = (
    "about a revision before 0020, which cannot run on Citus: every migration ends by"
    " distributing, and Citus keeps no key without instance_id, which those revisions have"
)


def config_for(url: str) -> Config:
    config = alembic_config()
    config.attributes["database_url"] = url
    return config


def constraints_of_api_token(url: str) -> set[str]:
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT conname FROM pg_constraint WHERE conrelid = 'api_token'::regclass"
        ).fetchall()
    return {str(r[0]) for r in rows}


def test_0019_refuses_undelimited_prefixes_naming_the_tokens_until_they_are_rescoped(
    scratch_database: str,
) -> None:
    if has_citus(scratch_database):
        pytest.skip(BEFORE_0020)
    config = config_for(scratch_database)
    command.upgrade(config, "0018")
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
    assert revision_of(scratch_database) == "0018"
    assert "ck_api_token_key_prefix_separated" not in constraints_of_api_token(scratch_database)

    with psycopg.connect(scratch_database, autocommit=True) as conn:
        conn.execute("UPDATE api_token SET key_prefix = 'acme-' WHERE name = 'acme-ci'")
    command.upgrade(config, "0019")
    assert "ck_api_token_key_prefix_separated" in constraints_of_api_token(scratch_database)
    command.downgrade(config, "0018")
    assert "ck_api_token_key_prefix_separated" not in constraints_of_api_token(scratch_database)
    command.upgrade(config, "head")


def test_0031_refuses_tokens_named_as_the_service_names_itself_until_they_are_renamed(
    scratch_database: str,
) -> None:
    config = config_for(scratch_database)
    command.upgrade(config, "0030")
    with psycopg.connect(scratch_database, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO api_token (name, scope, token_sha256) VALUES"
            " ('sweeper', 'write', sha256('s')), ('cli:root', 'admin', sha256('c')),"
            " ('ci', 'write', sha256('x'))"
        )
    with pytest.raises(MigrationRefused) as refused:
        command.upgrade(config, "0031")
    message = str(refused.value)
    assert "the tokens cli:root, sweeper are named as the service names itself" in message
    assert "UPDATE api_token SET name" in message
    assert revision_of(scratch_database) == "0030"
    assert "ck_api_token_name_not_reserved" not in constraints_of_api_token(scratch_database)

    with psycopg.connect(scratch_database, autocommit=True) as conn:
        conn.execute("UPDATE api_token SET name = 'ci-sweeper' WHERE name = 'sweeper'")
        conn.execute("DELETE FROM api_token WHERE name = 'cli:root'")
    command.upgrade(config, "0031")
    assert "ck_api_token_name_not_reserved" in constraints_of_api_token(scratch_database)
    command.downgrade(config, "0030")
    assert "ck_api_token_name_not_reserved" not in constraints_of_api_token(scratch_database)
    command.upgrade(config, "head")


# --- downgrades that would widen access or drop data ---------------------------------------

INSTANCE = (
    "INSERT INTO process_instance (id, instance_key)"
    " VALUES (steprecord_instance_id('run-1'), 'run-1')"
)
RUNNING_STEP = """
INSERT INTO workflow_step_record (instance_id, step_slug, ordinal, status, attempt_count,
                                  started_at)
SELECT id, 'a', 0, 'running', 1, now() FROM process_instance WHERE instance_key = 'run-1'
"""
WRITTEN_STEP = """
INSERT INTO workflow_step_record (instance_id, step_slug, ordinal, status, attempt_count,
                                  started_at, updated_by)
SELECT id, 'a', 0, 'running', 1, now(), 'ci' FROM process_instance WHERE instance_key = 'run-1'
"""
DELETE_INSTANCES = ["DELETE FROM workflow_step_record", "DELETE FROM process_instance"]
TRACED = "SELECT set_config('steprecord.trace_id', '0af7651916cd43dd8448eb211c80319c', false)"
TOKEN = "INSERT INTO api_token (name, scope, token_sha256) VALUES ('ci', 'write', sha256('t'))"


class Loss:
    """Data that a downgrade to `target` would lose, what its refusal names, and how to
    remove that data so the downgrade proceeds unforced."""

    def __init__(self, target: str, setup: list[str], named: str, remove: list[str]) -> None:
        self.target, self.setup, self.named, self.remove = target, setup, named, remove


LOSSES = {
    "0035 drops the labels": Loss(
        "0034",
        [INSTANCE, 'UPDATE process_instance SET labels = \'{"env": "prod"}\''],
        "1 instances' labels would be dropped",
        DELETE_INSTANCES,
    ),
    "0025 drops the writers": Loss(
        "0024",
        [INSTANCE, WRITTEN_STEP],
        "1 records' and 1 attempts' writers (updated_by, reported_by)",
        DELETE_INSTANCES,
    ),
    "0015 widens a prefixed token": Loss(
        "0014",
        [
            "INSERT INTO api_token (name, scope, token_sha256, key_prefix)"
            " VALUES ('acme-ci', 'read', sha256('a'), 'acme-')"
        ],
        "the tokens acme-ci (prefix acme-) would reach every instance",
        ["DELETE FROM api_token"],
    ),
    "0016 drops trace ids": Loss(
        "0015",
        [TRACED, INSTANCE, RUNNING_STEP],
        "1 attempts' trace ids",
        DELETE_INSTANCES,
    ),
    "0004 reopens anonymous access": Loss(
        "0003",
        [TOKEN, "DELETE FROM api_token"],
        "anonymous requests on a loopback address would be accepted at once",
        ["UPDATE access_policy SET tokens_required = false"],
    ),
    "0003 drops the history": Loss(
        "0002",
        [INSTANCE, RUNNING_STEP],
        "1 attempts of history (workflow_step_attempt), and the leases of 0 running steps",
        DELETE_INSTANCES,
    ),
    "0002 drops the tokens": Loss(
        "0001",
        [TOKEN, "UPDATE access_policy SET tokens_required = false"],
        "the tokens ci would be deleted",
        ["DELETE FROM api_token"],
    ),
    "0001 drops the records": Loss(
        "base",
        [INSTANCE],  # with steps, 0003 would refuse first (their history)
        "1 instances with 0 step records would be deleted",
        DELETE_INSTANCES,
    ),
}


def run_sql(url: str, statements: list[str]) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        for statement in statements:
            conn.execute(statement)


@pytest.mark.parametrize("case", LOSSES)
def test_a_downgrade_that_would_lose_data_or_widen_access_refuses_unless_forced(
    scratch_database: str, case: str, capsys: pytest.CaptureFixture[str]
) -> None:
    loss = LOSSES[case]
    if (loss.target == "base" or loss.target < "0020") and has_citus(scratch_database):
        pytest.skip(BEFORE_0020)
    config = config_for(scratch_database)
    command.upgrade(config, "head")
    head = revision_of(scratch_database)
    run_sql(scratch_database, loss.setup)
    with pytest.raises(MigrationRefused) as refused:
        command.downgrade(config, loss.target)
    assert loss.named in str(refused.value)
    assert "force=true" in str(refused.value)
    assert revision_of(scratch_database) == head  # nothing changed

    run_sql(scratch_database, loss.remove)  # without that data, it proceeds unforced
    command.downgrade(config, loss.target)
    command.upgrade(config, "head")

    run_sql(scratch_database, loss.setup)
    forced = config_for(scratch_database)
    forced.attributes["force"] = True
    command.downgrade(forced, loss.target)
    said = capsys.readouterr().err
    assert "forced: " in said
    assert loss.named in said
    if loss.target != "base":
        assert revision_of(scratch_database) == loss.target
    command.upgrade(config, "head")


COMPLETED_STEP = """
INSERT INTO workflow_step_record (instance_id, step_slug, ordinal, status, attempt_count,
                                  started_at, completed_at)
SELECT id, 'a', 0, 'completed', 1, now(), now() FROM process_instance WHERE instance_key = 'run-1'
"""
# Revision 0024's reopen: the only writer of the repair log.
REOPEN = (
    "SELECT outcome FROM steprecord_reopen(steprecord_instance_id('run-1'), 'run-1', 'a', 1,"
    " 'charged twice', 'ops')"
)


def test_the_downgrade_of_0024_refuses_to_drop_the_repair_log_unless_forced(
    scratch_database: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # At 0024 itself: above it, a reopen names its writer, and 0025 would refuse first.
    config = config_for(scratch_database)
    command.upgrade(config, "0024")
    run_sql(scratch_database, [INSTANCE, COMPLETED_STEP, REOPEN])
    with pytest.raises(MigrationRefused) as refused:
        command.downgrade(config, "0023")
    named = "1 repairs of 1 instances (workflow_step_repair: who reopened which step, and why)"
    assert named in str(refused.value)
    assert "force=true" in str(refused.value)
    assert revision_of(scratch_database) == "0024"

    forced = config_for(scratch_database)
    forced.attributes["force"] = True
    command.downgrade(forced, "0023")
    assert named in capsys.readouterr().err
    assert revision_of(scratch_database) == "0023"

    command.upgrade(config, "0024")  # with no repair logged, it proceeds unforced
    command.downgrade(config, "0023")
    command.upgrade(config, "head")


def test_a_downgrade_is_forced_from_alembic_s_command_line(scratch_database: str) -> None:
    config = config_for(scratch_database)
    command.upgrade(config, "head")
    run_sql(scratch_database, LOSSES["0025 drops the writers"].setup)
    config.cmd_opts = argparse.Namespace(x=["force=true"])
    command.downgrade(config, "0024")
    assert revision_of(scratch_database) == "0024"


def test_on_citus_the_downgrade_of_0020_refuses_and_changes_nothing(scratch_database: str) -> None:
    """Citus keeps no key without the distribution column, which the revisions before 0020
    need: going below it refuses, saying why, and the downgrades before it in the same run
    are undone too."""
    config = config_for(scratch_database)
    command.upgrade(config, "head")
    if not has_citus(scratch_database):
        pytest.skip("about a database distributed on Citus; on one node 0020's downgrade proceeds")
    head = revision_of(scratch_database)
    with pytest.raises(MigrationRefused) as refused:
        command.downgrade(config, "0019")
    assert "downgrade of 0020 refused: the database is distributed on Citus" in str(refused.value)
    assert revision_of(scratch_database) == head
