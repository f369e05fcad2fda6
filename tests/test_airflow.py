"""steprecord_client.airflow: the Airflow 3 plugin (docs/airflow.md).

Two parts:

- The plugin's rules and its behaviour against the live service, driven here with stand-ins
  for Airflow's task instances and dag runs (identities, messages, a dead service, a dag
  run's end closing what its tries left running).
- A real Airflow 3.3 from PyPI, in a virtualenv of its own (it brings SQLAlchemy 2.1):
  `tests/airflow_dags/recorded.py` run with `dag.test()` against a service this module
  starts, then what the record says compared with what Airflow's own database says, try by
  try; and a task process killed with `kill -9` ending failed within its lease. Then the
  same in `airflow standalone` with the LocalExecutor (`tests/airflow_dags/standalone_run.py`).
  The virtualenv is `$STEPRECORD_TEST_AIRFLOW_VENV`, else `.venv-airflow` in the repository
  (`.ci/run` makes it), else made here (about two minutes); when it cannot be made these
  tests are skipped (and fail with `CI=true`).

Every process a test or a fixture starts is stopped by it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NamedTuple
from urllib.parse import quote

import httpx
import pytest
from steprecord_client import airflow as plugin

from tests.support.servers import free_port, start_server, stop
from tests.support.waits import eventually, wait_for

ROOT = Path(__file__).resolve().parent.parent
DAGS = Path(__file__).resolve().parent / "airflow_dags"
AIRFLOW_VERSION = "3.3.2"
IN_CI = os.environ.get("CI") == "true"


def path_of(key: str, slug: str | None = None) -> str:
    base = f"/v1/instances/{quote(key, safe='')}"
    return base if slug is None else f"{base}/steps/{quote(slug, safe='')}"


# --------------------------------------------------------------------------- identities


def test_a_dag_run_is_its_dag_id_and_run_id_as_they_are() -> None:
    run_id = "scheduled__2026-12-06T00:00:00+00:00"
    assert plugin.instance_key("etl_daily", run_id) == f"etl_daily:{run_id}"
    custom = "manual__2026-12-06T10:00:00.123456+00:00~rerun"
    assert plugin.instance_key("etl", custom) == f"etl:{custom}"


def test_a_key_too_long_or_outside_the_alphabet_is_cut_readably_and_uniquely() -> None:
    run_id = "scheduled__2026-12-06T00:00:00+00:00"
    long_dag = "d" * 230
    key = plugin.instance_key(long_dag, run_id)
    assert len(key) == 200
    assert key.startswith("d" * 100)
    assert f":{run_id}~" in key  # a short run id is kept whole
    assert key != plugin.instance_key(long_dag + "x", run_id)
    long_run = "manual__" + "r" * 300
    key = plugin.instance_key("etl", long_run)
    assert len(key) == 200
    assert key.startswith("etl:manual__rrr")
    assert key != plugin.instance_key("etl", long_run + "s")
    # A non-ASCII letter (Airflow's dag ids are \w) and a leading underscore.
    key = plugin.instance_key("_ventes_été", run_id)
    assert key.startswith(f"ventes_-t-:{run_id}~")
    assert key != plugin.instance_key("_ventes_ete", run_id)
    for made in (key, plugin.instance_key(long_dag, long_run)):
        assert plugin._KEY_RE.fullmatch(made)


def test_a_task_is_its_task_id_and_a_mapped_task_adds_its_map_index() -> None:
    assert plugin.step_slug("extract") == "extract"
    assert plugin.step_slug("group.extract", -1) == "group.extract"
    assert plugin.step_slug("load", 0) == "load:0"
    assert plugin.step_slug("load", 39) == "load:39"
    odd = plugin.step_slug("_cleanup", 3)
    assert odd.startswith("cleanup-")
    assert odd.endswith(":3")
    assert odd.rsplit(":", 1)[0] == plugin.step_slug("_cleanup", 4).rsplit(":", 1)[0]
    long = plugin.step_slug("t" * 250, 12345)
    assert len(long) == 200
    assert long.endswith(":12345")


def test_a_try_labels_its_dag_run_with_the_dag_the_owner_and_the_run_type() -> None:
    one = plugin._Try.of(task_instance())
    assert one.labels == {
        "airflow.dag": "etl",
        "airflow.owner": "data",
        "airflow.run_type": "scheduled",
    }
    manual = task_instance(run_id="x", dag_run=SimpleNamespace(run_type="manual"))
    assert plugin._Try.of(manual).labels["airflow.run_type"] == "manual"
    unknown = plugin._Try.of(task_instance(run_id="custom-7", task=None))
    assert unknown.labels == {"airflow.dag": "etl"}


def test_a_message_too_long_keeps_its_head_and_its_tail_around_a_marker() -> None:
    text = "Traceback (most recent call last):\n" + "  frame é\n" * 20000 + "ValueError: the end"
    fitted = plugin.fit_message(text)
    assert len(fitted.encode("utf-8")) <= 65536
    assert fitted.startswith("Traceback (most recent call last):")
    assert fitted.endswith("ValueError: the end")
    assert "bytes cut by steprecord_client" in fitted
    assert plugin.fit_message("short\x00") == "short\ufffd"
    assert plugin.fit_message("x" * 65536) == "x" * 65536


# --------------------------------------------------------------------------- stand-ins


def task_instance(**fields: Any) -> SimpleNamespace:
    """What the plugin reads of a task instance (Airflow's `RuntimeTaskInstance` on a worker,
    an ORM `TaskInstance` in the scheduler)."""
    now = datetime.now(UTC)
    values: dict[str, Any] = {
        "dag_id": "etl",
        "run_id": "scheduled__2026-12-06T00:00:00+00:00",
        "task_id": "extract",
        "map_index": -1,
        "try_number": 1,
        "max_tries": 0,
        "state": "running",
        "start_date": now,
        "end_date": None,
        "hostname": "worker-1",
        "task": SimpleNamespace(
            operator_name="PythonOperator", owner="data", pool="default_pool", queue="default"
        ),
    }
    values.update(fields)
    return SimpleNamespace(**values)


def settings(url: str | None, **more: Any) -> plugin.Settings:
    return plugin.Settings(url=url, **more)


@pytest.fixture
def live(server_url: str) -> Iterator[plugin.SteprecordListener]:
    """A listener of the test's own reporting to the shared service."""
    listener = plugin.SteprecordListener(
        lambda: settings(server_url, lease_seconds=30, close_after_seconds=0.0)
    )
    yield listener
    listener.flush(10)
    stop_heartbeats(listener)


def stop_heartbeats(listener: plugin.SteprecordListener) -> None:
    """End the heartbeat threads of the tries a test left running."""
    for one in listener._tries.values():
        one.stop.set()


KEY = "etl:scheduled__2026-12-06T00:00:00+00:00"


def test_a_try_is_started_finished_and_retried_as_attempts(
    live: plugin.SteprecordListener, client: httpx.Client
) -> None:
    first = task_instance(max_tries=1)
    live.on_task_instance_running(previous_state="queued", task_instance=first)
    assert live.flush(10)
    record = client.get(path_of(KEY, "extract")).json()
    assert (record["status"], record["attempt_count"]) == ("running", 1)
    labels = client.get("/v1/instances/" + KEY).json()["labels"]
    assert labels == {
        "airflow.dag": "etl",
        "airflow.owner": "data",
        "airflow.run_type": "scheduled",
    }
    assert record["lease_expires_at"] is not None
    first.state, first.end_date = "up_for_retry", datetime.now(UTC)
    live.on_task_instance_failed(
        previous_state="running", task_instance=first, error=ValueError("no rows")
    )
    second = task_instance(try_number=2, max_tries=1)
    live.on_task_instance_running(previous_state="queued", task_instance=second)
    second.state, second.end_date = "success", datetime.now(UTC)
    live.on_task_instance_success(previous_state="running", task_instance=second)
    assert live.flush(10)
    attempts = client.get(path_of(KEY, "extract") + "/attempts").json()["items"]
    assert [(a["attempt"], a["status"]) for a in attempts] == [(1, "failed"), (2, "completed")]
    assert attempts[0]["error_code"] == "ValueError"
    assert attempts[0]["error_message"].startswith(
        "Airflow try 1 of 2 (up_for_retry): dag etl, task extract, operator PythonOperator"
    )
    assert "ValueError: no rows" in attempts[0]["error_message"]
    assert attempts[1]["output"] == {
        "state": "success",
        "dag_id": "etl",
        "run_id": "scheduled__2026-12-06T00:00:00+00:00",
        "task_id": "extract",
        "map_index": None,
        "try_number": 2,
        "max_tries": 1,
        "operator": "PythonOperator",
        "owner": "data",
        "pool": "default_pool",
        "queue": "default",
        "hostname": "worker-1",
    }


def test_the_scheduler_s_failure_as_text_fails_the_running_attempt(
    live: plugin.SteprecordListener, client: httpx.Client
) -> None:
    worker = plugin.SteprecordListener(lambda: settings(live.settings().url, lease_seconds=30))
    worker.on_task_instance_running(previous_state="queued", task_instance=task_instance())
    worker.flush(10)
    # The scheduler's ORM task instance: no `task`, the error a string.
    orm = task_instance(
        task=None, state="failed", end_date=datetime.now(UTC), operator="PythonOperator"
    )
    live.on_task_instance_failed(
        previous_state="running",
        task_instance=orm,
        error="Task Instance heartbeat timeout: no heartbeat for 300 s",
    )
    live.flush(10)
    stop_heartbeats(worker)
    record = client.get(path_of(KEY, "extract")).json()
    assert (record["status"], record["error_code"]) == ("failed", "heartbeat_timeout")
    assert "no heartbeat for 300 s" in record["error_message"]


def test_a_dag_run_s_end_fails_the_tries_it_left_running(
    live: plugin.SteprecordListener, client: httpx.Client
) -> None:
    for index in range(3):
        one = task_instance(task_id="load", map_index=index)
        live.on_task_instance_running(previous_state="queued", task_instance=one)
    done = task_instance(task_id="load", map_index=0, state="success", end_date=datetime.now(UTC))
    live.on_task_instance_success(previous_state="running", task_instance=done)
    live.flush(10)
    # Tries 1 and 2 were killed: no hook; the dag run ends (in the scheduler).
    run = SimpleNamespace(
        dag_id="etl", run_id="scheduled__2026-12-06T00:00:00+00:00", end_date=datetime.now(UTC)
    )
    began = time.monotonic()
    live.on_dag_run_failed(dag_run=run, msg="task_failure")
    assert time.monotonic() - began < 0.05  # the scheduler never waits

    def closed() -> list[dict[str, Any]] | None:
        items: list[dict[str, Any]] = client.get(path_of(KEY) + "/steps").json()["items"]
        return None if any(r["status"] == "running" for r in items) else items

    records = wait_for("the running tries closed", closed)
    states = {r["step_slug"]: (r["status"], r["error_code"]) for r in records}
    assert states == {
        "load:0": ("completed", None),
        "load:1": ("failed", "dag_run_ended"),
        "load:2": ("failed", "dag_run_ended"),
    }


def test_a_skipped_try_is_completed_with_its_state_and_a_state_set_by_hand_says_so(
    live: plugin.SteprecordListener, client: httpx.Client
) -> None:
    one = task_instance()
    live.on_task_instance_running(previous_state="queued", task_instance=one)
    one.state, one.end_date = "skipped", datetime.now(UTC)
    live.on_task_instance_skipped(previous_state="running", task_instance=one)
    marked = task_instance(task_id="report", try_number=0, state="success", task=None)
    live.on_task_instance_success(previous_state=None, task_instance=marked)
    live.flush(10)
    skipped = client.get(path_of(KEY, "extract")).json()
    assert (skipped["status"], skipped["output"]["state"]) == ("completed", "skipped")
    by_hand = client.get(path_of(KEY, "report")).json()
    assert by_hand["status"] == "completed"
    assert by_hand["output"]["set_by_hand"] is True


def test_without_a_url_nothing_is_recorded_and_the_log_says_so_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    listener = plugin.SteprecordListener(lambda: settings(None))
    with caplog.at_level(logging.WARNING, logger="steprecord_client.airflow"):
        for _ in range(3):
            listener.on_task_instance_running(
                previous_state="queued", task_instance=task_instance()
            )
    said = [r for r in caplog.records if "url is not set" in r.getMessage()]
    assert len(said) == 1
    assert listener._sender_ is None


def test_a_dead_service_never_holds_a_hook_and_the_flush_is_bounded(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with contextlib.closing(__import__("socket").socket()) as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens there
    listener = plugin.SteprecordListener(
        lambda: settings(f"http://127.0.0.1:{port}", flush_seconds=1.0, lease_seconds=30)
    )
    with caplog.at_level(logging.WARNING, logger="steprecord_client.airflow"):
        began = time.monotonic()
        for index in range(20):
            one = task_instance(task_id=f"t{index}")
            listener.on_task_instance_running(previous_state="queued", task_instance=one)
            one.state = "failed"
            listener.on_task_instance_failed(
                previous_state="running", task_instance=one, error=RuntimeError("x")
            )
        assert time.monotonic() - began < 0.5
        began = time.monotonic()
        listener.before_stopping(component=None)  # the end of a task runner: a bounded flush
        assert time.monotonic() - began < 2.5
    unreachable = [r for r in caplog.records if "until it answers again" in r.getMessage()]
    assert len(unreachable) == 1


# --------------------------------------------------------------------------- real Airflow


def _airflow_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _has_airflow(venv: Path) -> bool:
    python = _airflow_python(venv)
    if not python.exists():
        return False
    probe = subprocess.run(
        [str(python), "-c", "import airflow, sys; sys.stdout.write(airflow.__version__)"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return probe.returncode == 0 and probe.stdout.strip() == AIRFLOW_VERSION


def _unavailable(reason: str) -> None:
    if IN_CI:
        pytest.fail(reason)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def airflow_venv() -> Path:
    """Airflow 3.3 in a virtualenv of its own, with this client installed (for its entry
    point; the tests put the source tree first on the path, so the code is the tree's)."""
    if os.environ.get("STEPRECORD_TEST_CITUS") == "1":
        pytest.skip(
            "a real Airflow runs on one node only: the plugin is the client's, and the keys it"
            " makes are tested on the cluster by tests/test_run_id_keys.py and the stand-ins here"
        )
    venv = Path(os.environ.get("STEPRECORD_TEST_AIRFLOW_VENV") or ROOT / ".venv-airflow")
    if not _has_airflow(venv):
        try:
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
            subprocess.run(
                [
                    str(_airflow_python(venv)),
                    "-m",
                    "pip",
                    "install",
                    "-q",
                    "--disable-pip-version-check",
                    f"apache-airflow=={AIRFLOW_VERSION}",
                    f"{ROOT / 'clients' / 'python'}[airflow]",
                ],
                check=True,
                timeout=900,
                capture_output=True,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            _unavailable(f"Airflow {AIRFLOW_VERSION} could not be installed in {venv}: {exc}")
        if not _has_airflow(venv):
            _unavailable(f"Airflow {AIRFLOW_VERSION} is not importable in {venv}")
    entry = subprocess.run(
        [
            str(_airflow_python(venv)),
            "-c",
            "from importlib.metadata import entry_points;"
            "print([e.value for e in entry_points(group='airflow.plugins')])",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if "steprecord_client.airflow:SteprecordPlugin" not in entry.stdout:
        subprocess.run(
            [
                str(_airflow_python(venv)),
                "-m",
                "pip",
                "install",
                "-q",
                "--disable-pip-version-check",
                "--no-deps",
                str(ROOT / "clients" / "python"),
            ],
            check=True,
            timeout=300,
            capture_output=True,
        )
    return venv


@pytest.fixture(scope="module")
def service(own_database: str) -> Iterator[str]:
    """A service of this module's own (its records must outlive one test), sweeping often."""
    url, proc = start_server(own_database, env={"STEPRECORD_SWEEP_SECONDS": "0.2"})
    try:
        yield url
    finally:
        stop(proc)


def airflow_env(home: Path, url: str, **more: str) -> dict[str, str]:
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("AIRFLOW", "VIRTUAL_ENV", "PYTHON"))
    }
    env.update(
        AIRFLOW_HOME=str(home),
        AIRFLOW__CORE__LOAD_EXAMPLES="False",
        AIRFLOW__CORE__DAGS_FOLDER=str(DAGS),
        AIRFLOW__CORE__UNIT_TEST_MODE="False",
        AIRFLOW__STEPRECORD__URL=url,
        AIRFLOW__STEPRECORD__CLOSE_AFTER_SECONDS="0",
        PYTHONPATH=str(ROOT / "clients" / "python"),
    )
    env.update(more)
    return env


@pytest.fixture(scope="module")
def airflow_home(airflow_venv: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An Airflow home with its SQLite database migrated."""
    home = tmp_path_factory.mktemp("airflow-home")
    subprocess.run(
        [str(airflow_venv / "bin" / "airflow"), "db", "migrate"],
        env=airflow_env(home, "http://127.0.0.1:9"),
        check=True,
        capture_output=True,
        timeout=300,
    )
    return home


@contextlib.contextmanager
def dag_process(
    venv: Path, home: Path, url: str, dag: str, state: Path, **env: str
) -> Iterator[subprocess.Popen[bytes]]:
    """`python dag.py` (its `dag.test()`), in a process group of its own, stopped on the way
    out whatever happened."""
    log = (state / "dag.log").open("wb")
    proc = subprocess.Popen(
        [str(_airflow_python(venv)), str(DAGS / dag)],
        env=airflow_env(home, url, STATE_DIR=str(state), **env),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def airflow_tries(home: Path, dag_id: str) -> tuple[str, dict[str, list[tuple[int, str]]]]:
    """The dag's last run id, and per step slug its tries as Airflow's database keeps them
    (`task_instance_history` for earlier tries, `task_instance` for the latest), only tries
    that ran (a try number of 0 never did)."""
    with contextlib.closing(sqlite3.connect(home / "airflow.db")) as db:
        (run_id,) = db.execute(
            "SELECT run_id FROM dag_run WHERE dag_id = ? ORDER BY id DESC LIMIT 1", (dag_id,)
        ).fetchone()
        rows = db.execute(
            "SELECT task_id, map_index, try_number, state FROM task_instance_history"
            " WHERE dag_id = ? AND run_id = ?"
            " UNION ALL SELECT task_id, map_index, try_number, state FROM task_instance"
            " WHERE dag_id = ? AND run_id = ?",
            (dag_id, run_id, dag_id, run_id),
        ).fetchall()
    tries: dict[str, list[tuple[int, str]]] = {}
    for task_id, map_index, try_number, state in rows:
        if try_number >= 1:
            tries.setdefault(plugin.step_slug(task_id, map_index), []).append((try_number, state))
    return run_id, {slug: sorted(found) for slug, found in tries.items()}


AS_RECORDED = {"success": "completed", "skipped": "completed", "failed": "failed"}
AS_RECORDED["up_for_retry"] = "failed"


@pytest.fixture(scope="module")
def recorded_run(
    airflow_venv: Path,
    standalone_airflow: Standalone,
    airflow_home: Path,
    service: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[str, dict[str, list[tuple[int, str]]]]:
    """`recorded.py` run once with `dag.test()`; its run id and Airflow's tries. (It asks for
    the standalone Airflow first, only to start it: see `standalone_airflow`.)"""
    state = tmp_path_factory.mktemp("recorded")
    with dag_process(airflow_venv, airflow_home, service, "recorded.py", state) as proc:
        try:
            proc.wait(240)
        except subprocess.TimeoutExpired:
            pytest.fail("dag.test() of recorded.py took over 240 s")
    output = (state / "dag.log").read_text(errors="replace")
    assert "DagRun Finished" in output, output[-3000:]
    return airflow_tries(airflow_home, "recorded")


def test_the_record_says_what_airflow_s_database_says_try_by_try(
    recorded_run: tuple[str, dict[str, list[tuple[int, str]]]], service: str
) -> None:
    run_id, tries = recorded_run
    key = f"recorded:{run_id}"
    assert "+" in key  # the run id as Airflow made it, `+00:00` included
    with httpx.Client(base_url=service, timeout=30) as client:
        steps = client.get(path_of(key) + "/steps", params={"limit": 1000}).json()["items"]
        recorded = {}
        for step in steps:
            items = client.get(path_of(key, step["step_slug"]) + "/attempts").json()["items"]
            recorded[step["step_slug"]] = [(a["attempt"], a["status"]) for a in items]
    expected = {
        slug: [(number, AS_RECORDED[state]) for number, state in found]
        for slug, found in tries.items()
    }
    assert recorded == expected
    # What the dag made: a retried task, a mapped task of 20, a skipped branch (never tried,
    # so never recorded), a task that skipped itself, a failing task, a sensor.
    assert expected["flaky"] == [(1, "failed"), (2, "failed"), (3, "completed")]
    assert [f"load:{i}" for i in range(20)] == sorted(
        (s for s in expected if s.startswith("load:")), key=lambda s: int(s.split(":")[1])
    )
    assert "not_taken" not in expected
    assert expected["nothing_to_do"] == [(1, "completed")]
    assert expected["broken"] == [(1, "failed"), (2, "failed")]
    assert expected["wait"] == [(1, "completed")]  # three pokes, one try


def test_each_try_carries_its_details_and_its_error(
    recorded_run: tuple[str, dict[str, list[tuple[int, str]]]], service: str
) -> None:
    run_id, _ = recorded_run
    key = f"recorded:{run_id}"
    with httpx.Client(base_url=service, timeout=30) as client:
        load = client.get(path_of(key, "load:7")).json()
        assert load["output"] | {"hostname": None} == {
            "state": "success",
            "dag_id": "recorded",
            "run_id": run_id,
            "task_id": "load",
            "map_index": 7,
            "try_number": 1,
            "max_tries": 0,
            "operator": "@task",
            "owner": "airflow",
            "pool": "default_pool",
            "queue": "default",
            "hostname": None,
        }
        skipped = client.get(path_of(key, "nothing_to_do")).json()
        assert skipped["output"]["state"] == "skipped"
        broken = client.get(path_of(key, "broken") + "/attempts").json()["items"]
        assert [a["error_code"] for a in broken] == ["RuntimeError", "RuntimeError"]
        assert broken[0]["error_message"].startswith("Airflow try 1 of 2 (up_for_retry)")
        assert broken[1]["error_message"].startswith("Airflow try 2 of 2 (failed)")
        assert "Traceback (most recent call last)" in broken[1]["error_message"]
        assert "RuntimeError: broken on purpose" in broken[1]["error_message"]
        flaky = client.get(path_of(key, "flaky") + "/attempts").json()["items"]
        assert "owner data-team" in flaky[0]["error_message"]
        stats = client.get("/v1/stats/steps", params={"prefix": "recorded:"}).json()["items"]
        by_name = {item["name"]: item["attempts"] for item in stats}
        assert by_name["load"]["completed"] == 20
        assert not any(name.startswith("load:") for name in by_name)
        running = client.get(path_of(key) + "/steps", params={"status": "running"}).json()
        assert running["items"] == []


def test_a_task_process_killed_with_kill_9_ends_failed_within_its_lease(
    airflow_venv: Path, airflow_home: Path, service: str, tmp_path: Path
) -> None:
    lease = 3
    with dag_process(
        airflow_venv,
        airflow_home,
        service,
        "killed.py",
        tmp_path,
        AIRFLOW__STEPRECORD__LEASE_SECONDS=str(lease),
    ) as proc:
        pid = int(
            wait_for(
                "the task's pid",
                lambda: (tmp_path / "pid").read_text() if (tmp_path / "pid").exists() else None,
                seconds=120,
            )
        )
        with httpx.Client(base_url=service, timeout=30) as client:

            def running() -> dict[str, Any] | None:
                listed = client.get("/v1/instances", params={"limit": 100}).json()["items"]
                keys = [
                    i["instance_key"] for i in listed if i["instance_key"].startswith("killed:")
                ]
                if not keys:
                    return None
                record = client.get(path_of(keys[0], "sleeper"))
                body: dict[str, Any] = record.json()
                return body if record.status_code == 200 and body["status"] == "running" else None

            record = wait_for("the try recorded running", running, seconds=60)
            os.kill(pid, signal.SIGKILL)
            killed = time.monotonic()
            proc.wait(30)

            def failed() -> dict[str, Any] | None:
                body: dict[str, Any] = client.get(path_of(record["instance_key"], "sleeper")).json()
                return body if body["status"] == "failed" else None

            final = wait_for("the try failed by its lease", failed, seconds=lease + 10)
            took = time.monotonic() - killed
    assert final["error_code"] == "lease_expired"
    assert final["attempt_count"] == 1
    assert took < lease + 5, took


# --------------------------------------------------------------------------- airflow standalone


def processes_of(home: Path) -> list[int]:
    """The processes whose environment names this Airflow home, whatever process group they
    took (not those that rewrote their title with setproctitle: that overwrites the
    environment /proc shows, as the API server and LocalExecutor's workers do)."""
    marker = f"AIRFLOW_HOME={home}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if marker in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
    return found


def descendants(root: int) -> set[int]:
    """Every process below `root` now: its children, theirs, and so on."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError, ValueError):
            if entry.name.isdigit():
                # After the command's closing parenthesis: state, then the parent's pid.
                parent = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
                children.setdefault(parent, []).append(int(entry.name))
    found: set[int] = set()
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@contextlib.contextmanager
def standalone(venv: Path, home: Path, url: str, state: Path) -> Iterator[str]:
    """`airflow standalone` with the LocalExecutor on loopback (its API server on a free
    port, everyone admin, no example dags), yielding the API's base URL; every process it
    started is killed on the way out."""
    port = free_port()
    env = airflow_env(
        home,
        url,
        STATE_DIR=str(state),
        PATH=f"{venv / 'bin'}:{os.environ.get('PATH', '')}",
        AIRFLOW__CORE__EXECUTOR="LocalExecutor",
        # Two tasks at a time (the sleeper and one other) and a patient execution API: on
        # SQLite, more at once on a busy machine timed out a task's start (the try then
        # "finished while queued" and Airflow's database kept no trace of it).
        AIRFLOW__CORE__PARALLELISM="2",
        AIRFLOW__WORKERS__EXECUTION_API_TIMEOUT="60",
        AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS="True",
        AIRFLOW__CORE__EXECUTION_API_SERVER_URL=f"http://127.0.0.1:{port}/execution/",
        AIRFLOW__API__HOST="127.0.0.1",
        AIRFLOW__API__PORT=str(port),
        AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL="2",
        # Each dag file parsed once (at the start): a parse is a process of its own, and one
        # every 30 s (the default) only takes CPU from the run on a busy machine.
        AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL="600",
        AIRFLOW__SCHEDULER__SCHEDULER_HEARTBEAT_SEC="1",
        AIRFLOW__STEPRECORD__LEASE_SECONDS="10",
        AIRFLOW__STEPRECORD__CLOSE_AFTER_SECONDS="2",
    )
    log = (state / "standalone.log").open("wb")
    proc = subprocess.Popen(
        [str(venv / "bin" / "airflow"), "standalone"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        # Killed at once, not stopped: nothing is left to read from it. Its components share
        # its process group; a task process takes a group of its own, so it is found below
        # the standalone before its parents die (then by the Airflow home, if it shows it).
        doomed = descendants(proc.pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        doomed |= set(processes_of(home))
        for pid in doomed:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait(30)
        wait_for(
            "every standalone process gone",
            lambda: not (any(alive(pid) for pid in doomed) or processes_of(home)) or None,
        )
        log.close()


class Standalone(NamedTuple):
    api: str
    home: Path
    state: Path


@pytest.fixture(scope="module")
def standalone_airflow(
    airflow_venv: Path, service: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Standalone]:
    """`airflow standalone` in an Airflow home of its own (it migrates its database itself),
    started and not waited for. The dag.test() tests ask for it first, so that its starting
    (about a minute on busy cores, CPU for five interpreters) goes on beside theirs instead of
    after them."""
    home = tmp_path_factory.mktemp("standalone-home")
    state = tmp_path_factory.mktemp("standalone")
    with standalone(airflow_venv, home, service, state) as api:
        yield Standalone(api, home, state)


def test_airflow_standalone_with_local_executor_records_every_try_and_a_killed_one_ends_failed(
    standalone_airflow: Standalone, service: str
) -> None:
    """Production's shape: each try in a task process of its own, forked by LocalExecutor's
    workers; the scheduler reports the dag run's end. A task process killed with `kill -9`
    (no hook) ends failed within its lease (10 s here): by the lease, or by the dag run's
    end, whichever comes first.

    The deadlines are for two busy cores (CI runs this beside the whole suite on a Citus
    cluster): there, standalone's five interpreters took about a minute to start (beside the
    dag.test() tests, see `standalone_airflow`), and the run 30 to 40 s from its trigger to
    its end (a sensor's second poke comes 15 s after its first)."""
    api, home, state = standalone_airflow
    with (
        httpx.Client(base_url=api, timeout=30) as airflow,
        httpx.Client(base_url=service, timeout=30) as client,
    ):

        def parsed() -> bool | None:
            with contextlib.suppress(httpx.TransportError):
                return airflow.get("/api/v2/dags/standalone_run").status_code == 200 or None
            return None

        # The API server starts last (58 s at load average 7); polled twice a second, not to
        # take its CPU.
        wait_for("the dag parsed by standalone", parsed, seconds=150, interval=0.5)
        # A dag is paused at creation (`dags_are_paused_at_creation`): its runs never start.
        unpaused = airflow.patch("/api/v2/dags/standalone_run", json={"is_paused": False})
        assert unpaused.status_code == 200, unpaused.text
        run = airflow.post("/api/v2/dags/standalone_run/dagRuns", json={"logical_date": None})
        assert run.status_code == 200, run.text
        run_id = run.json()["dag_run_id"]
        key = f"standalone_run:{run_id}"
        pid_file = state / "pid"
        # The sleeper goes first (its priority), but the first tries wait for the execution
        # API's first answer: up to 20 s on busy cores.
        pid = int(
            wait_for(
                "the sleeper's pid",
                lambda: pid_file.read_text() if pid_file.exists() else None,
                seconds=90,
            )
        )

        def sleeper(status: str) -> dict[str, Any] | None:
            response = client.get(path_of(key, "sleeper"))
            body: dict[str, Any] = response.json()
            return body if response.status_code == 200 and body["status"] == status else None

        # The try's start report, sent by the task process: 5 s at most, seen so far.
        wait_for("the sleeper recorded running", lambda: sleeper("running"), 30, interval=0.2)
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        # Its lease (10 s) and the service's sweep; checked more closely below.
        final = wait_for("the killed try failed", lambda: sleeper("failed"), 20, interval=0.2)
        took = time.monotonic() - killed

        def finished() -> str | None:
            body = airflow.get(f"/api/v2/dags/standalone_run/dagRuns/{run_id}").json()
            return body["state"] if body["state"] in ("success", "failed") else None

        # The sensor's second poke, 15 s after its first, then the scheduler's next loops.
        assert wait_for("the dag run's end", finished, seconds=60, interval=1) == "failed"
        _, tries = airflow_tries(home, "standalone_run")
        expected = {
            slug: [(number, AS_RECORDED[state]) for number, state in found]
            for slug, found in tries.items()
        }

        def recorded() -> dict[str, list[tuple[int, str]]]:
            found = {}
            steps = client.get(path_of(key) + "/steps", params={"limit": 1000}).json()["items"]
            for step in steps:
                slug = step["step_slug"]
                items = client.get(path_of(key, slug) + "/attempts").json()["items"]
                found[slug] = [(a["attempt"], a["status"]) for a in items]
            return found

        # The scheduler's last reports (close_after_seconds is 2) may land after the run's end.
        with contextlib.suppress(AssertionError):
            eventually(lambda: recorded() == expected, interval=0.5, what="the same tries")
        assert recorded() == expected
    assert final["error_code"] in ("lease_expired", "dag_run_ended"), final
    assert took < 10 + 5, took
    assert expected["flaky"] == [(1, "failed"), (2, "completed")]
    assert expected["wait"] == [(1, "completed")]
    assert expected["sleeper"] == [(1, "failed")]
    assert {f"load:{i}" for i in range(3)} <= set(expected)
