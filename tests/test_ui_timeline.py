"""The instance page's timeline: ticks relative to the first start in units fit for the run
(milliseconds for a 50 ms run, days for a 3-day one), a minimum bar width, idle gaps
compressed and marked, each bar's details on hover and keyboard focus, and rows added live
drawn by the same server code as the rest."""

import itertools
import re
from datetime import UTC, datetime, timedelta

import httpx
import pytest
from playwright.sync_api import Page, expect

from app.dashboard import timeline
from tests.support.browser import screenshot
from tests.support.http import html, post
from tests.support.waits import wait_for

RUN = datetime(2026, 12, 1, 8, 0, tzinfo=UTC)
TASK_ID = "5f0c7d6e-2b1a-4c3d-9e8f-0a1b2c3d4e5f"
CELERY = f"shop.tasks.charge:{TASK_ID}"


def at(**delta: float) -> str:
    return (RUN + timedelta(**delta)).isoformat().replace("+00:00", "Z")


def step(
    client: httpx.Client, instance: str, slug: str, start: str, end: str | None, **fail: str
) -> None:
    assert post(client, "start", {"attempt": 1, "started_at": start}, instance, slug).is_success
    if end is not None:
        kind = "fail" if fail else "complete"
        body = {"attempt": 1, "completed_at": end, **fail}
        assert post(client, kind, body, instance, slug).is_success


def fifty_ms_run(client: httpx.Client, instance: str = "fast-1") -> None:
    step(client, instance, "parse", at(), at(milliseconds=8))
    step(client, instance, "validate", at(milliseconds=8), at(milliseconds=9))
    step(client, instance, "store", at(milliseconds=9), at(milliseconds=50))


def three_day_run(client: httpx.Client, instance: str = "slow-1") -> None:
    """Extract for 5 minutes, wait 2 days for an approval, nothing for 20 hours, then a
    failed shipment retried (its error's first line shown)."""
    step(client, instance, "extract", at(), at(minutes=5))
    step(client, instance, "await-approval", at(minutes=5), at(days=2))
    failure = {"error_code": "CarrierDown", "error_message": "carrier API answered 503\ntrace…"}
    step(client, instance, "ship", at(days=2, hours=20), at(days=2, hours=20, minutes=1), **failure)
    again = {"attempt": 2, "started_at": at(days=2, hours=20, minutes=2)}
    assert post(client, "start", again, instance, "ship").is_success
    done = {"attempt": 2, "completed_at": at(days=3)}
    assert post(client, "complete", done, instance, "ship").is_success


def tick_labels(page: str) -> list[str]:
    return re.findall(r'class="axis tick-label"[^>]*>([^<]+)<', page)


# --- the scale, without a browser ------------------------------------------------------


def test_a_50_ms_run_is_ticked_in_milliseconds(client: httpx.Client) -> None:
    fifty_ms_run(client)
    labels = tick_labels(html(client, "/ui/instances/fast-1"))
    assert labels[:3] == ["+0 ms", "+10 ms", "+20 ms"], labels
    assert "+50 ms" in labels


def test_a_3_day_run_is_ticked_in_hours_and_days_with_its_idle_gap_marked(
    client: httpx.Client,
) -> None:
    three_day_run(client)
    page = html(client, "/ui/instances/slow-1")
    labels = tick_labels(page)
    assert labels[0] == "+0 h", labels
    assert "+1 d" in labels, labels
    assert all(re.fullmatch(r"\+(\d+ d ?)?(\d+ h)?", label) for label in labels), labels
    # The 20 idle hours between the approval and the shipment are one break, marked.
    assert page.count('class="gap-mark"') == 1
    assert "⋯ 20 h" in page
    assert "20 h with no step running, not drawn" in page


def test_the_steps_table_shows_the_first_line_of_the_error_message(client: httpx.Client) -> None:
    three_day_run(client, "slow-2")
    step(client, "slow-2", "notify", at(days=3), at(days=3, seconds=1), error_code="Boom",
         error_message="first line\nsecond line")  # fmt: skip
    page = html(client, "/ui/instances/slow-2")
    row = re.search(r'<tr data-step="notify".*?</tr>', page)
    assert row is not None
    assert "<code>Boom</code>: first line" in row.group(0)
    assert "second line" not in row.group(0)


def test_a_bar_is_never_narrower_than_the_minimum_nor_past_the_end() -> None:
    ms = timedelta(milliseconds=1)
    scale = timeline.scale(
        [(RUN, RUN + timedelta(days=3)), (RUN + timedelta(days=1), RUN + timedelta(days=1) + ms)],
        running=False,
        now=RUN,
    )
    assert scale is not None
    x, width = scale.bar(RUN + timedelta(days=1), RUN + timedelta(days=1) + ms)
    assert width == timeline.MIN_BAR
    x, width = scale.bar(RUN + timedelta(days=3) - ms, RUN + timedelta(days=3))
    assert x + width <= timeline.LABEL + timeline.AREA + 1e-9


def test_a_lane_s_attempts_keep_a_gap_and_stay_within_the_area() -> None:
    # Two 50 ms attempts beside a 2-hour step: each at the minimum width, the second after a
    # gap; and at the very end of the run, moved back rather than past the area's end.
    end = timeline.LABEL + timeline.AREA
    short = [(50.0, timeline.MIN_BAR), (50.001, timeline.MIN_BAR)]
    (x1, w1), (x2, w2) = timeline.separate(short)
    assert (w1, w2) == (timeline.MIN_BAR, timeline.MIN_BAR)
    assert x2 - (x1 + w1) >= timeline.MIN_GAP - 1e-9
    at_end = [(end - timeline.MIN_BAR, timeline.MIN_BAR)] * 3
    placed = timeline.separate(at_end)
    assert placed[-1][0] + placed[-1][1] <= end + 1e-9
    assert all(
        b[0] - (a[0] + a[1]) >= timeline.MIN_GAP - 1e-9 for a, b in itertools.pairwise(placed)
    )


@pytest.mark.parametrize(
    ("span", "first_ticks"),
    [
        (timedelta(milliseconds=50), ["+0 ms", "+10 ms"]),
        (timedelta(seconds=3), ["+0 ms", "+500 ms", "+1 s"]),
        (timedelta(minutes=1), ["+0 s", "+10 s"]),
        (timedelta(hours=2), ["+0 min", "+15 min", "+30 min"]),
        (timedelta(days=3), ["+0 h", "+12 h", "+1 d"]),
    ],
)
def test_ticks_are_chosen_for_the_span(span: timedelta, first_ticks: list[str]) -> None:
    scale = timeline.scale([(RUN, RUN + span)], running=False, now=RUN)
    assert scale is not None
    labels = [tick.label for tick in scale.ticks]
    assert labels[: len(first_ticks)] == first_ticks
    assert 4 <= len(labels) <= 9
    xs = [tick.x for tick in scale.ticks]
    assert all(b - a >= timeline.TICK_ROOM for a, b in itertools.pairwise(xs))


# --- in a real browser -----------------------------------------------------------------


def test_a_1_ms_step_in_a_3_day_run_is_drawn_at_least_3_pixels_wide(
    page: Page, client: httpx.Client
) -> None:
    three_day_run(client)
    step(client, "slow-1", "ping", at(days=1), at(days=1, milliseconds=1))
    page.goto("/ui/instances/slow-1")
    bar = page.locator('g.lane[data-step="ping"] rect.bar')
    box = bar.bounding_box()
    assert box is not None
    assert box["width"] >= 3, box
    screenshot(page, "timeline-3-day-run")


def test_a_bars_details_show_on_hover_and_on_keyboard_focus(
    page: Page, client: httpx.Client
) -> None:
    three_day_run(client)
    page.goto("/ui/instances/slow-1")
    bar = page.locator('g.lane[data-step="ship"] rect.bar').first
    label = bar.get_attribute("aria-label") or ""
    for text in ("attempt 1", "failed", "CarrierDown", "carrier API answered 503", "took 1 min"):
        assert text in label, label
    assert "trace…" not in label  # the first line only
    tip = page.locator("#tip")
    expect(tip).to_be_hidden()
    bar.hover()
    expect(tip).to_be_visible()
    expect(tip).to_contain_text("attempt 1: failed")
    page.mouse.move(0, 0)
    expect(tip).to_be_hidden()
    # By keyboard: tab from the last lane label onto the shipment's first bar.
    page.locator('g.lane[data-step="ship"] a').focus()
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.getAttribute('data-attempt')") == "1"
    expect(tip).to_be_visible()
    expect(tip).to_contain_text("CarrierDown: carrier API answered 503")
    screenshot(page, "timeline-focus", full_page=False)
    page.keyboard.press("Escape")
    expect(tip).to_be_hidden()


def test_a_50_ms_run_reads_well_in_the_browser(page: Page, client: httpx.Client) -> None:
    fifty_ms_run(client)
    page.goto("/ui/instances/fast-1")
    expect(page.locator("text.tick-label").first).to_have_text("+0 ms")
    widths = [b.bounding_box() for b in page.locator("rect.bar").all()]
    assert all(box is not None and box["width"] >= 3 for box in widths), widths
    screenshot(page, "timeline-50-ms-run")


def test_a_run_with_one_very_long_step(page: Page, client: httpx.Client) -> None:
    step(client, "long-1", "fetch", at(), at(seconds=2))
    step(client, "long-1", "train-model", at(seconds=2), at(hours=5))
    step(client, "long-1", "publish", at(hours=5), at(hours=5, seconds=3))
    page.goto("/ui/instances/long-1")
    expect(page.locator("text.tick-label").nth(1)).to_have_text("+1 h")
    for slug in ("fetch", "publish"):
        box = page.locator(f'g.lane[data-step="{slug}"] rect.bar').bounding_box()
        assert box is not None
        assert box["width"] >= 3, box
    screenshot(page, "timeline-one-long-step")


def lane_and_row(page: Page, slug: str) -> tuple[str, str]:
    lane = page.locator(f'g.lane[data-step="{slug}"]').evaluate("e => e.outerHTML")
    row = page.locator(f'#steps tr[data-step="{slug}"]').evaluate("e => e.outerHTML")
    return lane, row


def test_a_row_added_live_is_drawn_as_the_server_draws_it_celery_slug_included(
    page: Page, client: httpx.Client
) -> None:
    step(client, TASK_ID, "fetch", at(), at(seconds=1))
    page.goto(f"/ui/instances/{TASK_ID}")
    expect(page.locator("#live")).to_have_text("live", timeout=10_000)
    page.evaluate("window.notReloaded = true")
    failure = {"error_code": "CardDeclined", "error_message": "declined\nby the bank"}
    step(client, TASK_ID, CELERY, at(seconds=1), at(seconds=2), **failure)
    row = page.locator(f'#steps tr[data-step="{CELERY}"]')
    expect(row.locator("td.status")).to_contain_text("failed", timeout=10_000)
    expect(row.locator("td").nth(1)).to_have_text("shop.tasks.charge:5f0c7d6e…")
    live = lane_and_row(page, CELERY)
    assert page.evaluate("window.notReloaded") is True
    page.reload()
    assert lane_and_row(page, CELERY) == live


def test_a_running_bar_grows_to_now_on_the_servers_scale(page: Page, client: httpx.Client) -> None:
    # Running for 100 s: the scale leaves 5 s of room past now, so the bar grows by about 1 %
    # of the width a second for several seconds before the server draws a new scale (a
    # shorter run reaches the scale's end at once and is drawn again every second).
    started = (datetime.now(UTC) - timedelta(seconds=100)).isoformat()
    step(client, "busy-1", "done", started, (datetime.now(UTC) - timedelta(seconds=99)).isoformat())
    assert post(client, "start", {"started_at": started}, "busy-1", "work").is_success
    page.goto("/ui/instances/busy-1")
    bar = page.locator('g.lane[data-step="work"] rect.bar.running')
    first = bar.bounding_box()
    assert first is not None
    wait_for(
        "the running bar to grow",
        lambda: (box := bar.bounding_box()) is not None and box["width"] > first["width"] + 5,
    )
