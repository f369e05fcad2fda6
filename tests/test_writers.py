"""Who wrote it: each record keeps `updated_by`, each attempt entry `reported_by`.

The writer is the name of the token whose request last wrote the row, `anonymous` without
tokens, `sweeper` for a lease the sweeper closed (docs/database.md, "Who wrote it").
The shared server runs without tokens; a server of this module's own runs with tokens.
"""

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from tests.support.citus import has_citus
from tests.support.databases import migrated_database
from tests.support.http import T1, T2, attempts, post, record, step_path
from tests.support.rows import BASE, Conn, insert, refused
from tests.support.servers import logged_server, steprecord
from tests.support.streams import Stream
from tests.support.tokens import access_loaded
from tests.support.waits import eventually, wait_for

GUARD = "tr_workflow_step_record_transition"
HISTORY_GUARD = "tr_workflow_step_attempt_guard"


def writers(client: httpx.Client, instance: str = "order-1", step: str = "charge") -> Any:
    """The record's writer, then `(attempt, status, reported_by)` of each history entry."""
    entries = [
        (a["attempt"], a["status"], a["reported_by"]) for a in attempts(client, instance, step)
    ]
    return record(client, instance, step)["updated_by"], entries


# --- without tokens: anonymous, and the sweeper -------------------------------------------


def test_a_request_without_tokens_writes_as_anonymous(client: httpx.Client) -> None:
    created = post(client, "start", {"attempt": 1, "started_at": T1})
    assert created.status_code == 201, created.text
    assert created.json()["updated_by"] == "anonymous"
    assert writers(client) == ("anonymous", [(1, "running", "anonymous")])


def test_a_swept_lease_is_written_by_the_sweeper(client: httpx.Client) -> None:
    assert post(client, "start", {"attempt": 1, "lease_seconds": 1}).status_code == 201
    wait_for("the sweep", lambda: record(client)["status"] == "failed" or None)
    assert writers(client) == ("sweeper", [(1, "failed", "sweeper")])


def test_the_stream_s_record_names_its_writer(
    client: httpx.Client, open_stream: Callable[..., Stream]
) -> None:
    assert post(client, "declare").status_code == 201
    stream = open_stream()
    assert post(client, "start").status_code == 200
    shown = [json.loads(event.data) for event in stream.events(2)]
    assert [(r["status"], r["updated_by"]) for r in shown] == [
        ("pending", "anonymous"),
        ("running", "anonymous"),
    ]


def test_the_dashboard_s_step_page_shows_who_wrote_the_record_and_each_attempt(
    client: httpx.Client,
) -> None:
    assert post(client, "start", {"attempt": 1, "lease_seconds": 1}).status_code == 201
    wait_for("the sweep", lambda: record(client)["status"] == "failed" or None)
    assert post(client, "start", {"attempt": 2}).status_code == 200
    page = client.get("/ui/instances/order-1/steps/charge")
    assert page.status_code == 200, page.text
    assert 'by <span class="writer">anonymous</span>' in page.text
    assert '<dt>Reported by</dt><dd class="writer">anonymous</dd>' in page.text
    assert '<dt>Reported by</dt><dd class="writer">sweeper</dd>' in page.text


# --- with tokens ----------------------------------------------------------------------------


class Writers:
    def __init__(self, url: str, database_url: str, log: Path) -> None:
        self.url, self.database_url = url, database_url
        self.tokens = {name: self.create(name) for name in ("ci-runner", "worker.7", "ops")}
        eventually(lambda: access_loaded(log, 1, len(self.tokens)))

    def create(self, name: str) -> dict[str, str]:
        done = steprecord(self.database_url, "token", "create", name, "--scope", "write")
        assert done.returncode == 0, done.stderr
        return {"Authorization": f"Bearer {done.stdout.strip()}"}

    def client(self, name: str) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.tokens[name], timeout=30)


@pytest.fixture(scope="module")
def with_tokens(server_dsn: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Writers]:
    with migrated_database(server_dsn, "steprecord_writers_") as database_url:
        log = tmp_path_factory.mktemp("writers") / "stdout.jsonl"
        env = {"STEPRECORD_TOKEN_REFRESH_SECONDS": "0.5"}
        with logged_server(database_url, log, env=env) as url:
            yield Writers(url, database_url, log)


@pytest.fixture
def as_(with_tokens: Writers) -> Iterator[Callable[[str], httpx.Client]]:
    """A client per token name, on emptied tables; every client is closed after the test."""
    with psycopg.connect(with_tokens.database_url, autocommit=True) as conn:
        conn.execute(
            "TRUNCATE process_instance, workflow_step_record, workflow_step_attempt,"
            " workflow_step_repair"
        )
    opened: dict[str, httpx.Client] = {}

    def client(name: str) -> httpx.Client:
        if name not in opened:
            opened[name] = with_tokens.client(name)
        return opened[name]

    yield client
    for c in opened.values():
        c.close()


def test_a_token_s_name_lands_in_the_record_and_its_attempt(
    as_: Callable[[str], httpx.Client],
) -> None:
    ci, ops = as_("ci-runner"), as_("ops")
    assert post(ci, "start", {"attempt": 1, "started_at": T1}).status_code == 201
    assert writers(ci) == ("ci-runner", [(1, "running", "ci-runner")])
    done = post(ops, "complete", {"attempt": 1, "completed_at": T2, "output": 1})
    assert done.status_code == 200, done.text
    assert done.json()["updated_by"] == "ops"
    assert writers(ci) == ("ops", [(1, "completed", "ops")])


def test_a_replay_or_a_refusal_changes_no_writer(as_: Callable[[str], httpx.Client]) -> None:
    ci, ops = as_("ci-runner"), as_("ops")
    body = {"attempt": 1, "started_at": T1, "completed_at": T2, "output": 1}
    assert post(ci, "complete", body).status_code == 201
    replay = post(ops, "complete", body)
    assert replay.status_code == 200
    assert replay.json()["updated_by"] == "ci-runner"
    conflict = post(ops, "fail", {"attempt": 1, "error_code": "E"})
    assert conflict.status_code == 409
    assert writers(ci) == ("ci-runner", [(1, "completed", "ci-runner")])


def test_a_heartbeat_writes_its_token_into_the_record_and_the_running_attempt(
    as_: Callable[[str], httpx.Client],
) -> None:
    ci, worker = as_("ci-runner"), as_("worker.7")
    assert post(ci, "start", {"attempt": 1, "lease_seconds": 60}).status_code == 201
    beat = post(worker, "heartbeat", {"attempt": 1, "lease_seconds": 120})
    assert beat.status_code == 200
    assert beat.json()["updated_by"] == "worker.7"
    assert writers(ci) == ("worker.7", [(1, "running", "worker.7")])


def test_a_batch_writes_its_token_into_every_record_it_writes(
    as_: Callable[[str], httpx.Client],
) -> None:
    ci, worker = as_("ci-runner"), as_("worker.7")
    assert post(ci, "start", {"attempt": 1}, step="b").status_code == 201
    events = [
        {"instance_key": "order-1", "step_slug": "a", "kind": "start", "attempt": 1},
        {"instance_key": "order-1", "step_slug": "b", "kind": "complete", "attempt": 1},
        {"instance_key": "order-2", "step_slug": "a", "kind": "declare"},
        {"instance_key": "order-1", "step_slug": "b", "kind": "complete", "attempt": 1},
    ]
    answer = worker.post("/v1/events", json={"events": events})
    assert answer.status_code == 200, answer.text
    results = answer.json()["results"]
    assert [r["status"] for r in results] == [201, 200, 201, 200]
    assert {r["record"]["updated_by"] for r in results} == {"worker.7"}
    assert writers(ci, step="a") == ("worker.7", [(1, "running", "worker.7")])
    assert writers(ci, step="b") == ("worker.7", [(1, "completed", "worker.7")])
    assert record(ci, "order-2", "a")["updated_by"] == "worker.7"


def test_a_late_report_names_its_reporter_and_leaves_the_record_s_writer(
    as_: Callable[[str], httpx.Client],
) -> None:
    ci, worker, ops = as_("ci-runner"), as_("worker.7"), as_("ops")
    assert post(worker, "start", {"attempt": 1, "started_at": T1}).status_code == 201
    assert post(ci, "start", {"attempt": 2}).status_code == 200
    # The takeover wrote attempt 1's entry (superseded): its last writer is ci-runner's.
    assert writers(ci) == (
        "ci-runner",
        [(1, "superseded", "ci-runner"), (2, "running", "ci-runner")],
    )
    late = post(ops, "fail", {"attempt": 1, "completed_at": T2, "error_code": "Late"})
    assert late.status_code == 409
    assert late.json()["recorded"] is True
    assert writers(ci) == ("ci-runner", [(1, "failed", "ops"), (2, "running", "ci-runner")])


def test_the_writer_in_the_json_of_every_read(as_: Callable[[str], httpx.Client]) -> None:
    worker = as_("worker.7")
    assert post(worker, "start").status_code == 201
    page = worker.get("/v1/instances/order-1/steps")
    assert [r["updated_by"] for r in page.json()["items"]] == ["worker.7"]
    across = worker.get("/v1/steps", params={"status": "running"})
    assert [r["updated_by"] for r in across.json()["items"]] == ["worker.7"]
    summary = worker.get(step_path(), params={"fields": "summary"})
    assert summary.json()["updated_by"] == "worker.7"


# --- raw SQL --------------------------------------------------------------------------------


def test_a_writer_is_a_name_of_the_names_alphabet(db: Conn, instance_id: int) -> None:
    for name in ("ci-runner", "anonymous", "sweeper", "a", "x" * 200):
        insert(db, instance_id, **BASE["running"], updated_by=name)
    for name in ("", "-lead", "has space", "x" * 201, "a/b"):
        refused(
            db,
            "ck_workflow_step_record_updated_by_format",
            "INSERT INTO workflow_step_record (instance_id, step_slug, ordinal, status,"
            " attempt_count, updated_by) VALUES (%s, 'bad', 999, 'pending', 1, %s)",
            (instance_id, name),
        )


def test_an_attempt_s_writer_is_a_name_too(db: Conn, instance_id: int) -> None:
    record_id = insert(db, instance_id, **BASE["running"])
    db.execute(f"ALTER TABLE workflow_step_attempt DISABLE TRIGGER {HISTORY_GUARD}")
    refused(
        db,
        "ck_workflow_step_attempt_reported_by_format",
        "INSERT INTO workflow_step_attempt (instance_id, record_id, attempt, status,"
        " started_at, reported_by) VALUES (%s, %s, 9, 'running', %s, 'has space')",
        (instance_id, record_id, T1),
    )


def test_the_judge_s_functions_write_their_last_argument(database_url: str) -> None:
    """Each call alone (autocommit), as the service makes it: on Citus a function delegated to
    a worker is sent there only outside a transaction block. The batch statement is one
    node's (on Citus the service sends each event of a batch to the one-event function)."""
    with psycopg.connect(database_url, autocommit=True) as db:
        batch = (
            "SELECT outcome, updated_by FROM steprecord_apply_events("
            " ARRAY[0], ARRAY['run-1'], ARRAY['s'],"
            " ARRAY['start'], ARRAY[1::bigint], NULL, NULL, NULL, NULL, NULL, NULL,"
            " ARRAY[NULL::bigint], ARRAY[60], NULL, 'hand')"
        )
        one = (
            "SELECT outcome, updated_by FROM steprecord_apply_event("
            " steprecord_instance_id('run-1'), 0, 'run-1', 's', 'start', 1, NULL, NULL, NULL,"
            " NULL, NULL, NULL, NULL, 60, NULL, 'hand')"
        )
        row = db.execute(one if has_citus(database_url) else batch).fetchone()
        assert row == ("created", "hand")
        row = db.execute(
            "SELECT outcome, updated_by FROM steprecord_heartbeat(ARRAY[0], ARRAY['run-1'],"
            " ARRAY['s'], ARRAY[1::bigint], ARRAY[60], 'beat')"
        ).fetchone()
        assert row == ("applied", "beat")
        row = db.execute(
            "SELECT outcome, updated_by FROM steprecord_apply_event("
            " steprecord_instance_id('run-1'), 0, 'run-1', 's', 'complete', 1, NULL, NULL, NULL,"
            " NULL, NULL, NULL, NULL, NULL, NULL, 'done')"
        ).fetchone()
        assert row == ("applied", "done")
        entry = db.execute("SELECT status, reported_by FROM workflow_step_attempt").fetchall()
        assert entry == [("completed", "done")]


def test_hand_written_sql_cannot_rewrite_who_finished_an_attempt(
    db: Conn, instance_id: int
) -> None:
    record_id = insert(db, instance_id, **BASE["completed"], updated_by="ci-runner")
    refused(
        db,
        GUARD,
        "UPDATE workflow_step_record SET updated_by = 'mallory' WHERE id = %s",
        (record_id,),
    )
    refused(
        db,
        HISTORY_GUARD,
        "UPDATE workflow_step_attempt SET reported_by = 'mallory' WHERE record_id = %s",
        (record_id,),
    )
    writer = db.execute("SELECT updated_by FROM workflow_step_record WHERE id = %s", (record_id,))
    assert writer.fetchone() == ("ci-runner",)


def test_a_hand_written_update_the_guard_allows_keeps_the_writer_it_names(
    db: Conn, instance_id: int
) -> None:
    """What the guard allows of a running record, it allows of its writer: an UPDATE that
    names none keeps the last one (the judge is the way to write a record as someone)."""
    record_id = insert(db, instance_id, **BASE["running"], updated_by="ci-runner")
    db.execute(
        "UPDATE workflow_step_record SET status = 'completed', completed_at = %s WHERE id = %s",
        (T2, record_id),
    )
    rows = db.execute(
        "SELECT r.updated_by, a.reported_by FROM workflow_step_record r"
        " JOIN workflow_step_attempt a ON a.instance_id = r.instance_id AND a.record_id = r.id"
        " WHERE r.id = %s",
        (record_id,),
    ).fetchall()
    assert rows == [("ci-runner", "ci-runner")]
