"""The dashboard read by a new user with a real workload, at 1,400 and 700 px: lane labels
name first with an id cut at its end, Failing now by failure time with a sparkline that
follows its step filter, p95 bars on a log scale with their values, short attempts that never
merge, a lease-less step running too long flagged, a step page's breadcrumb and indented large
outputs, and rows that fit on one line at 700 px."""

import json
import re
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from html import unescape

import httpx
import pytest
from playwright.sync_api import Browser, Page, expect

from app.dashboard import formatting as ui
from tests.support.browser import screenshot
from tests.support.http import html, post

ROOT_ID = "00000000-aaaa-4bbb-8ccc-000000000000"
FETCH = "shop.tasks.fetch_order:00000000-1111-4222-8333-444444444444"
CHARGE = "shop.tasks.charge_card:11111111-1111-4222-8333-444444444444"
SHIP = "shop.tasks.ship:22222222-1111-4222-8333-444444444444"
RECONCILE = "shop.tasks.reconcile:33333333-1111-4222-8333-444444444444"
NOW = datetime.now(UTC)
WIDTHS = (1400, 700)


def at(**delta: float) -> str:
    """A moment of the workload: it started 3 hours ago."""
    return (NOW - timedelta(hours=3) + timedelta(**delta)).isoformat()


def attempt(
    client: httpx.Client,
    instance: str,
    slug: str,
    number: int,
    start: str,
    end: str | None,
    error: str | None = None,
    **extra: object,
) -> None:
    body = {"attempt": number, "started_at": start}
    assert post(client, "start", body, instance, slug).is_success
    if end is None:
        return
    done = {"attempt": number, "completed_at": end, **extra}
    if error:
        assert post(client, "fail", done | {"error_code": error}, instance, slug).is_success
    else:
        assert post(client, "complete", done, instance, slug).is_success


def celery_chain(client: httpx.Client) -> None:
    """A chain of Celery tasks: an order fetched (its output over 64 KiB), a card charged on
    its second 50 ms try, a 2-hour shipment, and a reconciliation running for 2 hours without
    a lease."""
    order = {"order": 42, "lines": [{"sku": f"sku-{i:05}", "qty": i % 3 + 1} for i in range(3000)]}
    attempt(client, ROOT_ID, FETCH, 1, at(), at(seconds=1), output=order)
    attempt(client, ROOT_ID, CHARGE, 1, at(seconds=1), at(seconds=1.05), "CardDeclined")
    attempt(client, ROOT_ID, CHARGE, 2, at(seconds=1.06), at(seconds=1.11))
    attempt(client, ROOT_ID, SHIP, 1, at(seconds=1.2), at(hours=2, seconds=1.2))
    attempt(client, ROOT_ID, RECONCILE, 1, at(hours=1), None)


# --- without a browser -----------------------------------------------------------------


UUID = "00000000-1111-4222-8333-444444444444"


@pytest.mark.parametrize(
    ("slug", "size", "label"),
    [
        (f"shop.tasks.fetch_order:{UUID}", 28, "shop.tasks.fetch_order:0000…"),
        (f"shop.tasks.fetch_order:{UUID}", None, "shop.tasks.fetch_order:00000000…"),
        (f"shop.tasks.fetch_order:{UUID}", 20, "…fetch_order:000000…"),
        (f"shop.charge:{UUID}", 28, "shop.charge:00000000…"),
        ("load:17", 28, "load:17"),
        ("a_very_long_mapped_task_name_here:17", 20, "a_very_long_mapp…:17"),
        ("plain-step", 20, "plain-step"),
    ],
)
def test_a_label_keeps_the_name_and_cuts_the_id_at_its_end(
    slug: str, size: int | None, label: str
) -> None:
    assert ui.step_label(slug, size) == label
    assert size is None or len(label) <= size


def test_failing_now_is_ordered_by_failure_time_not_write_time(client: httpx.Client) -> None:
    # Written in this order, failed in the opposite one (a late report, a swept lease).
    attempt(client, "o-1", "charge", 1, at(minutes=1), at(minutes=2), "Early")
    attempt(client, "o-2", "charge", 1, at(minutes=3), at(minutes=30), "Latest")
    attempt(client, "o-3", "charge", 1, at(minutes=1), at(minutes=10), "Middle")
    for path in ("/ui/failing", "/ui/failing?step=charge"):
        page = html(client, path)
        order = re.findall(r"<code>(Early|Latest|Middle)</code>", page)
        assert order == ["Latest", "Middle", "Early"], (path, order)


def test_failing_now_s_sparkline_follows_its_step_filter(client: httpx.Client) -> None:
    celery_chain(client)
    attempt(client, "o-1", "export", 1, at(minutes=1), at(minutes=2), "DiskFull")
    attempt(client, "o-2", "export", 1, at(minutes=1), at(minutes=2), "DiskFull")

    def caption(path: str) -> str:
        found = re.search(r"<figcaption>(.*?)</figcaption>", html(client, path), re.S)
        assert found is not None
        return unescape(found[1])

    assert "3 in all" in caption("/ui/failing")
    assert "of step export per hour, last 24 hours: 2 in all" in caption("/ui/failing?step=export")
    step = "/ui/failing?step=shop.tasks.charge_card"
    assert "of step shop.tasks.charge_card per hour, last 24 hours: 1 in all" in caption(step)


def test_p95_bars_are_on_a_log_scale_with_their_values_written(client: httpx.Client) -> None:
    celery_chain(client)
    page = html(client, "/ui/stats")
    rows = dict(re.findall(r'<tr data-name="([^"]+)">(.*?)</tr>', page, re.S))
    share = {
        name: float(re.findall(r'data-share="([0-9.]+)"', row)[0])
        for name, row in rows.items()
        if "data-share" in row
    }
    assert share["shop.tasks.ship"] == 100.0
    # 50 ms beside 2 hours: a quarter of the bar on a log scale (a 700th on a linear one).
    assert 20 < share["shop.tasks.charge_card"] < 30, share
    assert '<span class="p95-text">2 h</span>' in rows["shop.tasks.ship"]
    assert re.search(r'<span class="p95-text">\d+ ms</span>', rows["shop.tasks.charge_card"])
    assert "(log scale)" in page


def test_a_lease_less_step_running_too_long_is_flagged_on_its_instance_page(
    client: httpx.Client,
) -> None:
    celery_chain(client)
    attempt(client, ROOT_ID, "leased", 1, at(hours=1), None, lease_seconds=None)
    lease = {"attempt": 1, "lease_seconds": 3600}
    assert client.post(f"/v1/instances/{ROOT_ID}/steps/leased/heartbeat", json=lease).is_success
    attempt(client, ROOT_ID, "recent", 1, (NOW - timedelta(minutes=5)).isoformat(), None)
    page = unescape(html(client, f"/ui/instances/{ROOT_ID}"))
    rows = dict(re.findall(r'<tr data-step="([^"]+)"(.*?)</tr>', page, re.S))
    assert "⚠ no lease" in rows[RECONCILE]
    assert re.search(r"running 2 h( \d+ min)? without a lease", rows[RECONCILE])
    assert "no lease" not in rows["leased"]  # a lease: the sweeper fails it if its worker dies
    assert "no lease" not in rows["recent"]  # not past STEPRECORD_LONG_RUNNING_AFTER (1 h)
    assert "1 step has been running longer than 1 h without a lease" in page


def test_the_step_page_s_breadcrumb_ends_in_the_step(client: httpx.Client) -> None:
    celery_chain(client)
    page = html(client, f"/ui/instances/{ROOT_ID}/steps/{FETCH}")
    crumbs = re.search(r'<nav class="crumbs".*?</nav>', page, re.S)
    assert crumbs is not None
    text = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", "", crumbs[0])).strip()
    assert text == f"Instances / {ROOT_ID} / shop.tasks.fetch_order:00000000…"


def test_a_large_output_is_indented_up_to_the_cut(client: httpx.Client) -> None:
    rows = [{"order": i, "sku": f"sku-{i:05}", "tags": ["a", "b"]} for i in range(4000)]
    attempt(client, "big-1", "export", 1, at(), at(seconds=1), output={"rows": rows})
    page = unescape(html(client, "/ui/instances/big-1/steps/export"))
    output = re.search(r'<pre class="output">(.*?)</pre>', page, re.S)
    assert output is not None
    assert "Showing the first 64 KiB of" in page
    lines = output[1].splitlines()
    assert lines[:5] == [
        "{",
        '  "rows": [',
        "    {",
        '      "sku": "sku-00000",',
        '      "tags": [',
    ]
    assert lines[-1] == "…"
    assert len(lines) > 1000


def test_the_sign_in_page_says_the_cookie_keeps_a_session_not_the_token(
    client: httpx.Client,
) -> None:
    page = re.sub(r"\s+", " ", html(client, "/ui/login"))
    assert "keeps a signed session in a cookie, never the token itself" in page
    assert "keeps it in a cookie" not in page


# --- in a real browser, at 1,400 and 700 px --------------------------------------------


@pytest.fixture(params=WIDTHS, ids=lambda width: f"{width}px")
def page(request: pytest.FixtureRequest, browser: Browser, server_url: str) -> Iterator[Page]:
    context = browser.new_context(
        base_url=server_url, viewport={"width": request.param, "height": 900}
    )
    try:
        yield context.new_page()
    finally:
        context.close()


def width_of(page: Page) -> int:
    return int(page.evaluate("window.innerWidth"))


def test_lanes_read_the_task_name_first_and_short_attempts_stay_apart(
    page: Page, client: httpx.Client
) -> None:
    celery_chain(client)
    page.goto(f"/ui/instances/{ROOT_ID}")
    lane = page.locator(f'g.lane[data-step="{FETCH}"] text.label')
    wide = width_of(page) >= 1000
    expect(lane).to_have_text(  # what is visible of the two labels
        re.compile("shop.tasks.fetch_order:0000…" if wide else "…fetch_order:000000…")
    )
    shown = lane.locator("tspan.wide" if wide else "tspan.narrow")
    assert shown.text_content() == (
        "shop.tasks.fetch_order:0000…" if wide else "…fetch_order:000000…"
    )
    hidden = lane.locator("tspan.narrow" if wide else "tspan.wide")
    expect(hidden).to_be_hidden()
    # The label ends before the bars begin.
    box, area = shown.bounding_box(), page.locator("#timeline").bounding_box()
    assert box is not None
    assert area is not None
    assert box["x"] + box["width"] < area["x"] + area["width"] * 0.22, (box, area)
    # Two 50 ms attempts beside a 2-hour step: two bars, apart.
    first, second = (
        b.bounding_box() for b in page.locator(f'g.lane[data-step="{CHARGE}"] rect.bar').all()
    )
    assert first is not None
    assert second is not None
    assert second["x"] - (first["x"] + first["width"]) >= 2.5, (first, second)
    expect(page.locator(f'#steps tr[data-step="{RECONCILE}"] .long-running').first).to_be_visible()
    if wide:
        screenshot(page, "instance-celery")


PAGES = {
    "instances": "/ui",
    "instance": f"/ui/instances/{ROOT_ID}",
    "step": f"/ui/instances/{ROOT_ID}/steps/{FETCH}",
    "failing": "/ui/failing",
    "stuck": "/ui/stuck",
    "stats": "/ui/stats",
}


def one_line_rows(page: Page) -> list[str]:
    """The table rows of a page taller than one line of text, as their text."""
    return list(
        page.evaluate(
            """() => [...document.querySelectorAll("main table tbody tr")]
                .filter(tr => tr.getBoundingClientRect().height > 36)
                .map(tr => tr.innerText)"""
        )
    )


def test_every_page_fits_its_width_with_rows_on_one_line(page: Page, client: httpx.Client) -> None:
    celery_chain(client)
    message = "Traceback (most recent call last):\n  ...\nValueError: no rows for 2026-12-06"
    for n in range(3):
        key = f"etl_daily:manual__2026-12-0{n + 1}T00:00:00+00:00"
        attempt(client, key, "load:3", 1, at(minutes=n), at(minutes=n + 1), "ValueError",
                error_message=message)  # fmt: skip
    for name, path in PAGES.items():
        page.goto(path)
        overflow = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
        assert overflow <= 0, (name, overflow)
        assert one_line_rows(page) == [], name
        if width_of(page) == 700:
            screenshot(page, f"narrow-{name}")


def test_json_dumps_is_what_a_whole_output_shows() -> None:
    text = json.dumps({"a": [1, {"b": 'x, "y": [z]'}, []], "c": {}})
    assert ui.pretty_head(text) == ui.pretty(text)
