"""Record every task try of every Airflow 3 dag run in steprecord: one installed plugin.

::

    pip install 'steprecord-client[airflow]'
    export AIRFLOW__STEPRECORD__URL=http://127.0.0.1:8000   # scheduler, workers, API server
    export AIRFLOW__STEPRECORD__TOKEN=...                   # a write token, when tokens exist

The distribution registers :class:`SteprecordPlugin` under Airflow's ``airflow.plugins`` entry
point; its listener is called by Airflow itself (the task runner on the workers, the scheduler,
the API server). Configuration is section ``[steprecord]`` of Airflow's configuration
(``url``, ``token``, ``lease_seconds``, ``flush_seconds``, ``close_after_seconds``); without
``url`` the plugin does nothing and says so once in the log. ``docs/airflow.md`` tells the
whole story; in short:

- **Identities.** The dag run is the instance, key ``{dag_id}:{run_id}``
  (:func:`instance_key`); a task is a step, slug ``task_id`` or, for a mapped task,
  ``task_id:map_index`` (:func:`step_slug`); a try is an attempt, ``try_number``.
- **Events.** ``running`` reports ``start`` with a lease, renewed by a heartbeat thread in the
  task's process; ``success`` reports ``complete`` with the task's details as the output;
  ``skipped`` (the task skipped itself) reports ``complete`` with ``"state": "skipped"``;
  ``failed`` reports ``fail`` with the exception's class as the code and its traceback
  (head and tail kept when it is too long) as the message, whether the try will be retried
  (``up_for_retry``) or not (``failed``). A sensor rescheduled between pokes and a deferred
  task keep one attempt: their ``running`` again with the same ``try_number`` is a replay,
  and the lease is extended to cover the wait.
- **Labels.** Each ``start`` sets the dag run's labels ``airflow.dag``, ``airflow.owner``
  (the task's owner) and ``airflow.run_type`` (``scheduled``, ``manual``, ...), so
  ``GET /v1/instances?label=airflow.dag=etl&label=airflow.run_type=scheduled`` lists them.
- **Closing.** A task process killed without a hook stops heartbeating, so the service's
  sweeper fails its attempt when the lease expires (``lease_expired``); and when the dag run
  ends, the steps of that run still recorded as running are failed with ``dag_run_ended``.
- **Never in the way.** Hooks only queue reports; one background thread per process sends
  them, each within a few seconds (bounded retries). A task waits for its reports at most
  ``flush_seconds`` when its try ends; the scheduler never waits. A service that cannot be
  reached is logged (once until it answers again), never raised.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import logging
import os
import queue
import re
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, ClassVar, Final

import httpx

from . import _core

__all__ = [
    "Settings",
    "SteprecordListener",
    "SteprecordPlugin",
    "fit_message",
    "instance_key",
    "listener",
    "step_slug",
]

log = logging.getLogger("steprecord_client.airflow")

KEY_CAP: Final = 200
"""Longest instance key and step slug."""

REPORT_BUDGET: Final = 3.0
"""Seconds one report may take, retries included, before it is logged and dropped."""

REPORT_BACKOFF: Final = _core.Backoff(max_retries=3, initial=0.1, cap=1.0)
"""Retries of one report after a transport error, a 503 or a 429."""

QUEUE_CAP: Final = 10000
"""Reports waiting in one process at most; beyond, new ones are dropped (and logged)."""

CLOSE_CODE: Final = "dag_run_ended"
"""The ``error_code`` of a try still running when its dag run ended."""

_KEY_OUT: Final = re.compile(r"[^A-Za-z0-9._:+~-]")
_SLUG_OUT: Final = re.compile(r"[^A-Za-z0-9._:-]")
_SLUG_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,199}")
_KEY_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:+~-]{0,199}")


# --------------------------------------------------------------------------- identities


def _digest(text: str, size: int) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:size]


def instance_key(dag_id: str, run_id: str) -> str:
    """The instance key of a dag run: ``{dag_id}:{run_id}`` as it stands when that is a valid
    key (1-200 characters of ``[A-Za-z0-9._:+~-]``, the first a letter or a digit; Airflow's
    default run-id pattern allows nothing else).

    Otherwise (too long, or characters outside the alphabet such as a non-ASCII letter in the
    dag id) it stays readable and unique: each character outside the alphabet becomes ``-``,
    characters that may not start a key are stripped from its front, the dag id and the run id
    are cut (the run id keeps at least half the room, or all of it when it is short), and
    ``~`` and the first 16 hex digits of the SHA-256 of the full ``{dag_id}:{run_id}`` end it:
    ``{dag id, cut}:{run id, cut}~{16 hex}``, exactly 200 characters or fewer.
    """
    raw = f"{dag_id}:{run_id}"
    if _KEY_RE.fullmatch(raw):
        return raw
    digest = _digest(raw, 16)
    dag = _KEY_OUT.sub("-", dag_id).lstrip("._:+~-") or "dag"
    run = _KEY_OUT.sub("-", run_id)
    room = KEY_CAP - len(digest) - 2  # the ":" between them, the "~" before the digest
    if len(dag) + len(run) > room:
        run = run[: max(room - len(dag), min(len(run), room // 2))]
        dag = dag[: room - len(run)]
    return f"{dag}:{run}~{digest}"


def step_slug(task_id: str, map_index: int | None = None) -> str:
    """The step slug of a task: its ``task_id`` (a task group's tasks are ``group.task``),
    and for a mapped task ``task_id:map_index`` (``load:17``), so statistics group the
    slugs of one mapped task under ``task_id``.

    A task id that is no valid slug (a character outside ``[A-Za-z0-9._:-]``, such as a
    non-ASCII letter, a leading ``_``, or too long) becomes readable and unique the same way
    as a key: each character outside the alphabet ``-``, leading non-alphanumerics stripped,
    cut to fit, then ``-`` and 8 hex digits of the SHA-256 of the task id (the map index kept
    whole after it)."""
    tail = f":{map_index}" if map_index is not None and map_index >= 0 else ""
    if _SLUG_RE.fullmatch(task_id) and len(task_id) + len(tail) <= KEY_CAP:
        return task_id + tail
    digest = _digest(task_id, 8)
    name = _SLUG_OUT.sub("-", task_id).lstrip("._:-") or "task"
    room = KEY_CAP - len(tail) - len(digest) - 1
    return f"{name[:room]}-{digest}{tail}"


# --------------------------------------------------------------------------- messages


def fit_message(text: str) -> str:
    """``text`` as an ``error_message`` the service takes: NUL characters become U+FFFD and
    lone surrogates ``?``, then :func:`steprecord_client._core.fit_message` keeps, when its
    UTF-8 is over 65536 bytes, its head and its tail (a traceback's first frames and, most
    telling, its last lines and the exception) around a line saying how many bytes were cut."""
    clean = text.replace("\x00", "\ufffd").encode("utf-8", "replace").decode("utf-8")
    return _core.fit_message(clean)


def _error_text(error: Any) -> str | None:
    """The whole story of an error: an exception's traceback (with its causes) when it has
    one, else its text; a string (what the scheduler and the API server pass) as it is."""
    if error is None:
        return None
    if isinstance(error, BaseException):
        try:
            text = "".join(traceback.format_exception(error))
        except Exception:
            text = _core.error_message_for(error) or type(error).__name__
        return text.rstrip("\n")
    return str(error)


def _error_code(error: Any, state: str | None, previous_state: Any) -> str:
    """The exception's class name; for a failure passed as text, what it says: a heartbeat
    timeout, a state set by hand, or the scheduler's ``task_failed``."""
    if isinstance(error, BaseException):
        return _core.error_code_for(error)
    text = str(error or "").lower()
    if "heartbeat" in text:
        return "heartbeat_timeout"
    if previous_state is None and "manually" in text:
        return "marked_failed"
    return "task_failed" if state != "up_for_retry" else "task_failed_will_retry"


# --------------------------------------------------------------------------- settings


@dataclass(frozen=True, slots=True)
class Settings:
    """Section ``[steprecord]`` of Airflow's configuration (``AIRFLOW__STEPRECORD__*``)."""

    url: str | None = None
    token: str | None = None
    lease_seconds: int = 60
    """Each try's lease; a heartbeat renews it every third of it while the task runs."""
    flush_seconds: float = 5.0
    """How long a task's process waits at most, when its try ends, for its reports."""
    close_after_seconds: float = 30.0
    """How long after a dag run ended its steps still running are failed (``dag_run_ended``):
    room for the reports of its last tries, sent by other processes, to arrive first."""

    @classmethod
    def from_airflow(cls) -> Settings:
        conf = _airflow_conf()

        def get(option: str) -> str | None:
            if conf is None:
                return os.environ.get(f"AIRFLOW__STEPRECORD__{option.upper()}") or None
            value = conf.get("steprecord", option, fallback=None)
            return (str(value).strip() or None) if value is not None else None

        def number(option: str, default: float) -> float:
            text = get(option)
            if text is None:
                return default
            try:
                return float(text)
            except ValueError:
                log.warning(
                    "steprecord: [steprecord] %s = %r is no number: %s", option, text, default
                )
                return default

        lease = int(number("lease_seconds", 60))
        if not 1 <= lease <= _core.LEASE_CAP:
            log.warning("steprecord: [steprecord] lease_seconds must be 1-86400; 60 is used")
            lease = 60
        return cls(
            url=get("url"),
            token=get("token"),
            lease_seconds=lease,
            flush_seconds=max(0.0, number("flush_seconds", 5.0)),
            close_after_seconds=max(0.0, number("close_after_seconds", 30.0)),
        )


def _airflow_conf() -> Any:
    with contextlib.suppress(Exception):
        from airflow.configuration import conf

        return conf
    with contextlib.suppress(Exception):
        from airflow.sdk.configuration import conf as sdk_conf

        return sdk_conf
    return None


# --------------------------------------------------------------------------- the sender


class _Sender:
    """One process's reports: a queue, drained in order by one daemon thread, each report
    within :data:`REPORT_BUDGET`. A forked child makes its own (see :meth:`Listener._sender`)."""

    def __init__(self, settings: Settings) -> None:
        assert settings.url is not None
        self.settings = settings
        self.pid = os.getpid()
        self.client = httpx.Client(
            base_url=settings.url.rstrip("/"),
            headers=_core.headers(settings.token),
            timeout=httpx.Timeout(2.0, connect=1.0),
        )
        self.jobs: queue.Queue[Callable[[], None]] = queue.Queue(QUEUE_CAP)
        self.thread: threading.Thread | None = None
        self.lock = threading.Lock()
        self.down_since: float | None = None  # when the service stopped answering, for the log
        self.dropped = 0

    def submit(self, job: Callable[[], None]) -> None:
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.warning("steprecord: %d reports dropped: the queue is full", self.dropped)
            return
        with self.lock:
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._drain, name="steprecord", daemon=True)
                self.thread.start()

    def _drain(self) -> None:
        while True:
            job = self.jobs.get()
            try:
                job()
            except Exception:
                log.exception("steprecord: a report failed")
            finally:
                self.jobs.task_done()

    def flush(self, seconds: float) -> bool:
        """Wait until every queued report was sent (or given up), at most ``seconds``."""
        deadline = time.monotonic() + seconds
        with self.jobs.all_tasks_done:
            while self.jobs.unfinished_tasks:
                left = deadline - time.monotonic()
                if left <= 0:
                    log.warning(
                        "steprecord: %d reports not sent within %.1f s; they are dropped",
                        self.jobs.unfinished_tasks,
                        seconds,
                    )
                    return False
                self.jobs.all_tasks_done.wait(left)
        return True

    def send(
        self, what: str, op: _core.Http, budget: float = REPORT_BUDGET
    ) -> httpx.Response | None:
        """Send ``op`` within ``budget`` seconds; ``None`` when it could not be delivered (logged
        once until the service answers again). Any answer is returned, refusals included."""
        try:
            kwargs = _core.request_kwargs(op)
        except Exception as exc:
            log.warning("steprecord: %s not recorded: %s", what, exc)
            return None
        deadline = time.monotonic() + budget
        retry = 0
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self._down(what, "no time left")
                return None
            timeout = httpx.Timeout(min(2.0, left), connect=min(1.0, left))
            response: httpx.Response | None = None
            try:
                response = self.client.request(op.method, op.path, timeout=timeout, **kwargs)
            except httpx.TransportError as exc:
                reason = f"{type(exc).__name__}: {exc}"
            except Exception as exc:  # an invalid URL, a closed client: never the task's concern
                log.warning("steprecord: %s not recorded: %s", what, exc)
                return None
            else:
                reason = f"{response.status_code} from the service"
            delay = REPORT_BACKOFF.delay(retry, response)
            if delay is None and response is not None:
                if self.down_since is not None:
                    log.warning(
                        "steprecord: the service answers again (after %.0f s)",
                        time.monotonic() - self.down_since,
                    )
                    self.down_since = None
                return response
            if delay is None or time.monotonic() + delay >= deadline:
                self._down(what, reason)
                return None
            retry += 1
            time.sleep(delay)

    def _down(self, what: str, reason: str) -> None:
        if self.down_since is None:
            self.down_since = time.monotonic()
            log.warning(
                "steprecord: %s not recorded: %s (%s); reports are dropped until it answers"
                " again, and this is logged once",
                what,
                reason,
                self.settings.url,
            )


def _refused(what: str, response: httpx.Response) -> None:
    problem = _core.problem_of(response)
    code = problem.get("code")
    if code == "stale_attempt":
        current = problem.get("current") or {}
        log.warning(
            "steprecord: %s refused: a newer attempt (%s) superseded this try",
            what,
            current.get("attempt_count"),
        )
    else:
        log.warning(
            "steprecord: %s refused: %s %s: %s",
            what,
            response.status_code,
            code,
            problem.get("detail"),
        )


# --------------------------------------------------------------------------- a task try


def _state(value: Any) -> str | None:
    """A ``TaskInstanceState`` (a ``str`` enum) or a string as its plain value."""
    if value is None:
        return None
    return str(getattr(value, "value", value))


def _aware(moment: Any) -> datetime | None:
    if not isinstance(moment, datetime):
        return None
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


@dataclass(slots=True)
class _Try:
    """One task try as a hook sees it, read at once from the task instance (plain values
    only: the scheduler's ORM object must not be touched from another thread)."""

    dag_id: str
    run_id: str
    task_id: str
    map_index: int | None
    attempt: int
    max_tries: int | None
    state: str | None
    started: datetime
    ended: datetime | None
    details: dict[str, Any]
    key: str = ""
    slug: str = ""
    pause: int = _core.LEASE_CAP
    """Seconds the try may wait between two runs of it: a sensor in reschedule mode between
    pokes, a deferred task for its trigger (see :func:`_pause_of`)."""
    stop: threading.Event = field(default_factory=threading.Event)
    finished: bool = False
    paused: bool = False
    run_type: str | None = None  # the dag run's: scheduled, manual, backfill, ...

    def __post_init__(self) -> None:
        self.key = instance_key(self.dag_id, self.run_id)
        self.slug = step_slug(self.task_id, self.map_index)

    @property
    def path(self) -> str:
        return _core.step_path(self.key, self.slug)

    @property
    def name(self) -> str:
        return f"{self.slug} in {self.key} (try {self.attempt})"

    @property
    def labels(self) -> dict[str, str]:
        """The labels its start sets on the dag run's instance: the dag, its owner, and the
        run's type (each value cut to the labels' limit; one unknown is left out)."""
        found = {
            "airflow.dag": self.dag_id,
            "airflow.owner": self.details.get("owner"),
            "airflow.run_type": self.run_type,
        }
        return {k: str(v)[: _core.MAX_LABEL_VALUE_CHARS] for k, v in found.items() if v}

    @classmethod
    def of(cls, ti: Any) -> _Try:
        task = getattr(ti, "task", None)
        map_index = getattr(ti, "map_index", None)
        map_index = int(map_index) if isinstance(map_index, int) and map_index >= 0 else None
        started = _aware(getattr(ti, "start_date", None))
        ended = _aware(getattr(ti, "end_date", None))
        try_number = getattr(ti, "try_number", None)
        max_tries = getattr(ti, "max_tries", None)
        operator = getattr(task, "operator_name", None) if task is not None else None
        details: dict[str, Any] = {
            "dag_id": str(ti.dag_id),
            "run_id": str(ti.run_id),
            "task_id": str(ti.task_id),
            "map_index": map_index,
            "try_number": try_number if isinstance(try_number, int) else None,
            "max_tries": max_tries if isinstance(max_tries, int) else None,
            "operator": _text(operator or getattr(ti, "operator", None) or _class_name(task)),
            "owner": _text(getattr(task, "owner", None)),
            "pool": _text(getattr(task, "pool", None) or getattr(ti, "pool", None)),
            "queue": _text(getattr(task, "queue", None) or getattr(ti, "queue", None)),
            "hostname": _text(getattr(ti, "hostname", None)),
        }
        return cls(
            dag_id=str(ti.dag_id),
            run_id=str(ti.run_id),
            task_id=str(ti.task_id),
            map_index=map_index,
            attempt=max(try_number if isinstance(try_number, int) else 1, 1),
            max_tries=details["max_tries"],
            state=_state(getattr(ti, "state", None)),
            started=started or ended or _core.now(),
            ended=ended,
            details=details,
            pause=_pause_of(task),
            run_type=_run_type(ti),
        )


# The run types Airflow 3 names in its run ids (`scheduled__2026-12-06T00:00:00+00:00`).
RUN_TYPES = ("scheduled", "manual", "backfill", "asset_triggered", "dataset_triggered")


def _run_type(ti: Any) -> str | None:
    """The dag run's type: its own (the scheduler's task instance holds its dag run), else
    the one its run id starts with, else None."""
    run_type = getattr(getattr(ti, "dag_run", None), "run_type", None)
    if run_type is not None:
        return _text(getattr(run_type, "value", run_type))
    prefix = str(getattr(ti, "run_id", "")).partition("__")[0]
    return prefix if prefix in RUN_TYPES else None


def _pause_of(task: Any) -> int:
    """How long a try of ``task`` may wait between two of its runs: for a sensor in reschedule
    mode, twice its longest poke interval (``max_wait`` with exponential backoff); else (a
    deferred task, waiting for its trigger) a day, the longest lease."""
    if task is None or getattr(task, "mode", None) != "reschedule":
        return _core.LEASE_CAP
    interval = _seconds(getattr(task, "poke_interval", None)) or 60.0
    if getattr(task, "exponential_backoff", False):
        interval = max(interval, _seconds(getattr(task, "max_wait", None)) or 3600.0)
    return max(1, min(int(2 * interval), _core.LEASE_CAP))


def _text(value: Any) -> str | None:
    return None if value is None else str(value)


def _class_name(value: Any) -> str | None:
    return None if value is None else type(value).__name__


def _summary(one: _Try, state: str | None) -> str:
    """One line on a try, first in its error message: what it was and whether Airflow will
    retry it."""
    d = one.details
    task = one.task_id if one.map_index is None else f"{one.task_id}[{one.map_index}]"
    tries = "" if one.max_tries is None else f" of {one.max_tries + 1}"
    parts = [
        f"Airflow try {one.attempt}{tries} ({state or 'failed'}): dag {one.dag_id}, task {task}"
    ]
    for name in ("operator", "owner", "pool", "queue", "hostname"):
        if d.get(name):
            parts.append(f"{name} {d[name]}")
    return ", ".join(parts)


# --------------------------------------------------------------------------- the listener


class SteprecordListener:
    """Airflow's listener hooks (``pluggy``'s, project ``airflow``), reporting each task try
    to the service (see the module's docstring). One instance serves a process; it is safe
    across ``fork`` (a child makes its own sender) and across threads."""

    def __init__(self, settings: Callable[[], Settings] = Settings.from_airflow) -> None:
        self._load_settings = settings
        self._settings: Settings | None = None
        self._sender_: _Sender | None = None
        self._lock = threading.Lock()
        self._tries: dict[tuple[str, str], _Try] = {}  # the tries this process runs
        self._closes: list[tuple[float, Callable[[], None]]] = []  # dag runs to close, and when
        self._timer: threading.Timer | None = None
        self._atexit = False
        # A child forked while another thread held the lock would wait on it for ever.
        method = weakref.WeakMethod(self._after_fork)
        os.register_at_fork(after_in_child=lambda: (bound := method()) and bound())

    def _after_fork(self) -> None:
        self._lock = threading.Lock()

    # -- configuration and the sender

    def settings(self) -> Settings:
        if self._settings is None:
            with self._lock:
                if self._settings is None:
                    settings = self._load_settings()
                    if settings.url is None:
                        log.warning(
                            "steprecord: [steprecord] url is not set (AIRFLOW__STEPRECORD__URL):"
                            " task tries are not recorded"
                        )
                    self._settings = settings
        return self._settings

    def _sender(self) -> _Sender | None:
        settings = self.settings()
        if settings.url is None:
            return None
        sender = self._sender_
        if sender is not None and sender.pid == os.getpid():
            return sender
        with self._lock:
            sender = self._sender_
            if sender is None or sender.pid != os.getpid():
                # A sender inherited through fork is dropped, not closed: its thread is gone
                # and its connections are the parent's.
                sender = self._sender_ = _Sender(settings)
                self._tries = {}
                self._closes = []
                self._timer = None
                if not self._atexit:
                    atexit.register(self._at_exit)
                    self._atexit = True
        return sender

    def flush(self, seconds: float | None = None) -> bool:
        """Send what is queued (and the dag-run closes still waiting), at most ``seconds``
        (``flush_seconds`` by default). Called when a try ends and when the process exits."""
        sender = self._sender()
        if sender is None:
            return True
        return sender.flush(self.settings().flush_seconds if seconds is None else seconds)

    def _at_exit(self) -> None:
        with contextlib.suppress(Exception):
            self._close_now()
            self.flush()

    # -- hooks (pluggy calls them by keyword; each returns at once, whatever happens)

    def on_task_instance_running(self, previous_state: Any, task_instance: Any) -> None:
        self._guard("running", self._running, previous_state, task_instance)

    def on_task_instance_success(self, previous_state: Any, task_instance: Any) -> None:
        self._guard("success", self._finished, previous_state, task_instance, "success", None)

    def on_task_instance_skipped(self, previous_state: Any, task_instance: Any) -> None:
        self._guard("skipped", self._finished, previous_state, task_instance, "skipped", None)

    def on_task_instance_failed(
        self, previous_state: Any, task_instance: Any, error: Any = None
    ) -> None:
        self._guard("failed", self._finished, previous_state, task_instance, "failed", error)

    def on_dag_run_success(self, dag_run: Any, msg: str) -> None:
        self._guard("dag run success", self._dag_run_ended, dag_run, "success", msg)

    def on_dag_run_failed(self, dag_run: Any, msg: str) -> None:
        self._guard("dag run failed", self._dag_run_ended, dag_run, "failed", msg)

    def before_stopping(self, component: Any) -> None:
        self._guard("stopping", self._stopping)

    def _guard(self, what: str, fn: Callable[..., None], *args: Any) -> None:
        try:
            if self._sender() is not None:
                fn(*args)
        except Exception:
            log.exception("steprecord: recording %s failed", what)

    # -- a try's life

    def _running(self, previous_state: Any, ti: Any) -> None:
        sender = self._sender()
        assert sender is not None
        one = _Try.of(ti)
        with self._lock:
            known = self._tries.get((one.key, one.slug))
            if known is not None and known.attempt == one.attempt and not known.finished:
                # The same try again in this process (a sensor's next poke in `dag.test`).
                known.stop.set()
            self._tries[(one.key, one.slug)] = one
        lease = self.settings().lease_seconds

        def start() -> None:
            body = {
                "attempt": one.attempt,
                "started_at": _core.timestamp(one.started),
                "lease_seconds": lease,
                "labels": one.labels,
            }
            what = f"start of {one.name}"
            response = sender.send(what, _core.Http("POST", f"{one.path}/start", body))
            if response is None:
                return
            if not response.is_success:
                _refused(what, response)
                return
            record = response.json()
            if record.get("attempt_count") == one.attempt and record.get("started_at"):
                # A rescheduled sensor's or a resumed deferred task's try: one attempt, which
                # started at its first poke; the answer says when.
                with contextlib.suppress(ValueError, TypeError):
                    one.started = datetime.fromisoformat(record["started_at"])
            if record.get("status") != "running" or record.get("attempt_count") != one.attempt:
                log.warning(
                    "steprecord: %s: the record is %s at attempt %s",
                    what,
                    record.get("status"),
                    record.get("attempt_count"),
                )

        sender.submit(start)
        self._heartbeat(sender, one, lease)

    def _heartbeat(self, sender: _Sender, one: _Try, lease: int) -> None:
        beat = _core.Heartbeat(one.path, one.attempt, lease)
        what = f"heartbeat of {one.name}"

        def run() -> None:
            while not one.stop.wait(beat.every):
                response = sender.send(what, beat.request())
                if response is not None and response.status_code == 409:
                    return  # finished, swept or superseded: the final report will say

        threading.Thread(target=run, name="steprecord-heartbeat", daemon=True).start()

    def _finished(self, previous_state: Any, ti: Any, outcome: str, error: Any) -> None:
        sender = self._sender()
        assert sender is not None
        seen = _Try.of(ti)
        with self._lock:
            one = self._tries.get((seen.key, seen.slug))
            if one is None or one.attempt != seen.attempt:
                one = seen  # reported by another process (scheduler, API server) or manually
            one.stop.set()
            one.finished = True
            if self._tries.get((one.key, one.slug)) is one:
                del self._tries[(one.key, one.slug)]
            state = seen.state or outcome
            ended = seen.ended or _core.now()
        by_hand = previous_state is None
        if outcome == "failed":
            text = _error_text(error)
            summary = _summary(one, state)
            message = summary if not text else f"{summary}\n\n{text}"
            fields: dict[str, Any] = {
                "error_code": _error_code(error, state, previous_state),
                "error_message": fit_message(message),
            }
            kind = "fail"
        else:
            output = {"state": state, **one.details, "try_number": one.attempt}
            if by_hand:
                output["set_by_hand"] = True
            fields = {"output": output}
            kind = "complete"

        def report() -> None:
            body = {
                "attempt": one.attempt,
                "started_at": _core.timestamp(one.started),
                "completed_at": _core.timestamp(max(ended, one.started)),
                **fields,
            }
            what = f"{kind} of {one.name}"
            response = sender.send(what, _core.Http("POST", f"{one.path}/{kind}", body))
            if response is not None and not response.is_success:
                _refused(what, response)

        sender.submit(report)

    def _stopping(self) -> None:
        """The end of a task runner's work: a try that did not finish (a sensor rescheduled,
        a task deferred) keeps its attempt running with a lease long enough for the wait;
        then the reports are flushed, within ``flush_seconds``."""
        sender = self._sender()
        assert sender is not None
        lease = self.settings().lease_seconds
        with self._lock:
            waiting = [one for one in self._tries.values() if not one.finished and not one.paused]
            for one in waiting:
                one.paused = True
                one.stop.set()
        for one in waiting:
            wait = max(1, min(one.pause + lease, _core.LEASE_CAP))
            beat = _core.Heartbeat(one.path, one.attempt, wait)
            sender.submit(functools.partial(_beat, sender, one, beat))
        self.flush()

    # -- the end of a dag run

    def _dag_run_ended(self, dag_run: Any, state: str, msg: str) -> None:
        """Fail, after ``close_after_seconds``, the steps of this run still running: tries
        whose process stopped without a hook (a ``kill -9``, a lost worker). Nothing here
        waits: the scheduler calls this."""
        key = instance_key(str(dag_run.dag_id), str(dag_run.run_id))
        ended = _aware(getattr(dag_run, "end_date", None)) or _core.now()
        settings = self.settings()

        def close() -> None:
            sender = self._sender()
            if sender is not None:
                _close_run(sender, key, ended, state, msg)

        with self._lock:
            self._closes.append((time.monotonic() + settings.close_after_seconds, close))
            if self._timer is None:
                self._timer = threading.Timer(settings.close_after_seconds, self._close_due)
                self._timer.daemon = True
                self._timer.start()

    def _close_due(self) -> None:
        sender = self._sender()
        now = time.monotonic()
        with self._lock:
            due = [job for when, job in self._closes if when <= now]
            self._closes = [(when, job) for when, job in self._closes if when > now]
            self._timer = None
            if self._closes:
                wait = max(0.0, min(when for when, _ in self._closes) - now)
                self._timer = threading.Timer(wait, self._close_due)
                self._timer.daemon = True
                self._timer.start()
        if sender is not None:
            for job in due:
                sender.submit(job)

    def _close_now(self) -> None:
        """At exit: the dag runs still to close are closed now (their reports from this
        process were queued before)."""
        sender = self._sender()
        with self._lock:
            due = [job for _, job in self._closes]
            self._closes = []
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
        if sender is not None:
            for job in due:
                sender.submit(job)


def _beat(sender: _Sender, one: _Try, beat: _core.Heartbeat) -> None:
    response = sender.send(f"heartbeat of {one.name}", beat.request())
    if response is not None and not response.is_success and response.status_code != 409:
        _refused(f"heartbeat of {one.name}", response)


def _close_run(sender: _Sender, key: str, ended: datetime, state: str, msg: str) -> None:
    """Fail every step of instance ``key`` still running, at its current attempt."""
    for record in _running_records(sender, key):
        attempt = record.get("attempt_count")
        slug = record.get("step_slug")
        if not isinstance(attempt, int) or not isinstance(slug, str):
            continue
        started = record.get("started_at")
        started_at = datetime.fromisoformat(started) if isinstance(started, str) else ended
        message = (
            f"the dag run ended ({state}: {msg}) while try {attempt} of {slug} was still"
            " recorded as running: its task process stopped without reporting (killed, or its"
            " worker lost)"
        )
        body = {
            "attempt": attempt,
            "started_at": _core.timestamp(started_at),
            "completed_at": _core.timestamp(max(ended, started_at)),
            "error_code": CLOSE_CODE,
            "error_message": fit_message(message),
        }
        what = f"close of {slug} in {key} (try {attempt})"
        path = _core.step_path(key, slug)
        response = sender.send(what, _core.Http("POST", f"{path}/fail", body))
        if response is not None and not response.is_success and response.status_code != 409:
            _refused(what, response)


def _running_records(sender: _Sender, key: str) -> Iterator[dict[str, Any]]:
    params = {"status": "running", "limit": "1000", "fields": "summary"}
    while True:
        op = _core.Http("GET", _core.steps_path(key), params=dict(params))
        response = sender.send(f"read of {key}'s running steps", op)
        if response is None or not response.is_success:
            return
        page = response.json()
        yield from page.get("items", [])
        cursor = page.get("next_cursor")
        if not cursor:
            return
        params["cursor"] = cursor


def _seconds(value: Any) -> float | None:
    if value is None:
        return None
    total = getattr(value, "total_seconds", None)
    with contextlib.suppress(TypeError, ValueError):
        return float(total()) if callable(total) else float(value)
    return None


# --------------------------------------------------------------------------- the plugin


def _hookimpl(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``fn`` as an implementation of Airflow's hook of the same name (pluggy's
    ``HookimplMarker("airflow")``; without pluggy, which Airflow brings, nothing to mark)."""
    try:
        import pluggy
    except ImportError:
        return fn
    marked: Callable[..., Any] = pluggy.HookimplMarker("airflow")(fn)
    return marked


for _name in (
    "on_task_instance_running",
    "on_task_instance_success",
    "on_task_instance_skipped",
    "on_task_instance_failed",
    "on_dag_run_success",
    "on_dag_run_failed",
    "before_stopping",
):
    _hookimpl(getattr(SteprecordListener, _name))

listener = SteprecordListener()
"""The listener the plugin registers: one per process."""


def _plugin_base() -> type:
    try:
        from airflow.plugins_manager import AirflowPlugin

        return AirflowPlugin  # type: ignore[no-any-return]
    except ImportError:
        from airflow.sdk.plugins_manager import AirflowPlugin as SdkPlugin

        return SdkPlugin  # type: ignore[no-any-return]


try:
    _Base: type = _plugin_base()
except ImportError:  # Airflow is not installed: the module still imports (for its helpers)
    _Base = object


class SteprecordPlugin(_Base):  # type: ignore[misc]
    """The Airflow plugin (entry point ``airflow.plugins``: ``steprecord``)."""

    name = "steprecord"
    listeners: ClassVar[list[Any]] = [listener]
