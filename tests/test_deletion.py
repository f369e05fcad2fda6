"""`DELETE /v1/instances/{instance_key}`: an instance goes with its records and their history,
its open streams end, and its key starts a new instance when used again."""

from collections.abc import Callable

import httpx
import psycopg
import pytest
from playwright.sync_api import Browser, expect

from tests.support.http import T1, T2, T3, post, problem
from tests.support.streams import Stream
from tests.support.waits import eventually

INSTANCE = "/v1/instances/order-1"


def rows_of(database_url: str, instance_key: str) -> tuple[int, int, int]:
    """(instances, records, attempts) stored under `instance_key`."""
    with psycopg.connect(database_url) as conn:
        row = conn.execute(
            "SELECT count(DISTINCT p.id), count(DISTINCT r.id), count(a.id)"
            " FROM process_instance p"
            " LEFT JOIN workflow_step_record r ON r.instance_id = p.id"
            " LEFT JOIN workflow_step_attempt a"
            " ON a.instance_id = r.instance_id AND a.record_id = r.id"
            # The instance's id as a value too: on Citus the join then runs on its one shard.
            " WHERE p.id = steprecord_instance_id(%s) AND p.instance_key = %s",
            (instance_key, instance_key),
        ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1]), int(row[2])


def finished_instance(client: httpx.Client) -> None:
    post(client, "start", {"attempt": 1, "started_at": T1})
    post(client, "fail", {"attempt": 1, "completed_at": T2, "error_code": "E"})
    post(client, "start", {"attempt": 2, "started_at": T2})
    post(client, "complete", {"attempt": 2, "completed_at": T3, "output": {"ok": True}})
    post(client, "declare", step="later")


def test_deleting_an_instance_removes_it_with_its_records_and_history(
    client: httpx.Client, database_url: str
) -> None:
    finished_instance(client)
    post(client, "start", {"attempt": 1, "started_at": T1}, instance="order-2")
    assert rows_of(database_url, "order-1") == (1, 2, 2)
    deleted = client.delete(INSTANCE)
    assert deleted.status_code == 204
    assert deleted.content == b""
    problem(client.get(INSTANCE), 404, "instance_not_found")
    problem(client.get(f"{INSTANCE}/steps"), 404, "instance_not_found")
    problem(client.get(f"{INSTANCE}/steps/charge/attempts"), 404, "instance_not_found")
    assert rows_of(database_url, "order-1") == (0, 0, 0)
    assert client.get("/v1/instances/order-2/steps/charge").status_code == 200  # others stay
    problem(client.delete(INSTANCE), 404, "instance_not_found")


def test_an_instance_with_a_running_step_is_deleted_only_when_forced(
    client: httpx.Client, database_url: str
) -> None:
    post(client, "start", {"attempt": 1, "started_at": T1})
    post(client, "declare", step="next")
    body = problem(client.delete(INSTANCE), 409, "instance_active")
    assert "1 step is still running" in body["detail"]
    assert "force=true" in body["detail"]
    assert rows_of(database_url, "order-1") == (1, 2, 1)  # nothing was deleted
    assert client.delete(INSTANCE, params={"force": "false"}).status_code == 409
    assert client.delete(INSTANCE, params={"force": "true"}).status_code == 204
    assert rows_of(database_url, "order-1") == (0, 0, 0)


@pytest.mark.parametrize("query", ["force=yes", "force=true&force=true&x=1", "forced=true"])
def test_a_bad_force_is_refused_before_anything_is_deleted(
    client: httpx.Client, database_url: str, query: str
) -> None:
    post(client, "start", {"attempt": 1, "started_at": T1})
    assert client.delete(f"{INSTANCE}?{query}").status_code == 422
    assert rows_of(database_url, "order-1") == (1, 1, 1)


def test_a_deleted_key_starts_a_new_instance(client: httpx.Client) -> None:
    finished_instance(client)
    old = client.get(INSTANCE).json()
    assert client.delete(INSTANCE).status_code == 204
    again = post(client, "start", {"attempt": 1, "started_at": T3})
    assert again.status_code == 201
    assert again.json()["ordinal"] == 0
    new = client.get(INSTANCE).json()
    assert new["id"] == old["id"]  # the key's own id (steprecord_instance_id), not a count
    assert new["created_at"] > old["created_at"]
    assert new["step_counts"] == {"pending": 0, "running": 1, "completed": 0, "failed": 0}
    history = client.get(f"{INSTANCE}/steps/charge/attempts").json()["items"]
    assert [(a["attempt"], a["status"]) for a in history] == [(1, "running")]


def test_open_streams_of_a_deleted_instance_end(
    client: httpx.Client, open_stream: Callable[..., Stream]
) -> None:
    finished_instance(client)
    stream = open_stream()
    stream.events(2)
    assert client.delete(INSTANCE).status_code == 204
    eventually(stream.ended, seconds=10)


def test_the_dashboard_shows_a_deleted_instance_as_gone(
    browser: Browser, server_url: str, client: httpx.Client
) -> None:
    finished_instance(client)
    context = browser.new_context(base_url=server_url)
    try:
        page = context.new_page()
        page.goto("/ui/instances/order-1")
        expect(page.locator("#live")).to_have_text("live", timeout=10_000)
        assert client.delete(INSTANCE).status_code == 204
        expect(page.locator("#live")).to_have_text(
            "deleted: this instance no longer exists", timeout=15_000
        )
        assert page.goto("/ui/instances/order-1").status == 404  # type: ignore[union-attr]
    finally:
        context.close()
