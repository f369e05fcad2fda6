"""Operations (README, "Operations"): metrics, request logs, graceful shutdown, PgBouncer."""

import json
import os
import re
import shutil
import signal
import subprocess
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from tests.support.databases import lock_waits
from tests.support.metrics import counter
from tests.support.servers import BEHIND_PGBOUNCER, pgbouncer, start_server, stop
from tests.support.waits import eventually


@pytest.fixture(scope="module")
def two_workers(
    own_database: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Path]]:
    log = tmp_path_factory.mktemp("logs") / "stdout.jsonl"
    with log.open("wb") as out:
        url, proc = start_server(own_database, "--workers", "2", stdout=out)
        try:
            yield url, log
        finally:
            stop(proc)


def test_metrics_sum_every_worker(two_workers: tuple[str, Path]) -> None:
    url, _ = two_workers
    key = "m-" + uuid.uuid4().hex[:8]
    with httpx.Client(base_url=url) as client:
        before = client.get("/metrics").text
        for i in range(12):
            assert client.post(f"/v1/instances/{key}/steps/s{i}/start").status_code == 201
        client.post(f"/v1/instances/{key}/steps/s0/start", json={"attempt": 1})
        client.post(f"/v1/instances/{key}/steps/s0/start", json={"attempt": "x"})
        client.get(f"/v1/instances/{key}/steps")
        scrapes = [client.get("/metrics") for _ in range(4)]
    assert all(s.status_code == 200 for s in scrapes)
    assert scrapes[0].headers["content-type"].startswith("text/plain")
    for scrape in scrapes:
        text = scrape.text
        created = counter(text, "steprecord_events_total", kind="start", outcome="created")
        assert (
            created - counter(before, "steprecord_events_total", kind="start", outcome="created")
            == 12
        )
        assert (
            counter(text, "steprecord_events_total", kind="start", outcome="stale_attempt")
            + counter(text, "steprecord_events_total", kind="start", outcome="replay")
            >= 1
        )
        assert counter(text, "steprecord_events_total", kind="start", outcome="refused") >= 1
        template = "/v1/instances/{instance_key}/steps/{step_slug}/start"
        assert (
            counter(
                text,
                "steprecord_http_request_duration_seconds_count",
                method="POST",
                route=template,
                status="201",
            )
            >= 12
        )
        assert key not in text  # routes are templates, never concrete paths
        assert "steprecord_db_pool_connections" in text


def log_lines(path: Path) -> list[dict[str, Any]]:
    lines = []
    for raw in path.read_text().splitlines():
        try:
            lines.append(json.loads(raw))
        except json.JSONDecodeError:
            continue
    return lines


def test_one_json_log_line_per_request_with_the_request_id(
    two_workers: tuple[str, Path],
) -> None:
    url, log = two_workers
    secret_output = "do-not-log-" + uuid.uuid4().hex
    mine = "trace-" + uuid.uuid4().hex[:12]
    with httpx.Client(base_url=url) as client:
        echoed = client.post(
            "/v1/instances/logs/steps/a/complete",
            json={"started_at": "2026-12-02T10:00:00Z", "output": secret_output},
            headers={"X-Request-ID": mine, "Authorization": "Bearer sr_secret-token"},
        )
        generated = client.get("/healthz", headers={"X-Request-ID": "bad id with spaces"})
    assert echoed.headers["x-request-id"] == mine
    made = generated.headers["x-request-id"]
    assert re.fullmatch(r"[A-Za-z0-9._:-]{1,128}", made)
    assert made != "bad id with spaces"
    # Each worker writes its line when it has answered: wait until both lines are there.
    eventually(lambda: {mine, made} <= {line.get("request_id") for line in log_lines(log)})
    lines = log_lines(log)
    ours = [line for line in lines if line.get("request_id") == mine]
    assert len(ours) == 1
    assert ours[0]["method"] == "POST"
    assert ours[0]["route"] == "/v1/instances/{instance_key}/steps/{step_slug}/complete"
    assert ours[0]["status"] == 401  # a token that matches nothing
    assert isinstance(ours[0]["duration_ms"], float | int)
    assert {"method", "route", "status", "duration_ms", "request_id"} <= ours[0].keys()
    text = log.read_text()
    assert secret_output not in text
    assert "sr_secret-token" not in text
    assert any(line.get("request_id") == made for line in lines)


@pytest.mark.parametrize("workers", ["1", "2"])
def test_sigterm_finishes_in_flight_requests(own_database: str, workers: str) -> None:
    url, proc = start_server(own_database, "--workers", workers)
    key = "term-" + uuid.uuid4().hex[:8]
    outcome: dict[str, Any] = {}
    try:
        assert httpx.post(f"{url}/v1/instances/{key}/steps/a/start").status_code == 201
        with psycopg.connect(own_database) as blocker:
            # Naming the instance's id, so that on Citus the lock is taken on its worker.
            blocker.execute(
                "SELECT 1 FROM workflow_step_record r JOIN process_instance p"
                " ON p.id = r.instance_id WHERE p.instance_key = %s"
                " AND p.id = steprecord_instance_id(%s) AND r.instance_id = p.id FOR UPDATE",
                (key, key),
            )

            def complete() -> None:
                outcome["response"] = httpx.post(
                    f"{url}/v1/instances/{key}/steps/a/complete", json={"output": 1}, timeout=30
                )

            worker = threading.Thread(target=complete)
            worker.start()
            with psycopg.connect(own_database, autocommit=True) as watcher:
                eventually(lambda: lock_waits(watcher) == 1)  # the request waits for the lock
            proc.send_signal(signal.SIGTERM)
            with pytest.raises(subprocess.TimeoutExpired):  # it holds on for the request
                proc.wait(0.5)
            blocker.rollback()
        worker.join(30)
        assert outcome["response"].status_code == 200
        assert proc.wait(20) == 0
    finally:
        stop(proc)
    with psycopg.connect(own_database) as conn:
        row = conn.execute(
            "SELECT r.status FROM workflow_step_record r JOIN process_instance p"
            " ON p.id = r.instance_id WHERE p.instance_key = %s",
            (key,),
        ).fetchone()
    assert row == ("completed",)


@pytest.mark.skipif(
    shutil.which("pgbouncer") is None and not os.environ.get("CI"),
    reason="PgBouncer is not installed (apt-get install pgbouncer); CI always runs this",
)
def test_works_behind_pgbouncer_in_transaction_mode(own_database: str) -> None:
    with pgbouncer(own_database) as bounced:
        url, proc = start_server(bounced, "--workers", "2", env=BEHIND_PGBOUNCER)
        try:
            key = "pgb-" + uuid.uuid4().hex[:8]
            with httpx.Client(base_url=url, timeout=30) as client:
                for i in range(20):
                    assert client.post(f"/v1/instances/{key}/steps/s{i}/start").status_code == 201
                    assert (
                        client.post(
                            f"/v1/instances/{key}/steps/s{i}/complete", json={"output": {"i": i}}
                        ).status_code
                        == 200
                    )
                events = [
                    {"instance_key": key, "step_slug": f"b{i}", "kind": "start"} for i in range(50)
                ]
                results = client.post("/v1/events", json={"events": events}).json()["results"]
                assert all(r["status"] == 201 for r in results)
                items = client.get(f"/v1/instances/{key}/steps", params={"limit": 1000}).json()
                assert len(items["items"]) == 70
                assert client.get("/readyz").status_code == 200
        finally:
            stop(proc)
