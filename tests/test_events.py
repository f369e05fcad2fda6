"""The merge rules, through the real HTTP stack; each test also says what the history must be.

The history (`GET .../attempts`) keeps one row per attempt that started; a replay or a refusal
writes none (docs/api.md, "Attempt history").
"""

from datetime import UTC, datetime, timedelta

import httpx
import psycopg

from tests.support.http import T0, T1, T2, T3, T4, attempts, history, post, problem, record


def count_rows(database_url: str) -> int:
    with psycopg.connect(database_url) as conn:
        row = conn.execute("SELECT count(*) FROM workflow_step_record").fetchone()
        assert row is not None
        return int(row[0])


def test_bare_start_creates_a_running_record_with_attempt_one(client: httpx.Client) -> None:
    response = post(client, "start")
    assert response.status_code == 201
    body = response.json()
    assert body["status"] == "running"
    assert body["attempt_count"] == 1
    assert body["ordinal"] == 0
    assert body["instance_key"] == "order-1"
    assert body["started_at"].endswith("Z")
    assert body["completed_at"] is None
    (only,) = attempts(client)
    assert (only["attempt"], only["status"], only["started_at"]) == (
        1,
        "running",
        body["started_at"],
    )


def test_retry_updates_the_same_record(client: httpx.Client, database_url: str) -> None:
    first = post(client, "start")
    second = post(client, "start")
    assert (first.status_code, second.status_code) == (201, 200)
    assert second.json()["id"] == first.json()["id"]
    assert second.json()["attempt_count"] == 2
    assert count_rows(database_url) == 1
    first_started = first.json()["started_at"]
    (one, two) = attempts(client)
    assert (one["status"], one["completed_at"]) == ("superseded", second.json()["started_at"])
    assert one["started_at"] == first_started
    assert (two["attempt"], two["status"]) == (2, "running")


def test_complete_takes_started_at_from_the_running_record(client: httpx.Client) -> None:
    post(client, "start", {"attempt": 1, "started_at": T1})
    body = post(client, "complete", {"attempt": 1, "output": {"charge_id": "ch_1"}}).json()
    assert body["status"] == "completed"
    assert body["started_at"] == T1
    assert body["output"] == {"charge_id": "ch_1"}
    assert body["completed_at"] >= T1
    (only,) = attempts(client)
    assert (only["status"], only["started_at"], only["output"]) == (
        "completed",
        T1,
        {"charge_id": "ch_1"},
    )


def test_complete_without_any_start_is_refused_and_writes_nothing(client: httpx.Client) -> None:
    body = problem(post(client, "complete", {"output": 1}), 409, "not_started")
    assert body["current"] is None
    problem(client.get("/v1/instances/order-1"), 404, "instance_not_found")
    problem(client.get("/v1/instances/order-1/steps/charge/attempts"), 404, "instance_not_found")


def test_complete_on_a_declared_step_without_started_at_is_not_started(
    client: httpx.Client,
) -> None:
    post(client, "declare")
    body = problem(post(client, "complete", {}), 409, "not_started")
    assert body["current"]["status"] == "pending"
    assert record(client)["status"] == "pending"
    assert history(client) == []


def test_complete_with_started_at_creates_the_record(client: httpx.Client) -> None:
    response = post(client, "complete", {"started_at": T1, "completed_at": T2, "output": [1]})
    assert response.status_code == 201
    body = response.json()
    assert (body["status"], body["attempt_count"], body["started_at"], body["completed_at"]) == (
        "completed",
        1,
        T1,
        T2,
    )
    (only,) = attempts(client)
    assert (only["status"], only["started_at"], only["completed_at"], only["output"]) == (
        "completed",
        T1,
        T2,
        [1],
    )


def test_missing_completed_at_is_never_before_started_at(client: httpx.Client) -> None:
    # A start ahead of the server's clock, within the 24 hours of skew it accepts.
    future = (datetime.now(UTC) + timedelta(hours=23)).strftime("%Y-%m-%dT%H:%M:%SZ")
    body = post(client, "fail", {"started_at": future, "error_code": "Boom"}).json()
    assert body["completed_at"] == future
    assert [(a["status"], a["completed_at"]) for a in attempts(client)] == [("failed", future)]


def test_replayed_completion_is_unchanged(client: httpx.Client) -> None:
    post(client, "start", {"attempt": 1, "started_at": T1})
    first = post(client, "complete", {"attempt": 1, "completed_at": T2, "output": {"a": 1, "b": 2}})
    again = post(client, "complete", {"attempt": 1, "completed_at": T3, "output": {"b": 2, "a": 1}})
    assert again.status_code == 200
    assert again.json() == first.json()  # updated_at and completed_at untouched
    (only,) = attempts(client)
    assert (only["status"], only["completed_at"], only["updated_at"]) == (
        "completed",
        T2,
        first.json()["updated_at"],
    )


def test_different_content_for_the_same_attempt_is_a_conflict(client: httpx.Client) -> None:
    post(client, "start", {"attempt": 1, "started_at": T1})
    post(client, "complete", {"attempt": 1, "output": {"a": 1}})
    body = problem(post(client, "complete", {"attempt": 1, "output": {"a": 2}}), 409, "conflict")
    assert body["current"]["output"] == {"a": 1}
    problem(post(client, "fail", {"attempt": 1, "error_code": "E"}), 409, "conflict")
    assert record(client)["output"] == {"a": 1}
    assert [(a["status"], a["output"]) for a in attempts(client)] == [("completed", {"a": 1})]


def test_fail_replay_compares_code_and_message(client: httpx.Client) -> None:
    post(client, "start", {"attempt": 1, "started_at": T1})
    post(client, "fail", {"attempt": 1, "error_code": "Timeout", "error_message": "slow"})
    assert (
        post(
            client, "fail", {"attempt": 1, "error_code": "Timeout", "error_message": "slow"}
        ).status_code
        == 200
    )
    problem(post(client, "fail", {"attempt": 1, "error_code": "Timeout"}), 409, "conflict")
    (only,) = attempts(client)
    assert (only["status"], only["error_code"], only["error_message"]) == (
        "failed",
        "Timeout",
        "slow",
    )


def test_stale_attempt_is_refused_with_the_current_record(client: httpx.Client) -> None:
    """The record never changes for an older attempt; its report is kept in the history."""
    post(client, "start", {"attempt": 2, "started_at": T2})
    body = problem(post(client, "complete", {"attempt": 1, "started_at": T1}), 409, "stale_attempt")
    assert body["current"]["attempt_count"] == 2
    assert body["recorded"] is True
    assert record(client)["status"] == "running"
    assert history(client) == [(1, "completed"), (2, "running")]


def test_late_start_of_the_same_attempt_is_unchanged(client: httpx.Client) -> None:
    post(client, "start", {"attempt": 1, "started_at": T1})
    done = post(client, "complete", {"attempt": 1, "completed_at": T2}).json()
    late = post(client, "start", {"attempt": 1, "started_at": T0})
    assert late.status_code == 200
    assert late.json() == done
    (only,) = attempts(client)
    assert (only["status"], only["started_at"]) == ("completed", T1)


def test_declare_on_an_existing_record_is_unchanged(client: httpx.Client) -> None:
    started = post(client, "start", {"attempt": 1, "started_at": T1}).json()
    declared = post(client, "declare", {"ordinal": 9})
    assert declared.status_code == 200
    assert declared.json() == started
    assert history(client) == [(1, "running")]


def test_declare_creates_a_pending_record(client: httpx.Client) -> None:
    response = post(client, "declare")
    assert response.status_code == 201
    body = response.json()
    assert (body["status"], body["attempt_count"], body["started_at"]) == ("pending", 1, None)
    assert history(client) == []


def test_start_after_declare_keeps_the_first_attempt(client: httpx.Client) -> None:
    post(client, "declare")
    body = post(client, "start").json()
    assert (body["status"], body["attempt_count"]) == ("running", 1)
    assert history(client) == [(1, "running")]


def test_higher_attempt_starts_afresh(client: httpx.Client) -> None:
    post(client, "start", {"attempt": 1, "started_at": T1})
    post(
        client, "fail", {"attempt": 1, "completed_at": T2, "error_code": "E", "error_message": "x"}
    )
    body = post(client, "start", {"attempt": 2, "started_at": T3}).json()
    assert body["status"] == "running"
    assert body["attempt_count"] == 2
    assert body["started_at"] == T3
    assert (body["completed_at"], body["error_code"], body["error_message"]) == (None, None, None)
    (one, two) = attempts(client)
    assert (one["status"], one["completed_at"], one["error_code"], one["error_message"]) == (
        "failed",
        T2,
        "E",
        "x",
    )
    assert (two["attempt"], two["status"], two["started_at"]) == (2, "running", T3)


def test_higher_attempt_terminal_needs_its_own_start(client: httpx.Client) -> None:
    post(client, "start", {"attempt": 1, "started_at": T1})
    problem(post(client, "complete", {"attempt": 2}), 409, "not_started")
    response = post(client, "complete", {"attempt": 2, "started_at": T3, "completed_at": T4})
    assert response.status_code == 200
    assert response.json()["started_at"] == T3
    (one, two) = attempts(client)
    assert (one["status"], one["started_at"], one["completed_at"]) == ("superseded", T1, T3)
    assert (two["status"], two["started_at"], two["completed_at"]) == ("completed", T3, T4)


def test_terminal_before_its_start_converges(client: httpx.Client) -> None:
    done = post(
        client,
        "complete",
        {"attempt": 1, "started_at": T1, "completed_at": T2, "output": {"ok": True}},
    )
    late = post(client, "start", {"attempt": 1, "started_at": T1})
    assert late.status_code == 200
    assert late.json() == done.json()
    assert [(a["status"], a["output"]) for a in attempts(client)] == [("completed", {"ok": True})]


def test_bare_complete_uses_the_current_attempt(client: httpx.Client) -> None:
    post(client, "start", {"attempt": 3, "started_at": T1})
    body = post(client, "complete", {}).json()
    assert (body["attempt_count"], body["status"], body["output"]) == (3, "completed", None)
    assert history(client) == [(3, "completed")]


def test_bare_start_on_a_finished_record_opens_the_next_attempt(client: httpx.Client) -> None:
    post(client, "start")
    post(client, "complete", {"output": "done"})
    body = post(client, "start").json()
    assert (body["attempt_count"], body["status"], body["output"]) == (2, "running", None)
    assert history(client) == [(1, "completed"), (2, "running")]


def test_external_output_url_is_recorded(client: httpx.Client) -> None:
    post(client, "start")
    body = post(client, "complete", {"external_output_url": "s3://bucket/key"}).json()
    assert body["external_output_url"] == "s3://bucket/key"
    assert body["output"] is None
    (only,) = attempts(client)
    assert (only["external_output_url"], only["output"]) == ("s3://bucket/key", None)


def test_null_output_means_no_output(client: httpx.Client) -> None:
    post(client, "start")
    body = post(client, "complete", {"output": None, "external_output_url": "https://x/y"}).json()
    assert body["output"] is None


def test_server_assigns_ordinals_in_first_seen_order(client: httpx.Client) -> None:
    ordinals = [post(client, "declare", step=f"s{i}").json()["ordinal"] for i in range(3)]
    assert ordinals == [0, 1, 2]


def test_client_ordinal_is_kept_and_later_steps_go_after_it(client: httpx.Client) -> None:
    assert post(client, "start", {"ordinal": 10}, step="a").json()["ordinal"] == 10
    assert post(client, "start", step="b").json()["ordinal"] == 11
    assert post(client, "start", {"ordinal": 5}, step="c").json()["ordinal"] == 5
    assert post(client, "start", step="d").json()["ordinal"] == 12


def test_ordinal_on_an_existing_record_is_ignored(client: httpx.Client) -> None:
    post(client, "start", {"ordinal": 4})
    assert post(client, "start", {"ordinal": 7}).json()["ordinal"] == 4


def test_client_ordinal_used_by_another_step_is_refused(
    client: httpx.Client, database_url: str
) -> None:
    post(client, "start", {"ordinal": 3}, step="a")
    body = problem(post(client, "start", {"ordinal": 3}, step="b"), 409, "ordinal_taken")
    assert "ordinal 3 is held by step 'a'" in body["detail"]
    assert count_rows(database_url) == 1
    problem(client.get("/v1/instances/order-1/steps/b/attempts"), 404, "step_not_found")


def test_no_ordinal_left_is_refused(client: httpx.Client, database_url: str) -> None:
    post(client, "start", {"ordinal": 2147483647}, step="last")
    problem(post(client, "start", step="next"), 409, "ordinal_taken")
    assert count_rows(database_url) == 1
    assert history(client, step="last") == [(1, "running")]


def test_each_instance_has_its_own_steps(client: httpx.Client) -> None:
    a = post(client, "start", instance="run-a").json()
    b = post(client, "start", instance="run-b").json()
    assert a["id"] != b["id"]
    assert (a["ordinal"], b["ordinal"]) == (0, 0)


def test_timing_against_the_recorded_start_is_refused_by_the_database(
    client: httpx.Client,
) -> None:
    post(client, "start", {"attempt": 1, "started_at": T2})
    body = problem(
        post(client, "complete", {"attempt": 1, "completed_at": T1}), 422, "invalid_timing"
    )
    assert "ck_workflow_step_record_timing" in body["detail"]
    assert record(client)["status"] == "running"
    assert history(client) == [(1, "running")]


def test_replay_does_not_touch_updated_at(client: httpx.Client, database_url: str) -> None:
    post(client, "start", {"attempt": 1, "started_at": T1})
    with psycopg.connect(database_url) as conn:
        before = conn.execute("SELECT xmin::text, updated_at FROM workflow_step_record").fetchone()
    assert post(client, "start", {"attempt": 1, "started_at": T1}).status_code == 200
    with psycopg.connect(database_url) as conn:
        after = conn.execute("SELECT xmin::text, updated_at FROM workflow_step_record").fetchone()
    assert before == after
    with psycopg.connect(database_url) as conn:
        rows = conn.execute("SELECT xmin::text, updated_at FROM workflow_step_attempt").fetchall()
    assert post(client, "start", {"attempt": 1, "started_at": T1}).status_code == 200
    post(client, "declare")
    with psycopg.connect(database_url) as conn:
        again = conn.execute("SELECT xmin::text, updated_at FROM workflow_step_attempt").fetchall()
    assert len(rows) == 1
    assert again == rows


def test_bare_start_at_the_last_attempt_is_a_conflict(client: httpx.Client) -> None:
    post(client, "start", {"attempt": 2147483647})
    body = problem(post(client, "start"), 409, "conflict")
    assert body["current"]["attempt_count"] == 2147483647
    assert history(client) == [(2147483647, "running")]


def test_long_integers_in_output_are_kept_exactly(client: httpx.Client) -> None:
    content = (
        b'{"started_at": "2026-12-02T10:00:01Z", "output": {"n": 123456789012345678901234567890}}'
    )
    response = client.post(
        "/v1/instances/order-1/steps/charge/complete",
        content=content,
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 201
    assert b"123456789012345678901234567890" in response.content
    assert record(client)["output"] == {"n": 123456789012345678901234567890}
