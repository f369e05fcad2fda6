"""Repairs, audited: an operator's reopen of a finished step, through the judge, kept in the
repair log; the admin scope, the refusals, two operators racing, a zombie's late report, the
log's guard against hand-written SQL, the CLI and the Python client.

Most tests use the shared anonymous server (loopback: its writer is `anonymous`); the scope
tests run a server of their own with tokens."""

import asyncio
import os
import pwd
import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from alembic import command
from steprecord_client import AsyncRecorder, Recorder, StaleAttempt

from app.cli.migrate import migrate
from app.cli.repair import writer_name
from app.data.common import constraint_name
from app.main import alembic_config
from tests.support.citus import has_citus
from tests.support.databases import migrated_database
from tests.support.http import attempts, history, post, problem, record, step_path
from tests.support.metrics import counter, metrics
from tests.support.servers import logged_server, steprecord
from tests.support.streams import Stream
from tests.support.tokens import access_loaded
from tests.support.waits import eventually

T1, T2, T3, T4 = (f"2026-12-02T10:00:0{n}Z" for n in (1, 2, 3, 4))
REASON = "the card processor confirmed the charge was reversed"
# A writer's alphabet (ck_workflow_step_record_updated_by_format), a token name's.
WRITER_NAME = r"[A-Za-z0-9][A-Za-z0-9._:-]{0,199}"


def reopen(
    client: httpx.Client,
    body: Any,
    instance: str = "order-1",
    step: str = "charge",
    headers: dict[str, str] | None = None,
) -> httpx.Response:
    return client.post(f"{step_path(instance, step)}/reopen", json=body, headers=headers)


def repairs(client: httpx.Client, instance: str = "order-1", **params: Any) -> Any:
    response = client.get(f"/v1/instances/{instance}/repairs", params=params)
    assert response.status_code == 200, response.text
    return response.json()


def completed(client: httpx.Client, instance: str = "order-1", step: str = "charge") -> None:
    assert post(client, "start", {"attempt": 1, "started_at": T1}, instance, step).is_success
    done = post(
        client, "complete", {"attempt": 1, "completed_at": T2, "output": {"n": 1}}, instance, step
    )
    assert done.status_code == 200, done.text


def failed(client: httpx.Client, instance: str = "order-1", step: str = "charge") -> None:
    assert post(client, "start", {"attempt": 1, "started_at": T1}, instance, step).is_success
    body = {"attempt": 1, "completed_at": T2, "error_code": "CardDeclined", "error_message": "no"}
    assert post(client, "fail", body, instance, step).status_code == 200


# --- what a reopen does --------------------------------------------------------------------


@pytest.mark.parametrize("finish", [completed, failed], ids=["completed", "failed"])
def test_reopen_makes_a_finished_step_pending_at_the_next_attempt_and_keeps_its_entry(
    client: httpx.Client, finish: Callable[[httpx.Client], None]
) -> None:
    finish(client)
    entry = attempts(client)[0]
    answer = reopen(client, {"reason": REASON, "attempt": 1})
    assert answer.status_code == 200, answer.text
    reopened = answer.json()
    assert reopened == record(client)
    assert reopened["status"] == "pending"
    assert reopened["attempt_count"] == 2
    for cleared in (
        "started_at",
        "completed_at",
        "output",
        "external_output_url",
        "error_code",
        "error_message",
        "lease_expires_at",
    ):
        assert reopened[cleared] is None, cleared
    assert reopened["updated_at"] > entry["updated_at"]
    assert attempts(client) == [entry]  # attempt 1's entry as it was; a pending one has none
    (logged,) = repairs(client)["items"]
    assert logged == {
        "step_slug": "charge",
        "action": "reopen",
        "attempt": 1,
        "reason": REASON,
        "by": "anonymous",
        "at": reopened["updated_at"],
    }


def test_after_a_reopen_the_next_start_runs_the_next_attempt_and_older_reports_are_stale(
    client: httpx.Client,
) -> None:
    completed(client)
    assert reopen(client, {"reason": REASON}).status_code == 200
    # A zombie of attempt 1 reports again, differently: stale, and its entry stays.
    late = post(client, "complete", {"attempt": 1, "completed_at": T3, "output": {"n": 9}})
    body = problem(late, 409, "stale_attempt")
    assert body["current"]["status"] == "pending"
    assert body["current"]["attempt_count"] == 2
    assert body["recorded"] is False
    assert problem(post(client, "start", {"attempt": 1}), 409, "stale_attempt")
    assert record(client)["status"] == "pending"
    # The next start without an attempt runs attempt 2, and it finishes as any attempt does.
    started = post(client, "start")
    assert started.status_code == 200, started.text
    assert (started.json()["status"], started.json()["attempt_count"]) == ("running", 2)
    assert post(client, "complete", {"attempt": 2, "output": {"n": 2}}).status_code == 200
    assert history(client) == [(1, "completed"), (2, "completed")]
    assert attempts(client)[0]["output"] == {"n": 1}
    # A late report of attempt 1 after attempt 2 finished: still stale, nothing changes.
    problem(
        post(client, "fail", {"attempt": 1, "started_at": T1, "error_code": "Late"}),
        409,
        "stale_attempt",
    )
    assert record(client)["output"] == {"n": 2}


def test_the_stream_sends_the_reopened_record(
    client: httpx.Client, open_stream: Callable[..., Stream]
) -> None:
    completed(client)
    stream = open_stream()
    assert stream.next_event().record["status"] == "completed"
    reopened = reopen(client, {"reason": REASON}).json()
    assert stream.next_event().record == reopened


def test_repairs_are_counted_in_metrics(client: httpx.Client, server_url: str) -> None:
    before = counter(metrics(server_url), "steprecord_repairs_total", action="reopen")
    completed(client)
    assert reopen(client, {"reason": REASON}).status_code == 200
    problem(reopen(client, {"reason": REASON}), 409, "not_finished")  # a refusal is no repair
    eventually(
        lambda: (
            counter(metrics(server_url), "steprecord_repairs_total", action="reopen") == before + 1
        )
    )


def test_the_repair_log_pages_newest_first(client: httpx.Client) -> None:
    for attempt in (1, 2, 3):
        post(client, "start", {"attempt": attempt})
        post(client, "complete", {"attempt": attempt})
        assert reopen(client, {"reason": f"r{attempt}", "attempt": attempt}).status_code == 200
    completed(client, step="other")
    assert reopen(client, {"reason": "other"}, step="other").status_code == 200
    everything = repairs(client)["items"]
    assert [(r["step_slug"], r["attempt"]) for r in everything] == [
        ("other", 1),
        ("charge", 3),
        ("charge", 2),
        ("charge", 1),
    ]
    seen, cursor = [], None
    while True:
        page = repairs(client, limit=1, **({"cursor": cursor} if cursor else {}))
        seen += page["items"]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == everything
    assert repairs(client, instance="order-1", limit=3)["next_cursor"] is not None
    # An instance without repairs has an empty log; an unknown one is a 404.
    post(client, "declare", instance="quiet")
    assert repairs(client, instance="quiet") == {"items": [], "next_cursor": None}
    problem(client.get("/v1/instances/nope/repairs"), 404, "instance_not_found")
    problem(
        client.get("/v1/instances/order-1/repairs", params={"cursor": "garbled"}),
        422,
        "validation_error",
    )


# --- refusals ------------------------------------------------------------------------------


def test_reopen_refusals_write_nothing(client: httpx.Client) -> None:
    post(client, "declare", step="waiting")
    post(client, "start", step="busy")
    completed(client)
    before = record(client)
    for body in (
        None,
        {},
        {"reason": ""},
        {"reason": "   "},
        {"reason": "x" * 501},
        {"reason": REASON, "attempt": 0},
        {"reason": REASON, "attempt": "1"},
        {"reason": REASON, "atempt": 1},
        [REASON],
    ):
        problem(reopen(client, body), 422, "validation_error")
    for step, status in (("waiting", "pending"), ("busy", "running")):
        refused = problem(reopen(client, {"reason": REASON}, step=step), 409, "not_finished")
        assert refused["current"]["status"] == status
    refused = problem(reopen(client, {"reason": REASON, "attempt": 2}), 409, "stale_attempt")
    assert refused["current"] == before
    problem(reopen(client, {"reason": REASON}, instance="nope"), 404, "instance_not_found")
    problem(reopen(client, {"reason": REASON}, step="nope"), 404, "step_not_found")
    assert record(client) == before
    assert repairs(client)["items"] == []


@pytest.mark.parametrize("attempt", [1, None], ids=["with-attempt", "without-attempt"])
def test_two_operators_racing_reopen_once(
    client: httpx.Client, server_url: str, attempt: int | None
) -> None:
    completed(client)
    barrier = threading.Barrier(2, timeout=30)
    answers: list[httpx.Response | BaseException] = []

    def operator() -> None:
        try:
            with httpx.Client(base_url=server_url, timeout=30) as own:
                barrier.wait()
                answers.append(reopen(own, {"reason": REASON, "attempt": attempt}))
        except BaseException as exc:  # reported below, never left at the barrier
            barrier.abort()
            answers.append(exc)

    threads = [threading.Thread(target=operator) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(isinstance(a, BaseException) for a in answers), answers
    statuses = sorted(a.status_code for a in answers if isinstance(a, httpx.Response))
    assert statuses == [200, 409], [a.text for a in answers if isinstance(a, httpx.Response)]
    (loser,) = [a for a in answers if isinstance(a, httpx.Response) and a.status_code == 409]
    assert loser.json()["code"] == ("stale_attempt" if attempt else "not_finished")
    assert record(client)["attempt_count"] == 2
    assert len(repairs(client)["items"]) == 1


# --- the database refuses hand-written repairs ---------------------------------------------


def test_hand_written_sql_cannot_reopen_or_touch_the_repair_log(
    client: httpx.Client, database_url: str
) -> None:
    completed(client)
    assert reopen(client, {"reason": REASON}).status_code == 200
    post(client, "start")
    post(client, "complete", {"attempt": 2})
    the_record = "instance_id = steprecord_instance_id('order-1') AND step_slug = 'charge'"
    refused: list[tuple[str, str]] = [
        # The record back to pending by hand, with or without the repair log.
        (
            f"UPDATE workflow_step_record SET status = 'pending', attempt_count = 3,"
            f" started_at = NULL, completed_at = NULL, output = NULL WHERE {the_record}",
            "tr_workflow_step_record_transition",
        ),
        (
            # VALUES, not INSERT ... SELECT: on Citus the coordinator routes it to the
            # instance's shard and the refusal keeps its SQLSTATE (as on one node).
            "INSERT INTO workflow_step_repair (instance_id, record_id, step_slug, action, attempt,"
            " reason, repaired_by) VALUES (steprecord_instance_id('order-1'), {record_id},"
            " 'charge', 'reopen', 1, 'forged', 'me')",
            "tr_workflow_step_repair_guard",
        ),
        ("UPDATE workflow_step_repair SET reason = 'rewritten'", "tr_workflow_step_repair_guard"),
        (
            "UPDATE workflow_step_repair SET repaired_by = 'someone else'",
            "tr_workflow_step_repair_guard",
        ),
        ("DELETE FROM workflow_step_repair", "tr_workflow_step_repair_guard"),
    ]
    with psycopg.connect(database_url, autocommit=True) as conn:
        found = conn.execute(f"SELECT id FROM workflow_step_record WHERE {the_record}").fetchone()
        assert found is not None
        for statement, name in refused:
            with pytest.raises(psycopg.errors.CheckViolation) as caught:
                conn.execute(statement.replace("{record_id}", str(found[0])))
            assert constraint_name(caught.value) == name, statement
        # The named CHECKs hold for the function's own writes too.
        for reason in ("", "x" * 501):
            with pytest.raises(psycopg.errors.CheckViolation) as caught:
                conn.execute(
                    "SELECT * FROM steprecord_reopen(steprecord_instance_id('order-1'),"
                    " 'order-1', 'charge', NULL, %s, 'me')",
                    (reason,),
                )
            assert constraint_name(caught.value) == "ck_workflow_step_repair_reason_length"
        # The function itself is the one way in.
        (outcome,) = (
            conn.execute(
                "SELECT outcome FROM steprecord_reopen(steprecord_instance_id('order-1'),"
                " 'order-1', 'charge', 2, 'by hand, through the judge', 'psql')"
            ).fetchone()
            or ()
        )
        assert outcome == "reopened"
    assert [r["by"] for r in repairs(client)["items"]] == ["psql", "anonymous"]
    assert record(client)["attempt_count"] == 3


def test_deleting_the_instance_removes_its_repair_log(
    client: httpx.Client, database_url: str
) -> None:
    completed(client)
    completed(client, instance="kept")
    assert reopen(client, {"reason": REASON}).status_code == 200
    assert reopen(client, {"reason": REASON}, instance="kept").status_code == 200
    assert client.delete("/v1/instances/order-1").status_code == 204
    with psycopg.connect(database_url) as conn:
        rows = conn.execute("SELECT step_slug, attempt FROM workflow_step_repair").fetchall()
    assert rows == [("charge", 1)]  # the other instance's
    assert len(repairs(client, instance="kept")["items"]) == 1


# --- the CLI and the Python client ---------------------------------------------------------


@pytest.mark.parametrize(
    ("user", "name"),
    [("ops", "cli:ops"), ("CORP\\j doe", "cli:CORP-j-doe"), ("", "cli"), ("x" * 300, None)],
)
def test_the_cli_s_writer_name_keeps_to_the_writers_alphabet(
    monkeypatch: pytest.MonkeyPatch, user: str, name: str | None
) -> None:
    entry = pwd.getpwuid(os.getuid())
    named = pwd.struct_passwd((user, *entry[1:]))
    monkeypatch.setattr(pwd, "getpwuid", lambda uid: named if uid == entry.pw_uid else None)
    written = writer_name()
    assert re.fullmatch(WRITER_NAME, written), written
    assert written == (name or ("cli:" + user)[:200])


def test_cli_reopens_and_logs_its_writer(
    client: httpx.Client, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    failed(client)
    # The environment names someone else: the writer is the user the system runs it as.
    monkeypatch.setenv("USER", "sweeper")
    monkeypatch.setenv("LOGNAME", "sweeper")
    done = steprecord(
        database_url, "repair", "reopen", "order-1", "charge", "--reason", REASON, "--attempt", "1"
    )
    assert done.returncode == 0, done.stderr
    assert '"status":"pending"' in done.stdout
    assert "attempt 2" in done.stderr
    (logged,) = repairs(client)["items"]
    assert logged["by"] == writer_name() == "cli:" + pwd.getpwuid(os.getuid()).pw_name
    assert logged["reason"] == REASON
    assert record(client)["updated_by"] == logged["by"]
    again = steprecord(database_url, "repair", "reopen", "order-1", "charge", "--reason", REASON)
    assert again.returncode == 1
    assert "not_finished" in again.stderr
    assert again.stdout == ""
    blank = steprecord(database_url, "repair", "reopen", "order-1", "charge", "--reason", " ")
    assert blank.returncode == 2
    assert "reason" in blank.stderr
    missing = steprecord(database_url, "repair", "reopen", "nope", "charge", "--reason", REASON)
    assert missing.returncode == 1
    assert "no instance 'nope'" in missing.stderr
    assert len(repairs(client)["items"]) == 1


def test_client_step_runs_a_reopened_step_again_and_returns_the_new_output(
    server_url: str, client: httpx.Client
) -> None:
    runs: list[int] = []
    with Recorder(server_url, backoff=0.01, max_backoff=0.05) as rec:

        @rec.step("charge")
        def charge() -> dict[str, int]:
            runs.append(1)
            return {"run": len(runs)}

        with rec.instance("order-1"):
            assert charge() == {"run": 1}
            assert charge() == {"run": 1}  # completed: its output, not run again
        reopened = rec.reopen("order-1", "charge", reason=REASON, attempt=1)
        assert (reopened["status"], reopened["attempt_count"]) == ("pending", 2)
        with pytest.raises(StaleAttempt):
            rec.reopen("order-1", "charge", reason=REASON, attempt=1)
        with rec.instance("order-1"):
            assert charge() == {"run": 2}
    assert len(runs) == 2
    assert history(client) == [(1, "completed"), (2, "completed")]
    assert record(client)["output"] == {"run": 2}


def test_async_client_reopens(server_url: str, client: httpx.Client) -> None:
    completed(client)

    async def main() -> dict[str, Any]:
        async with AsyncRecorder(server_url) as rec:
            return await rec.reopen("order-1", "charge", reason=REASON)

    reopened = asyncio.run(main())
    assert reopened == record(client)
    with pytest.raises(ValueError, match="reason"):
        Recorder(server_url).reopen("order-1", "charge", reason="")


# --- scopes and tenants --------------------------------------------------------------------


class Tokens:
    def __init__(self, url: str, database_url: str) -> None:
        self.url, self.database_url = url, database_url

    def create(self, name: str, scope: str, prefix: str | None = None) -> dict[str, str]:
        args = [
            "token",
            "create",
            name,
            "--scope",
            scope,
            *(["--prefix", prefix] if prefix else []),
        ]
        done = steprecord(self.database_url, *args)
        assert done.returncode == 0, done.stderr
        return {"Authorization": f"Bearer {done.stdout.strip()}"}


@pytest.fixture(scope="module")
def with_tokens(server_dsn: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tokens]:
    with migrated_database(server_dsn, "steprecord_repairs_") as database_url:
        log: Path = tmp_path_factory.mktemp("repairs") / "stdout.jsonl"
        env = {"STEPRECORD_TOKEN_REFRESH_SECONDS": "0.5"}
        with logged_server(database_url, log, env=env) as url:
            tokens = Tokens(url, database_url)
            tokens.admin = tokens.create("ops-admin", "admin")  # type: ignore[attr-defined]
            tokens.writer = tokens.create("ci", "write")  # type: ignore[attr-defined]
            tokens.reader = tokens.create("dash", "read")  # type: ignore[attr-defined]
            tokens.acme = tokens.create("acme-ops", "admin", "acme-")  # type: ignore[attr-defined]
            eventually(lambda: access_loaded(log, 1, 4))
            yield tokens


def test_reopen_needs_an_admin_token_and_stays_inside_its_prefix(with_tokens: Tokens) -> None:
    t: Any = with_tokens
    with httpx.Client(base_url=t.url, timeout=30) as http:
        for key in ("acme-1", "globex-1"):
            for kind, body in (("start", {"attempt": 1}), ("complete", {"attempt": 1})):
                answer = http.post(f"{step_path(key)}/{kind}", json=body, headers=t.writer)
                assert answer.is_success, answer.text
        ask = {"reason": REASON, "attempt": 1}
        problem(reopen(http, ask, "globex-1", headers=t.reader), 403, "forbidden")
        refused = problem(reopen(http, ask, "globex-1", headers=t.writer), 403, "forbidden")
        assert "--scope admin" in refused["detail"]
        problem(reopen(http, ask, "globex-1"), 401, "unauthorized")
        problem(reopen(http, ask, "globex-1", headers=t.acme), 403, "outside_prefix")
        assert http.get(step_path("globex-1"), headers=t.reader).json()["status"] == "completed"
        # admin includes write: the prefixed admin reports events inside its prefix.
        assert http.post(f"{step_path('acme-1', 'x')}/declare", headers=t.acme).status_code == 201
        assert reopen(http, ask, "acme-1", headers=t.acme).status_code == 200
        reopened = reopen(http, ask, "globex-1", headers=t.admin)
        assert reopened.status_code == 200, reopened.text
        # The reopen wrote the record: its operator is now its writer, not the token `ci`.
        assert reopened.json()["updated_by"] == "ops-admin"
        shown = http.get(step_path("globex-1"), headers=t.reader).json()
        assert (shown["status"], shown["updated_by"]) == ("pending", "ops-admin")
        logs = {
            key: http.get(f"/v1/instances/{key}/repairs", headers=t.reader).json()["items"]
            for key in ("acme-1", "globex-1")
        }
        assert [r["by"] for r in logs["acme-1"]] == ["acme-ops"]
        assert [r["by"] for r in logs["globex-1"]] == ["ops-admin"]


def test_deleting_a_repaired_instance_needs_an_admin_token(with_tokens: Tokens) -> None:
    t: Any = with_tokens
    with httpx.Client(base_url=t.url, timeout=30) as http:
        for key in ("fixed-1", "plain-1"):
            for kind in ("start", "complete"):
                answer = http.post(
                    f"{step_path(key)}/{kind}", json={"attempt": 1}, headers=t.writer
                )
                assert answer.is_success, answer.text
        assert reopen(http, {"reason": REASON}, "fixed-1", headers=t.admin).status_code == 200
        for force in ("false", "true"):
            refused = problem(
                http.delete(f"/v1/instances/fixed-1?force={force}", headers=t.writer),
                403,
                "forbidden",
            )
            assert "'fixed-1' has 1 repair in its repair log" in refused["detail"]
            assert "--scope admin" in refused["detail"]
        logged = http.get("/v1/instances/fixed-1/repairs", headers=t.reader).json()["items"]
        assert len(logged) == 1  # nothing was deleted
        assert http.delete("/v1/instances/plain-1", headers=t.writer).status_code == 204
        assert http.delete("/v1/instances/fixed-1", headers=t.admin).status_code == 204
        assert http.get("/v1/instances/fixed-1", headers=t.reader).status_code == 404


# --- the migration -------------------------------------------------------------------------


def test_migration_0024_downgrades_with_repairs_and_admin_tokens_and_upgrades_again(
    scratch_database: str,
) -> None:
    if has_citus(scratch_database):
        pytest.skip(
            "a downgrade reinstalls a revision's frozen SQL, which Citus refuses to forward to"
            " the workers of a distributed database (several commands in one statement): one"
            " node's migration test"
        )
    migrate(scratch_database)
    with psycopg.connect(scratch_database, autocommit=True) as conn:
        conn.execute(
            "SELECT * FROM steprecord_apply_event(steprecord_instance_id('k'), 0, 'k', 's',"
            " 'complete', 1, now(), now(), NULL, NULL, NULL, NULL, NULL, NULL)"
        )
        conn.execute(
            "SELECT * FROM steprecord_reopen(steprecord_instance_id('k'), 'k', 's', 1, 'why', 'me')"
        )
        conn.execute(
            "INSERT INTO api_token (name, scope, token_sha256) VALUES"
            " ('boss', 'admin', sha256('a')), ('ci', 'write', sha256('b'))"
        )
    config = alembic_config()
    config.attributes["database_url"] = scratch_database
    # The reopen named its writer (updated_by) and logged a repair: 0025's downgrade drops
    # the one and 0024's the other only when forced.
    config.attributes["force"] = True
    command.downgrade(config, "0023")
    with psycopg.connect(scratch_database, autocommit=True) as conn:
        assert conn.execute("SELECT name FROM api_token").fetchall() == [("ci",)]
        assert conn.execute("SELECT to_regclass('workflow_step_repair')").fetchone() == (None,)
        assert conn.execute(
            "SELECT count(*) FROM pg_proc WHERE proname IN"
            " ('steprecord_reopen', 'workflow_step_repair_guard')"
        ).fetchone() == (0,)
        # The guard as 0023 left it: a finished record back to pending at the next attempt
        # was not refused by it then.
        guard = conn.execute(
            "SELECT prosrc FROM pg_proc WHERE proname = 'workflow_step_record_guard_transition'"
        ).fetchone()
        assert guard is not None
        assert "steprecord.writer" not in guard[0]
        with pytest.raises(psycopg.errors.CheckViolation):
            conn.execute(
                "INSERT INTO api_token (name, scope, token_sha256)"
                " VALUES ('x', 'admin', sha256('c'))"
            )
    migrate(scratch_database)
    with psycopg.connect(scratch_database, autocommit=True) as conn:
        (outcome,) = conn.execute(
            "SELECT outcome FROM steprecord_reopen(steprecord_instance_id('k'), 'k', 's', 2,"
            " 'why', 'me')"
        ).fetchone() or (None,)
        assert outcome == "not_finished"
