"""The database's owner with no other right (as on a managed PostgreSQL, where no one is
superuser) migrates the schema, downgrades and upgrades it again, and serves every kind of
write and read the service makes."""

from typing import Any

import httpx
import psycopg
import pytest
from alembic import command
from alembic.script import ScriptDirectory

from app.main import alembic_config
from tests.helpers import (
    T1,
    T2,
    eventually,
    owned_database,
    start_server,
    steprecord,
    stop,
)


@pytest.fixture
def owner_url(server_dsn: str) -> Any:
    with owned_database(server_dsn, "steprecord_owner_") as url:
        yield url


def test_the_owner_is_no_superuser_and_may_not_set_placeholder_settings_by_function(
    owner_url: str,
) -> None:
    """What the tests below stand on: this role is refused what a superuser may do (a
    function's `SET` clause on a setting no extension defines), as a managed PostgreSQL's
    database owner is."""
    with psycopg.connect(owner_url, autocommit=True) as conn:
        row = conn.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user").fetchone()
        assert row == (False,)
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute(
                "CREATE FUNCTION f() RETURNS int LANGUAGE sql"
                " SET steprecord.writer = 'judge' AS 'SELECT 1'"
            )


def test_the_owner_with_no_other_right_migrates_downgrades_and_migrates_again(
    owner_url: str,
) -> None:
    done = steprecord(owner_url, "migrate")
    assert done.returncode == 0, done.stderr
    config = alembic_config()
    config.attributes["database_url"] = owner_url
    command.downgrade(config, "-1")
    again = steprecord(owner_url, "migrate")
    assert again.returncode == 0, again.stderr
    with psycopg.connect(owner_url) as conn:
        head = conn.execute("SELECT version_num FROM alembic_version").fetchone()
    assert head == (ScriptDirectory.from_config(config).get_current_head(),)


def test_the_owner_with_no_other_right_serves_every_write(owner_url: str) -> None:
    """`serve` migrates an empty database as its owner, then every path of the judge that
    writes: a new record, an update, a replay, a late report of an older attempt (the
    history's guard lets only the judge write it), a batch, a heartbeat, the sweeper closing
    an expired lease, a reopen (the repair log), a read and a deletion."""
    base, proc = start_server(owner_url, env={"STEPRECORD_SWEEP_SECONDS": "0.2"})
    try:
        with httpx.Client(base_url=base, timeout=30) as client:
            steps = "/v1/instances/order-1/steps"
            assert client.post(f"{steps}/charge/start", json={"attempt": 1}).status_code == 201
            assert client.post(f"{steps}/charge/start", json={"attempt": 2}).status_code == 200
            late = client.post(
                f"{steps}/charge/fail",
                json={"attempt": 1, "started_at": T1, "completed_at": T2, "error_code": "boom"},
            )
            assert late.status_code == 409, late.text  # stale_attempt, recorded as a late report
            assert late.json()["recorded"] is True
            done = client.post(f"{steps}/charge/complete", json={"attempt": 2, "output": 1})
            assert done.status_code == 200, done.text
            assert client.post(f"{steps}/charge/complete", json={"attempt": 2}).status_code in (
                200,
                409,
            )
            batch = client.post(
                "/v1/events",
                json={
                    "events": [
                        {"instance_key": "order-2", "step_slug": "a", "kind": "start"},
                        {"instance_key": "order-3", "step_slug": "b", "kind": "declare"},
                    ]
                },
            )
            assert [r["status"] for r in batch.json()["results"]] == [201, 201], batch.text
            leased = client.post(
                "/v1/instances/order-4/steps/wait/start", json={"lease_seconds": 1}
            )
            assert leased.status_code == 201, leased.text
            beat = client.post(
                "/v1/instances/order-4/steps/wait/heartbeat",
                json={"attempt": 1, "lease_seconds": 1},
            )
            assert beat.status_code == 200, beat.text
            eventually(
                lambda: client.get("/v1/instances/order-4/steps/wait").json()["status"] == "failed",
                what="the sweeper to fail the expired lease",
            )
            reopened = client.post(
                f"{steps}/charge/reopen", json={"reason": "refund reversed", "attempt": 2}
            )
            assert reopened.status_code == 200, reopened.text
            repairs = client.get("/v1/instances/order-1/repairs").json()["items"]
            assert [r["action"] for r in repairs] == ["reopen"]
            history = client.get(f"{steps}/charge/attempts").json()["items"]
            assert [(a["attempt"], a["status"]) for a in history] == [
                (1, "failed"),
                (2, "completed"),
            ]
            assert client.delete("/v1/instances/order-2?force=true").status_code == 204
            assert client.get("/v1/instances/order-2/steps").status_code == 404
    finally:
        stop(proc)
