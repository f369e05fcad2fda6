"""Instance keys take Airflow's run ids as they are: `+` and `~` besides the name alphabet,
on every route, in batches, pages, cursors, streams and the dashboard, sent percent-encoded or
not. Step slugs and other names keep their alphabet."""

from typing import Any
from urllib.parse import quote

import httpx
import psycopg
import pytest

from app.core.problems import KEY_RULE, NAME_RULE
from app.data.common import constraint_name
from tests.support.citus import has_citus
from tests.support.http import T0, T1, T2, post, problem

SCHEDULED = "etl_daily:scheduled__2026-12-06T00:00:00+00:00"
MANUAL = "etl_daily:manual__2026-12-06T10:00:00.123456+00:00~retry"
KEYS = [SCHEDULED, MANUAL]


def encoded(key: str) -> str:
    return quote(key, safe="")


def started(client: httpx.Client, key: str, step: str = "extract", **body: Any) -> Any:
    response = post(client, "start", {"attempt": 1, "started_at": T0, **body}, key, step)
    assert response.status_code == 201, response.text
    return response.json()


@pytest.mark.parametrize("key", KEYS)
def test_every_event_and_read_takes_a_run_id_key_as_it_is_or_percent_encoded(
    client: httpx.Client, key: str
) -> None:
    record = started(client, key, lease_seconds=60)
    assert record["instance_key"] == key
    path = f"/v1/instances/{encoded(key)}/steps/extract"
    beat = client.post(f"{path}/heartbeat", json={"attempt": 1, "lease_seconds": 60})
    assert beat.status_code == 200, beat.text
    done = client.post(f"{path}/complete", json={"attempt": 1, "completed_at": T1})
    assert done.status_code == 200, done.text
    assert done.json()["instance_key"] == key
    for spelled in (key, encoded(key)):
        base = f"/v1/instances/{spelled}"
        one = client.get(base)
        assert one.status_code == 200, one.text
        assert one.json()["instance_key"] == key
        assert client.get(f"{base}/steps").json()["items"][0]["instance_key"] == key
        assert client.get(f"{base}/steps/extract").json()["status"] == "completed"
        attempts = client.get(f"{base}/steps/extract/attempts").json()["items"]
        assert [a["status"] for a in attempts] == ["completed"]
        assert client.get(f"{base}/repairs").status_code == 200
    # A `+` is a `+` in a path: never read as a space, so the key with a space is another
    # (refused) key, not this one.
    spaced = key.replace("+", " ")
    if spaced != key:
        response = client.get(f"/v1/instances/{encoded(spaced)}")
        assert problem(response, 422, "validation_error")["errors"][0]["message"] == KEY_RULE


def test_reopen_and_delete_take_a_run_id_key(client: httpx.Client) -> None:
    started(client, SCHEDULED)
    failed = {"attempt": 1, "completed_at": T1, "error_code": "Boom"}
    post(client, "fail", failed, SCHEDULED, "extract")
    reopened = client.post(
        f"/v1/instances/{SCHEDULED}/steps/extract/reopen", json={"reason": "rerun by hand"}
    )
    assert reopened.status_code == 200, reopened.text
    repairs = client.get(f"/v1/instances/{encoded(SCHEDULED)}/repairs").json()["items"]
    assert [r["reason"] for r in repairs] == ["rerun by hand"]
    assert client.delete(f"/v1/instances/{encoded(SCHEDULED)}").status_code == 204
    assert client.get(f"/v1/instances/{SCHEDULED}").status_code == 404


def test_a_batch_takes_run_id_keys_and_still_refuses_them_as_slugs(client: httpx.Client) -> None:
    events = [
        {"instance_key": SCHEDULED, "step_slug": "load:3", "kind": "start", "attempt": 1},
        {"instance_key": MANUAL, "step_slug": "load:4", "kind": "declare"},
        {"instance_key": SCHEDULED, "step_slug": "load+3", "kind": "start"},
        {"instance_key": "+etl", "step_slug": "load", "kind": "start"},
    ]
    response = client.post("/v1/events", json={"events": events})
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    assert [r["status"] for r in results] == [201, 201, 422, 422]
    assert results[2]["problem"]["errors"] == [{"field": "step_slug", "message": NAME_RULE}]
    assert results[3]["problem"]["errors"] == [{"field": "instance_key", "message": KEY_RULE}]


@pytest.mark.parametrize(
    ("key", "slug", "field"),
    [
        ("+scheduled", "s", "instance_key"),  # a key still starts with a letter or digit
        ("~etl", "s", "instance_key"),
        ("etl/run", "s", "instance_key"),
        ("etl run", "s", "instance_key"),
        ("e" * 201, "s", "instance_key"),
        ("etl", "load+1", "step_slug"),  # slugs keep the name alphabet
        ("etl", "load~1", "step_slug"),
    ],
)
def test_what_stays_refused(client: httpx.Client, key: str, slug: str, field: str) -> None:
    response = client.post(f"/v1/instances/{encoded(key)}/steps/{encoded(slug)}/start")
    body = problem(response, 422, "validation_error")
    if "/" in key:  # refused before routing, as any slash is
        assert body["errors"] == [
            {"field": "path", "message": "instance keys and step slugs may not contain /"}
        ]
    else:
        assert body["errors"] == [
            {"field": field, "message": KEY_RULE if field == "instance_key" else NAME_RULE}
        ]


def test_an_error_code_keeps_the_name_alphabet(client: httpx.Client) -> None:
    started(client, SCHEDULED)
    body = {"attempt": 1, "completed_at": T1, "error_code": "up+for+retry"}
    problem(post(client, "fail", body, SCHEDULED, "extract"), 422, "validation_error")


def test_lists_and_their_cursors_page_through_run_id_keys(client: httpx.Client) -> None:
    keys = [f"etl_daily:scheduled__2026-12-{day:02d}T00:00:00+00:00" for day in range(1, 8)]
    for key in keys:
        started(client, key)
    seen: list[str] = []
    cursor: str | None = None
    while True:
        params: dict[str, Any] = {"limit": 3}
        if cursor:
            params["cursor"] = cursor
        page = client.get("/v1/instances", params=params).json()
        seen += [item["instance_key"] for item in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert sorted(seen) == sorted(keys)
    for index in range(5):
        started(client, keys[0], f"load:{index}")
    slugs: list[str] = []
    url: str | None = f"/v1/instances/{keys[0]}/steps?limit=2"
    again = f"/v1/instances/{encoded(keys[0])}/steps?limit=2&cursor="
    while url is not None:
        body = client.get(url).json()
        slugs += [r["step_slug"] for r in body["items"]]
        nxt = body["next_cursor"]
        url = None if nxt is None else again + nxt
    assert slugs == ["extract", *[f"load:{i}" for i in range(5)]]
    running = client.get("/v1/steps", params={"status": "running", "limit": 100}).json()
    assert {r["instance_key"] for r in running["items"]} == set(keys)


def test_the_database_takes_the_wider_keys_and_refuses_the_rest(
    db: psycopg.Connection[tuple[object, ...]],
) -> None:
    db.execute(
        "INSERT INTO process_instance (id, instance_key)"
        " VALUES (steprecord_instance_id(%(k)s), %(k)s)",
        {"k": SCHEDULED},
    )
    for bad in ("+x", "x y", "x/y", "load€"):
        with pytest.raises(psycopg.errors.CheckViolation) as refused, db.transaction():
            db.execute(
                "INSERT INTO process_instance (id, instance_key)"
                " VALUES (steprecord_instance_id(%(k)s), %(k)s)",
                {"k": bad},
            )
        # On Citus the refusal comes from the shard's copy: the name as on one node.
        assert constraint_name(refused.value) == "ck_process_instance_instance_key_format"


def test_the_dashboard_links_and_filters_run_id_keys(client: httpx.Client) -> None:
    started(client, SCHEDULED, "load:3")
    post(
        client,
        "fail",
        {"attempt": 1, "completed_at": T2, "error_code": "Boom"},
        SCHEDULED,
        "load:3",
    )
    listing = client.get("/ui")
    assert listing.status_code == 200
    link = f"/ui/instances/{encoded(SCHEDULED)}"
    assert f'href="{link}"' in listing.text
    for spelled in (SCHEDULED, encoded(SCHEDULED)):
        page = client.get(f"/ui/instances/{spelled}")
        assert page.status_code == 200, page.text
        assert f'href="{link}/steps/load%3A3"' in page.text
        step = client.get(f"/ui/instances/{spelled}/steps/load:3")
        assert step.status_code == 200, step.text
        assert "Mapped task <code>load</code>, map index <code>3</code>" in step.text
    # A prefix filter with a `+`, sent encoded as a browser's form sends it.
    filtered = client.get("/ui", params={"prefix": "etl_daily:scheduled__2026-12-06T00:00:00+"})
    assert filtered.status_code == 200
    assert f'href="{link}"' in filtered.text
    assert "A key prefix is" not in filtered.text
    stats = client.get("/ui/stats", params={"prefix": "etl_daily:scheduled__2026-12-06T00:00:00+"})
    assert stats.status_code == 200
    assert "A key prefix is" not in stats.text


def test_the_downgrade_refuses_while_a_key_holds_what_the_older_format_refuses(
    scratch_database: str,
) -> None:
    from alembic import command
    from alembic.script import ScriptDirectory

    from app.data.migrating import MigrationRefused
    from app.main import alembic_config

    if has_citus(scratch_database):
        pytest.skip("migrating down is for one server (as in tests/test_schema.py)")
    config = alembic_config()
    config.attributes["database_url"] = scratch_database
    before = ScriptDirectory.from_config(config).get_revision("0033").down_revision
    assert isinstance(before, str)
    command.upgrade(config, "0033")
    with psycopg.connect(scratch_database, autocommit=True) as conn:
        for key in (SCHEDULED, "plain-key"):
            conn.execute(
                "INSERT INTO process_instance (id, instance_key)"
                " VALUES (steprecord_instance_id(%(k)s), %(k)s)",
                {"k": key},
            )
    with pytest.raises(MigrationRefused) as refused:
        command.downgrade(config, before)
    assert f"1 instance keys hold '+' or '~' (e.g. {SCHEDULED})" in str(refused.value)
    with psycopg.connect(scratch_database, autocommit=True) as conn:
        version = conn.execute("SELECT version_num FROM alembic_version").fetchone()
        assert version == ("0033",)
        conn.execute("DELETE FROM process_instance WHERE instance_key = %s", (SCHEDULED,))
    command.downgrade(config, before)
    with (
        psycopg.connect(scratch_database, autocommit=True) as conn,
        pytest.raises(psycopg.errors.CheckViolation),
    ):
        conn.execute(
            "INSERT INTO process_instance (id, instance_key)"
            " VALUES (steprecord_instance_id(%(k)s), %(k)s)",
            {"k": SCHEDULED},
        )
    command.upgrade(config, "head")
