"""A dag run on the dashboard, recorded as the Airflow plugin records one (its events sent over
HTTP as the plugin sends them; no Airflow needed): the run is the instance `{dag_id}:{run_id}`,
a task a step, a mapped task's instances `load:0` … `load:19`, a try an attempt. The picture
of it is the one docs/airflow.md shows."""

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from playwright.sync_api import Browser, Page, expect
from steprecord_client.airflow import instance_key, step_slug

from tests.support.browser import screenshot
from tests.support.http import post

DAG, RUN_ID = "etl_daily", "scheduled__2026-12-06T00:00:00+00:00"
KEY = instance_key(DAG, RUN_ID)
RUN = datetime(2026, 12, 6, 0, 0, 4, tzinfo=UTC)
RETRIED, FAILED = 7, 13
MAPPED = 20


def at(seconds: float) -> str:
    return (RUN + timedelta(seconds=seconds)).isoformat()


def details(task_id: str, map_index: int, try_number: int) -> dict[str, Any]:
    """What the plugin reports of a try (its output, and its error message's first line)."""
    return {
        "dag_id": DAG,
        "run_id": RUN_ID,
        "task_id": task_id,
        "map_index": map_index,
        "try_number": try_number,
        "max_tries": 1,
        "operator": "@task",
        "owner": "data-team",
        "pool": "default_pool",
        "queue": "default",
        "hostname": "worker-1",
    }


def a_try(
    client: httpx.Client,
    task_id: str,
    map_index: int,
    try_number: int,
    start: float,
    end: float,
    failed: str | None = None,
) -> None:
    """One try as the plugin reports it: `start` with a lease, then `complete` with the try's
    details as its output, or `fail` with the exception's class and a traceback."""
    slug = step_slug(task_id, None if map_index < 0 else map_index)
    body = {"attempt": try_number, "started_at": at(start), "lease_seconds": 60}
    assert post(client, "start", body, quote(KEY, safe=":"), slug).is_success
    done: dict[str, Any] = {
        "attempt": try_number,
        "started_at": at(start),
        "completed_at": at(end),
    }
    d = details(task_id, map_index, try_number)
    if failed is None:
        done["output"] = {"state": "success", **d}
        assert post(client, "complete", done, quote(KEY, safe=":"), slug).is_success
        return
    task = task_id if map_index < 0 else f"{task_id}[{map_index}]"
    summary = (
        f"Airflow try {try_number} of 2 ({failed}): dag {DAG}, task {task}, operator @task,"
        " owner data-team, pool default_pool, queue default, hostname worker-1"
    )
    trace = (
        "Traceback (most recent call last):\n"
        '  File "/opt/airflow/dags/etl_daily.py", line 31, in load\n'
        "    rows = warehouse.fetch(partition)\n"
        f"ValueError: no rows for partition {map_index} of 2026-12-06"
    )
    done |= {"error_code": "ValueError", "error_message": f"{summary}\n\n{trace}"}
    assert post(client, "fail", done, quote(KEY, safe=":"), slug).is_success


def dag_run(client: httpx.Client) -> None:
    """`extract`, then `load` mapped over 20 partitions (partition 7 fails once and succeeds
    on its retry 30 s later; partition 13 fails both its tries), then `publish`."""
    a_try(client, "extract", -1, 1, 0, 42)
    for index in range(MAPPED):
        start = 44 + index * 1.5
        took = 12 + (index * 7) % 19
        if index == RETRIED:
            a_try(client, "load", index, 1, start, start + 4, failed="up_for_retry")
            a_try(client, "load", index, 2, start + 34, start + 34 + took)
        elif index == FAILED:
            a_try(client, "load", index, 1, start, start + 3, failed="up_for_retry")
            a_try(client, "load", index, 2, start + 33, start + 36, failed="failed")
        else:
            a_try(client, "load", index, 1, start, start + took)
    a_try(client, "publish", -1, 1, 140, 141.5)


@pytest.fixture
def page(browser: Browser, server_url: str) -> Iterator[Page]:
    context = browser.new_context(base_url=server_url, viewport={"width": 1400, "height": 900})
    try:
        yield context.new_page()
    finally:
        context.close()


def test_a_dag_run_reads_as_its_tasks_and_tries(page: Page, client: httpx.Client) -> None:
    dag_run(client)
    page.goto(f"/ui/instances/{quote(KEY, safe=':')}")
    expect(page.locator("h1")).to_contain_text(KEY)
    lanes = page.locator("g.lane text.label tspan.wide")
    expect(lanes).to_have_count(MAPPED + 2)
    assert lanes.all_text_contents()[:3] == ["extract", "load:0", "load:1"]
    retried = page.locator(f'g.lane[data-step="load:{RETRIED}"] rect.bar')
    expect(retried).to_have_count(2)
    first, second = (bar.bounding_box() for bar in retried.all())
    assert first is not None
    assert second is not None
    assert second["x"] > first["x"] + first["width"]
    row = page.locator(f'#steps tr[data-step="load:{FAILED}"]')
    expect(row.locator("td.status")).to_contain_text("failed")
    expect(row.locator("td.error")).to_have_text(
        f"ValueError: no rows for partition {FAILED} of 2026-12-06"
    )
    expect(page.locator(f'#steps tr[data-step="load:{RETRIED}"] td.attempts')).to_have_text("2")
    screenshot(page, "airflow-dag-run")
    # The mapped task's failures, over every map index, from its step page's name.
    page.goto("/ui/failing?step=load")
    expect(page.locator("table.list tbody tr")).to_have_count(1)
