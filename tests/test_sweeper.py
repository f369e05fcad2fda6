"""The sweeper across processes: several service instances, each with several workers, sweep
one database, and every expired lease is swept exactly once; an outage does not stop it."""

import time

import httpx
import psycopg

from app.cli.migrate import migrate
from app.ops.embedded import EmbeddedPostgres
from tests.support.metrics import counter
from tests.support.servers import start_server, stop
from tests.support.waits import eventually, wait_for

FAST = {"STEPRECORD_SWEEP_SECONDS": "0.05"}
STEPS = 300


def swept_count(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return counter(text, "steprecord_events_total", kind="fail", outcome="swept")


def test_two_service_instances_sweep_each_expired_lease_exactly_once(own_database: str) -> None:
    first, first_proc = start_server(own_database, "--workers", "2", env=FAST)
    try:
        second, second_proc = start_server(own_database, "--workers", "2", env=FAST)
        try:
            events = [
                {
                    "instance_key": f"run-{i % 10}",
                    "step_slug": f"s{i}",
                    "kind": "start",
                    "attempt": 1,
                    "lease_seconds": 1,
                }
                for i in range(STEPS)
            ]
            results = httpx.post(f"{first}/v1/events", json={"events": events}, timeout=30)
            assert [r["status"] for r in results.json()["results"]] == [201] * STEPS
            with psycopg.connect(own_database, autocommit=True) as conn:
                eventually(
                    lambda: (
                        conn.execute(
                            "SELECT count(*) FROM workflow_step_record WHERE status = 'running'"
                        ).fetchone()
                        == (0,)
                    ),
                    seconds=30,
                    interval=0.1,
                    what="the leases to be swept",
                )
                records = conn.execute(
                    "SELECT status, error_code FROM workflow_step_record"
                ).fetchall()
                history = conn.execute(
                    "SELECT record_id, count(*), min(status), min(error_code),"
                    " bool_and(completed_at = lease_expires_at)"
                    " FROM workflow_step_attempt GROUP BY record_id"
                ).fetchall()
            assert records == [("failed", "lease_expired")] * STEPS
            assert len(history) == STEPS
            # One attempt each, failed at the moment its lease expired.
            assert {row[1:] for row in history} == {(1, "failed", "lease_expired", True)}
            assert swept_count(first) + swept_count(second) == STEPS
        finally:
            stop(second_proc)
    finally:
        stop(first_proc)


def test_the_sweeper_resumes_after_a_database_outage(own_postgres: EmbeddedPostgres) -> None:
    migrate(own_postgres.url)
    url, proc = start_server(own_postgres.url, env={"STEPRECORD_SWEEP_SECONDS": "0.1"})
    try:
        with httpx.Client(base_url=url, timeout=10) as client:
            started = client.post(
                "/v1/instances/r/steps/a/start", json={"attempt": 1, "lease_seconds": 1}
            )
            assert started.status_code == 201
            own_postgres.stop()
            down = time.monotonic()
            while time.monotonic() - down < 1.5:  # the lease expires while the database is down
                assert client.get("/healthz").status_code == 200
                time.sleep(0.1)
            own_postgres.start()

            def failed() -> httpx.Response | None:
                response = client.get("/v1/instances/r/steps/a")
                if response.status_code == 200 and response.json()["status"] == "failed":
                    return response
                return None

            response = wait_for("the sweeper to resume", failed, seconds=15)
            assert response.json()["error_code"] == "lease_expired"
            assert response.json()["completed_at"] == started.json()["lease_expires_at"]
    finally:
        stop(proc)
