"""The command and the service's life: embedded default, restarts, outages, readiness."""

import asyncio
import os
import shutil
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import psycopg
import pytest
from alembic.util import CommandError

import app.main
from app.cli.migrate import migrate
from app.data.revision import MIGRATION_LOCK
from app.main import create_app, schema_head
from app.ops.embedded import EmbeddedPostgres
from tests.support import ROOT
from tests.support.databases import migrated_database
from tests.support.metrics import counter, metrics
from tests.support.servers import (
    BEHIND_PGBOUNCER,
    free_port,
    pgbouncer,
    start_server,
    stop,
    wait_ready,
)
from tests.support.waits import eventually, wait_for


def serve_embedded(data_dir: Path, *extra: str) -> tuple[str, subprocess.Popen[bytes]]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    env["STEPRECORD_DATA_DIR"] = str(data_dir)
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "serve", "--port", str(port), *extra],
        env=env,
        cwd=ROOT,
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, timeout=60)
    except BaseException:
        stop(proc)
        raise
    return url, proc


def test_serve_without_database_url_runs_embedded_and_keeps_records(server_dir: Path) -> None:
    data_dir = server_dir / "data"
    url, proc = serve_embedded(data_dir)
    try:
        created = httpx.post(f"{url}/v1/instances/run-1/steps/a/start", json={"attempt": 1})
        assert created.status_code == 201
    finally:
        stop(proc)
    assert proc.returncode == 0
    assert proc.stderr is not None
    banner = proc.stderr.read().decode()
    assert "embedded PostgreSQL" in banner
    assert "listening on http://127.0.0.1:" in banner
    assert not EmbeddedPostgres(data_dir).running(), "the embedded server outlived serve"
    url, proc = serve_embedded(data_dir)
    try:
        again = httpx.get(f"{url}/v1/instances/run-1/steps/a")
        assert again.status_code == 200
        assert again.json()["attempt_count"] == 1
    finally:
        stop(proc)


@pytest.mark.parametrize(
    "form",
    [
        "postgresql://postgres:s3cr%65t@/{dbname}?host={host}&port={port}",
        "postgresql://postgres@/{dbname}?host={host}&port={port}&password=s3cr%65t",
        "host={host} port={port} user=postgres password=s3cret dbname={dbname}",
    ],
    ids=["url userinfo", "url query", "key=value"],
)
def test_serve_banner_never_shows_the_database_password(database_url: str, form: str) -> None:
    info = psycopg.conninfo.conninfo_to_dict(database_url)
    host = str(info.get("host", "127.0.0.1"))
    secret_url = form.format(dbname=info["dbname"], host=host, port=info.get("port", 5432))
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "serve", "--port", str(free_port())],
        env={**os.environ, "DATABASE_URL": secret_url},
        cwd=ROOT,
        stderr=subprocess.PIPE,
    )
    lines = []
    try:
        assert proc.stderr is not None
        for raw in proc.stderr:
            lines.append(raw.decode())
            if "listening" in lines[-1]:
                break
    finally:
        stop(proc)
    banner = "".join(lines)
    assert "listening" in banner
    assert "password=***" in banner
    assert "s3cret" not in banner
    assert "s3cr%65t" not in banner


def test_migrate_command_brings_a_database_to_head(scratch_database: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "app.cli", "migrate"],
        env={**os.environ, "DATABASE_URL": scratch_database},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    with psycopg.connect(scratch_database) as conn:
        revision = conn.execute("SELECT version_num FROM alembic_version").fetchone()
    assert revision == (schema_head(),)


WAITING_FOR_A_LOCK = """
SELECT count(*) FROM pg_locks l JOIN pg_database d ON d.oid = l.database
WHERE l.locktype = 'advisory' AND NOT l.granted AND d.datname = current_database()
"""


def test_migrating_waits_for_the_migration_lock(scratch_database: str) -> None:
    with psycopg.connect(scratch_database) as holder:
        holder.execute(MIGRATION_LOCK)
        proc = subprocess.Popen(
            [sys.executable, "-m", "app.cli", "migrate"],
            env={**os.environ, "DATABASE_URL": scratch_database},
            cwd=ROOT,
        )
        try:

            def waiting() -> bool:
                if holder.execute(WAITING_FOR_A_LOCK).fetchone() == (1,):
                    return True
                assert proc.poll() is None, "migrate finished while the lock was held"
                return False

            eventually(waiting, seconds=30, what="migrate to wait for the lock")
            tables = holder.execute("SELECT count(*) FROM pg_tables WHERE schemaname = 'public'")
            assert tables.fetchone() == (0,)
            holder.commit()  # releases the lock
            assert proc.wait(60) == 0
        finally:
            stop(proc)
    with psycopg.connect(scratch_database) as conn:
        assert conn.execute("SELECT version_num FROM alembic_version").fetchone() == (
            schema_head(),
        )


def test_two_instances_starting_together_on_an_empty_database_both_become_ready(
    scratch_database: str, tmp_path: Path
) -> None:
    started: list[tuple[str, subprocess.Popen[bytes], Path]] = []
    try:
        for i in range(2):
            port, log = free_port(), tmp_path / f"serve-{i}.log"
            with log.open("wb") as err:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "app.cli", "serve", "--port", str(port)],
                    env={**os.environ, "DATABASE_URL": scratch_database},
                    cwd=ROOT,
                    stderr=err,
                )
            started.append((f"http://127.0.0.1:{port}", proc, log))
        for url, proc, _ in started:
            wait_ready(url, proc, timeout=60)
            assert httpx.post(f"{url}/v1/instances/r/steps/{url[-5:]}/start").status_code == 201
    finally:
        for _, proc, _ in started:
            stop(proc)
    for _, proc, log in started:
        assert proc.returncode == 0, log.read_text()
        assert "Traceback" not in log.read_text()
    with psycopg.connect(scratch_database) as conn:
        assert conn.execute("SELECT version_num FROM alembic_version").fetchall() == [
            (schema_head(),)
        ]


def readyz_at(database_url: str, revision: str) -> httpx.Response:
    """/readyz of an app of this code, its database stamped at `revision`."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("UPDATE alembic_version SET version_num = %s", (revision,))

    async def probe() -> httpx.Response:
        service = create_app()
        async with service.router.lifespan_context(service):
            transport = httpx.ASGITransport(app=service)
            async with httpx.AsyncClient(transport=transport, base_url="http://x") as client:
                return await client.get("/readyz")

    return asyncio.run(probe())


FUTURE = "0999_future_additions"


def test_readyz_accepts_a_database_ahead_by_a_compatible_revision(
    scratch_database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    migrate(scratch_database)
    monkeypatch.setenv("DATABASE_URL", scratch_database)
    monkeypatch.setattr(app.main, "COMPATIBLE_AHEAD", frozenset({FUTURE}))
    ready = readyz_at(scratch_database, FUTURE)
    assert ready.status_code == 200, ready.text
    assert ready.json() == {"status": "ready", "schema": FUTURE}
    migrate(scratch_database)  # leaves it as it is
    with psycopg.connect(scratch_database) as conn:
        assert conn.execute("SELECT version_num FROM alembic_version").fetchone() == (FUTURE,)


def test_readyz_refuses_a_database_at_an_unknown_or_older_revision(
    scratch_database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    migrate(scratch_database)
    monkeypatch.setenv("DATABASE_URL", scratch_database)
    unknown = readyz_at(scratch_database, FUTURE)
    assert unknown.status_code == 503
    assert unknown.json()["code"] == "unavailable"
    assert f"schema at {FUTURE}, a revision this code does not know" in unknown.json()["detail"]
    with pytest.raises(CommandError):
        migrate(scratch_database)
    behind = readyz_at(scratch_database, "0001")
    assert behind.status_code == 503
    assert "behind this code's head" in behind.json()["detail"]
    assert "steprecord migrate" in behind.json()["detail"]


def test_readyz_is_503_until_the_schema_is_at_head(scratch_database: str) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "uvicorn",
            "app.main:create_app",
            "--factory",
            "--port",
            str(port),
            "--log-level",
            "warning",
        ],
        env={**os.environ, "DATABASE_URL": scratch_database},
        cwd=ROOT,
    )
    url = f"http://127.0.0.1:{port}"
    try:

        def answered() -> httpx.Response | None:
            try:
                return httpx.get(f"{url}/healthz")
            except httpx.TransportError:
                return None

        health = wait_for("the health check to answer", answered, seconds=30)
        assert health.status_code == 200
        ready = httpx.get(f"{url}/readyz")
        assert ready.status_code == 503
        assert ready.json()["code"] == "unavailable"
        migrate(scratch_database)
        # Its answer comes from a check at most a second old.
        eventually(lambda: httpx.get(f"{url}/readyz").status_code == 200, seconds=2)
    finally:
        stop(proc)


def test_outage_answers_503_fast_and_recovers_by_itself(own_postgres: EmbeddedPostgres) -> None:
    migrate(own_postgres.url)
    url, proc = start_server(own_postgres.url)
    try:
        with httpx.Client(base_url=url, timeout=10) as client:
            assert client.post("/v1/instances/r/steps/a/start").status_code == 201
            own_postgres.stop()
            for _ in range(3):
                began = time.monotonic()
                down = client.post("/v1/instances/r/steps/b/start")
                assert time.monotonic() - began < 2
                assert down.status_code == 503
                assert down.json()["code"] == "unavailable"
                assert down.headers["retry-after"]
            eventually(lambda: client.get("/readyz").status_code == 503, seconds=2)
            assert client.get("/healthz").status_code == 200
            own_postgres.start()
            eventually(
                lambda: client.post("/v1/instances/r/steps/c/start").status_code == 201,
                seconds=1,
                interval=0.02,
                what="recovery within a second",
            )
            eventually(lambda: client.get("/readyz").status_code == 200, seconds=2)
            steps = client.get("/v1/instances/r/steps").json()["items"]
            assert [s["step_slug"] for s in steps] == ["a", "c"]
    finally:
        stop(proc)


@pytest.mark.skipif(
    shutil.which("pgbouncer") is None and not os.environ.get("CI"),
    reason="PgBouncer is not installed (apt-get install pgbouncer); CI always runs this",
)
@pytest.mark.parametrize("through", ["direct", "pgbouncer"])
def test_times_are_answered_in_utc_whatever_the_database_time_zone(
    scratch_database: str, through: str
) -> None:
    """The service's connections run in UTC, so every answer's times end in `Z`; behind
    PgBouncer in transaction mode the setting follows the service's clients and no one else's.
    """
    with psycopg.connect(scratch_database, autocommit=True) as conn:
        conn.execute(f"ALTER DATABASE {conn.info.dbname} SET TimeZone = 'America/St_Johns'")
    migrate(scratch_database)
    with ExitStack() as stack:
        url, env = scratch_database, {}
        if through == "pgbouncer":
            url, env = stack.enter_context(pgbouncer(scratch_database)), BEHIND_PGBOUNCER
        base, proc = start_server(url, "--workers", "2", env=env)
        stack.callback(stop, proc)
        body = {"attempt": 1, "started_at": "2026-12-02T10:00:00.5+02:00"}
        event = {"instance_key": "tz", "step_slug": "a", "kind": "start", **body}
        for _ in range(5):  # several server connections, on both workers
            step = f"{base}/v1/instances/tz/steps/a"
            answers = [
                httpx.post(f"{step}/start", json=body).json(),
                httpx.get(step).json(),
                httpx.get(f"{base}/v1/instances/tz/steps").json()["items"][0],
                httpx.post(f"{base}/v1/events", json={"events": [event]}).json()["results"][0][
                    "record"
                ],
            ]
            for record in answers:
                assert record["started_at"] == "2026-12-02T08:00:00.500000Z"
                assert record["created_at"].endswith("Z")
                assert record["updated_at"].endswith("Z")
            with psycopg.connect(url, autocommit=True) as other:
                assert other.execute("SHOW TimeZone").fetchone() == ("America/St_Johns",)


# Server times (`created_at`, `updated_at`, a lease's end) and the cursors that carry them
# differ between two runs; everything else of every answer must not.
SERVER_TIMES = {"created_at", "updated_at", "lease_expires_at", "next_cursor"}


def without_server_times(value: object) -> object:
    if isinstance(value, dict):
        return {k: without_server_times(v) for k, v in value.items() if k not in SERVER_TIMES}
    if isinstance(value, list):
        return [without_server_times(v) for v in value]
    return value


def conversation(base: str) -> list[tuple[int, object]]:
    """Every kind of write and read, accepted and refused, each asked three times (so a
    statement prepared on its first use answers the later ones)."""
    at = {"started_at": "2026-12-02T10:00:00Z"}
    done = {**at, "completed_at": "2026-12-02T10:00:01Z"}
    step = f"{base}/v1/instances/prep-1/steps"
    calls: list[tuple[str, str, object]] = [
        ("POST", f"{step}/a/start", {"attempt": 1, **at, "lease_seconds": 60}),
        ("POST", f"{step}/a/heartbeat", {"attempt": 1, "lease_seconds": 60}),
        ("POST", f"{step}/a/complete", {"attempt": 1, **done, "output": {"n": 1}}),
        ("POST", f"{step}/a/complete", {"attempt": 1, **done, "output": {"n": 2}}),
        ("POST", f"{step}/b/fail", {"attempt": 2, **done, "error_code": "E"}),
        ("POST", f"{step}/b/start", {"attempt": 1, **at}),
        ("POST", f"{step}/c/declare", {"ordinal": 0}),
        ("POST", f"{step}/d/complete", {"attempt": 1}),
        ("POST", f"{step}/e/start", {"attempt": 0}),
        (
            "POST",
            f"{base}/v1/events",
            {
                "events": [
                    {"instance_key": "prep-2", "step_slug": "x", "kind": "start", **at},
                    {"instance_key": "prep-2", "step_slug": "x", "kind": "complete", **done},
                    {"instance_key": "prep-2", "step_slug": "bad slug", "kind": "start"},
                ]
            },
        ),
        ("GET", f"{step}?limit=1", None),
        ("GET", f"{step}?order=started_at&status=completed,failed", None),
        ("GET", f"{step}/a", None),
        ("GET", f"{step}/a/attempts", None),
        ("GET", f"{base}/v1/instances/prep-1", None),
        ("GET", f"{base}/v1/instances", None),
        ("GET", f"{base}/v1/steps?status=failed", None),
        ("GET", f"{base}/v1/instances/prep-404/steps", None),
    ]
    answers = []
    with httpx.Client(timeout=30) as client:
        for _ in range(3):
            for method, url, body in calls:
                response = client.request(method, url, json=body)
                answers.append((response.status_code, without_server_times(response.json())))
    return answers


SECRET = "SELECT pg_get_functiondef('steprecord_instance_id_key()'::regprocedure)"


def test_answers_are_the_same_with_and_without_prepared_statements(server_dsn: str) -> None:
    answers = []
    secret = None  # the first database's, given to the second: the same keys, the same ids
    for env in ({}, BEHIND_PGBOUNCER):  # the default prepares statements; `none` does not
        with migrated_database(server_dsn, "steprecord_prepared_") as url:
            with psycopg.connect(url, autocommit=True) as conn:
                if secret is None:
                    row = conn.execute(SECRET).fetchone()
                    assert row is not None
                    secret = str(row[0])
                else:
                    conn.execute(secret)
            base, proc = start_server(url, env=env)
            try:
                answers.append(conversation(base))
            finally:
                stop(proc)
    assert answers[0] == answers[1]
    assert {status for status, _ in answers[0]} >= {200, 201, 404, 409, 422}


READINESS_CHECKS = "steprecord_readiness_checks_total"


def flood(url: str, requests: int, concurrency: int) -> tuple[list[int], float]:
    """`requests` GET /readyz, `concurrency` at a time, while one write goes through: the
    statuses (the write's last) and the seconds the flood took."""

    async def send() -> tuple[list[int], float]:
        limits = httpx.Limits(max_connections=concurrency + 1)
        async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60) as client:
            began = time.monotonic()
            answers = await asyncio.gather(
                *(client.get("/readyz") for _ in range(requests)),
                client.post("/v1/instances/flooded/steps/a/start"),
            )
            return [a.status_code for a in answers], time.monotonic() - began

    return asyncio.run(send())


def test_a_flood_of_readyz_runs_about_one_check_a_second_and_writes_go_on(
    own_postgres: EmbeddedPostgres,
) -> None:
    migrate(own_postgres.url)
    url, proc = start_server(own_postgres.url)
    try:
        before = counter(metrics(url), READINESS_CHECKS)
        statuses, seconds = flood(url, requests=300, concurrency=150)
        checks = counter(metrics(url), READINESS_CHECKS) - before
        assert statuses == [200] * 300 + [201]
        # A check's result answers for a second from when it began, and callers meanwhile
        # await the one in flight.
        assert 1 <= checks <= seconds + 2, f"{checks} checks in {seconds:.1f} s"
        own_postgres.stop()
        eventually(lambda: httpx.get(f"{url}/readyz").status_code == 503, seconds=2)
        own_postgres.start()
        eventually(lambda: httpx.get(f"{url}/readyz").status_code == 200, seconds=2)
    finally:
        stop(proc)
