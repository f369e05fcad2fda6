"""A page stops before its body passes 16 MiB, with the cursor after its last item: paging on
reads every item exactly once, in order (see docs/api.md, Reads)."""

from typing import Any

import httpx
import psycopg

from app.core.limits import MAX_MESSAGE_BYTES, MAX_OUTPUT_BYTES
from app.core.serialize import MAX_PAGE_BYTES, dumps_page, loads, shown
from tests.support.http import post, step_path

# `{"blob": "xx…x"}` as the database writes it: exactly the largest inline output.
BLOB = "x" * (MAX_OUTPUT_BYTES - len('{"blob": ""}'))
STEPS = 20  # 20 MiB of outputs: more than one page holds


def pages(client: httpx.Client, url: str, **params: Any) -> list[list[dict[str, Any]]]:
    """Every page of a listing, following `next_cursor`; each body within the bound."""
    found: list[list[dict[str, Any]]] = []
    cursor = None
    while True:
        query = {**params, **({"cursor": cursor} if cursor else {})}
        response = client.get(url, params=query)
        assert response.status_code == 200, response.text
        assert len(response.content) <= MAX_PAGE_BYTES
        body = response.json()
        found.append(body["items"])
        cursor = body["next_cursor"]
        if cursor is None:
            return found
        assert len(found) < 50, "the cursor never ends"


def test_pages_of_the_largest_outputs_stay_within_16_mib_and_page_on_to_every_item(
    client: httpx.Client,
) -> None:
    slugs = [f"s{i:02}" for i in range(STEPS)]
    for slug in slugs:
        assert post(client, "start", {"attempt": 1}, step=slug).status_code == 201
        assert post(client, "complete", {"output": {"blob": BLOB}}, step=slug).status_code == 200
    newest_first = slugs[::-1]
    listings = {
        "/v1/instances/order-1/steps": ({"order": "ordinal"}, slugs),
        "/v1/instances/order-1/steps?order=started_at": ({"order": "started_at"}, slugs),
        "/v1/steps": ({}, newest_first),
    }
    for url, (params, expected) in listings.items():
        found = pages(client, url.partition("?")[0], limit=1000, **params)
        assert len(found) == 2, (url, [len(page) for page in found])  # 20 MiB: two pages
        assert [item["step_slug"] for page in found for item in page] == expected, url
        assert all(item["output"] == {"blob": BLOB} for page in found for item in page)
        # The summary, without outputs, fits one page.
        summary = pages(client, url.partition("?")[0], limit=1000, fields="summary", **params)
        assert [item["step_slug"] for page in summary for item in page] == expected


def test_a_step_whose_attempts_pass_16_mib_pages_its_history_within_the_bound(
    client: httpx.Client,
) -> None:
    # Error messages at their largest, of characters JSON escapes into six bytes each:
    # 50 attempts write about 19 MiB.
    message = "\x01" * MAX_MESSAGE_BYTES
    count = 50
    for attempt in range(1, count + 1):
        assert post(client, "start", {"attempt": attempt}).status_code in (200, 201)
        body = {"attempt": attempt, "error_code": "E", "error_message": message}
        assert post(client, "fail", body).status_code == 200
    found = pages(client, f"{step_path()}/attempts", limit=1000)
    assert len(found) == 2, [len(page) for page in found]
    assert [a["attempt"] for page in found for a in page] == list(range(1, count + 1))
    assert all(a["error_message"] == message for page in found for a in page)


def test_an_item_larger_than_the_bound_alone_is_still_answered() -> None:
    def row(n: int, output: str) -> dict[str, Any]:
        return {"n": n, "output": output, "error_message": None, "external_output_url": None}

    rows = [row(1, '"' + "a" * 300 + '"'), row(2, '"b"')]
    body = dumps_page(rows, shown, rows[1], lambda row: f"after-{row['n']}", max_bytes=100)
    first = {"n": 1, "output": "a" * 300, "error_message": None, "external_output_url": None}
    assert loads(body) == {"items": [first], "next_cursor": "after-1"}


PAGE = (
    "SELECT step_slug, cut, ordinal FROM steprecord_list_page('order-1', 'ordinal', %s,"
    " '-infinity', 0, NULL, 1001, %s)"
)


def test_a_page_stops_reading_in_the_database_once_its_rows_hold_the_byte_budget(
    client: httpx.Client, db: psycopg.Connection[tuple[object, ...]]
) -> None:
    slugs = [f"s{i:02}" for i in range(7)]
    for slug in slugs:
        assert post(client, "start", {"attempt": 1}, step=slug).status_code == 201
        assert post(client, "complete", {"output": {"blob": BLOB}}, step=slug).status_code == 200
    budget = 3 * MAX_OUTPUT_BYTES  # three outputs reach it
    found: list[list[tuple[object, ...]]] = []
    after = -1
    while True:
        rows = db.execute(PAGE, (after, budget)).fetchall()
        found.append(rows)
        if not rows[-1][1]:
            break
        after = int(str(rows[-1][2]))
        assert len(found) < 10, "the pages never end"
    assert [[row[1] for row in page] for page in found] == [
        [False, False, True],
        [False, False, True],
        [False],
    ]
    assert [row[0] for page in found for row in page] == slugs
