"""Instance labels (docs/operations.md, "Labels and an instance's summary"): set by events,
batches and PATCH, refused beyond their limits by the service and by the database, filtered on
the lists; and an instance's summary."""

from datetime import UTC, datetime
from typing import Any

import httpx
import psycopg
import pytest

from app.data import reads
from app.data.common import constraint_name
from tests.support.http import T0, T1, T2, T3, post, problem


def send(
    client: httpx.Client, kind: str, instance: str = "order-1", step: str = "charge", **body: Any
) -> httpx.Response:
    """An event with `body`'s fields (none: no body)."""
    return post(client, kind, body or None, instance=instance, step=step)


def instance(client: httpx.Client, key: str = "order-1") -> Any:
    response = client.get(f"/v1/instances/{key}")
    assert response.status_code == 200, response.text
    return response.json()


def keys(client: httpx.Client, path: str = "/v1/instances", **params: Any) -> list[str]:
    response = client.get(path, params=params)
    assert response.status_code == 200, response.text
    return [item["instance_key"] for item in response.json()["items"]]


def test_an_event_s_labels_merge_into_its_instance_s_and_an_omission_removes_none(
    client: httpx.Client,
) -> None:
    send(client, "start", labels={"env": "prod", "team": "billing"})
    assert instance(client)["labels"] == {"env": "prod", "team": "billing"}
    send(client, "complete", step="charge", started_at=T1, labels={"env": "staging"})
    send(client, "declare", step="ship")  # no labels: the instance keeps its own
    assert instance(client)["labels"] == {"env": "staging", "team": "billing"}
    assert instance(client, "order-1")["labels"] == keys_labels(client)["order-1"]


def keys_labels(client: httpx.Client) -> dict[str, Any]:
    items = client.get("/v1/instances").json()["items"]
    return {item["instance_key"]: item["labels"] for item in items}


def test_a_refused_event_writes_no_labels(client: httpx.Client) -> None:
    send(client, "complete", attempt=2, started_at=T1, completed_at=T2, labels={"a": "1"})
    stale = send(client, "start", attempt=1, labels={"a": "stale"})
    assert stale.status_code == 409
    missing = send(client, "complete", instance="order-2", labels={"a": "x"})
    assert missing.status_code == 409  # not_started: no instance either
    assert instance(client)["labels"] == {"a": "1"}
    assert client.get("/v1/instances/order-2").status_code == 404


def test_a_batch_merges_each_event_s_labels_in_order(client: httpx.Client) -> None:
    events = [
        {"instance_key": "b-1", "step_slug": "a", "kind": "start", "labels": {"k": "1"}},
        {
            "instance_key": "b-1",
            "step_slug": "b",
            "kind": "declare",
            "labels": {"k": "2", "x": "y"},
        },
        {"instance_key": "b-2", "step_slug": "a", "kind": "declare", "labels": {"env": "prod"}},
        {"instance_key": "b-1", "step_slug": "a", "kind": "complete", "labels": {"done": "yes"}},
        {"instance_key": "b-3", "step_slug": "a", "kind": "complete", "labels": {"no": "pe"}},
    ]
    response = client.post("/v1/events", json={"events": events})
    assert [r["status"] for r in response.json()["results"]] == [201, 201, 201, 200, 409]
    assert instance(client, "b-1")["labels"] == {"k": "2", "x": "y", "done": "yes"}
    assert instance(client, "b-2")["labels"] == {"env": "prod"}
    assert client.get("/v1/instances/b-3").status_code == 404
    again = [{**events[2], "labels": {"env": "prod"}}, {**events[2], "labels": {"env": "dev"}}]
    client.post("/v1/events", json={"events": again})
    assert instance(client, "b-2")["labels"] == {"env": "dev"}


def test_patch_sets_and_removes_labels_as_json_merge_patch(client: httpx.Client) -> None:
    send(client, "start", labels={"env": "prod", "stale": "x"})
    response = client.patch(
        "/v1/instances/order-1", json={"labels": {"stale": None, "owner": "ana"}}
    )
    assert response.status_code == 200, response.text
    assert response.json()["labels"] == {"env": "prod", "owner": "ana"}
    assert response.json()["summary"]["status"] == "running"
    assert instance(client)["labels"] == {"env": "prod", "owner": "ana"}
    problem(
        client.patch("/v1/instances/nope", json={"labels": {"a": "b"}}), 404, "instance_not_found"
    )
    problem(client.patch("/v1/instances/order-1", json={"lables": {}}), 422, "validation_error")


@pytest.mark.parametrize(
    ("labels", "named"),
    [
        ({"a b": "x"}, "[A-Za-z0-9._/-]"),
        ({"k" * 64: "x"}, "1 to 63 characters"),
        ({"k": "v" * 201}, "over the limit of 200"),
        ({f"k{n}": "v" for n in range(33)}, "over the limit of 32"),
        ({"k": 1}, "string"),
    ],
)
def test_labels_beyond_a_limit_are_refused_naming_the_limit(
    client: httpx.Client, labels: dict[str, Any], named: str
) -> None:
    body = problem(send(client, "start", labels=labels), 422, "validation_error")
    assert named in body["detail"]
    assert client.get("/v1/instances/order-1").status_code == 404
    send(client, "start")
    body = problem(
        client.patch("/v1/instances/order-1", json={"labels": labels}), 422, "validation_error"
    )
    assert named in body["detail"]


def test_an_event_s_null_label_is_refused_and_says_how_to_remove_one(client: httpx.Client) -> None:
    body = problem(send(client, "start", labels={"a": None}), 422, "validation_error")
    assert "PATCH" in body["detail"]


def test_the_33rd_label_of_an_instance_is_refused_by_the_database_naming_its_constraint(
    client: httpx.Client,
) -> None:
    send(client, "start", labels={f"k{n}": "v" for n in range(32)})
    body = problem(
        send(client, "declare", step="b", labels={"one": "more"}), 422, "constraint_violation"
    )
    assert "ck_process_instance_labels_count" in body["detail"]
    assert "at most 32 labels" in body["detail"]
    assert client.get("/v1/instances/order-1/steps/b").status_code == 404  # nothing written
    body = problem(
        client.patch("/v1/instances/order-1", json={"labels": {"x": "y"}}),
        422,
        "constraint_violation",
    )
    assert "ck_process_instance_labels_count" in body["detail"]
    ok = client.patch("/v1/instances/order-1", json={"labels": {"k0": None, "x": "y"}})
    assert ok.status_code == 200
    assert len(ok.json()["labels"]) == 32


@pytest.mark.parametrize(
    ("labels", "constraint"),
    [
        ("'[]'", "ck_process_instance_labels_object"),
        ('\'{"a b": "x"}\'', "ck_process_instance_labels_key_format"),
        ("'{\"a\": 1}'", "ck_process_instance_labels_value_format"),
        ('\'{"a": ["x"]}\'', "ck_process_instance_labels_value_format"),
        (f'\'{{"a": "{"v" * 201}"}}\'', "ck_process_instance_labels_value_format"),
        (
            "(SELECT jsonb_object_agg('k' || n, 'v') FROM generate_series(1, 33) n)",
            "ck_process_instance_labels_count",
        ),
    ],
)
def test_the_database_refuses_labels_beyond_their_limits_by_named_checks(
    client: httpx.Client, db: psycopg.Connection[tuple[object, ...]], labels: str, constraint: str
) -> None:
    send(client, "start")
    with pytest.raises(psycopg.errors.CheckViolation) as refused:
        db.execute(f"UPDATE process_instance SET labels = {labels}")
    assert constraint_name(refused.value) == constraint  # on Citus: from its message


def test_the_lists_filter_by_every_label_asked_with_status_and_pages(client: httpx.Client) -> None:
    send(client, "start", instance="r-1", labels={"env": "prod", "dag": "etl"})
    send(
        client,
        "fail",
        instance="r-2",
        started_at=T1,
        error_code="E",
        labels={"env": "prod", "dag": "etl"},
    )
    send(client, "start", instance="r-3", labels={"env": "prod", "dag": "other"})
    send(client, "start", instance="r-4", labels={"env": "dev", "dag": "etl"})
    both: dict[str, Any] = {"label": ["env=prod", "dag=etl"]}
    assert keys(client, **both) == ["r-2", "r-1"]
    assert keys(client, label="env=prod") == ["r-3", "r-2", "r-1"]
    assert keys(client, **both, status="failed") == ["r-2"]
    assert keys(client, **both, status="running") == ["r-1"]
    assert keys(client, label="env=nope") == []
    first = client.get("/v1/instances", params={**both, "limit": 1}).json()
    assert [i["instance_key"] for i in first["items"]] == ["r-2"]
    rest = client.get("/v1/instances", params={**both, "cursor": first["next_cursor"]}).json()
    assert [i["instance_key"] for i in rest["items"]] == ["r-1"]
    assert rest["next_cursor"] is None
    assert sorted(keys(client, "/v1/steps", **both)) == ["r-1", "r-2"]
    assert keys(client, "/v1/steps", **both, status="failed") == ["r-2"]
    stats = client.get("/v1/stats/steps", params={"since": T0, "label": "dag=other"}).json()
    assert [(i["name"], i["attempts"]["running"]) for i in stats["items"]] == [("charge", 1)]
    stats = client.get("/v1/stats/steps", params={"since": T0, "label": "env=prod"}).json()
    assert stats["items"][0]["attempts"]["failed"] == 1


@pytest.mark.parametrize("label", ["env", "a b=x", "env=prod&", f"k={'v' * 201}"])
def test_a_malformed_label_filter_is_a_422(client: httpx.Client, label: str) -> None:
    for path in ("/v1/instances", "/v1/steps", "/v1/stats/steps"):
        if label == "env=prod&":
            continue
        problem(client.get(path, params={"label": label}), 422, "validation_error")
    problem(client.get("/v1/instances", params={"label": ["a=1", "a=2"]}), 422, "validation_error")


def test_the_label_filter_reads_the_labels_index(
    db: psycopg.Connection[tuple[object, ...]],
) -> None:
    # On Citus, as many rows on each of its 8 shards as on one node.
    citus = db.execute("SELECT 1 FROM pg_extension WHERE extname = 'citus'").fetchone()
    db.execute(
        """
        INSERT INTO process_instance (id, instance_key, labels)
        SELECT steprecord_instance_id('i' || n), 'i' || n,
               jsonb_build_object('env', 'prod', 'customer', 'c' || n, 'dag', 'd' || (n %% 100))
        FROM generate_series(1, %s) n
        """,
        (160_000 if citus else 20_000,),
    )
    if not citus:  # the rows are in the index's pending list, which a scan reads whole
        db.execute("SELECT gin_clean_pending_list('ix_process_instance_labels')")
    db.execute("ANALYZE process_instance")
    query = reads.list_instances_query(prefix=False, has=None, labels=True)
    params = {
        "before_created_at": "infinity",
        "before_id": 0,
        "created_after": None,
        "limit": 101,
        "labels": '{"customer": "c42", "env": "prod"}',
    }
    with db.cursor() as cur:
        cur.execute("EXPLAIN " + query, params)
        plan = "\n".join(str(row[0]) for row in cur.fetchall())
    assert "ix_process_instance_labels" in plan, plan


def test_an_instance_s_summary_follows_its_steps(client: httpx.Client) -> None:
    send(client, "declare", step="a")
    summary = instance(client)["summary"]
    assert summary == {
        "status": "pending",
        "first_started_at": None,
        "last_finished_at": None,
        "duration_ms": None,
        "failing_step": None,
    }
    send(client, "start", step="a", attempt=1, started_at=T0)
    send(client, "fail", step="b", started_at=T0, completed_at=T1, error_code="E")
    running = instance(client)["summary"]
    assert running["status"] == "running"
    assert running["failing_step"] == "b"
    assert running["duration_ms"] > 1000  # to now
    send(client, "complete", step="a", attempt=1, completed_at=T3)
    send(client, "fail", step="c", started_at=T1, completed_at=T2, error_code="E")
    failed = instance(client)["summary"]
    assert failed == {
        "status": "failed",
        "first_started_at": T0,
        "last_finished_at": T3,
        "duration_ms": 3000.0,
        "failing_step": "c",
    }
    for step in ("b", "c"):
        send(client, "complete", step=step, attempt=2, started_at=T3, completed_at=T3)
    completed = client.get("/v1/instances").json()["items"][0]["summary"]
    assert completed["status"] == "completed"
    assert completed["failing_step"] is None


def test_the_dashboard_shows_labels_and_filters_its_pages_by_them(client: httpx.Client) -> None:
    now = datetime.now(UTC).isoformat()
    send(
        client, "fail", instance="run-prod", started_at=now, error_code="E", labels={"env": "prod"}
    )
    send(client, "fail", instance="run-dev", started_at=now, error_code="E", labels={"env": "dev"})
    listed = client.get("/ui", params={"labels": "env=prod"})
    assert listed.status_code == 200
    assert "run-prod" in listed.text
    assert "run-dev" not in listed.text
    assert 'href="/ui?labels=env%3Dprod"' in listed.text  # a label is a link to its filter
    page = client.get("/ui/instances/run-dev").text
    assert "env=dev" in page
    failing = client.get("/ui/failing", params={"labels": "env=dev"}).text
    assert "run-dev" in failing
    assert "run-prod" not in failing
    assert "1 in all" in failing  # the sparkline counts the labelled failures only
    by_step = client.get("/ui/failing", params={"labels": "env=dev", "step": "charge"}).text
    assert "run-dev" in by_step
    assert "run-prod" not in by_step
    week = {"window": "7d", "labels": "env=nope"}
    assert "No attempt started in this window" in client.get("/ui/stats", params=week).text
    bad = client.get("/ui", params={"labels": "env"})
    assert bad.status_code == 422
    assert "KEY=VALUE" in bad.text
