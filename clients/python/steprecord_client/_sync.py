"""The blocking recorder, :class:`Recorder`."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import time
from collections.abc import Callable, Coroutine, Iterator, Mapping
from types import TracebackType
from typing import Any, Literal, ParamSpec, Self, TypeVar, overload

import httpx

from . import _core
from ._core import InstanceScope, Record

P = ParamSpec("P")
R = TypeVar("R")


class Recorder:
    """Records the steps of workflow instances in a steprecord service (blocking I/O).

    ``base_url`` is the service's root (``http://127.0.0.1:8000``); ``token``, when given,
    is sent as ``Authorization: Bearer <token>``. ``offload`` (``value -> url``) stores step
    outputs elsewhere: with it, *every* output is offloaded and only the URL is recorded;
    without it an output over 1 MiB of JSON raises :class:`ValueError`.

    Transport errors (:class:`httpx.TransportError`, timeouts included) and 503 answers are
    retried up to ``max_retries`` times, waiting ``backoff`` seconds doubling up to
    ``max_backoff`` (or a longer ``Retry-After``). Every report carries its attempt and
    timestamps, so a report re-sent after a lost answer is a replay to the service. When
    the retries run out, the transport error itself, or a :class:`StepRecordError` for the
    503, is raised. ``timeout`` is httpx's per-request timeout.

    ``retry_backoff``, ``retry_backoff_max`` and ``retry_jitter`` are the default pause of
    ``step(retries=N)`` between a failed attempt and the next: ``retry_backoff`` seconds
    doubling per failure up to ``retry_backoff_max``, each a random time between half and all
    of that when ``retry_jitter`` (1 s, 2 s, 4 s, ... up to 30 s by default; ``0`` retries back
    to back). ``step()`` can override each of them.

    ``labels`` (``{"env": "prod"}``) go with every attempt's ``start``: the service merges
    them into the instance's labels, which its lists filter by (``?label=env=prod``).

    The recorder is thread-safe; use it as a context manager, or call :meth:`close`.
    """

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        *,
        offload: Callable[[Any], str] | None = None,
        max_retries: int = 5,
        backoff: float = 0.2,
        max_backoff: float = 5.0,
        timeout: float | httpx.Timeout = 10.0,
        retry_backoff: float = 1.0,
        retry_backoff_max: float = 30.0,
        retry_jitter: bool = True,
        labels: Mapping[str, str] | None = None,
    ) -> None:
        self._offload = offload
        self._labels = _core.check_labels(labels)
        self._backoff = _core.Backoff(max_retries, backoff, max_backoff)
        self._pause = _core.RetryBackoff(retry_backoff, retry_backoff_max, retry_jitter)
        self._client = httpx.Client(
            base_url=base_url, headers=_core.headers(token), timeout=timeout
        )

    @property
    def offload(self) -> Callable[[Any], str] | None:
        """The ``offload`` callable given to the constructor, if any."""
        return self._offload

    # -- lifecycle

    def close(self) -> None:
        """Close the underlying HTTP client."""
        self._client.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- the current instance and steps

    def instance(self, key: str) -> InstanceScope:
        """``with rec.instance("order-123"):`` makes that the current instance.

        The key is kept in a context variable (shared by all recorders): it follows asyncio
        tasks and ``contextvars.copy_context()`` into threads. Invalid keys raise
        :class:`ValueError` here.
        """
        return InstanceScope(key)

    def step(
        self,
        slug: str,
        *,
        retries: int = 0,
        lease_seconds: int | None = None,
        retry_backoff: float | None = None,
        retry_backoff_max: float | None = None,
        retry_jitter: bool | None = None,
    ) -> _StepDecorator:
        """Decorator: make a function a recorded step named ``slug``.

        Calling the wrapped function (inside ``rec.instance(...)``, else :class:`NoInstance`
        before anything happens) reads the step's record once. A ``completed`` record is not
        run again: its output (or its ``external_output_url``) is returned. Otherwise the
        next attempt is reported started, the function runs, and ``complete`` (with the
        return value, which must be JSON) or ``fail`` (with the exception, re-raised as the
        same object) is reported. ``retries=N`` runs up to N more attempts after a failure,
        pausing before each as ``retry_backoff``, ``retry_backoff_max`` and ``retry_jitter``
        say (each ``None``: the recorder's; see :class:`Recorder`).
        ``lease_seconds=S`` starts each attempt with a lease of S seconds and sends heartbeats
        (every S/3 seconds, from a background thread) while the function runs, so a worker
        that dies mid-step has its attempt failed by the service's sweeper
        (``lease_expired``) within about S seconds.
        A 409 ``stale_attempt`` raises :class:`StaleAttempt`; on ``start`` the function is
        then not run. Output errors (not JSON, over the cap) report ``fail`` and are raised
        without retries. A fresh run returns the function's own return value.

        A plain ``def`` is wrapped into a plain function. An ``async def`` is wrapped into
        an ``async def`` whose HTTP calls run in a worker thread, so the event loop never
        blocks (prefer :class:`AsyncRecorder` in asyncio code). Each call runs in its own
        copy of the current context. The slug names one record per instance, so each step
        runs at most once per instance; for mapped steps build slugs per item, e.g.
        ``rec.step(f"fetch:{i}")(fetch)(i)``.
        """
        return _StepDecorator(
            self,
            _core.check_name(slug, "step slug"),
            _core.check_retries(retries),
            _core.check_lease(lease_seconds),
            _core.retry_backoff(self._pause, retry_backoff, retry_backoff_max, retry_jitter),
        )

    # -- repairs

    def reopen(
        self, instance_key: str, step_slug: str, *, reason: str, attempt: int | None = None
    ) -> Record:
        """Reopen a completed or failed step (an admin token): it becomes ``pending`` at its
        next attempt, so the next ``@rec.step`` call runs it again; the service's repair log
        keeps ``reason`` and who. ``attempt``: the attempt you saw finished (a
        :class:`StaleAttempt` when another is current). Returns the reopened record."""
        op = _core.reopen_request(instance_key, step_slug, reason, attempt)
        record: Record = _core.expect_json(self._send(op))
        return record

    # -- reads

    def record(self, instance_key: str, step_slug: str) -> Record | None:
        """The step's record as a dict, or ``None`` when the step or instance is unknown."""
        path = _core.step_path(instance_key, step_slug)
        return _core.record_or_none(self._send(_core.Http("GET", path)))

    def steps(
        self,
        instance_key: str,
        order: Literal["ordinal", "started_at"] = "ordinal",
        *,
        status: str | list[str] | tuple[str, ...] | None = None,
        page_size: int = 100,
    ) -> Iterator[Record]:
        """Iterate over an instance's records, fetching ``page_size`` per request.

        ``order="ordinal"`` gives declaration order, ``"started_at"`` start order with
        never-started steps last. ``status`` filters (``"running"`` or
        ``["running", "failed"]``). Pages are followed through ``next_cursor``; an unknown
        instance raises :class:`StepRecordError` (404 ``instance_not_found``).
        """
        path = _core.steps_path(instance_key)
        _core.list_params(order, status, page_size, None)  # validate now, not on first next()
        return self._iter_steps(path, order, status, page_size)

    def _iter_steps(
        self,
        path: str,
        order: str,
        status: str | list[str] | tuple[str, ...] | None,
        page_size: int,
    ) -> Iterator[Record]:
        cursor: str | None = None
        while True:
            params = _core.list_params(order, status, page_size, cursor)
            page = _core.expect_json(self._send(_core.Http("GET", path, params=params)))
            yield from page["items"]
            cursor = page.get("next_cursor")
            if cursor is None:
                return

    # -- transport

    def _send(self, op: _core.Http) -> httpx.Response:
        retry = 0
        while True:
            try:
                response = self._client.request(op.method, op.path, **_core.request_kwargs(op))
            except httpx.TransportError:
                delay = self._backoff.delay(retry, None)
                if delay is None:
                    raise
            else:
                delay = self._backoff.delay(retry, response)
                if delay is None:
                    return response
            retry += 1
            time.sleep(delay)

    async def _send_in_thread(self, op: _core.Http) -> httpx.Response:
        return await asyncio.to_thread(self._send, op)


class _StepDecorator:
    """What ``Recorder.step(...)`` returns; applied to a function it gives the wrapper."""

    __slots__ = ("_lease_seconds", "_pause", "_recorder", "_retries", "_slug")

    def __init__(
        self,
        recorder: Recorder,
        slug: str,
        retries: int,
        lease_seconds: int | None,
        pause: _core.RetryBackoff,
    ) -> None:
        self._recorder = recorder
        self._slug = slug
        self._retries = retries
        self._lease_seconds = lease_seconds
        self._pause = pause

    @overload
    def __call__(
        self, fn: Callable[P, Coroutine[Any, Any, R]]
    ) -> Callable[P, Coroutine[Any, Any, R]]: ...

    @overload
    def __call__(self, fn: Callable[P, R]) -> Callable[P, R]: ...

    def __call__(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        rec, slug, retries, lease = self._recorder, self._slug, self._retries, self._lease_seconds
        pause = self._pause
        if inspect.iscoroutinefunction(fn):
            return _core.make_async_wrapper(
                fn, slug, retries, rec._send_in_thread, rec._offload, lease, pause, rec._labels
            )

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            key = _core.require_instance(slug)
            flow = _core.step_flow(
                key, slug, retries, rec._offload is not None, lease, pause, rec._labels
            )
            return contextvars.copy_context().run(
                _core.drive_sync, flow, rec._send, lambda: fn(*args, **kwargs), rec._offload
            )

        return wrapper
