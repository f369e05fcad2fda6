"""Record every task of a Celery app in steprecord with one call.

::

    from celery import Celery
    from steprecord_client.celery import record_celery

    app = Celery("shop", broker="amqp://guest:guest@127.0.0.1:5672//")
    record_celery(app, "http://127.0.0.1:8000", token=None, lease_seconds=60)

Celery is imported only when :func:`record_celery` is called (install the extra:
``pip install 'steprecord-client[celery]'``). See ``docs/celery.md`` for the whole story; in
short:

- **Identities.** The instance key is the task's ``root_id`` (the first task of its chain,
  group or chord; a lone task's own id). The step slug is ``"<task name>:<task id>"``: one
  record per task invocation, so a task used twice in a chain is two records. Characters of
  the task name outside ``[A-Za-z0-9._:-]`` each become ``-`` (``tasks.send mail`` →
  ``tasks.send-mail``), characters that may not start a slug are stripped from its front,
  and the name is cut so the slug fits 200 characters (the id is kept whole; an id with
  characters outside the alphabet is mapped the same way). ``instance_key=`` and
  ``step_slug=`` take callables of the task request to choose either yourself. Celery's own
  tasks (names starting with ``celery.``, such as ``celery.chord_unlock``) are not recorded.
- **Attempts.** ``request.retries + 1``. A message redelivered after its worker died (same
  id, same ``retries``) finds its attempt already started (or already swept) and takes the
  next attempt after the record's current one.
- **Events.** ``start`` (with ``lease_seconds``) when the task begins, then a heartbeat
  every third of the lease from a thread of the process running the task; ``complete``
  with the return value when it is JSON of at most 1 MiB (otherwise no inline output, and
  ``offload(value) -> url`` stores it when given); ``fail`` with the exception's class name
  and text when the task raises, when it asks for a retry (reported as the retry is
  published, before the next attempt can start) and when it is revoked while running
  (``error_code`` ``revoked``).
- **Labels.** Each start sets two labels on its instance: ``celery.app`` (the app's
  ``main`` name) and ``celery.queue`` (the queue the task came from, its delivery's routing
  key), when known; ``labels=`` adds your own. Lists filter by them
  (``GET /v1/instances?label=celery.queue=emails``).
- **Traces.** With OpenTelemetry's API installed (the ``otel`` extra), every report carries
  the current trace context, so the attempt keeps the trace id of the task's span. Call
  ``CeleryInstrumentor().instrument()`` before :func:`record_celery`, so that the task's span
  is current when its start is reported; without a current span, the start carries the trace
  context the task's publisher sent in the message headers (W3C ``traceparent``), if any.
- **Reporting never breaks a task.** Each report has a budget of about three seconds
  (short timeouts, a few retries with the client's :class:`~steprecord_client._core.Backoff`);
  a report that cannot be delivered, or that the service refuses (a 409 such as
  ``stale_attempt`` included), is logged on the ``steprecord_client.celery`` logger and
  dropped. Nothing is raised into Celery.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, Final

import httpx

from . import _core
from ._sync import Recorder

if TYPE_CHECKING:
    from celery import Celery

__all__ = ["CeleryRecording", "record_celery", "step_slug_for", "task_key"]

log = logging.getLogger("steprecord_client.celery")

REPORT_BUDGET: Final = 3.0
"""Seconds one report may take, retries included, before it is logged and dropped."""

REQUEST_TIMEOUT: Final = httpx.Timeout(2.0, connect=1.0)
"""The per-request timeout of reports (each is also cut to what is left of the budget)."""

REPORT_BACKOFF: Final = _core.Backoff(max_retries=3, initial=0.1, cap=1.0)
"""Retries of one report after a transport error or a 503."""

_INVALID: Final = re.compile(r"[^A-Za-z0-9._:-]")
_LEADING: Final = re.compile(r"^[._:-]+")
_CAP: Final = 200

RequestFn = Callable[[Any], str]
"""A callable of the task request (``task.request``, a ``celery.app.task.Context``)."""


# --------------------------------------------------------------------------- identities


def _clean(text: str) -> str:
    """``text`` in the slug alphabet: each other character becomes ``-``; leading
    characters that may not start a slug are stripped."""
    return _LEADING.sub("", _INVALID.sub("-", text))


def task_key(task_id: str) -> str:
    """A task id as an instance key or slug part: mapped to the alphabet, cut to 200."""
    return _clean(task_id)[:_CAP] or "task"


def step_slug_for(task_name: str, task_id: str) -> str:
    """``"<task name>:<task id>"``, the name mapped to the slug alphabet and cut so the slug
    fits 200 characters (the id is kept whole when it fits)."""
    ident = _INVALID.sub("-", task_id)
    name = _clean(task_name)
    room = _CAP - len(ident) - 1
    if room < 1 or not name:
        return task_key(task_id) if room < 1 else task_key(f"task:{ident}")
    return f"{name[:room]}:{ident}"


def _default_key(request: Any) -> str:
    return task_key(str(getattr(request, "root_id", None) or request.id))


# --------------------------------------------------------------------------- a running task


@dataclass(slots=True)
class _Running:
    """What this process knows of a task it runs: identities, attempt, start, heartbeats."""

    task_id: str
    retries: int
    key: str
    slug: str
    attempt: int
    started: datetime
    stop: threading.Event = field(default_factory=threading.Event)
    reported: bool = False
    labels: dict[str, str] = field(default_factory=dict)  # sent with its start

    @property
    def path(self) -> str:
        return _core.step_path(self.key, self.slug)


class CeleryRecording:
    """The handle :func:`record_celery` returns: :meth:`disconnect` stops recording."""

    def __init__(
        self,
        app: Celery,
        base_url: str,
        *,
        token: str | None,
        lease_seconds: int,
        instance_key: RequestFn | None,
        step_slug: RequestFn | None,
        offload: Callable[[Any], str] | None,
        labels: Mapping[str, str] | None = None,
    ) -> None:
        self.app = app
        self._labels = _core.check_labels(labels) or {}
        self.base_url = base_url
        self.lease_seconds = lease_seconds
        self._token = token
        self._instance_key = instance_key or _default_key
        self._step_slug = step_slug
        self._offload = offload
        self._recorders: dict[int, Recorder] = {}
        self._lock = threading.Lock()
        self._local = threading.local()  # .stack: the tasks running in this thread
        self._running: dict[str, _Running] = {}  # by task id, for revokes from other threads
        self._receivers: list[tuple[Any, Callable[..., None]]] = []

    # -- wiring

    def connect(self) -> None:
        from celery import signals

        pairs: list[tuple[Any, Callable[..., None]]] = [
            (signals.task_prerun, self._on_prerun),
            (signals.task_success, self._on_success),
            (signals.task_failure, self._on_failure),
            (signals.task_retry, self._on_retry),
            (signals.task_revoked, self._on_revoked),
            (signals.task_postrun, self._on_postrun),
            (signals.before_task_publish, self._on_publish),
        ]
        for sig, receiver in pairs:
            sig.connect(receiver, weak=False)
        self._receivers = pairs

    def disconnect(self) -> None:
        """Disconnect from Celery's signals: this app's tasks are no longer recorded."""
        for sig, receiver in self._receivers:
            sig.disconnect(receiver)
        self._receivers = []

    def _ours(self, task: Any) -> bool:
        name = getattr(task, "name", None)
        return (
            getattr(task, "app", None) is self.app
            and isinstance(name, str)
            and not name.startswith("celery.")
        )

    def _identities(self, task: Any, request: Any) -> tuple[str, str] | None:
        try:
            key = _core.check_key(self._instance_key(request))
            if self._step_slug is not None:
                slug = _core.check_name(self._step_slug(request), "step slug")
            else:
                slug = step_slug_for(str(task.name), str(request.id))
        except Exception as exc:
            log.warning("steprecord: task %s[%s] not recorded: %s", task.name, request.id, exc)
            return None
        return key, slug

    def _stack(self) -> list[_Running]:
        stack: list[_Running] | None = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def _current(self, task_id: str | None) -> _Running | None:
        stack = self._stack()
        if stack and task_id is not None and stack[-1].task_id == task_id:
            return stack[-1]
        return None

    # -- transport: the client's HTTP layer, bounded

    def _recorder(self) -> Recorder:
        """This process's recorder (a forked pool child makes its own: an HTTP connection
        must not be shared across ``fork``)."""
        pid = os.getpid()
        with self._lock:
            recorder = self._recorders.get(pid)
            if recorder is None:
                recorder = Recorder(
                    self.base_url,
                    self._token,
                    max_retries=REPORT_BACKOFF.max_retries,
                    backoff=REPORT_BACKOFF.initial,
                    max_backoff=REPORT_BACKOFF.cap,
                    timeout=REQUEST_TIMEOUT,
                )
                # A recorder inherited from the parent is dropped, not closed: closing would
                # touch the parent's connections.
                self._recorders = {pid: recorder}
            return recorder

    def _send(self, what: str, op: _core.Http) -> httpx.Response | None:
        """Send ``op`` within the report budget; ``None`` (after one log line) when it could
        not be delivered. Any answer is returned, refusals included."""
        try:
            recorder = self._recorder()
            client, backoff = recorder._client, recorder._backoff
            kwargs = _core.request_kwargs(op)
        except Exception as exc:
            log.warning("steprecord: %s not recorded: %s", what, exc)
            return None
        deadline = time.monotonic() + REPORT_BUDGET
        retry = 0
        while True:
            left = deadline - time.monotonic()
            timeout = httpx.Timeout(min(REQUEST_TIMEOUT.read or left, left), connect=min(1.0, left))
            response: httpx.Response | None = None
            try:
                response = client.request(op.method, op.path, timeout=timeout, **kwargs)
            except httpx.TransportError as exc:
                reason = f"{type(exc).__name__}: {exc}"
            except Exception as exc:  # an invalid URL, a closed client: never the task's concern
                log.warning("steprecord: %s not recorded: %s", what, exc)
                return None
            else:
                reason = f"{response.status_code} from the service"
            delay = backoff.delay(retry, response)
            if delay is None and response is not None:
                return response
            if delay is None or time.monotonic() + delay >= deadline:
                log.warning(
                    "steprecord: %s not recorded after %d tries: %s", what, retry + 1, reason
                )
                return None
            retry += 1
            time.sleep(delay)

    def _refused(self, what: str, response: httpx.Response) -> None:
        problem = _core.problem_of(response)
        code = problem.get("code")
        if code == "stale_attempt":
            current = problem.get("current") or {}
            log.warning(
                "steprecord: %s refused: a newer attempt (%s) superseded this one",
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

    # -- the task's life

    def _on_prerun(self, sender: Any = None, task_id: str | None = None, **_: Any) -> None:
        try:
            if not self._ours(sender) or task_id is None:
                return
            request = sender.request
            names = self._identities(sender, request)
            if names is None:
                return
            retries = int(getattr(request, "retries", 0) or 0)
            running = _Running(task_id, retries, *names, attempt=retries + 1, started=_core.now())
            running.labels = self._labels_of(request)
            # The task's trace: its span when one is current (OpenTelemetry's Celery
            # instrumentation, connected before this), else the context its publisher sent.
            with _core.carried_trace(lambda name: getattr(request, name, None)):
                self._start(running)
            self._stack().append(running)
            with self._lock:
                self._running[task_id] = running
            self._heartbeat(running)
        except Exception:
            log.exception("steprecord: recording the start of task %s failed", task_id)

    def _labels_of(self, request: Any) -> dict[str, str]:
        """The app's name and the task's queue (its delivery's routing key), with the labels
        given to :func:`record_celery`; a value cut to the labels' limit."""
        delivery = getattr(request, "delivery_info", None) or {}
        found = {
            "celery.app": getattr(self.app, "main", None),
            "celery.queue": delivery.get("routing_key") if isinstance(delivery, dict) else None,
        }
        labels = {k: str(v)[: _core.MAX_LABEL_VALUE_CHARS] for k, v in found.items() if v}
        return {**labels, **self._labels}

    def _start(self, running: _Running) -> None:
        """Report ``start``; a redelivered message whose attempt is already taken (running
        elsewhere, or swept) takes the next attempt after the record's current one."""
        what = f"start of {running.slug} in {running.key}"
        for _ in range(3):
            running.started = _core.now()
            body = {
                "attempt": running.attempt,
                "started_at": _core.timestamp(running.started),
                "lease_seconds": self.lease_seconds,
                **({"labels": running.labels} if running.labels else {}),
            }
            response = self._send(what, _core.Http("POST", f"{running.path}/start", body))
            if response is None:
                return
            record: Any = None
            if response.is_success:
                record = response.json()
                if _owned(record, running.attempt, running.started):
                    return
            elif response.status_code == 409 and _core.problem_of(response).get("code") == (
                "stale_attempt"
            ):
                record = _core.problem_of(response).get("current")
            if not isinstance(record, dict) or not isinstance(record.get("attempt_count"), int):
                self._refused(what, response)
                return
            running.attempt = max(running.attempt, record["attempt_count"]) + 1
        log.warning("steprecord: %s: gave up taking a fresh attempt", what)

    def _heartbeat(self, running: _Running) -> None:
        beat = _core.Heartbeat(running.path, running.attempt, self.lease_seconds)
        what = f"heartbeat of {running.slug} in {running.key}"

        def run() -> None:
            while not running.stop.wait(beat.every):
                response = self._send(what, beat.request())
                if response is not None and response.status_code == 409:
                    return  # finished, swept or superseded: the final report will say

        threading.Thread(target=run, name="steprecord-heartbeat", daemon=True).start()

    def _finish(self, running: _Running, kind: str, fields: dict[str, Any]) -> None:
        running.stop.set()
        if running.reported:
            return
        running.reported = True
        body = {
            "attempt": running.attempt,
            "started_at": _core.timestamp(running.started),
            "completed_at": _core.timestamp(max(_core.now(), running.started)),
            **fields,
        }
        what = f"{kind} of {running.slug} in {running.key} (attempt {running.attempt})"
        response = self._send(what, _core.Http("POST", f"{running.path}/{kind}", body))
        if response is None or response.is_success:
            return
        if kind == "complete" and response.status_code in (413, 422) and fields:
            log.warning("steprecord: %s: the service refused the output; recorded without it", what)
            body = {k: v for k, v in body.items() if k not in fields}
            response = self._send(what, _core.Http("POST", f"{running.path}/complete", body))
            if response is None or response.is_success:
                return
        self._refused(what, response)

    def _fail(self, running: _Running, exc: BaseException | None, code: str | None = None) -> None:
        fields: dict[str, Any] = {
            "error_code": code or (_core.error_code_for(exc) if exc is not None else "Exception")
        }
        message = _core.error_message_for(exc) if exc is not None else None
        if message is not None:
            fields["error_message"] = message
        self._finish(running, "fail", fields)

    def _output(self, running: _Running, value: Any) -> dict[str, Any]:
        """The output fields for ``complete``: inline JSON within the cap, else the URL from
        ``offload`` when there is one, else none."""
        try:
            text = _core.jsonb_text(value)
        except (TypeError, ValueError):
            text = None
        if text is not None and len(text.encode("utf-8")) <= _core.OUTPUT_CAP:
            return {} if value is None else {"output": value}
        if self._offload is None:
            return {}
        try:
            return {"external_output_url": _core.check_url(self._offload(value))}
        except Exception as exc:
            log.warning("steprecord: offload of %s's output failed: %s", running.slug, exc)
            return {}

    def _on_success(self, sender: Any = None, result: Any = None, **_: Any) -> None:
        try:
            running = self._current(_task_id(sender)) if self._ours(sender) else None
            if running is not None:
                self._finish(running, "complete", self._output(running, result))
        except Exception:
            log.exception("steprecord: recording a task's success failed")

    def _on_failure(
        self,
        sender: Any = None,
        task_id: str | None = None,
        exception: BaseException | None = None,
        **_: Any,
    ) -> None:
        try:
            if not self._ours(sender):
                return
            running = self._current(task_id)
            if running is not None:
                self._fail(running, exception)
            elif task_id is not None:
                # Reported by the pool's parent process (the worker lost the child, a hard
                # time limit): the attempt is the one the record says is running.
                self._fail_running(sender, sender.request, exception, None)
        except Exception:
            log.exception("steprecord: recording the failure of task %s failed", task_id)

    def _on_retry(
        self, sender: Any = None, request: Any = None, reason: Any = None, **_: Any
    ) -> None:
        try:
            running = self._current(getattr(request, "id", None)) if self._ours(sender) else None
            if running is not None and not running.reported:  # else reported at publish
                self._fail(running, _retry_cause(reason))
        except Exception:
            log.exception("steprecord: recording a task's retry failed")

    def _on_publish(self, sender: Any = None, headers: Any = None, **_: Any) -> None:
        """A retry is a new message with the same id and ``retries`` + 1, published by the
        task itself: report the failed attempt now, before the next one can start."""
        try:
            task_id = headers.get("id") if isinstance(headers, dict) else None
            running = self._current(task_id)
            if running is None or running.reported:
                return
            if int(headers.get("retries") or 0) > running.retries:
                # `retry()` is called in the `except` block that caught the failure (as Celery's
                # documentation shows): that exception is the one being handled here.
                self._fail(running, _retry_cause(sys.exc_info()[1]))
        except Exception:
            log.exception("steprecord: recording a task's retry failed")

    def _on_revoked(
        self,
        sender: Any = None,
        request: Any = None,
        terminated: bool = False,
        signum: Any = None,
        **_: Any,
    ) -> None:
        try:
            if not self._ours(sender) or request is None:
                return
            message = f"revoked (terminated by {_signal_name(signum)})" if terminated else "revoked"
            with self._lock:
                running = self._running.get(str(request.id))
            if running is not None:
                self._fail(running, RuntimeError(message), "revoked")
            else:
                self._fail_running(sender, request, RuntimeError(message), "revoked")
        except Exception:
            log.exception("steprecord: recording a task's revoke failed")

    def _fail_running(
        self, task: Any, request: Any, exc: BaseException | None, code: str | None
    ) -> None:
        """Fail the record's running attempt, when it has one (nothing ran here)."""
        names = self._identities(task, request)
        if names is None:
            return
        key, slug = names
        path = _core.step_path(key, slug)
        response = self._send(f"read of {slug} in {key}", _core.Http("GET", path))
        if response is None or not response.is_success:
            return
        record = response.json()
        if record.get("status") != "running":
            return
        started = datetime.fromisoformat(record["started_at"])
        running = _Running(
            str(request.id), 0, key, slug, attempt=int(record["attempt_count"]), started=started
        )
        self._fail(running, exc, code)

    def _on_postrun(
        self, sender: Any = None, task_id: str | None = None, state: str | None = None, **_: Any
    ) -> None:
        try:
            running = self._current(task_id) if self._ours(sender) else None
            if running is None:
                return
            self._stack().pop()
            with self._lock:
                if self._running.get(running.task_id) is running:
                    del self._running[running.task_id]
            if state == "IGNORED":  # e.g. replaced by another signature: nothing failed
                self._finish(running, "complete", {})
            elif state == "REJECTED":
                self._fail(running, None, "rejected")
            running.stop.set()
        except Exception:
            log.exception("steprecord: recording the end of task %s failed", task_id)


def _signal_name(signum: Any) -> str:
    with contextlib.suppress(TypeError, ValueError):
        return signal.Signals(int(signum)).name
    return str(signum)


def _task_id(task: Any) -> str | None:
    with contextlib.suppress(Exception):
        return str(task.request.id)
    return None


def _owned(record: Any, attempt: int, started: datetime) -> bool:
    """Whether the answer to our ``start`` shows our attempt running with our start time
    (else another delivery of the same message holds or finished it)."""
    try:
        return bool(
            record.get("status") == "running"
            and record.get("attempt_count") == attempt
            and datetime.fromisoformat(record["started_at"]) == started
        )
    except (AttributeError, KeyError, TypeError, ValueError):
        return False


def _retry_cause(reason: Any) -> BaseException | None:
    """The exception a retry reports: the one given to ``retry(exc=...)``, else ``None``."""
    inner = getattr(reason, "exc", None)  # celery.exceptions.Retry carries the cause
    if isinstance(inner, BaseException):
        return inner
    if isinstance(reason, BaseException) and type(reason).__name__ != "Retry":
        return reason
    return None


def record_celery(
    app: Celery,
    base_url: str,
    *,
    token: str | None = None,
    lease_seconds: int = 60,
    instance_key: RequestFn | None = None,
    step_slug: RequestFn | None = None,
    offload: Callable[[Any], str] | None = None,
    labels: Mapping[str, str] | None = None,
) -> CeleryRecording:
    """Record every task of ``app`` in the steprecord service at ``base_url``.

    Connects Celery's task signals for this app only (another app of the same process is
    untouched); works in the worker's prefork, threads and solo pools. ``token`` is sent as
    ``Authorization: Bearer``; ``lease_seconds`` (1-86400) is each attempt's lease, renewed
    every third of it while the task runs. ``instance_key`` and ``step_slug``, callables of
    the task request, replace the default identities (``root_id``; ``"<name>:<id>"``).
    ``offload(value) -> url`` stores a return value that is not JSON or over 1 MiB.
    ``labels`` are set on every instance it records, besides ``celery.app`` and
    ``celery.queue``. Returns a handle whose ``disconnect()`` stops recording.
    """
    lease = _core.check_lease(lease_seconds)
    if lease is None:
        raise ValueError("lease_seconds is required: a recorded task always holds a lease")
    recording = CeleryRecording(
        app,
        base_url,
        token=token,
        lease_seconds=lease,
        instance_key=instance_key,
        step_slug=step_slug,
        offload=offload,
        labels=labels,
    )
    recording.connect()
    return recording
