"""The dashboard's statistics page (per step name: attempts, failure rate, a bar of the p95
duration, over a window of 1 h, 24 h or 7 d) and Failing now's failures-per-hour sparkline
and its filter by step name; within a tenant token's prefix, as the API reads them."""

import re
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from html import unescape

import httpx
import pytest
from playwright.sync_api import Page, expect

from app.cli.migrate import migrate
from tests.support.browser import screenshot
from tests.support.databases import create_database, drop_database
from tests.support.http import html, post
from tests.support.servers import start_server, stop
from tests.support.tokens import insert_token

TASK = "shop.tasks.charge"


def ago(**delta: float) -> str:
    return (datetime.now(UTC) - timedelta(**delta)).isoformat().replace("+00:00", "Z")


def run(
    client: httpx.Client,
    instance: str,
    slug: str,
    took: float,
    error: str | None = None,
    hours_ago: float = 0,
) -> None:
    """One attempt of `slug` started a minute (and `hours_ago`) ago, lasting `took` seconds."""
    start = datetime.now(UTC) - timedelta(minutes=1, hours=hours_ago)
    end = start + timedelta(seconds=took)
    body = {"attempt": 1, "started_at": start.isoformat()}
    assert post(client, "start", body, instance, slug).is_success
    done = {"attempt": 1, "completed_at": end.isoformat()}
    if error:
        assert post(client, "fail", {**done, "error_code": error}, instance, slug).is_success
    else:
        assert post(client, "complete", done, instance, slug).is_success


def workload(client: httpx.Client, prefix: str = "order-") -> None:
    """charge: 2 completed, 1 failed; a Celery task run 3 times (2 failed); ship: slow."""
    run(client, f"{prefix}1", "charge", 0.2)
    run(client, f"{prefix}2", "charge", 0.4)
    run(client, f"{prefix}3", "charge", 0.3, error="CardDeclined")
    for i, error in enumerate(("Timeout", "Timeout", None)):
        run(client, f"{prefix}{i + 1}", f"{TASK}:{uuid.uuid4()}", 1.0, error=error)
    run(client, f"{prefix}1", "ship", 30.0)


def stat_rows(page: str) -> dict[str, str]:
    return dict(re.findall(r'<tr data-name="([^"]+)">(.*?)</tr>', page, re.S))


def test_the_statistics_page_shows_each_step_name_as_the_api_counts_it(
    client: httpx.Client,
) -> None:
    workload(client)
    page = html(client, "/ui/stats")
    rows = stat_rows(page)
    api = client.get("/v1/stats/steps").json()["items"]
    assert list(rows) == [item["name"] for item in api]  # most attempts first, as the API
    assert set(rows) == {"charge", TASK, "ship"}  # a Celery task once, by its task name
    assert "33.3%" in rows["charge"]
    assert "66.7%" in rows[TASK]
    assert 'href="/ui/failing?step=shop.tasks.charge"' in rows[TASK]
    # The p95 bars are scaled to the slowest step's (on a log scale): ship's fills the column.
    assert 'data-share="100.00"' in rows["ship"]
    assert re.search(r'<span class="p95-text">(\d+\.\d s|\d+ ms)</span>', rows["charge"])
    assert 'href="/ui/stats"' in page  # linked from the nav


def test_the_statistics_window_is_an_hour_a_day_or_a_week(client: httpx.Client) -> None:
    start = {"attempt": 1, "started_at": ago(hours=3)}
    assert post(client, "start", start, "old-1", "backup").is_success
    assert post(client, "complete", {"completed_at": ago(hours=2)}, "old-1", "backup").is_success
    run(client, "new-1", "charge", 0.1)
    assert set(stat_rows(html(client, "/ui/stats?window=1h"))) == {"charge"}
    assert set(stat_rows(html(client, "/ui/stats?window=24h"))) == {"charge", "backup"}
    assert set(stat_rows(html(client, "/ui/stats?window=7d"))) == {"charge", "backup"}
    assert "checked> last hour" in html(client, "/ui/stats?window=1h")
    assert "The window is 1h, 24h or 7d." in html(client, "/ui/stats?window=30d", 422)


def test_failing_now_filters_by_step_name_a_celery_task_over_every_task_id(
    client: httpx.Client,
) -> None:
    workload(client)
    run(client, "order-9", f"{TASK}x:{uuid.uuid4()}", 1.0, error="Other")  # another task
    page = unescape(html(client, f"/ui/failing?step={TASK}"))
    assert page.count("<tr>") == 2 + 1  # the header and the task's two failures
    assert "Timeout" in page
    assert "CardDeclined" not in page
    assert "Other" not in page
    charge = unescape(html(client, "/ui/failing?step=charge"))
    assert "CardDeclined" in charge
    assert "Timeout" not in charge


def test_failing_now_has_a_sparkline_of_failures_per_hour(client: httpx.Client) -> None:
    workload(client)
    page = html(client, "/ui/failing")
    spark = re.search(r'<figure class="spark">.*?</figure>', page, re.S)
    assert spark is not None
    assert "Failed attempts per hour, last 24 hours: 3 in all" in spark.group(0)
    assert len(re.findall(r"<rect ", spark.group(0))) in (24, 25)  # every hour, the current too
    assert re.search(r": 3 failed</title>", spark.group(0))


# --- within a tenant token's prefix ----------------------------------------------------


@pytest.fixture(scope="module")
def tenant(server_dsn: str) -> Iterator[tuple[str, str, str]]:
    """A server of this module's own: (url, a write token, a read token of prefix `acme-`)."""
    name = "steprecord_ui_stats_" + uuid.uuid4().hex[:8]
    database_url = create_database(server_dsn, name)
    try:
        migrate(database_url)
        write = insert_token(database_url, "orchestrator", "write", None)
        acme = insert_token(database_url, "acme", "read", "acme-")
        url, proc = start_server(database_url)
        try:
            yield url, write, acme
        finally:
            stop(proc)
    finally:
        drop_database(server_dsn, name)


def test_a_tenant_sees_the_statistics_and_failures_of_its_prefix_only(
    tenant: tuple[str, str, str],
) -> None:
    url, write, acme = tenant
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {write}"}) as writer:
        workload(writer, "acme-")
        run(writer, "other-1", "refund", 2.0, error="Nope")
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {acme}"}) as reader:
        api = reader.get("/v1/stats/steps").json()["items"]
        rows = stat_rows(html(reader, "/ui/stats"))
        assert list(rows) == [item["name"] for item in api]
        assert "refund" not in rows
        assert not stat_rows(html(reader, "/ui/stats?prefix=other-"))
        failing = html(reader, "/ui/failing")
        assert "Nope" not in failing
        assert "3 in all" in failing
        assert "Nope" not in html(reader, "/ui/failing?step=refund")


# --- in a real browser -----------------------------------------------------------------


def test_the_statistics_page_and_failing_now_in_the_browser(
    page: Page, client: httpx.Client
) -> None:
    workload(client)
    for hours_ago, failures in ((3, 1), (7, 4), (8, 2), (15, 1), (20, 3)):
        for i in range(failures):
            run(client, f"batch-{hours_ago}-{i}", "export", 5.0, "DiskFull", hours_ago)
    page.goto("/ui")
    page.click("nav >> text=Statistics")
    expect(page.locator("h1")).to_have_text("Statistics")
    expect(page.locator("tr[data-name]")).to_have_count(4)
    bar = page.locator('tr[data-name="ship"] .p95-bar').bounding_box()
    assert bar is not None
    assert bar["width"] > 100
    screenshot(page, "statistics")
    page.click(f"text={TASK}")
    expect(page.locator("h1")).to_have_text("Failing now")
    expect(page.locator("table.list tbody tr")).to_have_count(2)
    expect(page.locator(".spark svg")).to_be_visible()
    page.goto("/ui/failing")
    screenshot(page, "failing-now")
