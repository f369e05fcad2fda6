"""The dashboard at /ui: its pages over HTTP, its access rules, and in a real browser.

The browser is Debian's chromium driven by Playwright, never a downloaded one. Without
chromium the browser tests are skipped, except in CI (`CI=true`), where they fail.
Screenshots go to tests/artifacts/ (ignored by git, kept by CI).
"""

import json
import re
import time
import uuid
from collections.abc import Iterator
from html import unescape
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from playwright.sync_api import Browser, Page, expect
from steprecord_client import fit_message

from app.access import sessions
from app.cli.migrate import migrate
from app.core.shown import shown
from app.data import dashboard, reads
from tests.support.browser import screenshot
from tests.support.databases import create_database, drop_database
from tests.support.http import T0, T1, T2, T3, T4, html, post
from tests.support.plans import one_shard, plan
from tests.support.servers import start_server, stop
from tests.support.tokens import insert_token
from tests.support.waits import eventually

ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
SCRIPT = "<script>window.pwned = 1</script>"
IMAGE = "<img src=x onerror=window.pwned=1>"
SCRIPT_URL = "javascript://example.com/%0Awindow.pwned=1"


def order_with_history(client: httpx.Client, instance: str = "order-1") -> None:
    """charge: attempt 1 failed, attempt 2 completed; ship: attempt 1 superseded by a running
    attempt 2; pack: swept (its lease expired); notify: declared only."""
    for kind, body in [
        ("start", {"attempt": 1, "started_at": T0}),
        ("fail", {"attempt": 1, "completed_at": T1, "error_code": "CardDeclined"}),
        ("start", {"attempt": 2, "started_at": T2}),
        ("complete", {"attempt": 2, "completed_at": T3, "output": {"charge_id": "ch_1"}}),
    ]:
        assert post(client, kind, body, instance, "charge").status_code < 300
    assert post(client, "start", {"attempt": 1, "started_at": T3}, instance, "ship").is_success
    assert post(client, "start", {"attempt": 2, "started_at": T4}, instance, "ship").is_success
    swept = {"attempt": 1, "completed_at": T4, "error_code": "lease_expired"}
    assert post(client, "start", {"attempt": 1, "started_at": T1}, instance, "pack").is_success
    assert post(client, "fail", swept, instance, "pack").is_success
    assert post(client, "declare", None, instance, "notify").is_success


# --- pages over HTTP -------------------------------------------------------------------


def test_an_empty_service_says_how_to_report_a_first_step(client: httpx.Client) -> None:
    page = html(client, "/ui")
    assert "No instances yet" in page
    assert "curl -X POST" in page
    assert "/v1/instances/order-1/steps/charge/start" in page


def test_the_instance_list_shows_instances_newest_first_with_step_counts(
    client: httpx.Client,
) -> None:
    order_with_history(client, "order-1")
    assert post(client, "start", None, "invoice-7", "render").is_success
    page = html(client, "/ui")
    assert page.index("invoice-7") < page.index("order-1")
    row = page[page.index("order-1") :]
    row = row[: row.index("</tr>")]
    for text in ("1 failed", "1 running", "1 pending", "1 completed"):
        assert text in row, row


def test_the_list_filters_by_failed_or_running_steps_and_by_key_prefix(
    client: httpx.Client,
) -> None:
    assert post(client, "start", None, "run-a", "s").is_success
    assert post(client, "start", None, "run-b", "s").is_success
    fail = {"error_code": "Boom"}
    assert post(client, "fail", fail, "run-b", "s").is_success
    assert post(client, "declare", None, "job-c", "s").is_success
    links = re.compile(r'href="/ui/instances/([^"/]+)"')
    assert links.findall(html(client, "/ui?status=failed")) == ["run-b"]
    assert links.findall(html(client, "/ui?status=running")) == ["run-a"]
    assert links.findall(html(client, "/ui?prefix=run-")) == ["run-b", "run-a"]
    assert links.findall(html(client, "/ui?prefix=run-&status=running")) == ["run-a"]
    nothing = html(client, "/ui?prefix=zzz")
    assert links.findall(nothing) == []
    assert "No instance matches these filters" in nothing


def test_the_list_pages_through_older_instances(client: httpx.Client) -> None:
    for i in range(55):
        assert post(client, "declare", None, f"batch-{i:02}", "s").is_success
    first = html(client, "/ui")
    assert "batch-54" in first
    assert "batch-04" not in first
    older = re.search(r'href="(/ui\?cursor=[^"]+)"', first)
    assert older is not None
    second = html(client, older.group(1).replace("&amp;", "&"))
    assert "batch-04" in second
    assert "batch-00" in second
    assert "batch-54" not in second


@pytest.mark.parametrize(
    "query", ["status=stuck", "prefix=%3Cscript%3E", "prefix=a%20b", "cursor=garbled"]
)
def test_a_bad_filter_is_a_422_page_that_says_what_is_allowed(
    client: httpx.Client, query: str
) -> None:
    page = html(client, f"/ui?{query}", 422)
    assert 'class="error"' in page
    assert "<script>" not in page


def test_the_instance_page_has_a_lane_per_step_and_a_bar_per_attempt(
    client: httpx.Client,
) -> None:
    order_with_history(client)
    page = html(client, "/ui/instances/order-1")
    lanes = re.findall(r'<g class="lane" data-step="([^"]+)"', page)
    assert lanes == ["charge", "ship", "pack", "notify"]  # ordinal order
    bars = re.findall(r'<rect class="bar (\w+)"[^>]*data-attempt="(\d+)"', page)
    assert bars == [
        ("failed", "1"),
        ("completed", "2"),
        ("superseded", "1"),
        ("running", "2"),
        ("swept", "1"),
    ]
    assert "failed, lease expired" in page  # in words, not only in colour
    assert "swept (lease expired)" in page  # the legend
    assert page.count("<tr data-step=") == 4
    assert 'data-stream="/v1/instances/order-1/stream"' in page


def test_the_step_page_shows_every_attempt_with_its_error_and_output(
    client: httpx.Client,
) -> None:
    order_with_history(client)
    page = html(client, "/ui/instances/order-1/steps/charge")
    assert page.index("Attempt 2") < page.index("Attempt 1")  # newest first
    assert "CardDeclined" in page
    assert '"charge_id": "ch_1"' in unescape(page)  # pretty-printed: a space after the colon
    assert "2026-12-02 10:00:00 UTC" in page


def fail_attempts(client: httpx.Client, count: int, message: str | None = None) -> None:
    """`count` failed attempts of order-1/charge, each with `message` when given."""
    for attempt in range(1, count + 1):
        assert post(client, "start", {"attempt": attempt}).is_success
        failure = {"attempt": attempt, "error_code": "E"}
        assert post(client, "fail", failure | ({"error_message": message} if message else {}))


def test_the_step_page_shows_a_large_output_cut_at_64_kib_with_a_link_to_all_of_it(
    client: httpx.Client,
) -> None:
    fail_attempts(client, 1)
    output = {"blob": "x" * 200_000}
    assert post(client, "start", {"attempt": 2}).is_success
    assert post(client, "complete", {"attempt": 2, "output": output}).is_success
    page = unescape(html(client, "/ui/instances/order-1/steps/charge"))
    size = len('{"blob": ""}') + 200_000
    assert f"Showing the first 64 KiB of {size:,} bytes; full output at" in page
    assert len(page) < 100_000  # the output is not all there
    link = re.search(r'href="(/v1/instances/order-1/steps/charge/attempts\?[^"]+)"', page)
    assert link is not None
    (whole,) = client.get(link[1]).json()["items"]  # the link leads to that attempt alone
    assert (whole["attempt"], whole["output"]) == (2, output)


def test_the_step_page_shows_the_newest_attempts_within_4_mib_and_says_how_many_it_left_out(
    client: httpx.Client,
) -> None:
    fail_attempts(client, 80, "m" * 65536)  # 5 MiB of error messages
    page = html(client, "/ui/instances/order-1/steps/charge")
    shown = [int(n) for n in re.findall(r"<h2>Attempt (\d+) ", page)]
    assert shown == list(range(80, 80 - len(shown), -1))  # the newest, newest first
    assert len(shown) == 4 * 1024 * 1024 // 65536
    assert len(page) < 5 * 1024 * 1024
    older = 80 - len(shown)
    assert f"{older} older attempts not shown" in page
    assert 'href="/v1/instances/order-1/steps/charge/attempts"' in page


def test_the_instance_page_draws_the_newest_50_attempts_of_a_step_and_says_so(
    client: httpx.Client,
) -> None:
    fail_attempts(client, 60)
    assert post(client, "start", {"attempt": 1}, step="ship").is_success
    page = html(client, "/ui/instances/order-1")
    lane = re.findall(r'data-attempt="(\d+)"', page)
    assert sorted(map(int, lane)) == [1, *range(11, 61)]  # ship's one, charge's newest 50
    assert "1 step has more than 50 attempts: the timeline draws the newest 50" in page


def send_batches(client: httpx.Client, events: list[dict[str, Any]]) -> None:
    for start in range(0, len(events), 250):
        answer = client.post("/v1/events", json={"events": events[start : start + 250]})
        assert answer.status_code == 200, answer.text
        assert all(r["status"] in (200, 201) for r in answer.json()["results"])


def test_an_instance_page_of_many_retried_steps_draws_at_most_5000_bars_and_says_so(
    client: httpx.Client,
) -> None:
    """120 steps of 45 attempts: each lane draws its newest 41 (5,000 bars over 120 lanes),
    not 5,400, and the page says so."""
    steps, tries = 120, 45
    send_batches(
        client,
        [
            {
                "instance_key": "retried",
                "step_slug": f"s{n:03}",
                "kind": "fail",
                "attempt": attempt,
                "started_at": T0,
                "completed_at": T1,
                "error_code": "E",
            }
            for n in range(steps)
            for attempt in range(1, tries + 1)
        ],
    )
    page = html(client, "/ui/instances/retried")
    lane = 5000 // steps
    assert len(re.findall(r'data-attempt="(\d+)"', page)) == steps * lane
    assert f"{steps} steps have more than {lane} attempts: the timeline draws the newest" in page


def test_an_instance_page_shows_its_first_1000_steps_and_says_how_many_it_has(
    client: httpx.Client,
) -> None:
    send_batches(
        client,
        [{"instance_key": "wide", "step_slug": f"s{n:04}", "kind": "declare"} for n in range(1003)],
    )
    page = unescape(html(client, "/ui/instances/wide"))
    assert page.count("<tr data-step=") == 1000
    assert "Showing the first 1,000 of 1,003 steps; the API lists every one" in page
    assert 'href="/v1/instances/wide/steps"' in page


def test_outputs_and_errors_are_text_never_markup(client: httpx.Client) -> None:
    assert post(client, "start", None, "x-1", "a").is_success
    output = {"html": SCRIPT, "img": IMAGE}
    assert post(client, "complete", {"output": output}, "x-1", "a").is_success
    assert post(client, "start", None, "x-1", "b").is_success
    failure = {"error_code": "Boom", "error_message": IMAGE + SCRIPT}
    assert post(client, "fail", failure, "x-1", "b").is_success
    for path in ("/ui/instances/x-1/steps/a", "/ui/instances/x-1/steps/b", "/ui/failing"):
        page = html(client, path)
        assert "<script>window" not in page
        assert "<img" not in page
        assert "&lt;script&gt;window.pwned = 1&lt;/script&gt;" in page or "&lt;img" in page


# A terminal's clear-screen and red, a C1 CSI, and a right-to-left override with its isolate.
CONTROLS = "\x1b[2J\x1b[31mred\x9b0m \u202egnp.exe\u2069 done\r"
CONTROLS_SHOWN = "\\u001b[2J\\u001b[31mred\\u009b0m \\u202egnp.exe\\u2069 done\\u000d"


def test_terminal_escapes_and_bidi_controls_are_shown_never_acted_on() -> None:
    assert shown(CONTROLS) == CONTROLS_SHOWN
    assert shown("line 1\r\nline 2\n\tindented é ✓ عربى") == "line 1\r\nline 2\n\tindented é ✓ عربى"
    assert json.loads(shown(json.dumps({"m": CONTROLS}, ensure_ascii=False))) == {"m": CONTROLS}


def test_a_reason_s_and_an_output_s_escapes_and_bidi_controls_are_shown_as_text(
    client: httpx.Client,
) -> None:
    assert post(client, "start", None, "ctl", "a").is_success
    assert post(client, "complete", {"output": {"note": CONTROLS}}, "ctl", "a").is_success
    assert post(client, "start", None, "ctl", "b").is_success
    failure = {"error_code": "Boom", "error_message": CONTROLS}
    assert post(client, "fail", failure, "ctl", "b").is_success
    for path in ("/ui/instances/ctl", "/ui/instances/ctl/steps/a", "/ui/instances/ctl/steps/b"):
        page = unescape(html(client, path))
        assert not re.search("[\x1b\x9b\u202e\u2069\r]", page), path
        assert "\\u001b[2J\\u001b[31mred\\u009b0m \\u202egnp.exe\\u2069 done" in page, path
    failing = unescape(html(client, "/ui/failing"))
    assert "\\u202egnp.exe" in failing
    assert "\u202e" not in failing


def test_an_external_output_is_a_link_only_for_http_and_https(client: httpx.Client) -> None:
    assert post(client, "start", None, "x-2", "a").is_success
    body = {"external_output_url": SCRIPT_URL}
    assert post(client, "complete", body, "x-2", "a").is_success
    assert post(client, "start", None, "x-2", "b").is_success
    body = {"external_output_url": "https://files.example.com/out.json"}
    assert post(client, "complete", body, "x-2", "b").is_success
    page = html(client, "/ui/instances/x-2/steps/a")
    assert 'href="javascript' not in page.lower()
    assert "javascript://example.com/%0Awindow.pwned=1" in page
    page = html(client, "/ui/instances/x-2/steps/b")
    assert 'href="https://files.example.com/out.json"' in page


def test_an_unknown_instance_or_step_is_a_404_page(client: httpx.Client) -> None:
    assert post(client, "declare", None, "known", "a").is_success
    assert "No instance has the key" in html(client, "/ui/instances/nope", 404)
    assert "has no step" in html(client, "/ui/instances/known/steps/nope", 404)
    html(client, "/ui/instances/not%20a%20key", 404)


def test_failing_now_and_stuck_list_steps_across_instances(client: httpx.Client) -> None:
    assert "Nothing is failing" in html(client, "/ui/failing")
    assert "Nothing is stuck" in html(client, "/ui/stuck")
    assert post(client, "start", None, "a-1", "s").is_success
    assert post(client, "fail", {"error_code": "Boom"}, "a-1", "s").is_success
    assert post(client, "start", {"lease_seconds": 1}, "a-2", "s").is_success
    failing = html(client, "/ui/failing")
    assert "a-1" in failing
    assert "Boom" in failing
    assert "a-2" not in failing
    # The lease expires after a second; the sweeper (every 0.2 s here) may then fail the step,
    # so it is either listed as stuck or, swept, as failing with lease_expired.
    eventually(
        lambda: (
            "a-2" in html(client, "/ui/stuck") or "lease_expired" in html(client, "/ui/failing")
        ),
        seconds=10,
        interval=0.1,
        what="the expired lease to show",
    )


TRACEBACK = (
    "Traceback (most recent call last):\n"
    + "".join(f'  File "shop.py", line {n}, in step_{n}\n    step_{n + 1}()\n' for n in range(2000))
    + "KeyError: 'sku-9'\n\n"
)


def test_a_failed_step_s_reason_is_a_traceback_s_exception_line_or_a_message_s_first_line(
    client: httpx.Client,
) -> None:
    deep = fit_message(TRACEBACK)  # over 64 KiB: its head and its tail, as the client sends it
    assert len(TRACEBACK.encode()) > 65536
    assert deep.endswith("KeyError: 'sku-9'\n\n")
    for slug, message in [("pay", deep), ("ship", "no carrier for the zone\nzone: 7; tried: 3")]:
        assert post(client, "start", None, "order-1", slug).is_success
        failure = {"error_code": "E", "error_message": message}
        assert post(client, "fail", failure, "order-1", slug).is_success

    page = unescape(html(client, "/ui/instances/order-1"))
    rows = dict(re.findall(r'<tr data-step="(\w+)".*?<td class="error"[^>]*>(.*?)</td>', page))
    assert rows["pay"] == "<code>E</code>: KeyError: 'sku-9'"
    assert rows["ship"] == "<code>E</code>: no carrier for the zone"
    tips = re.findall(r'<rect class="bar failed"[^>]*aria-label="([^"]*)"', page)
    assert any("error: E: KeyError: 'sku-9'" in tip for tip in tips), tips
    assert "Traceback (most recent" not in page

    failing = unescape(html(client, "/ui/failing"))
    hints = re.findall(r'<span class="hint">(.*?)</span>', failing)
    assert sorted(hints) == ["KeyError: 'sku-9'", "no carrier for the zone"]


def test_the_assets_are_served_by_the_service(client: httpx.Client) -> None:
    css = client.get("/static/ui/ui.css")
    assert css.status_code == 200
    assert css.headers["content-type"].startswith("text/css")
    js = client.get("/static/ui/ui.js")
    assert js.status_code == 200
    assert "EventSource" in js.text
    page = html(client, "/ui")
    assert "//" not in re.sub(r"https?://127\.0\.0\.1:\d+", "", page.split("<main")[0])


def test_without_tokens_the_dashboard_is_open_only_where_the_api_is(
    client: httpx.Client,
) -> None:
    refused = client.get("/ui", headers={"X-Forwarded-For": "203.0.113.9"})
    assert refused.status_code == 401
    assert 'name="token"' in refused.text
    assert "proxy" in refused.text
    assert client.get("/v1/instances", headers={"Via": "1.1 proxy"}).status_code == 401


# --- access with tokens ----------------------------------------------------------------


@pytest.fixture(scope="module")
def guarded(server_dsn: str) -> Iterator[tuple[str, str, str]]:
    """A server of this module's own with a read and a write token: (url, read, write)."""
    name = "steprecord_ui_" + uuid.uuid4().hex[:8]
    database_url = create_database(server_dsn, name)
    try:
        migrate(database_url)
        read = insert_token(database_url, "dashboard", "read")
        write = insert_token(database_url, "orchestrator", "write")
        url, proc = start_server(database_url)
        try:
            yield url, read, write
        finally:
            stop(proc)
    finally:
        drop_database(server_dsn, name)


def login(url: str, token: str, **headers: str) -> httpx.Response:
    """The sign-in form posted as a browser posts it from the service's own page."""
    return httpx.post(
        f"{url}/ui/login",
        data={"token": token, "next": "/ui/failing"},
        headers={"Origin": url, **headers},
    )


def session_of(answer: httpx.Response, name: str = "steprecord_ui_token") -> str:
    """The dashboard's session a sign-in answer sets in its cookie (`name`: over plain http)."""
    value = answer.headers["set-cookie"].split(";")[0]
    named, _, session = value.partition("=")
    assert named == name
    return session


def test_with_tokens_the_dashboard_asks_for_a_token(guarded: tuple[str, str, str]) -> None:
    url, _, _ = guarded
    for path in ("/ui", "/ui/instances/x", "/ui/failing"):
        page = httpx.get(url + path)
        assert page.status_code == 401
        assert page.headers["content-type"].startswith("text/html")
        assert 'name="token"' in page.text
    api = httpx.get(url + "/v1/instances")
    assert api.status_code == 401
    assert api.headers["content-type"].startswith("application/problem+json")
    assert httpx.get(url + "/static/ui/ui.css").status_code == 200


def test_a_wrong_token_shows_the_form_again_with_an_error(guarded: tuple[str, str, str]) -> None:
    url, _, _ = guarded
    refused = login(url, "sr_not-a-token")
    assert refused.status_code == 401
    assert "unknown or revoked" in refused.text
    assert 'value="/ui/failing"' in refused.text
    assert "set-cookie" not in refused.headers


def test_a_read_token_is_kept_in_an_httponly_strict_cookie(guarded: tuple[str, str, str]) -> None:
    url, read, _ = guarded
    answer = login(url, read)
    assert answer.status_code == 303
    assert answer.headers["location"] == "/ui/failing"
    cookie = answer.headers["set-cookie"]
    assert cookie.startswith("steprecord_ui_token=")
    flags = {part.strip().lower() for part in cookie.split(";")[1:]}
    assert {"httponly", "samesite=strict", "path=/"} <= flags
    assert "secure" not in flags  # plain http: a Secure cookie would never come back
    jar = {"steprecord_ui_token": session_of(answer)}
    with httpx.Client(base_url=url, cookies=jar) as browser_like:
        assert browser_like.get("/ui").status_code == 200
        assert browser_like.get("/v1/instances").status_code == 200  # so the stream works too
        assert "Log out" in browser_like.get("/ui").text


def test_the_cookie_is_secure_when_the_request_was_https(guarded: tuple[str, str, str]) -> None:
    url, read, _ = guarded
    answer = login(url, read, **{"X-Forwarded-Proto": "https"})
    assert answer.status_code == 303
    flags = {part.strip().lower() for part in answer.headers["set-cookie"].split(";")[1:]}
    assert "secure" in flags
    assert "path=/" in flags
    assert not any(flag.startswith("domain") for flag in flags)


def test_over_https_the_session_is_a_host_prefixed_cookie_and_only_that_one_is_read(
    guarded: tuple[str, str, str],
) -> None:
    """`__Host-` over https: no other host of the domain and no page over http can set it. A
    cookie of the plain name (one planted over http) is no session over https."""
    url, read, _ = guarded
    https = {"X-Forwarded-Proto": "https"}
    session = session_of(login(url, read, **https), "__Host-steprecord_ui_token")
    signed_in = httpx.get(
        f"{url}/ui", headers=https, cookies={"__Host-steprecord_ui_token": session}
    )
    assert signed_in.status_code == 200
    assert "Log out" in signed_in.text
    planted = httpx.get(f"{url}/ui", headers=https, cookies={"steprecord_ui_token": session})
    assert planted.status_code == 401
    assert "Sign in" in planted.text
    plain = session_of(login(url, read))  # over plain http: the plain name, not Secure
    assert httpx.get(f"{url}/ui", cookies={"steprecord_ui_token": plain}).status_code == 200


def test_the_cookie_never_grants_write_even_for_a_write_token(
    guarded: tuple[str, str, str],
) -> None:
    url, _, write = guarded
    answer = login(url, write)
    assert answer.status_code == 303
    jar = {"steprecord_ui_token": session_of(answer)}
    with httpx.Client(base_url=url, cookies=jar) as browser_like:
        assert browser_like.get("/ui").status_code == 200
        refused = browser_like.post("/v1/instances/c-1/steps/a/start")
        assert refused.status_code == 401
        assert browser_like.post("/v1/events", json={"events": []}).status_code == 401
    allowed = httpx.post(
        f"{url}/v1/instances/c-1/steps/a/start", headers={"Authorization": f"Bearer {write}"}
    )
    assert allowed.status_code == 201


def test_signing_in_returns_only_to_a_dashboard_page(guarded: tuple[str, str, str]) -> None:
    url, read, _ = guarded
    for target in ("https://evil.example/", "//evil.example/ui", "/ui/../v1", "/metrics"):
        answer = httpx.post(
            f"{url}/ui/login", data={"token": read, "next": target}, headers={"Origin": url}
        )
        assert answer.status_code == 303
        assert answer.headers["location"] == "/ui", target


def test_logging_out_clears_the_cookie(guarded: tuple[str, str, str]) -> None:
    url, read, _ = guarded
    session = session_of(login(url, read))
    answer = httpx.post(
        f"{url}/ui/logout", cookies={"steprecord_ui_token": session}, headers={"Origin": url}
    )
    assert answer.status_code == 303
    cookie = answer.headers["set-cookie"].lower()
    assert cookie.startswith('steprecord_ui_token="";') or "max-age=0" in cookie


def test_a_sign_in_posted_from_another_site_is_refused_and_sets_no_cookie(
    guarded: tuple[str, str, str],
) -> None:
    url, read, _ = guarded
    form = {"token": read, "next": "/ui"}
    for headers in (
        {"Origin": "https://evil.example"},
        {"Origin": "null"},
        {"Referer": "https://evil.example/page"},
        {},  # a browser always says where a form came from
    ):
        refused = httpx.post(f"{url}/ui/login", data=form, headers=headers)
        assert refused.status_code == 403, headers
        assert "set-cookie" not in refused.headers
        assert "another site" in refused.text
    accepted = httpx.post(f"{url}/ui/login", data=form, headers={"Referer": f"{url}/ui/login"})
    assert accepted.status_code == 303
    assert "set-cookie" in accepted.headers


def test_the_cookie_holds_a_signed_expiring_session_never_the_token(
    guarded: tuple[str, str, str],
) -> None:
    url, read, _ = guarded
    answer = login(url, read)
    session = session_of(answer)
    assert read not in answer.headers["set-cookie"]
    assert read.removeprefix("sr_") not in session
    flags = {part.strip().lower() for part in answer.headers["set-cookie"].split(";")[1:]}
    assert "max-age=43200" in flags  # it expires (STEPRECORD_SESSION_SECONDS)
    assert httpx.get(f"{url}/ui", cookies={"steprecord_ui_token": session}).status_code == 200
    token_id, expires, mac = session.split(".")
    for forged in (
        f"{token_id}.{int(expires) + 86400}.{mac}",  # a later expiry, same signature
        f"{int(token_id) + 1}.{expires}.{mac}",  # another token
        f"{token_id}.{expires}.{mac[:-2]}AA",
    ):
        page = httpx.get(f"{url}/ui", cookies={"steprecord_ui_token": forged})
        assert page.status_code == 401, forged
    as_bearer = httpx.get(f"{url}/v1/instances", headers={"Authorization": f"Bearer {session}"})
    assert as_bearer.status_code == 401  # a session is no token


def test_a_session_past_its_expiry_names_no_token() -> None:
    secret, digest = b"k" * 32, bytes(32)
    now = time.time()
    assert sessions.token_id_of(sessions.sign(secret, 7, digest, int(now) + 60), now) == 7
    assert sessions.token_id_of(sessions.sign(secret, 7, digest, int(now) - 1), now) is None
    assert sessions.verify(secret, sessions.sign(secret, 7, digest, 1), digest)
    assert not sessions.verify(b"x" * 32, sessions.sign(secret, 7, digest, 1), digest)


def test_signing_out_is_a_post_from_the_dashboard_itself(guarded: tuple[str, str, str]) -> None:
    url, read, _ = guarded
    jar = {"steprecord_ui_token": session_of(login(url, read))}
    page = httpx.get(f"{url}/ui/logout", cookies=jar)
    assert page.status_code == 405
    assert page.headers["allow"] == "POST"
    assert "set-cookie" not in page.headers  # a link or an image cannot sign anyone out
    forged = httpx.post(f"{url}/ui/logout", cookies=jar, headers={"Origin": "https://evil.example"})
    assert forged.status_code == 403
    assert "set-cookie" not in forged.headers
    assert httpx.get(f"{url}/ui", cookies=jar).status_code == 200  # still signed in


def test_dashboard_pages_may_not_be_framed_nor_kept(guarded: tuple[str, str, str]) -> None:
    url, read, _ = guarded
    jar = {"steprecord_ui_token": session_of(login(url, read))}
    pages = [
        httpx.get(f"{url}/ui"),  # the sign-in form, as a refusal
        httpx.get(f"{url}/ui/login"),
        httpx.get(f"{url}/ui", cookies=jar),
        httpx.get(f"{url}/ui/failing", cookies=jar),
        httpx.get(f"{url}/ui/instances/nothing-here", cookies=jar),
    ]
    for page in pages:
        assert page.headers["x-frame-options"] == "DENY", page.url
        policy = page.headers["content-security-policy"]
        assert "frame-ancestors 'none'" in policy
        assert "script-src 'self'" in policy
        assert page.headers["cache-control"] == "no-store"


def test_the_cookie_is_not_secure_on_the_word_of_an_untrusted_proxy(server_dsn: str) -> None:
    name = "steprecord_ui_proxy_" + uuid.uuid4().hex[:8]
    database_url = create_database(server_dsn, name)
    try:
        migrate(database_url)
        read = insert_token(database_url, "dashboard", "read")
        # Only 192.0.2.1 is trusted: the test's requests come from 127.0.0.1.
        url, proc = start_server(database_url, env={"STEPRECORD_TRUSTED_PROXIES": "192.0.2.1"})
        try:
            answer = login(url, read, **{"X-Forwarded-Proto": "https"})
        finally:
            stop(proc)
    finally:
        drop_database(server_dsn, name)
    assert answer.status_code == 303
    flags = {part.strip().lower() for part in answer.headers["set-cookie"].split(";")[1:]}
    assert "secure" not in flags


# --- the indexes behind the list -------------------------------------------------------


@pytest.fixture
def many_instances(db: psycopg.Connection[tuple[object, ...]]) -> Any:
    """10^4 instances of 3 steps, a few with failed or running steps (rolled back). On Citus
    all in one shard (see `one_shard`): spread over the shards they would be a few hundred or
    thousand a shard, which the planner rightly reads whole; a shard as full as one node's
    table is planned as that table."""
    db.execute(
        """
        INSERT INTO process_instance (id, instance_key, created_at)
        SELECT steprecord_instance_id(k), k, timestamptz '2026-01-01' + i * interval '1 s'
        FROM generate_series(1, 10000 * %(shards)s * 2) i,
             LATERAL (SELECT CASE WHEN i %% 100 = 0 THEN 'job-' ELSE 'run-' END || i AS k) x
        WHERE hashint8(steprecord_instance_id(k)) BETWEEN %(low)s AND %(high)s
        LIMIT 10000
        """,
        vars(one_shard(db)),
    )
    db.execute("""
        INSERT INTO workflow_step_record (instance_id, step_slug, ordinal, status, attempt_count,
                                          started_at, completed_at, error_code)
        SELECT p.id, 'step-' || s, s, x.status, 1,
               CASE WHEN x.status <> 'pending' THEN timestamptz '2026-01-01' END,
               CASE WHEN x.status IN ('completed', 'failed') THEN timestamptz '2026-01-02' END,
               CASE WHEN x.status = 'failed' THEN 'E' END
        FROM process_instance p, generate_series(0, 2) s,
             LATERAL (SELECT split_part(p.instance_key, '-', 2)::int AS n) k,
             LATERAL (SELECT CASE WHEN n % 500 = 0 AND s = 2 THEN 'failed'
                                  WHEN n % 300 = 0 AND s = 2 THEN 'running'
                                  ELSE 'completed' END AS status) x
    """)
    db.execute("ANALYZE process_instance")
    db.execute("ANALYZE workflow_step_record")
    db.execute("ANALYZE workflow_step_attempt")
    return db


LIST = {"before_created_at": "infinity", "before_id": 0, "limit": 51}


# In a database whose collation is C, the unique index on the key is byte-ordered too and the
# planner may read the prefix from it instead.
PREFIX = ("ix_process_instance_instance_key_prefix", "uq_process_instance_instance_key")
# "Has failed/running steps": a probe per instance into the partial index, or, when few
# records have that status, the status index read first.
TROUBLE = ("ix_workflow_step_record_running_failed", "ix_workflow_step_record_status_updated_at_id")
# For running steps also the running records' own partial index (the long-running list's),
# with a prefix too: the few running records read first, then their instances. Which index the
# planner takes turns on the statistics of a table whose instance ids (keyed by each database's
# secret) differ on every run.
RUNNING = (*TROUBLE, "ix_workflow_step_record_running_started_at_id")


@pytest.mark.parametrize(
    ("prefix", "has", "indexes"),
    [
        (False, None, ("ix_process_instance_created_at_id",)),
        (True, None, PREFIX),
        (False, "failed", TROUBLE),
        (False, "running", RUNNING),
        (True, "running", (*PREFIX, *RUNNING)),
    ],
)
def test_each_instance_filter_is_served_by_an_index(
    many_instances: Any, prefix: bool, has: reads.Trouble | None, indexes: tuple[str, ...]
) -> None:
    params = {**LIST, **reads.prefix_params("job-990")}  # one key of 10^4: job-9900
    text = plan(many_instances, reads.list_instances_query(prefix=prefix, has=has), params)
    # On Citus the plan shown is the first shard's, the one the fixture loaded.
    assert one_shard(many_instances).table in text, text
    assert any(index in text for index in indexes), text
    assert "Seq Scan" not in text, text


def test_the_instance_and_step_pages_read_steps_and_attempts_by_index(
    many_instances: Any,
) -> None:
    # An instance of the loaded shard (on Citus the others are empty, and read whole).
    row = many_instances.execute(
        "SELECT id, instance_key FROM process_instance"
        " WHERE hashint8(id) BETWEEN %(low)s AND %(high)s AND instance_key LIKE 'job-%%'"
        " LIMIT 1",
        vars(one_shard(many_instances)),
    ).fetchone()
    assert row is not None
    queries = (dashboard.INSTANCE_STEPS, dashboard.INSTANCE_ATTEMPTS, dashboard.STEP_ATTEMPTS)
    for query in queries:
        params = {
            "instance_id": row[0],
            "instance_key": row[1],
            "limit": 1001,
            "last_ordinal": 2,
            "record_id": 500,
            "lane": dashboard.LANE_ATTEMPTS,
        }
        text = plan(many_instances, query, params)
        assert "Seq Scan" not in text, text


def test_a_prefix_range_ends_just_past_the_keys_it_starts() -> None:
    assert reads.prefix_params("run-") == {
        "prefix_low": "run-",
        "prefix_high": "run.",
        "prefix_like": "run-%",
    }
    assert reads.prefix_params("a:9")["prefix_high"] == "a::"
    assert reads.prefix_params("a_b")["prefix_like"] == "a\\_b%"


# --- in a real browser -----------------------------------------------------------------


def shot(page: Page, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def test_the_browser_shows_what_the_api_holds(page: Page, client: httpx.Client) -> None:
    order_with_history(client)
    page.goto("/ui")
    row = page.locator("table.list tbody tr", has_text="order-1")
    expect(row).to_contain_text("1 failed")
    expect(row).to_contain_text("1 running")
    page.click("text=order-1")
    expect(page.locator("h1")).to_contain_text("order-1")
    records = client.get("/v1/instances/order-1/steps").json()["items"]
    table = page.locator("#steps tbody tr")
    expect(table).to_have_count(len(records))
    for index, record in enumerate(records):
        cells = table.nth(index).locator("td")
        expect(cells.nth(1)).to_have_text(record["step_slug"])
        expect(cells.nth(2)).to_contain_text(record["status"])
        expect(cells.nth(3)).to_have_text(str(record["attempt_count"]))
        lane = page.locator("g.lane").nth(index)
        expect(lane).to_have_attribute("data-step", record["step_slug"])
        history = client.get(f"/v1/instances/order-1/steps/{record['step_slug']}/attempts")
        expect(lane.locator("rect.bar")).to_have_count(len(history.json()["items"]))
    for bar in page.locator("rect.bar").all():  # every bar has a place and a width
        assert float((bar.get_attribute("width") or "0%").rstrip("%")) > 0
    shot(page, "instance")


def test_a_write_appears_on_an_open_page_without_a_reload(page: Page, client: httpx.Client) -> None:
    order_with_history(client)
    page.goto("/ui/instances/order-1")
    expect(page.locator("#live")).to_have_text("live", timeout=10_000)
    page.evaluate("window.notReloaded = true")
    body = {"attempt": 2, "completed_at": "2026-12-02T10:00:06Z", "output": {"ok": True}}
    assert post(client, "complete", body, "order-1", "ship").is_success
    assert post(client, "start", {"attempt": 1, "started_at": T4}, "order-1", "late").is_success
    ship = page.locator('#steps tr[data-step="ship"]')
    expect(ship.locator("td.status")).to_contain_text("completed", timeout=10_000)
    expect(page.locator('g.lane[data-step="ship"] rect.bar.completed')).to_have_count(1)
    late = page.locator('#steps tr[data-step="late"]')
    expect(late.locator("td.status")).to_contain_text("running", timeout=10_000)
    expect(page.locator('g.lane[data-step="late"] rect.bar.running')).to_have_count(1)
    assert page.evaluate("window.notReloaded") is True
    shot(page, "instance-live")


def test_markup_in_an_output_or_error_is_shown_as_text(page: Page, client: httpx.Client) -> None:
    assert post(client, "start", None, "x-1", "a").is_success
    output = {"html": SCRIPT, "img": IMAGE}
    assert post(client, "complete", {"output": output}, "x-1", "a").is_success
    assert post(client, "start", None, "x-1", "b").is_success
    failure = {"error_code": "Boom", "error_message": IMAGE}
    assert post(client, "fail", failure, "x-1", "b").is_success
    page.goto("/ui/instances/x-1/steps/a")
    expect(page.locator("pre.output")).to_contain_text(SCRIPT)
    expect(page.locator("pre.output")).to_contain_text(IMAGE)
    page.goto("/ui/instances/x-1/steps/b")
    expect(page.locator("pre.error-text")).to_have_text(IMAGE)
    assert page.locator("main img").count() == 0
    assert page.evaluate("window.pwned") is None
    shot(page, "step-markup")


def test_a_javascript_url_is_not_a_link(page: Page, client: httpx.Client) -> None:
    assert post(client, "start", None, "x-2", "a").is_success
    body = {"external_output_url": SCRIPT_URL}
    assert post(client, "complete", body, "x-2", "a").is_success
    page.goto("/ui/instances/x-2/steps/a")
    expect(page.locator("code.nolink")).to_have_text(SCRIPT_URL)
    assert page.locator("main a[href^='javascript' i]").count() == 0
    page.locator("code.nolink").click()
    assert page.evaluate("window.pwned") is None


def test_with_a_token_the_browser_gets_in_only_after_entering_a_read_token(
    browser: Browser, guarded: tuple[str, str, str]
) -> None:
    url, read, write = guarded
    created = httpx.post(
        f"{url}/v1/instances/t-1/steps/a/start", headers={"Authorization": f"Bearer {write}"}
    )
    assert created.status_code in (200, 201)
    context = browser.new_context(base_url=url)
    try:
        page = context.new_page()
        refused = page.goto("/ui/instances/t-1")
        assert refused is not None
        assert refused.status == 401
        expect(page.locator("input[name=token]")).to_be_visible()
        page.fill("input[name=token]", "sr_wrong")
        page.click("button[type=submit]")
        expect(page.locator(".error")).to_contain_text("unknown or revoked")
        page.fill("input[name=token]", read)
        page.click("button[type=submit]")
        expect(page.locator("h1")).to_contain_text("t-1")
        assert read not in page.evaluate("document.cookie")  # HttpOnly: scripts never see it
        expect(page.locator("#live")).to_have_text("live", timeout=10_000)
        page.click("text=Log out")
        expect(page.locator("input[name=token]")).to_be_visible()
    finally:
        context.close()


@pytest.mark.parametrize("width", [1400, 700])
def test_the_log_out_button_sits_on_the_navigation_s_line(
    browser: Browser, guarded: tuple[str, str, str], width: int
) -> None:
    url, read, _ = guarded
    context = browser.new_context(base_url=url, viewport={"width": width, "height": 600})
    try:
        page = context.new_page()
        page.goto("/ui/stats")
        page.fill("input[name=token]", read)
        page.click("button[type=submit]")
        expect(page.locator("h1")).to_have_text("Statistics")
        button = page.locator("header button", has_text="Log out")
        link = page.locator("header nav a", has_text="Statistics")
        # The words on one line: the middles of the two texts' line boxes.
        middle = "e => { const r = document.createRange(); r.selectNodeContents(e);"
        middle += " const b = r.getBoundingClientRect(); return b.top + b.height / 2; }"
        assert abs(button.evaluate(middle) - link.evaluate(middle)) <= 1.5
        box, header = button.bounding_box(), page.locator("header").bounding_box()
        assert box is not None
        assert header is not None
        assert width - 60 <= box["x"] + box["width"] <= width - 8  # at the bar's end
        assert header["height"] < 60  # one line
        screenshot(page, f"signed-in-header-{width}", full_page=False)
    finally:
        context.close()
