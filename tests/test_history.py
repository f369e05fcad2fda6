"""`GET .../steps/{step_slug}/attempts`: every attempt of a step, in attempt order."""

from typing import Any

import httpx
import pytest

from tests.support.http import T1, T2, T3, T4, attempts, history, post, problem, record, step_path


def retried(client: httpx.Client) -> None:
    """Attempt 1 failed, attempt 2 overtaken while running, attempt 3 completed."""
    post(client, "start", {"attempt": 1, "started_at": T1})
    post(
        client,
        "fail",
        {
            "attempt": 1,
            "completed_at": T2,
            "error_code": "CardDeclined",
            "error_message": "insufficient funds",
        },
    )
    post(client, "start", {"attempt": 2, "started_at": T2})
    post(
        client,
        "complete",
        {"attempt": 3, "started_at": T3, "completed_at": T4, "output": {"charge_id": "ch_1"}},
    )


def test_the_history_tells_what_each_attempt_did(client: httpx.Client) -> None:
    retried(client)
    items = client.get(f"{step_path()}/attempts").json()["items"]
    shown = [
        {
            k: a[k]
            for k in (
                "attempt",
                "status",
                "started_at",
                "completed_at",
                "error_code",
                "error_message",
                "output",
                "external_output_url",
                "lease_expires_at",
            )
        }
        for a in items
    ]
    assert shown == [
        {
            "attempt": 1,
            "status": "failed",
            "started_at": T1,
            "completed_at": T2,
            "error_code": "CardDeclined",
            "error_message": "insufficient funds",
            "output": None,
            "external_output_url": None,
            "lease_expires_at": None,
        },
        {
            "attempt": 2,
            "status": "superseded",
            "started_at": T2,
            "completed_at": T3,
            "error_code": None,
            "error_message": None,
            "output": None,
            "external_output_url": None,
            "lease_expires_at": None,
        },
        {
            "attempt": 3,
            "status": "completed",
            "started_at": T3,
            "completed_at": T4,
            "error_code": None,
            "error_message": None,
            "output": {"charge_id": "ch_1"},
            "external_output_url": None,
            "lease_expires_at": None,
        },
    ]
    assert all(a["created_at"].endswith("Z") and a["updated_at"].endswith("Z") for a in items)


def test_the_record_shows_only_the_latest_attempt(client: httpx.Client) -> None:
    retried(client)
    body = record(client)
    assert (body["attempt_count"], body["status"], body["error_code"]) == (3, "completed", None)
    assert "attempts" not in body


def test_attempts_are_paged_by_keyset(client: httpx.Client) -> None:
    retried(client)
    seen: list[int] = []
    params: dict[str, Any] = {"limit": 1}
    while True:
        page = client.get(f"{step_path()}/attempts", params=params).json()
        seen += [a["attempt"] for a in page["items"]]
        if page["next_cursor"] is None:
            break
        params["cursor"] = page["next_cursor"]
    assert seen == [1, 2, 3]


def test_a_summary_omits_output_and_message(client: httpx.Client) -> None:
    retried(client)
    items = client.get(f"{step_path()}/attempts", params={"fields": "summary"}).json()["items"]
    assert all("output" not in a and "error_message" not in a for a in items)
    assert items[0]["error_code"] == "CardDeclined"


def test_a_declared_step_has_an_empty_history(client: httpx.Client) -> None:
    post(client, "declare")
    assert client.get(f"{step_path()}/attempts").json() == {"items": [], "next_cursor": None}


def test_unknown_instance_or_step_is_a_404(client: httpx.Client) -> None:
    problem(client.get(f"{step_path()}/attempts"), 404, "instance_not_found")
    post(client, "start", step="other")
    problem(client.get(f"{step_path()}/attempts"), 404, "step_not_found")


@pytest.mark.parametrize(
    "params",
    [{"limit": 0}, {"limit": 1001}, {"cursor": "nope"}, {"fields": "all"}],
)
def test_bad_attempt_queries_are_refused(client: httpx.Client, params: dict[str, Any]) -> None:
    post(client, "start")
    problem(client.get(f"{step_path()}/attempts", params=params), 422, "validation_error")


def test_a_cursor_of_the_step_list_is_not_an_attempts_cursor(client: httpx.Client) -> None:
    post(client, "start", step="a")
    post(client, "start", step="charge")
    cursor = client.get("/v1/instances/order-1/steps", params={"limit": 1}).json()["next_cursor"]
    problem(
        client.get(f"{step_path()}/attempts", params={"cursor": cursor}), 422, "validation_error"
    )


def test_a_late_report_of_a_superseded_attempt_is_kept_in_the_history_not_the_record(
    client: httpx.Client,
) -> None:
    post(client, "start", {"attempt": 1, "started_at": T1})
    post(client, "start", {"attempt": 2, "started_at": T2})
    late = {"attempt": 1, "completed_at": T2, "error_code": "Timeout", "error_message": "slow"}
    body = problem(post(client, "fail", late), 409, "stale_attempt")
    assert body["recorded"] is True
    assert "kept in the step's history" in body["detail"]
    assert body["current"]["attempt_count"] == 2
    assert body["current"]["status"] == "running"
    assert problem(post(client, "fail", late), 409, "stale_attempt")["recorded"] is True
    other = {**late, "error_code": "Other"}
    assert problem(post(client, "fail", other), 409, "stale_attempt")["recorded"] is False
    stale_start = problem(
        post(client, "start", {"attempt": 1, "started_at": T1}), 409, "stale_attempt"
    )
    assert stale_start["recorded"] is False
    first = attempts(client)[0]
    assert (first["attempt"], first["status"], first["error_code"]) == (1, "failed", "Timeout")
    assert (first["started_at"], first["completed_at"], first["error_message"]) == (T1, T2, "slow")
    assert record(client)["status"] == "running"
    assert history(client) == [(1, "failed"), (2, "running")]


def test_a_late_report_of_an_attempt_the_history_never_saw_becomes_its_entry(
    client: httpx.Client,
) -> None:
    post(client, "start", {"attempt": 3, "started_at": T3})
    late = {"attempt": 2, "completed_at": T2, "output": {"partial": True}}
    assert problem(post(client, "complete", late), 409, "stale_attempt")["recorded"] is True
    entry = attempts(client)[0]
    # No start was ever reported for attempt 2: it started, as far as anyone knows, when it ended.
    assert (entry["attempt"], entry["status"], entry["started_at"]) == (2, "completed", T2)
    assert entry["output"] == {"partial": True}
    assert history(client) == [(2, "completed"), (3, "running")]
