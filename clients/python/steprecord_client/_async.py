"""The asyncio recorder, :class:`AsyncRecorder`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping
from types import TracebackType
from typing import Any, Literal, ParamSpec, Self, TypeVar, overload

import httpx

from . import _core
from ._core import InstanceScope, Record

P = ParamSpec("P")
R = TypeVar("R")


class AsyncRecorder:
    """Records the steps of workflow instances in a steprecord service (asyncio).

    Mirrors :class:`Recorder` with an :class:`httpx.AsyncClient`: same arguments, same
    semantics; wrapped steps are coroutine functions, :meth:`steps` is an async iterator,
    and ``offload`` may also be an ``async def`` (or return an awaitable). Use it as an
    async context manager, or call :meth:`aclose`.
    """

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        *,
        offload: Callable[[Any], str | Awaitable[str]] | None = None,
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
        self._client = httpx.AsyncClient(
            base_url=base_url, headers=_core.headers(token), timeout=timeout
        )

    @property
    def offload(self) -> Callable[[Any], str | Awaitable[str]] | None:
        """The ``offload`` callable given to the constructor, if any."""
        return self._offload

    # -- lifecycle

    async def aclose(self) -> None:
        """Close the underlying HTTP client."""
        await self._client.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    # -- the current instance and steps

    def instance(self, key: str) -> InstanceScope:
        """``with`` or ``async with rec.instance("order-123"):`` sets the current instance.

        The key is kept in a context variable (shared by all recorders), so tasks created
        inside the block inherit it and tasks elsewhere do not see it.
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
    ) -> _AsyncStepDecorator:
        """Decorator: make a function a recorded step named ``slug``; see ``Recorder.step``.

        The wrapper is always a coroutine function, to be awaited inside an instance
        (:class:`NoInstance` otherwise, raised when awaited, before anything happens).
        An ``async def`` is awaited in the wrapper's own task (its own copy of the
        context); a plain ``def`` runs in a worker thread via :func:`asyncio.to_thread`.
        With ``lease_seconds``, heartbeats are sent from a background task while it runs.
        Between attempts of ``retries=N`` it pauses with :func:`asyncio.sleep`.
        """
        return _AsyncStepDecorator(
            self,
            _core.check_name(slug, "step slug"),
            _core.check_retries(retries),
            _core.check_lease(lease_seconds),
            _core.retry_backoff(self._pause, retry_backoff, retry_backoff_max, retry_jitter),
        )

    # -- repairs

    async def reopen(
        self, instance_key: str, step_slug: str, *, reason: str, attempt: int | None = None
    ) -> Record:
        """``await rec.reopen(key, slug, reason=...)`` — see ``Recorder.reopen``."""
        op = _core.reopen_request(instance_key, step_slug, reason, attempt)
        record: Record = _core.expect_json(await self._send(op))
        return record

    # -- reads

    async def record(self, instance_key: str, step_slug: str) -> Record | None:
        """The step's record as a dict, or ``None`` when the step or instance is unknown."""
        path = _core.step_path(instance_key, step_slug)
        return _core.record_or_none(await self._send(_core.Http("GET", path)))

    def steps(
        self,
        instance_key: str,
        order: Literal["ordinal", "started_at"] = "ordinal",
        *,
        status: str | list[str] | tuple[str, ...] | None = None,
        page_size: int = 100,
    ) -> AsyncIterator[Record]:
        """``async for record in rec.steps(key):`` — see ``Recorder.steps``."""
        path = _core.steps_path(instance_key)
        _core.list_params(order, status, page_size, None)  # validate now
        return self._iter_steps(path, order, status, page_size)

    async def _iter_steps(
        self,
        path: str,
        order: str,
        status: str | list[str] | tuple[str, ...] | None,
        page_size: int,
    ) -> AsyncIterator[Record]:
        cursor: str | None = None
        while True:
            params = _core.list_params(order, status, page_size, cursor)
            page = _core.expect_json(await self._send(_core.Http("GET", path, params=params)))
            for item in page["items"]:
                yield item
            cursor = page.get("next_cursor")
            if cursor is None:
                return

    # -- transport

    async def _send(self, op: _core.Http) -> httpx.Response:
        retry = 0
        while True:
            try:
                response = await self._client.request(
                    op.method, op.path, **_core.request_kwargs(op)
                )
            except httpx.TransportError:
                delay = self._backoff.delay(retry, None)
                if delay is None:
                    raise
            else:
                delay = self._backoff.delay(retry, response)
                if delay is None:
                    return response
            retry += 1
            await asyncio.sleep(delay)


class _AsyncStepDecorator:
    """What ``AsyncRecorder.step(...)`` returns; applied to a function it gives the wrapper."""

    __slots__ = ("_lease_seconds", "_pause", "_recorder", "_retries", "_slug")

    def __init__(
        self,
        recorder: AsyncRecorder,
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
    def __call__(self, fn: Callable[P, Awaitable[R]]) -> Callable[P, Coroutine[Any, Any, R]]: ...

    @overload
    def __call__(self, fn: Callable[P, R]) -> Callable[P, Coroutine[Any, Any, R]]: ...

    def __call__(self, fn: Callable[..., Any]) -> Callable[..., Coroutine[Any, Any, Any]]:
        rec = self._recorder
        return _core.make_async_wrapper(
            fn,
            self._slug,
            self._retries,
            rec._send,
            rec._offload,
            self._lease_seconds,
            self._pause,
            rec._labels,
        )
