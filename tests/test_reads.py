"""The reads (docs/api.md, "Reads"): lists in both orders, cursors, filters, summaries,
instances."""

import base64
import zoneinfo
from datetime import UTC, datetime, timedelta, timezone, tzinfo
from typing import Any

import httpx
import psycopg
import pytest
from psycopg.rows import dict_row, tuple_row

from app.core.domain import Order
from app.core.serialize import dumps, page_json, record_json, timestamp
from app.data import reads
from tests.bench import queries
from tests.support.http import T1, T2, T3, post, problem, record

STEPS = "/v1/instances/order-1/steps"


def collect(client: httpx.Client, **params: Any) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    cursor = None
    while True:
        query = {**params, **({"cursor": cursor} if cursor else {})}
        response = client.get(STEPS, params=query)
        assert response.status_code == 200, response.text
        body = response.json()
        assert len(body["items"]) <= params.get("limit", 100)
        items.extend(body["items"])
        cursor = body["next_cursor"]
        if cursor is None:
            return items


@pytest.fixture
def history(client: httpx.Client) -> None:
    # ordinal order a, b, c, d, e; started order c, a, e; b and d never started
    post(client, "declare", step="a")
    post(client, "declare", step="b")
    post(client, "start", {"started_at": T1}, step="c")
    post(client, "declare", step="d")
    post(client, "start", {"started_at": T3}, step="e")
    post(client, "start", {"started_at": T2}, step="a")
    post(client, "complete", {"output": {"big": "x" * 100}}, step="a")
    post(client, "fail", {"error_code": "E", "error_message": "bad"}, step="e")


@pytest.mark.usefixtures("history")
@pytest.mark.parametrize("limit", [1, 2, 3, 100])
def test_list_by_ordinal_pages_through_every_record_once(client: httpx.Client, limit: int) -> None:
    items = collect(client, limit=limit)
    assert [i["step_slug"] for i in items] == ["a", "b", "c", "d", "e"]
    assert [i["ordinal"] for i in items] == [0, 1, 2, 3, 4]


@pytest.mark.usefixtures("history")
@pytest.mark.parametrize("limit", [1, 2, 3, 100])
def test_list_by_started_at_puts_never_started_steps_last(client: httpx.Client, limit: int) -> None:
    items = collect(client, order="started_at", limit=limit)
    assert [i["step_slug"] for i in items] == ["c", "a", "e", "b", "d"]


def test_started_at_ties_are_broken_by_id(client: httpx.Client) -> None:
    for slug in ("z", "y", "x"):
        post(client, "start", {"started_at": T1}, step=slug)
    items = collect(client, order="started_at", limit=1)
    assert [i["step_slug"] for i in items] == ["z", "y", "x"]
    assert [i["id"] for i in items] == sorted(i["id"] for i in items)


@pytest.mark.usefixtures("history")
def test_status_filter_takes_several_statuses(client: httpx.Client) -> None:
    items = collect(client, status="running,failed", limit=1)
    assert [(i["step_slug"], i["status"]) for i in items] == [("c", "running"), ("e", "failed")]
    started = collect(client, order="started_at", status="pending", limit=1)
    assert [i["step_slug"] for i in started] == ["b", "d"]


@pytest.mark.usefixtures("history")
def test_unknown_status_is_a_validation_error(client: httpx.Client) -> None:
    problem(client.get(STEPS, params={"status": "running,done"}), 422, "validation_error")


@pytest.mark.usefixtures("history")
def test_summary_omits_output_and_error_message(client: httpx.Client) -> None:
    items = client.get(STEPS, params={"fields": "summary"}).json()["items"]
    assert all("output" not in i and "error_message" not in i for i in items)
    one = client.get(f"{STEPS}/a", params={"fields": "summary"}).json()
    assert "output" not in one
    assert one["status"] == "completed"


@pytest.mark.usefixtures("history")
def test_outputs_are_not_truncated(client: httpx.Client) -> None:
    assert record(client, step="a")["output"] == {"big": "x" * 100}


@pytest.mark.usefixtures("history")
@pytest.mark.parametrize("limit", [0, 1001, "x"])
def test_limit_out_of_range_is_a_validation_error(client: httpx.Client, limit: Any) -> None:
    problem(client.get(STEPS, params={"limit": limit}), 422, "validation_error")


@pytest.mark.usefixtures("history")
def test_cursor_from_the_other_order_is_refused(client: httpx.Client) -> None:
    cursor = client.get(STEPS, params={"limit": 1}).json()["next_cursor"]
    problem(
        client.get(STEPS, params={"order": "started_at", "cursor": cursor}), 422, "validation_error"
    )
    other = client.get(STEPS, params={"limit": 1, "order": "started_at"}).json()["next_cursor"]
    problem(client.get(STEPS, params={"cursor": other}), 422, "validation_error")


@pytest.mark.usefixtures("history")
@pytest.mark.parametrize(
    "cursor",
    [
        "garbage!",
        "",
        base64.urlsafe_b64encode(b'["o","x"]').decode(),
        base64.urlsafe_b64encode(b'["s","not a time",1]').decode(),
        base64.urlsafe_b64encode(b"{}").decode(),
    ],
)
def test_garbled_cursor_is_refused(client: httpx.Client, cursor: str) -> None:
    for order in ("ordinal", "started_at"):
        problem(
            client.get(STEPS, params={"cursor": cursor, "order": order}), 422, "validation_error"
        )


def test_unknown_instance_is_not_found_on_every_read(client: httpx.Client) -> None:
    problem(client.get(STEPS), 404, "instance_not_found")
    problem(client.get(f"{STEPS}/a"), 404, "instance_not_found")
    problem(client.get("/v1/instances/order-1"), 404, "instance_not_found")


def test_unknown_step_is_not_found(client: httpx.Client) -> None:
    post(client, "declare", step="a")
    problem(client.get(f"{STEPS}/b"), 404, "step_not_found")


def test_instance_with_no_matching_steps_lists_nothing(client: httpx.Client) -> None:
    post(client, "declare", step="a")
    body = client.get(STEPS, params={"status": "failed"}).json()
    assert body == {"items": [], "next_cursor": None}


@pytest.mark.usefixtures("history")
def test_instance_summary_counts_steps_by_status(client: httpx.Client) -> None:
    body = client.get("/v1/instances/order-1").json()
    assert body["instance_key"] == "order-1"
    assert body["created_at"].endswith("Z")
    assert body["step_counts"] == {"pending": 2, "running": 1, "completed": 1, "failed": 1}


def test_instances_are_listed_newest_first_across_pages(client: httpx.Client) -> None:
    keys = [f"run-{i}" for i in range(7)]
    for key in keys:
        post(client, "declare", instance=key)
    seen: list[str] = []
    cursor = None
    while True:
        params: dict[str, Any] = {"limit": 3, **({"cursor": cursor} if cursor else {})}
        body = client.get("/v1/instances", params=params).json()
        seen.extend(i["instance_key"] for i in body["items"])
        assert all({"id", "instance_key", "created_at"} <= i.keys() for i in body["items"])
        cursor = body["next_cursor"]
        if cursor is None:
            break
    assert seen == list(reversed(keys))
    problem(client.get("/v1/instances", params={"cursor": "bad"}), 422, "validation_error")


def test_record_timestamps_are_utc_with_z(client: httpx.Client) -> None:
    post(client, "start", {"started_at": "2026-12-02T12:00:00+02:00"})
    body = record(client)
    assert body["started_at"] == "2026-12-02T10:00:00Z"
    assert body["created_at"].endswith("Z")


def test_health_and_readiness(client: httpx.Client) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz")
    assert ready.status_code == 200
    assert ready.json()["status"] == "ready"


# Values where a JSON renderer could differ: timestamps with and without microseconds, before
# 1970, given in another zone; every control character, quotes, backslashes, U+2028, non-BMP
# characters; outputs with long integers, trailing zeros, escapes and nesting.
TRICKY_TEXT = "".join(map(chr, range(1, 32))) + '\x7f"\\/é\u2028😀 end'
TRICKY_RECORDS: list[dict[str, Any]] = [
    {"status": "pending", "created_at": "1000-01-01T00:00:00Z"},
    {
        "status": "running",
        "started_at": "1969-12-31T23:59:59.999999Z",
        "lease_expires_at": "2026-12-02T10:00:01.5+05:30",
    },
    {
        "status": "completed",
        "started_at": "2026-12-02T10:00:01.000001Z",
        "completed_at": "2026-12-02T10:00:02Z",
        "output": '{"n": 123456789012345678901234567890, "f": 1.50, "e": 1e2, "z": -0,'
        ' "s": "\\u001f\\"\\\\\\ud83d\\ude00\u2028", "nested": {"a": [true, null, {}], "b": []}}',
    },
    {
        "status": "completed",
        "started_at": T1,
        "completed_at": T1,
        "external_output_url": "s3://b/" + "é" * 3 + '?q="x"',
    },
    {"status": "completed", "started_at": T1, "completed_at": T2, "output": '"just text"'},
    {
        "status": "failed",
        "started_at": T1,
        "completed_at": "2026-12-02T10:00:02.100000Z",
        "error_code": "Boom.x:y-z",
        "error_message": TRICKY_TEXT,
    },
]


@pytest.mark.parametrize("summary", [False, True])
@pytest.mark.parametrize("order", ["ordinal", "started_at"])
def test_a_page_from_the_page_function_renders_byte_for_byte_as_the_rows_query(
    db: psycopg.Connection[tuple[object, ...]], order: Order, summary: bool
) -> None:
    """The page function's rows, read in binary as the service reads them, render exactly as
    the reference query's rows read as text, on tricky values: every control character,
    U+2028, non-BMP characters, long integers in outputs, times with and without
    microseconds, in the first page and the position of its last record."""
    row = db.execute(
        "INSERT INTO process_instance (id, instance_key)"
        " VALUES (steprecord_instance_id('tricky-1'), 'tricky-1') RETURNING id"
    ).fetchone()
    assert row is not None
    for ordinal, fields in enumerate(TRICKY_RECORDS * 2):
        values = {"step_slug": f"s{ordinal}", "ordinal": 2147483647 - ordinal, **fields}
        values.setdefault("attempt_count", 3)
        columns = ", ".join(["instance_id", *values])
        marks = ", ".join(["%s"] * (len(values) + 1))
        db.execute(
            f"INSERT INTO workflow_step_record ({columns}) VALUES ({marks})",
            [row[0], *values.values()],
        )
    db.execute("SET TIME ZONE 'UTC'")  # as the service's connections are (app.core.db)
    params: dict[str, Any] = {
        "instance_key": "tricky-1",
        "statuses": None,
        "after_ordinal": -1,
        "after_started_at": "-infinity",
        "after_id": 0,
        "limit": 8,
    }
    function_params = ["tricky-1", order, -1, "-infinity", 0, None, 8, reads.PAGE_READ_BYTES]
    rows_query = queries.LIST_BY_ORDINAL if order == "ordinal" else queries.LIST_BY_STARTED_AT
    with psycopg.RawCursor(db, row_factory=tuple_row) as cur:
        page = cur.execute(reads.LIST_PAGE, function_params, binary=True).fetchall()
        assert cur.description is not None
        assert tuple(column.name for column in cur.description) == (*reads.PAGE_COLUMNS, "cut")
    with db.cursor(row_factory=dict_row) as cur:
        rows = cur.execute(rows_query, params).fetchall()
    assert len(page) == len(rows) == 8
    assert [item[0] for item in page] == [item["id"] for item in rows]
    for item in rows:
        item["instance_key"] = "tricky-1"
    assert not any(item[-1] for item in page)  # well within the bytes of a page
    items = [dict(zip(reads.PAGE_COLUMNS, item[:-1], strict=True)) for item in page]
    expected = dumps([record_json(item, summary) for item in rows])
    assert dumps(page_json(items, summary)) == expected


@pytest.mark.parametrize(
    "zone",
    [UTC, timezone(timedelta(0)), zoneinfo.ZoneInfo("UTC"), zoneinfo.ZoneInfo("Etc/UTC")],
    ids=["datetime.UTC", "timezone(0)", "ZoneInfo(UTC)", "ZoneInfo(Etc/UTC)"],
)
@pytest.mark.parametrize("microsecond", [0, 1, 120000, 999999])
def test_answers_render_a_utc_time_exactly_as_the_documented_format(
    zone: tzinfo, microsecond: int
) -> None:
    """`Z`, and microseconds only when not zero, whichever UTC zone object psycopg returns."""
    value = datetime(2026, 12, 4, 5, 1, 7, microsecond, tzinfo=zone)
    assert dumps({"t": value}) == f'{{"t":"{timestamp(value)}"}}'.encode()
    assert timestamp(value).endswith(("07Z", f".{microsecond:06d}Z"))


# Page queries and what each answers: FastAPI's parameter handling, declared by the endpoint's
# signature, accepts or refuses them as it does for every route.
PAGE_QUERIES = {
    "": 200,
    "limit=2": 200,
    "limit=1000": 200,
    "order=ordinal&limit=1": 200,
    "order=started_at&limit=2": 200,
    "fields=summary&limit=3": 200,
    "status=running,failed": 200,
    "status=%20failed%20,completed": 200,
    "status=": 422,
    "status=bogus": 422,
    "cursor=garbage!": 422,
    "cursor=": 422,
    "order=started_at&cursor=WyJvIiwwXQ": 422,  # a cursor of the other order
    "limit=0": 422,
    "limit=1001": 422,
    "limit=02": 200,
    "limit=%2B2": 200,
    "limit=x": 422,
    "limit=2&limit=3": 200,
    "order=bogus": 422,
    "order=Ordinal": 422,
    "fields=none": 422,
    "limt=2": 422,
}


@pytest.mark.usefixtures("history")
def test_page_queries_are_accepted_or_refused_as_the_endpoint_declares(
    client: httpx.Client,
) -> None:
    first = client.get(STEPS, params={"limit": 2}).json()["next_cursor"]
    by_start = client.get(STEPS, params={"limit": 2, "order": "started_at"}).json()["next_cursor"]
    expected = {f"{STEPS}?{query}": status for query, status in PAGE_QUERIES.items()}
    expected |= {
        f"{STEPS}?cursor={first}": 200,
        f"{STEPS}?order=started_at&cursor={by_start}": 200,
        "/v1/instances/nobody/steps": 404,
        "/v1/instances/-bad/steps?limit=2": 422,
    }
    for path, status in expected.items():
        assert client.get(path).status_code == status, path
