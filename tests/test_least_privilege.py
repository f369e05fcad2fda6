"""The database's owner with no other right (as on a managed PostgreSQL, where no one is
superuser) migrates the schema, downgrades and upgrades it again, and serves every kind of
write and read the service makes."""

from collections.abc import Iterator
from typing import Any

import httpx
import psycopg
import pytest
from alembic import command
from alembic.script import ScriptDirectory

from app.data import roles
from app.data.common import constraint_name
from app.main import alembic_config
from tests.support.databases import login_role, owned_database
from tests.support.http import T1, T2
from tests.support.servers import free_port, start_server, steprecord, stop
from tests.support.waits import eventually

SHORT_SWEEP = {"STEPRECORD_SWEEP_SECONDS": "0.2"}


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


def every_write(client: httpx.Client) -> None:
    """Every path of the judge that writes, as the service makes it: a new record, an update, a
    replay, a late report of an older attempt (the history's guard lets only the judge write
    it), a batch, a heartbeat, the sweeper closing an expired lease (the service is started
    with a short sweep), a reopen (the repair log), a read and a deletion."""
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
    leased = client.post("/v1/instances/order-4/steps/wait/start", json={"lease_seconds": 1})
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


def test_the_owner_with_no_other_right_serves_every_write(owner_url: str) -> None:
    """`serve` migrates an empty database as its owner, then serves every write."""
    base, proc = start_server(owner_url, env=SHORT_SWEEP)
    try:
        with httpx.Client(base_url=base, timeout=30) as client:
            every_write(client)
    finally:
        stop(proc)


@pytest.fixture
def owner_and_runtime(server_dsn: str) -> Iterator[tuple[str, str]]:
    """The owner's URL of a database migrated by it, and the URL of a runtime role it granted
    (`steprecord grant`), which an administrator made with no right of its own."""
    with (
        login_role(server_dsn, "steprecord_runtime_") as role,
        owned_database(server_dsn, "steprecord_owner_") as owner,
    ):
        assert steprecord(owner, "migrate").returncode == 0
        granted = steprecord(owner, "grant", role)
        assert granted.returncode == 0, granted.stderr
        yield owner, psycopg.conninfo.make_conninfo(owner, user=role)


def test_a_runtime_role_granted_by_the_owner_serves_every_write_with_a_token_and_prunes(
    owner_and_runtime: tuple[str, str],
) -> None:
    owner, runtime = owner_and_runtime
    made = steprecord(owner, "token", "create", "ops", "--scope", "admin")
    assert made.returncode == 0, made.stderr
    auth = {"Authorization": f"Bearer {made.stdout.strip()}"}
    base, proc = start_server(runtime, env=SHORT_SWEEP)
    try:
        with httpx.Client(base_url=base, timeout=30, headers=auth) as client:
            every_write(client)
        eventually(lambda: token_used(owner, "ops"), what="the token's use to be noted")
    finally:
        stop(proc)
    pruned = steprecord(runtime, "prune", "--before", "2100-01-01T00:00:00Z")
    assert pruned.returncode == 0, pruned.stderr
    assert "1 instances" in pruned.stderr + pruned.stdout  # order-4, its one step failed


def token_used(url: str, name: str) -> bool:
    """Whether the token's last use is noted (the one write to a token the service makes)."""
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT last_used_at FROM api_token WHERE name = %s", (name,)).fetchone()
    return row is not None and row[0] is not None


FORBIDDEN_WRITES = (
    "INSERT INTO process_instance (id, instance_key) VALUES (steprecord_instance_id('x'), 'x')",
    "UPDATE process_instance SET next_ordinal = next_ordinal",
    "DELETE FROM process_instance",
    "UPDATE workflow_step_record SET status = 'pending'",
    "DELETE FROM workflow_step_record",
    "UPDATE workflow_step_attempt SET reported_by = 'me'",
    "DELETE FROM workflow_step_attempt",
    "DELETE FROM workflow_step_repair",
    "INSERT INTO workflow_step_repair (instance_id, record_id, step_slug, action, attempt,"
    " reason, repaired_by) SELECT instance_id, id, step_slug, 'reopen', 1, 'forged',"
    " 'acme-admin' FROM workflow_step_record",
    "UPDATE api_token SET scope = 'admin'",
    "INSERT INTO api_token (name, scope, token_sha256) VALUES ('mine', 'admin', 'x')",
    "UPDATE access_policy SET tokens_required = false",
)


def test_the_runtime_role_writes_no_table_directly_even_saying_it_is_a_repair(
    owner_and_runtime: tuple[str, str],
) -> None:
    """Valid rows first (the judge writes them for the runtime role), then every direct write
    of theirs, plain and with the setting the guards once trusted: each refused for want of
    the right."""
    _, runtime = owner_and_runtime
    with psycopg.connect(runtime) as conn:
        conn.execute(
            "SELECT * FROM steprecord_apply_event(steprecord_instance_id('order-1'), 0,"
            " 'order-1', 'charge', 'complete', 1, %s, %s, '1', NULL, NULL, NULL, NULL, NULL)",
            (T1, T2),
        )
        conn.commit()
        for writer in (None, "repair", "judge"):
            for statement in FORBIDDEN_WRITES:
                if writer is not None:
                    conn.execute("SELECT set_config('steprecord.writer', %s, true)", (writer,))
                with pytest.raises(psycopg.errors.InsufficientPrivilege):
                    conn.execute(statement)
                conn.rollback()
        row = conn.execute("SELECT status FROM workflow_step_record").fetchone()
    assert row == ("completed",)


def test_a_role_later_given_write_rights_still_cannot_pass_for_the_judge_or_a_repair(
    server_dsn: str, owner_and_runtime: tuple[str, str]
) -> None:
    """The guards trust `steprecord.writer` only from the schema's owner: a role the owner
    granted INSERT and UPDATE (an analytics job, a careless grant) that says it is a repair,
    or the judge, is refused by the guard, not by a right."""
    owner, _ = owner_and_runtime
    with login_role(server_dsn, "steprecord_writer_") as role:
        with psycopg.connect(owner, autocommit=True) as conn:
            conn.execute(
                "SELECT * FROM steprecord_apply_event(steprecord_instance_id('order-1'), 0,"
                " 'order-1', 'charge', 'complete', 2, %s, %s, '1', NULL, NULL, NULL, NULL,"
                " NULL)",
                (T1, T2),
            )
            conn.execute(
                f"GRANT SELECT, INSERT, UPDATE ON workflow_step_record, workflow_step_attempt,"
                f" workflow_step_repair TO {role}"
            )
            instance_id, record_id = conn.execute(
                "SELECT instance_id, id FROM workflow_step_record"
            ).fetchone() or (None, None)
        # Each names its instance, as a forger would (on Citus, so, one shard's statement).
        forged = [
            (
                "repair",
                "UPDATE workflow_step_record SET status = 'pending', attempt_count = 3,"
                " started_at = NULL, completed_at = NULL, output = NULL"
                " WHERE instance_id = %(instance)s",
                "tr_workflow_step_record_transition",
            ),
            (
                "judge",
                "INSERT INTO workflow_step_attempt (instance_id, record_id, attempt, status,"
                " started_at, completed_at)"
                " VALUES (%(instance)s, %(record)s, 1, 'failed', %(t1)s, %(t2)s)",
                "tr_workflow_step_attempt_guard",
            ),
            (
                "repair",
                "INSERT INTO workflow_step_repair (instance_id, record_id, step_slug, action,"
                " attempt, reason, repaired_by) VALUES (%(instance)s, %(record)s, 'charge',"
                " 'reopen', 2, 'forged', 'acme-admin')",
                "tr_workflow_step_repair_guard",
            ),
        ]
        values = {"instance": instance_id, "record": record_id, "t1": T1, "t2": T2}
        try:
            with psycopg.connect(psycopg.conninfo.make_conninfo(owner, user=role)) as conn:
                for writer, statement, guard in forged:
                    conn.execute("SELECT set_config('steprecord.writer', %s, true)", (writer,))
                    with pytest.raises(psycopg.errors.CheckViolation) as refused:
                        conn.execute(statement, values)
                    assert constraint_name(refused.value) == guard
                    conn.rollback()
        finally:
            with psycopg.connect(owner, autocommit=True) as conn:
                conn.execute(
                    f"REVOKE ALL ON workflow_step_record, workflow_step_attempt,"
                    f" workflow_step_repair FROM {role}"
                )


def test_every_function_that_writes_runs_as_its_owner_with_a_fixed_path_for_granted_roles_only(
    owner_and_runtime: tuple[str, str],
) -> None:
    """The functions that run with their owner's rights are exactly those `steprecord grant`
    names; none is callable by PUBLIC, and each fixes its search_path."""
    owner, _ = owner_and_runtime
    with psycopg.connect(owner) as conn:
        rows = conn.execute(
            "SELECT p.proname, p.proconfig, has_function_privilege('public', p.oid, 'EXECUTE')"
            " FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace"
            " WHERE n.nspname = 'public' AND p.prosecdef ORDER BY p.proname"
        ).fetchall()
    assert sorted(name for name, _, _ in rows) == sorted(roles.CALL)
    for name, config, public in rows:
        assert not public, f"{name} is callable by PUBLIC"
        assert "search_path=pg_catalog, public, pg_temp" in (config or []), name


def test_a_role_that_was_not_granted_calls_no_function_that_writes(
    server_dsn: str, owner_and_runtime: tuple[str, str]
) -> None:
    owner, _ = owner_and_runtime
    with (
        login_role(server_dsn, "steprecord_other_") as role,
        psycopg.connect(psycopg.conninfo.make_conninfo(owner, user=role)) as conn,
        pytest.raises(psycopg.errors.InsufficientPrivilege),
    ):
        conn.execute("SELECT steprecord_sweep_instance(steprecord_instance_id('order-1'))")


def test_serve_and_grant_say_what_to_do_when_run_as_the_wrong_role_or_too_early(
    server_dsn: str,
) -> None:
    with (
        login_role(server_dsn, "steprecord_runtime_") as role,
        owned_database(server_dsn, "steprecord_owner_") as owner,
    ):
        runtime = psycopg.conninfo.make_conninfo(owner, user=role)
        refused = steprecord(runtime, "serve", "--port", str(free_port()))
        assert refused.returncode == 1
        assert "only the database's owner migrates it" in refused.stderr, refused.stderr
        assert "Traceback" not in refused.stderr
        unmigrated = steprecord(owner, "grant", role)
        assert unmigrated.returncode == 1
        assert "run steprecord migrate first" in unmigrated.stderr, unmigrated.stderr
        assert steprecord(owner, "migrate").returncode == 0
        missing = steprecord(owner, "grant", "no_such_role_here")
        assert missing.returncode == 1
        assert "CREATE ROLE" in missing.stderr, missing.stderr
        not_owner = steprecord(runtime, "grant", role)
        assert not_owner.returncode == 1
        assert "the database's owner" in not_owner.stderr, not_owner.stderr


def test_a_migration_that_creates_the_judge_again_keeps_the_runtime_role_s_right_to_call_it(
    owner_and_runtime: tuple[str, str],
) -> None:
    """Revision 0035 drops and creates the judge's functions (their arguments changed), which
    loses what was granted on them: `migrate` grants them again to the roles `steprecord
    grant` made, so the runtime role judges on after an upgrade without another grant."""
    owner, runtime = owner_and_runtime
    config = alembic_config()
    config.attributes["database_url"] = owner
    command.downgrade(config, "-1")
    assert steprecord(owner, "migrate").returncode == 0
    with psycopg.connect(runtime) as conn:
        row = conn.execute(
            "SELECT outcome FROM steprecord_apply_event(steprecord_instance_id('order-1'), 0,"
            " 'order-1', 'charge', 'start', 1, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL)"
        ).fetchone()
    assert row == ("created",)
    again = steprecord(owner, "migrate")  # at head: nothing to grant, nothing changed
    assert again.returncode == 0, again.stderr
