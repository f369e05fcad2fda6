"""The dashboard's step page shows a step's repairs: when, who, which attempt, and why."""

import httpx
from playwright.sync_api import Page, expect

from tests.support.browser import screenshot
from tests.support.http import post, step_path

REASON = "refund confirmed by the processor <b>by hand</b>; run the charge again"


def reopen(client: httpx.Client, reason: str, attempt: int) -> None:
    answer = client.post(f"{step_path()}/reopen", json={"reason": reason, "attempt": attempt})
    assert answer.status_code == 200, answer.text


def test_the_step_page_lists_repairs_newest_first_as_text(client: httpx.Client) -> None:
    post(client, "start", {"attempt": 1})
    post(client, "fail", {"attempt": 1, "error_code": "CardDeclined"})
    reopen(client, REASON, 1)
    post(client, "start")
    post(client, "complete", {"attempt": 2})
    reopen(client, "second look", 2)
    page = client.get("/ui/instances/order-1/steps/charge").text
    assert page.count('<h2 id="repairs">Repairs</h2>') == 1
    assert page.index("second look") < page.index("refund confirmed")
    assert "&lt;b&gt;by hand&lt;/b&gt;" in page
    assert "<b>by hand" not in page
    assert "anonymous" in page
    assert "Reopened, not started again yet: attempt 3" in page
    other = client.get("/ui/instances/order-1/steps/other")
    assert other.status_code == 404
    post(client, "declare", step="other")
    assert "Repairs" not in client.get("/ui/instances/order-1/steps/other").text


def test_the_step_page_shows_repairs_in_the_browser(page: Page, client: httpx.Client) -> None:
    post(client, "start", {"attempt": 1})
    post(client, "fail", {"attempt": 1, "error_code": "CardDeclined", "error_message": "no"})
    reopen(client, REASON, 1)
    post(client, "start")
    post(client, "complete", {"attempt": 2, "output": {"charge_id": "ch_2"}})
    page.goto("/ui/instances/order-1/steps/charge")
    rows = page.locator("table.repairs tbody tr")
    expect(rows).to_have_count(1)
    expect(rows.first).to_contain_text("anonymous")
    expect(rows.first).to_contain_text(REASON)
    expect(page.locator("article.attempt")).to_have_count(2)
    screenshot(page, "step-repairs")
