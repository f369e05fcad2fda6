"""Faults: bounded statements, held locks, a database that stops answering, brief outages."""

import asyncio
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from app.access.tokens import new_token
from app.core.db import Pool
from tests.support import ROOT
from tests.support.citus import citus_workers
from tests.support.databases import lock_waits
from tests.support.http import problem
from tests.support.proxy import FreezableProxy, upstream
from tests.support.servers import BEHIND_PGBOUNCER, free_port, pgbouncer, start_server, stop
from tests.support.waits import eventually

STATEMENT_TIMEOUT = 1.0
BOUNDED = {"STEPRECORD_STATEMENT_TIMEOUT": str(STATEMENT_TIMEOUT)}
# The service's sessions are watched, and the faults made, on the node its URL names: on a
# Citus cluster each service here stays on that node (no shard map, so no calls straight to
# the workers). A worker's faults under the shard map are tests/test_citus_faults.py's.
ON_THE_NODE_GIVEN = {"STEPRECORD_CITUS_DIRECT": "false"}
# The pool gives up on a statement whose cancel the server does not answer after 0.5 s more.
WITHIN_BOUND = STATEMENT_TIMEOUT + 0.5 + 0.4
needs_pgbouncer = pytest.mark.skipif(
    shutil.which("pgbouncer") is None and not os.environ.get("CI"),
    reason="PgBouncer is not installed (apt-get install pgbouncer); CI always runs this",
)

Watcher = psycopg.Connection[tuple[Any, ...]]


@pytest.fixture
def watcher(own_database: str) -> Iterator[Watcher]:
    """A connection of the test's own that looks at the server's sessions."""
    with psycopg.connect(own_database, autocommit=True) as conn:
        yield conn


def tagged(database_url: str, application_name: str) -> str:
    return psycopg.conninfo.make_conninfo(database_url, application_name=application_name)


def sessions(watcher: Watcher, application_name: str) -> dict[int, str | None]:
    """The service's sessions (pid: what each waits for), known by their application name."""
    rows = watcher.execute(
        "SELECT pid, wait_event_type FROM pg_stat_activity"
        " WHERE application_name = %s AND pid <> pg_backend_pid()",
        (application_name,),
    ).fetchall()
    return {pid: wait for pid, wait in rows}


@contextmanager
def serving(
    database_url: str, *extra: str, env: dict[str, str], stdout: Any = None
) -> Iterator[str]:
    url, proc = start_server(database_url, *extra, env=ON_THE_NODE_GIVEN | env, stdout=stdout)
    try:
        yield url
    finally:
        stop(proc)


@contextmanager
def row_locked(database_url: str, instance_key: str, step_slug: str) -> Iterator[None]:
    """A raw connection holds the record's row lock until the block ends."""
    with psycopg.connect(database_url) as holder:
        # Naming the instance's id, so that on Citus the lock is taken on its worker.
        locked = holder.execute(
            "SELECT r.id FROM workflow_step_record r JOIN process_instance p"
            " ON p.id = r.instance_id WHERE p.instance_key = %s AND r.step_slug = %s"
            " AND p.id = steprecord_instance_id(%s) AND r.instance_id = p.id"
            " FOR UPDATE OF r",
            (instance_key, step_slug, instance_key),
        ).fetchall()
        assert len(locked) == 1
        try:
            yield
        finally:
            holder.rollback()


def alter_database(database_url: str, change: str) -> None:
    """`ALTER DATABASE <its name> <change>` on its server and, on Citus, on every worker too:
    a record is locked and written on the worker holding its shard, in a session that takes
    the worker's own settings (the coordinator does not hand its database's on)."""
    database = psycopg.conninfo.conninfo_to_dict(database_url)["dbname"]
    for url in (database_url, *citus_workers(database_url)):
        with psycopg.connect(url, autocommit=True) as conn:
            # Writable even while the database is read-only: this may be what undoes it.
            conn.execute("SET default_transaction_read_only = off")
            conn.execute(f'ALTER DATABASE "{database}" {change}')


def timed(send: Callable[[], httpx.Response]) -> tuple[httpx.Response, float]:
    began = time.monotonic()
    response = send()
    return response, time.monotonic() - began


def complete_while_locked(
    url: str, key: str, watcher: Watcher, application_name: str | None = None
) -> tuple[httpx.Response, float, set[int]]:
    """Post `complete` on a locked record; while it waits, a read takes a second connection.

    Answers the response, its duration and the service's sessions seen while it waited.
    """
    outcome: list[tuple[httpx.Response, float]] = []

    def complete() -> None:
        with httpx.Client(base_url=url, timeout=30) as client:
            path = f"/v1/instances/{key}/steps/a/complete"
            outcome.append(timed(lambda: client.post(path, json={"output": 1})))

    waiting = threading.Thread(target=complete)
    waiting.start()
    try:
        eventually(lambda: lock_waits(watcher) == 1, seconds=STATEMENT_TIMEOUT)
        assert httpx.get(f"{url}/v1/instances/{key}", timeout=30).status_code == 200
        seen = set(sessions(watcher, application_name)) if application_name else set()
    finally:
        waiting.join(30)
    assert outcome, "the request did not come back"
    return *outcome[0], seen


def test_held_row_lock_answers_503_within_the_statement_timeout_and_keeps_the_pool(
    own_database: str, watcher: Watcher
) -> None:
    name = "steprecord-lock-" + uuid.uuid4().hex[:8]
    key = "lock-" + uuid.uuid4().hex[:8]
    with serving(tagged(own_database, name), env=BOUNDED) as url:
        assert httpx.post(f"{url}/v1/instances/{key}/steps/a/start").status_code == 201
        with row_locked(own_database, key, "a"):
            response, seconds, seen = complete_while_locked(url, key, watcher, name)
            detail = problem(response, 503, "unavailable")["detail"]
            assert detail.startswith("cancelled at the 1 s statement timeout: retry after 1 s")
            assert response.headers["retry-after"]
            assert STATEMENT_TIMEOUT <= seconds < WITHIN_BOUND
            assert lock_waits(watcher) == 0, "the statement still waits in the server"
            assert len(seen) >= 2
            assert seen <= set(sessions(watcher, name)), "the pool dropped healthy connections"
        after = httpx.post(f"{url}/v1/instances/{key}/steps/a/complete", json={"output": 1})
        assert after.status_code == 200
        assert after.json()["status"] == "completed"


@needs_pgbouncer
def test_held_row_lock_behind_pgbouncer_is_cancelled_in_the_server(
    own_database: str, watcher: Watcher
) -> None:
    key = "bounced-" + uuid.uuid4().hex[:8]
    env = BOUNDED | BEHIND_PGBOUNCER
    with pgbouncer(own_database) as bounced, serving(bounced, "--workers", "2", env=env) as url:
        assert httpx.post(f"{url}/v1/instances/{key}/steps/a/start").status_code == 201
        with row_locked(own_database, key, "a"):
            response, seconds, _ = complete_while_locked(url, key, watcher)
            problem(response, 503, "unavailable")
            assert response.headers["retry-after"]
            assert seconds < WITHIN_BOUND
            assert lock_waits(watcher) == 0, "the cancel did not reach the server"
        after = httpx.post(f"{url}/v1/instances/{key}/steps/a/complete", json={"output": 1})
        assert after.status_code == 200


def test_lock_timeout_of_the_database_answers_503_and_keeps_the_pool(
    own_database: str, watcher: Watcher
) -> None:
    """A `lock_timeout` an operator sets on the database or role (55P03) is not an outage."""
    name = "steprecord-lock-timeout-" + uuid.uuid4().hex[:8]
    key = "lt-" + uuid.uuid4().hex[:8]
    alter_database(own_database, "SET lock_timeout = '1s'")
    try:
        env = {"STEPRECORD_STATEMENT_TIMEOUT": "30"}
        with serving(tagged(own_database, name), env=env) as url:
            assert httpx.post(f"{url}/v1/instances/{key}/steps/a/start").status_code == 201
            with row_locked(own_database, key, "a"):
                response, seconds, seen = complete_while_locked(url, key, watcher, name)
                assert "lock timeout" in problem(response, 503, "unavailable")["detail"]
                assert response.headers["retry-after"]
                assert seconds < 5
                assert len(seen) >= 2
                assert seen <= set(sessions(watcher, name)), "the pool dropped healthy connections"
            after = httpx.post(f"{url}/v1/instances/{key}/steps/a/complete", json={"output": 1})
            assert after.status_code == 200
    finally:
        alter_database(own_database, "RESET lock_timeout")


def start_app(database_url: str) -> tuple[str, subprocess.Popen[bytes]]:
    """The app under uvicorn, without `serve`'s migration (which needs a working database)."""
    port = free_port()
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "uvicorn", "app.main:create_app", "--factory"),
            *("--port", str(port), "--log-level", "warning"),
        ],
        env={**os.environ, "DATABASE_URL": database_url},
        cwd=ROOT,
    )
    url = f"http://127.0.0.1:{port}"
    try:

        def alive() -> bool:
            assert proc.poll() is None, "the server exited"
            try:
                return httpx.get(f"{url}/healthz", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        eventually(alive, seconds=30)
    except BaseException:
        stop(proc)
        raise
    return url, proc


def hammer(url: str, paths: list[str], seconds: float) -> list[tuple[httpx.Response, float]]:
    """Requests to `paths` from one thread per path, over and over for `seconds`."""
    stop_at = time.monotonic() + seconds

    def keep_sending(path: str) -> list[tuple[httpx.Response, float]]:
        answers = []
        method = "POST" if path.endswith("/start") else "GET"
        with httpx.Client(base_url=url, timeout=30) as client:
            while time.monotonic() < stop_at:
                answers.append(timed(lambda: client.request(method, path)))
        return answers

    with ThreadPoolExecutor(len(paths)) as pool:
        return [answer for answers in pool.map(keep_sending, paths) for answer in answers]


def assert_prompt_503s(answers: list[tuple[httpx.Response, float]]) -> None:
    assert answers
    for response, seconds in answers:
        problem(response, 503, "unavailable")
        assert response.headers["retry-after"]
        assert seconds < 2, f"a request took {seconds:.2f} s"


def test_database_that_accepts_and_never_answers_gets_503_within_2_seconds(
    own_database: str,
) -> None:
    with FreezableProxy(upstream(own_database), frozen=True) as proxy:
        url, proc = start_app(proxy.url(own_database))
        try:
            paths = ["/readyz"] * 14 + ["/v1/instances/r/steps/a/start", "/v1/instances"]
            assert_prompt_503s(hammer(url, paths, seconds=4))
        finally:
            stop(proc)


def test_database_that_stops_answering_mid_session_gets_503_within_2_seconds_and_recovers(
    own_database: str,
) -> None:
    key = "hung-" + uuid.uuid4().hex[:8]
    with FreezableProxy(upstream(own_database)) as proxy:
        url, proc = start_server(proxy.url(own_database), env=BOUNDED | ON_THE_NODE_GIVEN)
        try:
            with httpx.Client(base_url=url, timeout=30) as client:
                assert client.post(f"/v1/instances/{key}/steps/a/start").status_code == 201
                proxy.freeze()
                # /readyz answers from a check at most a second old: the last one, before the
                # freeze, may still answer for it.
                eventually(lambda: client.get("/readyz").status_code == 503, seconds=5)
                paths = [f"/v1/instances/{key}/steps/b{i}/start" for i in range(8)]
                paths += [f"/v1/instances/{key}/steps", "/readyz"] * 3
                assert_prompt_503s(hammer(url, paths, seconds=4))
                proxy.thaw()
                path = f"/v1/instances/{key}/steps/c/start"
                eventually(lambda: client.post(path).status_code == 201, seconds=5)
                # /readyz answers from a check at most a second old.
                eventually(lambda: client.get("/readyz").status_code == 200, seconds=2)
        finally:
            stop(proc)


def terminate_sessions(watcher: Watcher, application_name: str) -> None:
    watcher.execute(
        "SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity"
        " WHERE application_name = %s AND pid <> pg_backend_pid()",
        (application_name,),
    )


def logged(path: Path, check: Callable[[dict[str, Any]], bool]) -> bool:
    for raw in path.read_text().splitlines():
        try:
            line = json.loads(raw)
        except json.JSONDecodeError:
            continue
        if isinstance(line, dict) and check(line):
            return True
    return False


def test_revoked_token_stops_working_after_the_database_was_briefly_down_and_strange(
    own_database: str, watcher: Watcher, tmp_path: Path
) -> None:
    """The token reload survives an outage and an error it did not expect (here a migration
    under way renamed a column), so a later revocation still takes effect on every worker."""
    name = "steprecord-tokens-" + uuid.uuid4().hex[:8]
    token, digest = new_token()
    bearer = {"Authorization": f"Bearer {token}"}
    log = tmp_path / "stdout.jsonl"
    env = {**BOUNDED, "STEPRECORD_TOKEN_REFRESH_SECONDS": "0.3"}
    with (
        log.open("wb") as out,
        serving(tagged(own_database, name), "--workers", "2", env=env, stdout=out) as url,
        httpx.Client(base_url=url, timeout=30) as client,
    ):

        def every_worker(answers: Callable[[], int], status: int) -> bool:
            return all(answers() == status for _ in range(8))

        watcher.execute(
            "INSERT INTO api_token (name, scope, token_sha256) VALUES (%s, 'write', %s)",
            (name, digest),
        )
        try:
            eventually(lambda: every_worker(lambda: client.get("/v1/instances").status_code, 401))
            assert every_worker(
                lambda: client.get("/v1/instances", headers=bearer).status_code, 200
            )
            terminate_sessions(watcher, name)
            watcher.execute("ALTER TABLE api_token RENAME COLUMN scope TO scope_during_migration")
            try:
                eventually(
                    lambda: logged(
                        log,
                        lambda line: (
                            line.get("logger") == "steprecord.access"
                            and "UndefinedColumn" in line.get("error", "")
                        ),
                    )
                )
            finally:
                watcher.execute(
                    "ALTER TABLE api_token RENAME COLUMN scope_during_migration TO scope"
                )
            terminate_sessions(watcher, name)
        finally:
            watcher.execute("DELETE FROM api_token WHERE name = %s", (name,))
            # The module's other tests run anonymously: reopen access, as
            # `steprecord token allow-anonymous` would.
            watcher.execute("UPDATE access_policy SET tokens_required = false")
        eventually(
            lambda: every_worker(
                lambda: client.get("/v1/instances", headers=bearer).status_code, 401
            ),
            seconds=15,
        )


def test_write_to_a_read_only_database_answers_503(own_database: str, watcher: Watcher) -> None:
    """A standby that is not promoted yet refuses writes: that is an outage, not a 500."""
    name = "steprecord-read-only-" + uuid.uuid4().hex[:8]
    key = "ro-" + uuid.uuid4().hex[:8]
    with serving(tagged(own_database, name), env=BOUNDED) as url:
        alter_database(own_database, "SET default_transaction_read_only = on")
        try:
            terminate_sessions(watcher, name)

            def refused_as_read_only() -> bool:
                # The first answer may still be the terminated session's.
                refused = httpx.post(f"{url}/v1/instances/{key}/steps/a/start")
                assert refused.headers["retry-after"]
                return "read-only" in problem(refused, 503, "unavailable")["detail"]

            eventually(refused_as_read_only)
        finally:
            alter_database(own_database, "RESET default_transaction_read_only")
        terminate_sessions(watcher, name)
        path = f"{url}/v1/instances/{key}/steps/a/start"
        eventually(lambda: httpx.post(path).status_code == 201)


def report_batch(key: str) -> list[dict[str, Any]]:
    """Three statements: a step seen again starts the next one (a, b | a, x, b | x)."""
    steps: list[tuple[str, str, dict[str, Any]]] = [
        ("a", "start", {"started_at": "2026-12-02T10:00:01Z"}),
        ("b", "start", {"started_at": "2026-12-02T10:00:01Z"}),
        ("a", "complete", {"completed_at": "2026-12-02T10:00:02Z", "output": {"a": 1}}),
        ("x", "start", {"started_at": "2026-12-02T10:00:02Z"}),
        ("b", "fail", {"completed_at": "2026-12-02T10:00:03Z", "error_code": "E"}),
        ("x", "complete", {"completed_at": "2026-12-02T10:00:03Z", "output": 2}),
    ]
    return [
        {"instance_key": key, "step_slug": slug, "kind": kind, "attempt": 1, **fields}
        for slug, kind, fields in steps
    ]


def facts(client: httpx.Client, key: str) -> dict[str, tuple[Any, ...]]:
    items = client.get(f"/v1/instances/{key}/steps").json()["items"]
    fields = (
        *("ordinal", "status", "attempt_count", "output", "external_output_url"),
        *("started_at", "completed_at", "error_code", "error_message"),
    )
    return {item["step_slug"]: tuple(item[f] for f in fields) for item in items}


def test_batch_cut_by_an_outage_midway_ends_as_a_clean_run_when_sent_again(
    own_database: str, watcher: Watcher
) -> None:
    """Earlier statements of a batch stay committed when a later one meets an outage; sending
    the whole batch again replays them and applies the rest (see docs/api.md, Batch)."""
    name = "steprecord-batch-" + uuid.uuid4().hex[:8]
    cut, clean = "cut-" + uuid.uuid4().hex[:8], "clean-" + uuid.uuid4().hex[:8]
    env = {"STEPRECORD_STATEMENT_TIMEOUT": "30"}
    with (
        serving(tagged(own_database, name), env=env) as url,
        httpx.Client(base_url=url, timeout=60) as client,
    ):
        for key in (cut, clean):
            assert client.post(f"/v1/instances/{key}/steps/x/declare").status_code == 201
        sent = client.post("/v1/events", json={"events": report_batch(clean)})
        assert all(r["status"] in (200, 201) for r in sent.json()["results"])

        answers: list[httpx.Response] = []
        with row_locked(own_database, cut, "x"):  # the second statement waits for x
            sending = threading.Thread(
                target=lambda: answers.append(
                    client.post("/v1/events", json={"events": report_batch(cut)})
                )
            )
            sending.start()
            try:
                eventually(lambda: lock_waits(watcher) == 1)
                watcher.execute(
                    "SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity"
                    " WHERE application_name = %s AND wait_event_type = 'Lock'",
                    (name,),
                )
            finally:
                sending.join(30)
        problem(answers[0], 503, "unavailable")
        left = facts(client, cut)
        # One node judges the batch in three statements, the second (a, x, b) cut whole; Citus
        # judges each event in a transaction of its own, so a's complete, before x, stays.
        cut_at = ("completed" if citus_workers(own_database) else "running", "running", "pending")
        assert (left["a"][1], left["b"][1], left["x"][1]) == cut_at

        for _ in range(2):  # again after the outage, and once more: a replay of it all
            again = client.post("/v1/events", json={"events": report_batch(cut)})
            assert again.status_code == 200
            assert all(r["status"] in (200, 201) for r in again.json()["results"])
            assert facts(client, cut) == facts(client, clean)


@contextmanager
def role_and_database(server_dsn: str, stem: str) -> Iterator[tuple[str, str]]:
    """A login role and a database named after `stem`, dropped afterwards: (role, database)."""
    role, name = f"{stem}_role", f"{stem}_db"
    with psycopg.connect(server_dsn, autocommit=True) as admin:
        admin.execute(f'CREATE ROLE "{role}" LOGIN SUPERUSER')
        admin.execute(f'CREATE DATABASE "{name}" OWNER "{role}"')
    try:
        yield role, name
    finally:
        with psycopg.connect(server_dsn, autocommit=True) as admin:
            admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            admin.execute(f'DROP ROLE IF EXISTS "{role}"')


def test_problems_never_carry_the_database_s_host_port_user_or_name(
    server_dsn: str, tmp_path: Path
) -> None:
    """The driver's message names where the database is: the log has it, under the request's
    id; the answers (API, readiness, batch, dashboard) say what happened in other words."""
    stem = "leak_" + uuid.uuid4().hex[:8]
    log = tmp_path / "service.log"
    with role_and_database(server_dsn, stem) as (role, name), log.open("wb") as out:
        where = psycopg.conninfo.conninfo_to_dict(server_dsn)
        host, port = str(where.get("host") or "localhost"), str(where.get("port") or 5432)
        url = psycopg.conninfo.make_conninfo(
            server_dsn, user=role, dbname=name, application_name=stem
        )
        with (
            serving(url, env=BOUNDED, stdout=out) as base,
            psycopg.connect(server_dsn, autocommit=True) as admin,
        ):
            assert httpx.post(f"{base}/v1/instances/k/steps/a/start").status_code == 201
            secrets = (host, port, role, name)
            sent = 0

            def refused(trigger: str) -> bool:
                """Every kind of request answers without connection details; true once each
                is a 503 and the log names `trigger` under one of their request ids."""
                nonlocal sent
                ids, statuses = [], []
                for method, path, body in [
                    ("POST", "/v1/instances/k/steps/b/start", None),
                    ("GET", "/v1/instances", None),
                    ("GET", "/readyz", None),
                    ("GET", "/ui", None),
                    (
                        "POST",
                        "/v1/events",
                        {"events": [{"instance_key": "k", "step_slug": "c", "kind": "start"}]},
                    ),
                ]:
                    sent += 1
                    rid = f"{stem}-{sent}"
                    ids.append(rid)
                    answer = httpx.request(
                        method, base + path, json=body, headers={"X-Request-ID": rid}, timeout=10
                    )
                    statuses.append(answer.status_code)
                    for secret in secrets:
                        assert secret not in answer.text, (path, secret, answer.text)
                # /readyz may answer from a check of the last second, before the fault.
                return statuses == [503] * len(statuses) and logged(
                    log,
                    lambda line: (
                        line.get("request_id") in ids
                        and line.get("logger") == "steprecord.database"
                        and trigger in line.get("message", "")
                    ),
                )

            # The database refuses new sessions, then the role may no longer log in: each
            # time the driver's message names them (and where the server is).
            admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
            terminate_sessions(admin, stem)
            eventually(lambda: refused(f'database "{name}"'), seconds=10)
            assert logged(
                log, lambda line: host in line.get("message", "") and port in line["message"]
            )
            admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
            admin.execute(f'ALTER ROLE "{role}" NOLOGIN')
            terminate_sessions(admin, stem)
            eventually(lambda: refused(f'role "{role}"'), seconds=10)


# --- a connection that met an unexpected error ----------------------------------------------


def test_a_connection_on_which_the_database_raised_an_unhandled_error_is_not_reused(
    own_database: str,
) -> None:
    """The next user of the pool gets another session: whatever the failed one kept (a
    statement prepared, a setting) cannot meet the next request."""

    async def sessions() -> tuple[int, int, int]:
        pool = Pool(own_database, size=1, timeout=10, statement_timeout=10, prepare_threshold=0)
        try:
            async with pool.connection() as conn:
                first = await (await conn.execute("SELECT pg_backend_pid() AS pid")).fetchone()
            async with pool.connection() as conn:
                again = await (await conn.execute("SELECT pg_backend_pid() AS pid")).fetchone()
            with pytest.raises(psycopg.errors.DivisionByZero):
                async with pool.connection() as conn:
                    await conn.execute("SELECT 1 / 0")
            async with pool.connection() as conn:
                after = await (await conn.execute("SELECT pg_backend_pid() AS pid")).fetchone()
        finally:
            await pool.close()
        pids = [row["pid"] for row in (first, again, after) if row is not None]
        assert len(pids) == 3
        return pids[0], pids[1], pids[2]

    first, again, after = asyncio.run(sessions())
    assert again == first  # a session that met no error is kept
    assert after != first


def test_a_batch_of_heartbeats_over_many_instances_is_judged_and_the_next_events_succeed(
    client: httpx.Client,
) -> None:
    """Twenty running instances, one heartbeat each in one batch: each is judged as its own
    endpoint would (on Citus too, where the instances live on several workers); then new steps
    start on the same service, as after any answer."""
    keys = [f"beat-{n}" for n in range(20)]
    started = [{"instance_key": k, "step_slug": "s", "kind": "start", "attempt": 1} for k in keys]
    assert client.post("/v1/events", json={"events": started}).status_code == 200
    beats = [
        {
            "instance_key": k,
            "step_slug": "s",
            "kind": "heartbeat",
            "attempt": 1,
            "lease_seconds": 60,
        }
        for k in keys
    ]
    answer = client.post("/v1/events", json={"events": beats})
    assert answer.status_code == 200, answer.text
    assert [r["status"] for r in answer.json()["results"]] == [200] * 20
    for n in range(20):
        response = client.post(f"/v1/instances/beat-{n}/steps/next/start")
        assert response.status_code == 201, response.text
