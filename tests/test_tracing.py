"""Traces: OpenTelemetry spans exported over OTLP/HTTP, and the trace id each attempt keeps
(docs/operations.md, "Traces").

The traced service is the real one (`steprecord serve`), exporting to a real OTLP/HTTP
receiver that this module starts in a thread and that decodes every export's protobuf
(tests/support/tracing.py, `otlp_receiver`); nothing of the SDK is mocked. The shared server of the
other tests has no endpoint: it exports nothing and keeps a caller's `traceparent` alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from alembic import command
from fastapi import FastAPI
from kombu import Exchange, Queue
from opentelemetry.sdk.trace import TracerProvider
from psycopg import sql
from pydantic import SecretStr, ValidationError
from steprecord_client import AsyncRecorder, Recorder
from steprecord_client.celery import step_slug_for

from app.core import tracing
from app.core.config import Settings
from app.dashboard import formatting as ui
from app.data.common import constraint_name
from app.main import alembic_config, create_app
from tests import celery_traced_tasks
from tests.support import ROOT
from tests.support.brokers import require_celery_services
from tests.support.citus import has_citus
from tests.support.http import attempts
from tests.support.servers import free_port, start_server, steprecord, stop
from tests.support.tracing import OtlpReceiver, Span, otlp_receiver
from tests.support.waits import wait_for

SERVICE = "steprecord-trace-test"
TRACE_URL = "https://traces.example/trace/{trace_id}?from=steprecord"
START = "POST /v1/instances/{instance_key}/steps/{step_slug}/start"
CHECK = "ck_workflow_step_attempt_trace_id_format"


def ids() -> tuple[str, str]:
    """A fresh W3C trace id and span id (lowercase hex)."""
    return uuid.uuid4().hex, uuid.uuid4().hex[:16]


def traceparent(trace_id: str, span_id: str) -> dict[str, str]:
    return {"traceparent": f"00-{trace_id}-{span_id}-01"}


def key() -> str:
    return f"trace-{uuid.uuid4().hex[:12]}"


def trace_ids(client: httpx.Client, instance: str, step: str = "charge") -> list[str | None]:
    return [a["trace_id"] for a in attempts(client, instance, step)]


def server_and_database(receiver: OtlpReceiver, trace_id: str) -> tuple[Span, Span]:
    """The server span of a request of this trace and the database span under it (waited for:
    spans leave the service in batches)."""

    def found() -> tuple[Span, Span] | None:
        spans = receiver.spans(trace_id)
        servers = [s for s in spans if s.kind == "server"]
        clients = [s for s in spans if s.kind == "client" and s.name not in PLACEMENT]
        return (servers[0], clients[0]) if servers and clients else None

    server, database = wait_for(f"the spans of trace {trace_id}", found)
    spans = receiver.spans(trace_id)
    assert len([s for s in spans if s.name not in PLACEMENT]) == 2, spans
    assert all(s.parent_span_id == server.span_id for s in spans if s.name in PLACEMENT)
    return server, database


# On a Citus cluster the service first asks the coordinator where a new instance lives, and
# checks a node the first time it reaches it (app/ops/nodes.py): spans of the request too.
PLACEMENT = frozenset({"shards_of", "node_check"})


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    with otlp_receiver() as running:
        yield running


@pytest.fixture(scope="module")
def traced(own_database: str, receiver: OtlpReceiver) -> Iterator[str]:
    """The service exporting its traces to the receiver, with trace links on its dashboard;
    two workers, each with its own provider and exporter."""
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
        "OTEL_BSP_SCHEDULE_DELAY": "50",  # milliseconds between exports
        "OTEL_SERVICE_NAME": SERVICE,
        "STEPRECORD_TRACE_URL": TRACE_URL,
    }
    base, proc = start_server(own_database, "--workers", "2", env=env)
    try:
        yield base
    finally:
        stop(proc)


@pytest.fixture
def tc(traced: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=traced, timeout=30) as c:
        yield c


# --- the traced service ----------------------------------------------------------------------


def test_a_request_with_a_traceparent_is_a_server_span_of_that_trace_over_its_database_call(
    tc: httpx.Client, receiver: OtlpReceiver
) -> None:
    trace_id, caller = ids()
    instance = key()
    started = tc.post(
        f"/v1/instances/{instance}/steps/charge/start",
        json={"attempt": 1},
        headers=traceparent(trace_id, caller),
    )
    assert started.status_code == 201, started.text
    server, database = server_and_database(receiver, trace_id)
    assert (server.kind, server.name, server.parent_span_id) == ("server", START, caller)
    assert server.service == SERVICE
    assert server.attributes["http.route"] == START.split(" ", 1)[1]
    assert (database.kind, database.name, database.parent_span_id) == (
        "client",
        "apply_event",
        server.span_id,
    )
    assert database.attributes["db.system"] == "postgresql"
    assert database.attributes["db.namespace"]
    assert trace_ids(tc, instance) == [trace_id]


def test_without_a_traceparent_the_attempt_keeps_the_services_own_trace(
    tc: httpx.Client, receiver: OtlpReceiver
) -> None:
    instance = key()
    assert tc.post(f"/v1/instances/{instance}/steps/charge/start").status_code == 201
    (trace_id,) = trace_ids(tc, instance)
    assert trace_id is not None
    assert len(trace_id) == 32
    server, database = server_and_database(receiver, trace_id)
    assert server.parent_span_id == ""  # the trace began in the service
    assert database.parent_span_id == server.span_id


def test_a_replay_keeps_the_attempts_trace_and_each_later_attempt_gets_its_own(
    tc: httpx.Client,
) -> None:
    instance = key()
    path = f"/v1/instances/{instance}/steps/charge"
    first, second, third, fourth, fifth = (ids() for _ in range(5))
    answers = [
        tc.post(f"{path}/start", json={"attempt": 1}, headers=traceparent(*first)),
        tc.post(f"{path}/start", json={"attempt": 1}, headers=traceparent(*second)),  # replay
        tc.post(
            f"{path}/fail", json={"attempt": 1, "error_code": "E"}, headers=traceparent(*third)
        ),
        tc.post(f"{path}/start", json={"attempt": 2}, headers=traceparent(*fourth)),
        tc.post(f"{path}/start", json={"attempt": 3}, headers=traceparent(*fifth)),
    ]
    assert [a.status_code for a in answers] == [201, 200, 200, 200, 200]
    history = attempts(tc, instance)
    assert [(a["status"], a["trace_id"]) for a in history] == [
        ("failed", first[0]),  # started by the first start; the replay and its end kept it
        ("superseded", fourth[0]),
        ("running", fifth[0]),
    ]


def test_a_batch_gives_its_trace_to_every_attempt_it_starts(
    tc: httpx.Client, receiver: OtlpReceiver
) -> None:
    trace_id, caller = ids()
    instance = key()
    events = [
        {"instance_key": instance, "step_slug": step, "kind": "start", "attempt": 1}
        for step in ("pack", "ship")
    ]
    answer = tc.post("/v1/events", json={"events": events}, headers=traceparent(trace_id, caller))
    assert [r["status"] for r in answer.json()["results"]] == [201, 201]
    assert trace_ids(tc, instance, "pack") == trace_ids(tc, instance, "ship") == [trace_id]
    server, database = server_and_database(receiver, trace_id)
    assert (server.name, server.parent_span_id) == ("POST /v1/events", caller)
    assert (database.name, database.parent_span_id) == ("apply_events", server.span_id)


def test_a_read_has_a_database_span_named_after_its_data_function(
    tc: httpx.Client, receiver: OtlpReceiver
) -> None:
    instance = key()
    assert tc.post(f"/v1/instances/{instance}/steps/charge/start").status_code == 201
    trace_id, caller = ids()
    read = tc.get(f"/v1/instances/{instance}/steps/charge", headers=traceparent(trace_id, caller))
    assert read.status_code == 200
    server, database = server_and_database(receiver, trace_id)
    assert server.name == "GET /v1/instances/{instance_key}/steps/{step_slug}"
    assert (database.name, database.parent_span_id) == ("get_step", server.span_id)


def test_the_dashboard_links_each_attempt_to_its_trace(tc: httpx.Client) -> None:
    instance = key()
    trace_id, caller = ids()
    tc.post(f"/v1/instances/{instance}/steps/charge/start", headers=traceparent(trace_id, caller))
    page = tc.get(f"/ui/instances/{instance}/steps/charge")
    assert page.status_code == 200
    link = TRACE_URL.replace("{trace_id}", trace_id)
    assert f'<a class="trace" href="{link}"' in page.text
    assert f">{trace_id}</a>" in page.text


def test_with_the_sdk_disabled_nothing_is_exported(
    own_database: str, receiver: OtlpReceiver
) -> None:
    """OTEL_SDK_DISABLED=true turns tracing off although an endpoint is set: the service
    exports nothing (it is stopped, so any batch it held has been flushed, before looking),
    and the attempt keeps the caller's trace id all the same."""
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
        "OTEL_BSP_SCHEDULE_DELAY": "50",
        "OTEL_SDK_DISABLED": "true",
        "OTEL_SERVICE_NAME": "steprecord-disabled",
    }
    base, proc = start_server(own_database, env=env)
    try:
        trace_id, caller = ids()
        instance = key()
        with httpx.Client(base_url=base, timeout=30) as client:
            started = client.post(
                f"/v1/instances/{instance}/steps/charge/start",
                headers=traceparent(trace_id, caller),
            )
            assert started.status_code == 201
            assert trace_ids(client, instance) == [trace_id]
    finally:
        stop(proc)
    assert receiver.spans(trace_id) == []
    assert [s for s in receiver.spans() if s.service == "steprecord-disabled"] == []


# --- without an endpoint ---------------------------------------------------------------------


def test_without_an_endpoint_an_attempt_keeps_the_callers_valid_traceparent_else_null(
    client: httpx.Client,
) -> None:
    trace_id, caller = ids()
    client.post("/v1/instances/t/steps/given/start", headers=traceparent(trace_id, caller))
    client.post("/v1/instances/t/steps/none/start")
    malformed = {
        "upper": f"00-{trace_id.upper()}-{caller}-01",
        "zeros": f"00-{'0' * 32}-{caller}-01",
        "short": f"00-{trace_id[:31]}-{caller}-01",
        "no-flags": f"00-{trace_id}-{caller}",
        "version-ff": f"ff-{trace_id}-{caller}-01",
        "garbage": "not a traceparent",
    }
    for step, header in malformed.items():
        answer = client.post(f"/v1/instances/t/steps/{step}/start", headers={"traceparent": header})
        assert answer.status_code == 201, answer.text
    assert trace_ids(client, "t", "given") == [trace_id]
    for step in ("none", *malformed):
        assert trace_ids(client, "t", step) == [None], step


def test_without_an_endpoint_a_batch_keeps_the_callers_trace(client: httpx.Client) -> None:
    trace_id, caller = ids()
    events = [{"instance_key": "b", "step_slug": s, "kind": "start"} for s in ("one", "two")]
    client.post("/v1/events", json={"events": events}, headers=traceparent(trace_id, caller))
    assert trace_ids(client, "b", "one") == trace_ids(client, "b", "two") == [trace_id]


def test_the_dashboard_shows_the_trace_id_as_text_without_a_trace_url(
    client: httpx.Client,
) -> None:
    trace_id, caller = ids()
    client.post("/v1/instances/u/steps/charge/start", headers=traceparent(trace_id, caller))
    page = client.get("/ui/instances/u/steps/charge")
    assert f'<code class="trace">{trace_id}</code>' in page.text
    assert 'class="trace" href' not in page.text


def _middleware_classes(app: FastAPI) -> set[str]:
    names = set()
    layer: Any = app.build_middleware_stack()
    while layer is not None:
        names.add(type(layer).__name__)
        layer = getattr(layer, "app", None)
    return names


def test_tracing_is_on_only_with_an_endpoint_and_off_it_adds_no_middleware_nor_provider(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = Settings(database_url=SecretStr("postgresql://unused"))
    for name in (*tracing.ENDPOINTS, "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(name, raising=False)
    off = create_app(settings)
    assert off.state.tracing is None
    assert "OpenTelemetryMiddleware" not in _middleware_classes(off)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:9/v1/traces")
    on = create_app(settings)
    assert isinstance(on.state.tracing, TracerProvider)
    assert "OpenTelemetryMiddleware" in _middleware_classes(on)
    on.state.tracing.shutdown()


@pytest.mark.parametrize(
    ("environ", "on"),
    [
        ({}, False),
        ({"OTEL_SERVICE_NAME": "x", "OTEL_EXPORTER_OTLP_HEADERS": "a=b"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": " "}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_SDK_DISABLED": "TRUE"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_SDK_DISABLED": "false"}, True),
    ],
)
def test_tracing_is_enabled_by_an_otlp_endpoint_unless_the_sdk_is_disabled(
    environ: dict[str, str], on: bool
) -> None:
    assert tracing.enabled(environ) is on


def test_a_trace_url_must_hold_the_trace_id_and_the_id_is_escaped_into_it(
    own_database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValidationError, match=r"\{trace_id\}"):
        Settings(trace_url="https://traces.example/trace/")
    assert ui.trace_link("https://t.example/{trace_id}", "a b/c") == "https://t.example/a%20b%2Fc"
    assert ui.trace_link(None, "ab") is None
    monkeypatch.setenv("STEPRECORD_TRACE_URL", "https://traces.example/trace/")
    refused = steprecord(own_database, "serve", "--port", str(free_port()))
    assert refused.returncode == 2
    assert "invalid setting STEPRECORD_TRACE_URL" in refused.stderr
    assert "Traceback" not in refused.stderr


# --- the database ----------------------------------------------------------------------------

# The instance's id derived from the key in the call's own arguments, as the service calls it
# (on Citus, a call reading its key from a subquery beside it crashed the coordinator's backend
# outside a transaction block: a fault of Citus, not of the judge).
APPLY = (
    "SELECT outcome FROM steprecord_apply_event(steprecord_instance_id(%(key)s::text), 0,"
    " %(key)s::text, %(slug)s, 'start', 1, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,"
    " %(trace_id)s)"
)
TRACES_OF = """
SELECT r.step_slug, a.trace_id FROM workflow_step_attempt a
JOIN workflow_step_record r ON r.instance_id = a.instance_id AND r.id = a.record_id
JOIN process_instance p ON p.id = r.instance_id
WHERE p.instance_key = %s
"""
BY_HAND = """
INSERT INTO workflow_step_record (instance_id, step_slug, ordinal, status, attempt_count,
                                  started_at)
SELECT id, %s, %s, 'running', 1, now() FROM process_instance WHERE instance_key = %s
"""


def test_hand_written_sql_leaves_the_trace_id_null_even_after_a_judged_event(
    own_database: str,
) -> None:
    """In one transaction: the judge's function starts an attempt with a trace id, then a
    hand-written INSERT starts another: the trace id held for the function's call only.

    On Citus the function is called alone (it is sent to its instance's worker only outside a
    transaction block), then the INSERT follows on the same session, whose connection to
    that worker the function's call left behind: the trace id must not outlive the call
    there either."""
    instance = key()
    trace_id, _ = ids()
    distributed = has_citus(own_database)
    with psycopg.connect(own_database, autocommit=distributed) as conn:
        assert conn.execute(
            APPLY, {"key": instance, "slug": "judged", "trace_id": trace_id}
        ).fetchone() == ("created",)
        if distributed:
            conn.autocommit = False  # the rest in one transaction, rolled back
        conn.execute(BY_HAND, ("by-hand", 1, instance))
        assert conn.execute("SELECT current_setting('steprecord.trace_id', true)").fetchone() in (
            ("",),
            (None,),
        )
        assert dict(conn.execute(TRACES_OF, (instance,)).fetchall()) == {
            "judged": trace_id,
            "by-hand": None,
        }
        conn.rollback()


def test_the_check_refuses_every_malformed_trace_id(own_database: str) -> None:
    """Raw SQL: a running record inserted while `steprecord.trace_id` holds a value makes
    its attempt with that value (the column's default): a valid id passes, every forbidden
    form is refused by the named CHECK. No write of the history may change it afterwards."""
    instance = key()
    valid = "0123456789abcdef0123456789abcdef"
    forbidden = [
        valid.upper(),
        "0" * 32,
        valid[:31],
        valid + "0",
        "g" * 32,
        f"{valid[:8]}-{valid[9:]}",
        f" {valid[1:]}",
    ]
    distributed = has_citus(own_database)
    # On Citus the attempt is written by the record's trigger on a worker, where the column's
    # default reads the setting: SET LOCAL reaches the workers (set_config would stay on the
    # coordinator). There the CHECK's refusal comes back from the trigger's write as an
    # internal error naming the constraint in its message only.
    refusal = psycopg.Error if distributed else psycopg.errors.CheckViolation
    with psycopg.connect(own_database) as conn:
        if distributed:
            conn.execute("SET citus.propagate_set_commands TO 'local'")

        def started(slug: str, ordinal: int, trace_id: str) -> None:
            setting = sql.SQL("SET LOCAL steprecord.trace_id TO {}").format(sql.Literal(trace_id))
            conn.execute(setting)
            conn.execute(BY_HAND, (slug, ordinal, instance))

        conn.execute(
            "INSERT INTO process_instance (id, instance_key)"
            " SELECT steprecord_instance_id(k), k FROM (VALUES (%s)) AS v(k)",
            (instance,),
        )
        started("valid", 0, valid)
        assert dict(conn.execute(TRACES_OF, (instance,)).fetchall()) == {"valid": valid}
        for ordinal, value in enumerate(forbidden, start=1):
            with pytest.raises(refusal) as refused, conn.transaction():
                started(f"bad-{ordinal}", ordinal, value)
            assert constraint_name(refused.value) == CHECK, value
        with pytest.raises(psycopg.errors.CheckViolation) as guarded, conn.transaction():
            conn.execute("UPDATE workflow_step_attempt SET trace_id = %s", (valid[::-1],))
        assert constraint_name(guarded.value) == "tr_workflow_step_attempt_guard"
        conn.rollback()


FUNCTIONS = """
SELECT p.oid::regprocedure::text, pg_get_functiondef(p.oid) FROM pg_proc p
WHERE p.proname IN ('steprecord_apply_event', 'steprecord_apply_events')
"""
COLUMN = """
SELECT column_default FROM information_schema.columns
WHERE table_name = 'workflow_step_attempt' AND column_name = 'trace_id'
"""
# The one-event function as revisions 0016 to 0019 declared it (0020 puts the instance's id first).
CALL_0016 = (
    "SELECT outcome FROM steprecord_apply_event(0, %s, %s, 'start', 1, NULL, NULL, NULL, NULL,"
    " NULL, NULL, NULL, NULL, %s)"
)
OLD_CALL = (
    "SELECT outcome FROM steprecord_apply_event(0, %s, %s, 'start', 1, NULL, NULL, NULL, NULL,"
    " NULL, NULL, NULL, NULL)"
)


def test_migration_0016_adds_the_trace_id_and_its_downgrade_restores_0015(
    scratch_database: str,
) -> None:
    if has_citus(scratch_database):
        pytest.skip(
            "one node's migration: revision 0015 predates the derived instance ids (0020), so"
            " its unique keys leave out the distribution column and Citus cannot distribute"
            " it; the cluster starts at head"
        )
    config = alembic_config()
    config.attributes["database_url"] = scratch_database
    command.upgrade(config, "0015")
    with psycopg.connect(scratch_database, autocommit=True) as conn:
        before: dict[str, str] = dict(conn.execute(FUNCTIONS).fetchall())
        conn.execute(OLD_CALL, ("old", "step"))
    command.upgrade(config, "0016")
    trace_id, _ = ids()
    with psycopg.connect(scratch_database, autocommit=True) as conn:
        assert dict(conn.execute(TRACES_OF, ("old",)).fetchall()) == {"step": None}
        assert conn.execute(CALL_0016, ("new", "step", trace_id)).fetchone() == ("created",)
        assert conn.execute(OLD_CALL, ("new", "other")).fetchone() == ("created",)
        assert dict(conn.execute(TRACES_OF, ("new",)).fetchall()) == {
            "step": trace_id,
            "other": None,
        }
        (default,) = conn.execute(COLUMN).fetchone() or (None,)
        assert "steprecord.trace_id" in str(default)
        assert set(dict(conn.execute(FUNCTIONS).fetchall())) == {
            name.replace(")", ",text)") for name in before
        }
    config.attributes["force"] = True  # the trace ids are dropped knowingly (it refuses else)
    command.downgrade(config, "0015")
    with psycopg.connect(scratch_database, autocommit=True) as conn:
        assert dict(conn.execute(FUNCTIONS).fetchall()) == before
        assert conn.execute(COLUMN).fetchone() is None
        assert conn.execute(OLD_CALL, ("new", "again")).fetchone() == ("created",)
    command.upgrade(config, "head")


# --- the Python client -----------------------------------------------------------------------


def test_the_client_sends_the_trace_context_of_the_current_span(
    traced: str, receiver: OtlpReceiver, tc: httpx.Client
) -> None:
    tracer = TracerProvider().get_tracer("orchestrator")  # the SDK's spans: real ids
    inside, outside = key(), key()
    with Recorder(traced) as rec:

        @rec.step("charge")
        def charge() -> int:
            return 1

        with tracer.start_as_current_span("orchestrate") as span, rec.instance(inside):
            charge()
        with rec.instance(outside):
            charge()
    context = span.get_span_context()
    trace_id, span_id = format(context.trace_id, "032x"), format(context.span_id, "016x")
    assert trace_ids(tc, inside) == [trace_id]

    def started() -> Span | None:
        return next((s for s in receiver.spans(trace_id) if s.name == START), None)

    assert wait_for("the start's server span", started).parent_span_id == span_id
    (own,) = trace_ids(tc, outside)  # no span current: no context sent, the service's own
    assert own is not None
    assert own != trace_id


def test_the_async_client_sends_the_trace_context_of_the_current_span(
    server_url: str, client: httpx.Client
) -> None:
    tracer = TracerProvider().get_tracer("orchestrator")

    async def run() -> str:
        async with AsyncRecorder(server_url) as rec:

            @rec.step("fetch")
            async def fetch() -> str:
                return "ok"

            with tracer.start_as_current_span("crawl") as span:
                async with rec.instance("async-traced"):
                    await fetch()
            return format(span.get_span_context().trace_id, "032x")

    trace_id = asyncio.run(run())
    assert trace_ids(client, "async-traced", "fetch") == [trace_id]


# --- Celery ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def broker() -> None:
    require_celery_services()


@contextmanager
def celery_worker(tmp_path: Path, service: str, *, instrument: bool) -> Iterator[str]:
    """A solo-pool worker of tests/celery_traced_tasks.py on a queue of its own (declared
    empty, deleted afterwards), in its own process group; yields the queue's name."""
    app = celery_traced_tasks.app
    name = f"steprecord-traced-{uuid.uuid4().hex[:10]}"
    queue = Queue(name, Exchange(name, type="direct"), routing_key=name)
    with app.connection_for_write() as conn:
        queue(conn.default_channel).declare()
    log = tmp_path / f"{name}.log"
    env = {
        **os.environ,
        "STEPRECORD_TEST_QUEUE": name,
        "STEPRECORD_TEST_SERVICE": service,
        "STEPRECORD_TEST_INSTRUMENT": "1" if instrument else "0",
    }
    command = [
        sys.executable, "-m", "celery", "-A", "tests.celery_traced_tasks", "worker",
        "--pool", "solo", "--queues", name, "--hostname", f"{name}@%h", "--without-gossip",
        "--without-mingle", "--without-heartbeat", "--loglevel", "INFO",
    ]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    try:
        wait_for(
            "the worker to be ready",
            lambda: proc.poll() is not None or " ready." in log.read_text(errors="replace"),
            seconds=30,
        )
        assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
        yield name
    except BaseException:
        print(log.read_text(errors="replace")[-5000:])
        raise
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGQUIT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        with app.connection_for_write() as conn:
            queue(conn.default_channel).delete()


def _task_trace(client: httpx.Client, queue: str, headers: dict[str, str] | None = None) -> Any:
    """Run `current_trace` on the worker: the trace id the task saw, and its attempt's."""
    result = celery_traced_tasks.current_trace.apply_async(queue=queue, headers=headers or {})
    seen = result.get(timeout=30)
    slug = step_slug_for(celery_traced_tasks.current_trace.name, result.id)
    return seen, trace_ids(client, result.id, slug)


def test_a_celery_task_in_a_span_reports_its_start_with_the_tasks_trace(
    broker: None, server_url: str, client: httpx.Client, tmp_path: Path
) -> None:
    """OpenTelemetry's Celery instrumentation runs each task in a span; the attempt keeps its
    trace id, whether the trace began in the task or came from its publisher."""
    with celery_worker(tmp_path, server_url, instrument=True) as queue:
        seen, kept = _task_trace(client, queue)
        assert seen is not None
        assert kept == [seen]
        trace_id, caller = ids()
        seen, kept = _task_trace(client, queue, traceparent(trace_id, caller))
        assert (seen, kept) == (trace_id, [trace_id])


def test_a_celery_task_without_a_span_reports_its_start_with_the_publishers_trace(
    broker: None, server_url: str, client: httpx.Client, tmp_path: Path
) -> None:
    with celery_worker(tmp_path, server_url, instrument=False) as queue:
        trace_id, caller = ids()
        seen, kept = _task_trace(client, queue, traceparent(trace_id, caller))
        assert (seen, kept) == (None, [trace_id])
        seen, kept = _task_trace(client, queue)
        assert (seen, kept) == (None, [None])
