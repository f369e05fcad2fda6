"""The logic shared by :class:`Recorder` and :class:`AsyncRecorder`.

Nothing in this module performs I/O. The life of one wrapped call is written once, as the
generator :func:`step_flow`, which *yields* what it needs done — an HTTP request
(:class:`Http`), running the user's callback (:class:`Invoke`) or offloading an output
(:class:`Offload`) — and receives the result through ``send`` (or the exception through
``throw``). :func:`drive_sync` and :func:`drive_async` are the two small loops that carry
those operations out with blocking or awaitable primitives.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import json
import random
import re
import threading
import time
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Coroutine,
    Generator,
    Iterator,
    Mapping,
)
from contextvars import ContextVar, Token
from dataclasses import dataclass
from datetime import UTC, datetime
from types import TracebackType
from typing import Any, Final

import httpx

try:  # OpenTelemetry's API (the `otel` extra): requests carry the current trace context
    from opentelemetry import context as otel_context
    from opentelemetry import propagate as otel_propagate
    from opentelemetry import trace as otel_trace

    TRACE_CONTEXT = True
except ImportError:  # without it, nothing is sent
    TRACE_CONTEXT = False

__version__ = "0.1.0"

__all__ = [
    "InstanceScope",
    "NoInstance",
    "StaleAttempt",
    "StepRecordError",
    "current_instance",
    "fit_message",
]

Record = dict[str, Any]
"""A step record as the service returns it: a plain JSON object."""

OUTPUT_CAP: Final = 1024 * 1024
"""Largest inline output, in bytes of UTF-8 of its JSON text as PostgreSQL prints ``jsonb``."""

MESSAGE_CAP: Final = 65536
"""Largest ``error_message``, in bytes of UTF-8."""

URL_CAP: Final = 2048
"""Longest ``external_output_url``, in characters."""

LEASE_CAP: Final = 86400
"""Longest lease a ``start`` or ``heartbeat`` may ask for, in seconds."""

_NAME_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,199}")
# An instance key may also hold `+` and `~` (an Airflow run id, e.g. `...T00:00:00+00:00`).
_KEY_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:+~-]{0,199}")
_LABEL_KEY_RE: Final = re.compile(r"[A-Za-z0-9._/-]{1,63}")
MAX_LABELS: Final = 32
MAX_LABEL_VALUE_CHARS: Final = 200
_CODE_INVALID_RE: Final = re.compile(r"[^A-Za-z0-9._:-]+")
_URL_RE: Final = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://\S+")
# A JSON escape of NUL: "\u0000" preceded by an even number of backslashes.
_NUL_ESCAPE_RE: Final = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")


# --------------------------------------------------------------------------- errors


class StepRecordError(Exception):
    """The service refused a request (a 4xx, or a 5xx that outlasted the retries).

    ``status`` is the HTTP status, ``code`` the problem's stable ``code`` (see the README, e.g.
    ``"validation_error"``; ``None`` if the answer was not problem+json) and ``problem`` the
    whole RFC 9457 problem document as a dict.
    """

    def __init__(self, status: int, problem: Mapping[str, Any]) -> None:
        self.status = status
        self.problem: dict[str, Any] = dict(problem)
        code = problem.get("code")
        self.code: str | None = code if isinstance(code, str) else None
        detail = problem.get("detail") or problem.get("title") or ""
        super().__init__(f"{status} {self.code or 'error'}: {detail}".rstrip(": "))


class StaleAttempt(StepRecordError):
    """This worker's attempt was superseded; it must stop working on the step.

    Raised when the service answers a report with 409 ``stale_attempt`` (a newer attempt
    has started), and also when the answer to ``start`` shows that another worker already
    holds or finished this very attempt. ``current`` is the record as it stands, so the
    caller can see which attempt won. Raised by ``start``, the callback is not run.
    """

    def __init__(self, status: int, problem: Mapping[str, Any]) -> None:
        super().__init__(status, problem)
        current = problem.get("current")
        self.current: Record | None = current if isinstance(current, dict) else None
        # True when the service kept this late complete/fail in the attempt's history.
        self.recorded: bool = problem.get("recorded") is True


class NoInstance(RuntimeError):
    """A wrapped step was called outside any ``with rec.instance(key):`` block.

    Raised before anything is reported or run.
    """


# --------------------------------------------------------------------------- the current instance

# One module-level variable (contextvars must not be created per object): the current
# instance is shared by every recorder of the process.
_current_instance: ContextVar[str | None] = ContextVar("steprecord_instance", default=None)


def current_instance() -> str | None:
    """The instance key set by the innermost enclosing ``instance()`` block, if any."""
    return _current_instance.get()


class InstanceScope:
    """Sets the current instance for the duration of a ``with`` or ``async with`` block.

    Returned by ``Recorder.instance()`` and ``AsyncRecorder.instance()``. The key lives in a
    :class:`contextvars.ContextVar`, so it follows asyncio tasks created inside the block
    and threads started through ``contextvars.copy_context().run``; leaving the block
    restores the previous value. Blocks nest. Entering the value returns the key.
    """

    __slots__ = ("_tokens", "key")

    def __init__(self, key: str) -> None:
        self.key = check_key(key)
        self._tokens: list[Token[str | None]] = []

    def __enter__(self) -> str:
        self._tokens.append(_current_instance.set(self.key))
        return self.key

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        _current_instance.reset(self._tokens.pop())

    async def __aenter__(self) -> str:
        return self.__enter__()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.__exit__(exc_type, exc, tb)


def require_instance(slug: str) -> str:
    key = _current_instance.get()
    if key is None:
        raise NoInstance(
            f"step {slug!r} was called outside any instance: "
            f"wrap the call in `with rec.instance(key):`"
        )
    return key


# --------------------------------------------------------------------------- pure helpers


def check_name(value: str, what: str) -> str:
    """Validate an instance key or step slug (1-200 of ``[A-Za-z0-9._:-]``, alnum first)."""
    if not isinstance(value, str) or _NAME_RE.fullmatch(value) is None:
        raise ValueError(
            f"invalid {what} {value!r}: 1-200 characters of [A-Za-z0-9._:-], "
            f"starting with a letter or digit"
        )
    return value


def check_key(value: str, what: str = "instance key") -> str:
    """Validate an instance key: a name that may also hold ``+`` and ``~``."""
    if not isinstance(value, str) or _KEY_RE.fullmatch(value) is None:
        raise ValueError(
            f"invalid {what} {value!r}: 1-200 characters of [A-Za-z0-9._:+~-], "
            f"starting with a letter or digit"
        )
    return value


def check_labels(labels: Mapping[str, str] | None) -> dict[str, str] | None:
    """Validate instance labels (the service's limits): at most 32, keys 1-63 characters of
    ``[A-Za-z0-9._/-]``, values strings of at most 200 characters. A copy, or None for none."""
    if not labels:
        return None
    if len(labels) > MAX_LABELS:
        raise ValueError(f"{len(labels)} labels, over the limit of {MAX_LABELS}")
    for key, value in labels.items():
        if not isinstance(key, str) or _LABEL_KEY_RE.fullmatch(key) is None:
            raise ValueError(f"invalid label key {key!r}: 1-63 characters of [A-Za-z0-9._/-]")
        if not isinstance(value, str) or len(value) > MAX_LABEL_VALUE_CHARS:
            raise ValueError(
                f"invalid value of label {key!r}: a string of at most"
                f" {MAX_LABEL_VALUE_CHARS} characters"
            )
    return dict(labels)


def error_code_for(exc: BaseException) -> str:
    """The ``error_code`` for an exception: its class name made valid for the code format.

    Runs of characters outside ``[A-Za-z0-9._:-]`` become ``-``, leading characters that
    may not start a code are stripped, and the result is cut to 200 characters. A name
    with nothing usable left gives ``"Exception"``.
    """
    code = _CODE_INVALID_RE.sub("-", type(exc).__name__).lstrip("._:-")[:200]
    return code or "Exception"


def error_message_for(exc: BaseException) -> str | None:
    """The ``error_message`` for an exception: ``str(exc)`` made acceptable to the service.

    NUL characters become U+FFFD, lone surrogates become ``?``, and a text over 65536 bytes
    of UTF-8 is fitted by :func:`fit_message` (its head and its tail kept). Empty gives
    ``None``.
    """
    try:
        text = str(exc)
    except Exception:  # a broken __str__ must not hide the failure itself
        text = f"<unprintable {type(exc).__name__}>"
    text = text.replace("\x00", "\ufffd").encode("utf-8", "replace").decode("utf-8")
    return fit_message(text) or None


def fit_message(text: str) -> str:
    """``text`` within the service's 65536 bytes of UTF-8: as it is when it fits, else its
    head and its tail with a line in between saying how many bytes were cut.

    A traceback starts with where it began and ends with the exception itself, its most
    useful line, so both ends are kept: the first third of the room for the head, the rest
    for the tail. Cuts fall on character boundaries, so the result is valid UTF-8.
    """
    data = text.encode("utf-8")
    if len(data) <= MESSAGE_CAP:
        return text
    # The marker's length depends on the count it names, which depends on the marker's
    # length: a count of as many digits as the text's size is never shorter.
    room = MESSAGE_CAP - len(_cut_marker(len(data)).encode("utf-8"))
    head = data[: room // 3].decode("utf-8", "ignore").encode("utf-8")
    tail = data[len(data) - (room - len(head)) :].decode("utf-8", "ignore").encode("utf-8")
    marker = _cut_marker(len(data) - len(head) - len(tail))
    return head.decode("utf-8") + marker + tail.decode("utf-8")


def _cut_marker(cut: int) -> str:
    return f"\n[... {cut} bytes cut by steprecord_client to fit the 65536-byte limit ...]\n"


def next_attempt(record: Record | None) -> int:
    """The attempt a new run takes: 1 with no record, the count when pending, else +1."""
    if record is None:
        return 1
    count = int(record["attempt_count"])
    return count if record.get("status") == "pending" else count + 1


def memoised_output(record: Record) -> Any:
    """What a completed record gives back: its external URL if offloaded, else ``output``."""
    url = record.get("external_output_url")
    return url if url is not None else record.get("output")


def now() -> datetime:
    return datetime.now(UTC)


def timestamp(moment: datetime) -> str:
    """RFC 3339 in UTC with a ``Z`` suffix and microseconds."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def jsonb_text(value: Any) -> str:
    """Serialise an output like PostgreSQL prints ``jsonb`` (``", "`` and ``": "``).

    Raises :class:`TypeError` for a value that is not JSON and :class:`ValueError` for
    NaN/Infinity, a NUL character or a lone surrogate (the service refuses those).
    """
    text = json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(", ", ": "))
    if _NUL_ESCAPE_RE.search(text):
        raise ValueError("step output contains a NUL character, which the service refuses")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            "step output contains a lone surrogate, which the service refuses"
        ) from exc
    return text


def encode_body(body: Mapping[str, Any]) -> bytes:
    return json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def check_url(url: object) -> str:
    if not isinstance(url, str):
        raise TypeError(f"offload() must return the URL as a str, not {type(url).__name__}")
    if len(url) > URL_CAP or "\x00" in url or _URL_RE.fullmatch(url) is None:
        raise ValueError(
            f"offload() returned {url[:100]!r}: not a scheme:// URL of at most {URL_CAP} characters"
        )
    return url


RETRIED_STATUSES = frozenset({429, 503})


@dataclass(frozen=True, slots=True)
class Backoff:
    """Bounded exponential backoff for transport errors and 503 and 429 answers (the
    database out or busy; this token's share of the service's connections in use).

    Retry ``n`` (0-based) waits ``min(initial * 2**n, cap)`` seconds, or the answer's
    ``Retry-After`` when that is longer (still at most ``cap``). After ``max_retries``
    retries the last error or answer stands.
    """

    max_retries: int = 5
    initial: float = 0.2
    cap: float = 5.0

    def __post_init__(self) -> None:
        if self.max_retries < 0 or self.initial < 0 or self.cap < 0:
            raise ValueError("max_retries, backoff and max_backoff must not be negative")

    def delay(self, retry: int, response: httpx.Response | None) -> float | None:
        """Seconds to wait before retry number ``retry``, or ``None`` to stop.

        ``response`` is ``None`` after a transport error; an answer other than 503 or 429 is
        final (a 429 ran nothing, so sending it again is always safe).
        """
        if response is not None and response.status_code not in RETRIED_STATUSES:
            return None
        if retry >= self.max_retries:
            return None
        wait = min(self.initial * 2.0**retry, self.cap)
        if response is not None:
            with contextlib.suppress(ValueError):  # an HTTP-date is ignored
                wait = max(wait, min(float(response.headers.get("Retry-After", 0)), self.cap))
        return wait


@dataclass(frozen=True, slots=True)
class RetryBackoff:
    """The pause between a failed attempt of a ``retries=N`` step and its next attempt.

    Before the attempt that follows failure ``n`` (1 for the first failure) the step waits
    ``min(initial * 2**(n - 1), cap)`` seconds; with ``jitter`` a uniformly random time
    between half of that and all of it (so workers that failed together do not retry in
    step, and no pause collapses to nothing). ``initial=0`` retries back to back.
    """

    initial: float = 1.0
    cap: float = 30.0
    jitter: bool = True

    def __post_init__(self) -> None:
        for name in ("initial", "cap"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
                raise ValueError(f"retry backoff {name} must be a number >= 0, not {value!r}")

    def delay(self, failure: int) -> float:
        """Seconds to wait after failure number ``failure`` (1-based)."""
        wait: float = min(self.initial * 2.0 ** min(failure - 1, 64), self.cap)
        if self.jitter:
            wait = random.uniform(wait / 2, wait)
        return wait


NO_PAUSE: Final = RetryBackoff(0.0, 0.0, False)


def retry_backoff(
    default: RetryBackoff,
    initial: float | None = None,
    cap: float | None = None,
    jitter: bool | None = None,
) -> RetryBackoff:
    """``default`` with whichever of its fields are given replaced (and checked)."""
    return RetryBackoff(
        default.initial if initial is None else initial,
        default.cap if cap is None else cap,
        default.jitter if jitter is None else jitter,
    )


def problem_of(response: httpx.Response) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict):
        return body
    return {"status": response.status_code, "detail": response.text[:500]}


def error_for(response: httpx.Response) -> StepRecordError:
    problem = problem_of(response)
    if response.status_code == 409 and problem.get("code") == "stale_attempt":
        return StaleAttempt(response.status_code, problem)
    return StepRecordError(response.status_code, problem)


def expect_json(response: httpx.Response) -> Any:
    """The body of a 2xx answer; any other answer raises its :class:`StepRecordError`."""
    if not response.is_success:
        raise error_for(response)
    try:
        return response.json()
    except ValueError:
        raise StepRecordError(
            response.status_code, {"detail": "the service answered with a body that is not JSON"}
        ) from None


def record_or_none(response: httpx.Response) -> Record | None:
    """A record from a GET, or ``None`` for 404 ``instance_not_found``/``step_not_found``."""
    if response.status_code == 404:
        problem = problem_of(response)
        if problem.get("code") in ("instance_not_found", "step_not_found"):
            return None
    record: Record = expect_json(response)
    return record


def list_params(
    order: str, status: str | list[str] | tuple[str, ...] | None, limit: int, cursor: str | None
) -> dict[str, str]:
    if order not in ("ordinal", "started_at"):
        raise ValueError(f"order must be 'ordinal' or 'started_at', not {order!r}")
    if not 1 <= limit <= 1000:
        raise ValueError("page_size must be between 1 and 1000")
    params = {"order": order, "limit": str(limit)}
    if status is not None:
        params["status"] = status if isinstance(status, str) else ",".join(status)
    if cursor is not None:
        params["cursor"] = cursor
    return params


def reopen_request(key: str, slug: str, reason: str, attempt: int | None) -> Http:
    """``POST .../reopen`` (admin scope): a finished step made pending at its next attempt."""
    if not isinstance(reason, str) or not 1 <= len(reason) <= 500 or not reason.strip():
        raise ValueError("reason must say why, in 1 to 500 characters")
    body: dict[str, Any] = {"reason": reason}
    if attempt is not None:
        body["attempt"] = attempt
    return Http("POST", f"{step_path(key, slug)}/reopen", body)


def steps_path(key: str) -> str:
    return f"/v1/instances/{check_key(key)}/steps"


def step_path(key: str, slug: str) -> str:
    return f"{steps_path(key)}/{check_name(slug, 'step slug')}"


# --------------------------------------------------------------------------- the step flow


@dataclass(frozen=True, slots=True)
class Http:
    """Operation: send one request (with transport retries); the result is the response."""

    method: str
    path: str
    body: dict[str, Any] | None = None
    params: dict[str, str] | None = None


@dataclass(frozen=True, slots=True)
class Offload:
    """Operation: call ``offload(value)``; the result is the URL it returns."""

    value: Any


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """Keep attempt ``attempt``'s lease alive: ``lease_seconds`` from each heartbeat, sent
    every third of the lease while the callback runs."""

    path: str
    attempt: int
    lease_seconds: int

    @property
    def every(self) -> float:
        return self.lease_seconds / 3

    def request(self) -> Http:
        body = {"attempt": self.attempt, "lease_seconds": self.lease_seconds}
        return Http("POST", f"{self.path}/heartbeat", body)


def heartbeat_goes_on(response: httpx.Response | BaseException) -> bool:
    """Whether to keep sending heartbeats after this answer (or error).

    A 409 (the attempt was superseded, swept or finished) ends them: the worker's ``complete``
    or ``fail`` will then be told why. Anything else — a transport error that outlasted the
    retries, a 503 — is tried again at the next beat.
    """
    return not (isinstance(response, httpx.Response) and response.status_code == 409)


@contextlib.contextmanager
def heartbeats_in_thread(
    beat: Heartbeat | None, send: Callable[[Http], httpx.Response]
) -> Iterator[None]:
    """Send ``beat`` from a background thread until the block ends."""
    if beat is None:
        yield
        return
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(beat.every):
            try:
                answer: httpx.Response | BaseException = send(beat.request())
            except Exception as exc:
                answer = exc
            if not heartbeat_goes_on(answer):
                return

    thread = threading.Thread(target=run, name="steprecord-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


@contextlib.asynccontextmanager
async def heartbeats_in_task(
    beat: Heartbeat | None, send: Callable[[Http], Awaitable[httpx.Response]]
) -> AsyncIterator[None]:
    """Send ``beat`` from a background task until the block ends."""
    if beat is None:
        yield
        return

    async def run() -> None:
        while True:
            await asyncio.sleep(beat.every)
            try:
                answer: httpx.Response | BaseException = await send(beat.request())
            except Exception as exc:
                answer = exc
            if not heartbeat_goes_on(answer):
                return

    task = asyncio.create_task(run())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@dataclass(frozen=True, slots=True)
class Invoke:
    """Operation: run the callback (sending ``heartbeat`` meanwhile, if any); the result is
    its return value (or it is thrown in)."""

    heartbeat: Heartbeat | None = None


@dataclass(frozen=True, slots=True)
class Pause:
    """Operation: wait ``seconds`` (between a failed attempt and the next)."""

    seconds: float


Op = Http | Offload | Invoke | Pause
Flow = Generator[Op, Any, Any]


def _report_fail(path: str, attempt: int, started: datetime, exc: BaseException) -> Flow:
    body = {
        "attempt": attempt,
        "started_at": timestamp(started),
        "completed_at": timestamp(max(now(), started)),
        "error_code": error_code_for(exc),
        "error_message": error_message_for(exc),
    }
    expect_json((yield Http("POST", f"{path}/fail", body)))


def _check_owned(record: Record, attempt: int, started: datetime) -> None:
    """Refuse to run when the ``start`` answer shows another worker holds this attempt.

    A ``start`` for an attempt that another worker already started (or finished) is a
    replay to the service (200, unchanged); only the record's ``started_at`` and status
    tell the two workers apart.
    """
    try:
        mine = (
            record.get("status") == "running"
            and record.get("attempt_count") == attempt
            and datetime.fromisoformat(record["started_at"]) == started
        )
    except (KeyError, TypeError, ValueError):
        mine = False
    if not mine:
        raise StaleAttempt(
            409,
            {
                "type": "about:blank",
                "title": "Attempt already taken",
                "status": 409,
                "code": "stale_attempt",
                "detail": f"attempt {attempt} was already started or finished by another worker",
                "current": record,
            },
        )


def _output_fields(value: Any, has_offload: bool) -> Flow:
    text = jsonb_text(value)
    if has_offload:
        url = yield Offload(value)
        return {"external_output_url": check_url(url)}
    size = len(text.encode("utf-8"))
    if size > OUTPUT_CAP:
        raise ValueError(
            f"step output is {size} bytes of JSON, over the {OUTPUT_CAP}-byte inline cap; "
            f"give the recorder an offload= callable to store large outputs elsewhere"
        )
    return {} if value is None else {"output": value}


def step_flow(
    key: str,
    slug: str,
    retries: int,
    has_offload: bool,
    lease_seconds: int | None = None,
    pause: RetryBackoff = NO_PAUSE,
    labels: Mapping[str, str] | None = None,
) -> Flow:
    """The life of one call of a wrapped step (see the README); returns what the call returns.

    1. Read the record once. ``completed``: return its external URL or its output.
    2. Otherwise take the next attempt (see :func:`next_attempt`) and, per attempt,
       report ``start`` with explicit ``attempt`` and ``started_at`` (and ``lease_seconds``
       when given, and the recorder's ``labels``, which the service merges into the
       instance's); a :class:`StaleAttempt` here means the callback is not run.
    3. Run the callback, with heartbeats every third of the lease while it runs when
       ``lease_seconds`` is given. If it raises an :class:`Exception`, report ``fail`` and, while
       retries remain, wait as ``pause`` says and go again with attempt + 1; else re-raise
       the same exception object.
       (A :class:`BaseException` such as ``KeyboardInterrupt`` or ``CancelledError``
       propagates at once and reports nothing: the record stays ``running``, like a crash.)
    4. Prepare the output: it must be JSON; offloaded when the recorder has ``offload``,
       else at most 1 MiB. A failure here (``TypeError``/``ValueError``, or an exception
       from ``offload``) reports ``fail`` for the attempt and is raised, without retries:
       ``complete`` is never sent for it.
    5. Report ``complete``; if the service refuses the output itself (413/422), report
       ``fail`` with that :class:`StepRecordError` and raise it. Return the callback's value.

    When a report fails after an exception was caught, the report's error is raised and the
    original exception is its ``__context__``.
    """
    path = step_path(key, slug)
    record = record_or_none((yield Http("GET", path)))
    if record is not None and record.get("status") == "completed":
        return memoised_output(record)
    attempt = next_attempt(record)
    for round_ in range(retries + 1):
        started = now()
        start: dict[str, Any] = {"attempt": attempt, "started_at": timestamp(started)}
        if labels:
            start["labels"] = dict(labels)
        beat = None
        if lease_seconds is not None:
            start["lease_seconds"] = lease_seconds
            beat = Heartbeat(path, attempt, lease_seconds)
        _check_owned(expect_json((yield Http("POST", f"{path}/start", start))), attempt, started)
        try:
            value = yield Invoke(beat)
        except Exception as exc:
            yield from _report_fail(path, attempt, started, exc)
            if round_ < retries:
                wait = pause.delay(round_ + 1)
                if wait > 0:
                    yield Pause(wait)
                attempt += 1
                continue
            raise
        try:
            fields = yield from _output_fields(value, has_offload)
        except Exception as exc:
            yield from _report_fail(path, attempt, started, exc)
            raise
        body = {
            "attempt": attempt,
            "started_at": timestamp(started),
            "completed_at": timestamp(max(now(), started)),
            **fields,
        }
        try:
            expect_json((yield Http("POST", f"{path}/complete", body)))
        except StepRecordError as exc:
            if exc.status in (413, 422):
                yield from _report_fail(path, attempt, started, exc)
            raise
        return value
    raise AssertionError("unreachable")  # pragma: no cover


def drive_sync(
    flow: Flow,
    send: Callable[[Http], httpx.Response],
    invoke: Callable[[], Any],
    offload: Callable[[Any], Any] | None,
) -> Any:
    """Run ``flow`` to its end with blocking operations; return its value."""
    result: Any = None
    error: BaseException | None = None
    try:
        while True:
            try:
                op = flow.send(result) if error is None else flow.throw(error)
            except StopIteration as stop:
                return stop.value
            result, error = None, None
            try:
                if isinstance(op, Http):
                    result = send(op)
                elif isinstance(op, Offload):
                    assert offload is not None
                    result = offload(op.value)
                    if inspect.isawaitable(result):
                        if inspect.iscoroutine(result):
                            result.close()
                        raise TypeError(
                            "offload() returned an awaitable: use a plain function with "
                            "Recorder, or use AsyncRecorder"
                        )
                elif isinstance(op, Pause):
                    time.sleep(op.seconds)
                else:
                    with heartbeats_in_thread(op.heartbeat, send):
                        result = invoke()
            except BaseException as exc:  # handed to the flow, which decides
                error = exc
    finally:
        flow.close()
        del error


async def drive_async(
    flow: Flow,
    send: Callable[[Http], Awaitable[httpx.Response]],
    invoke: Callable[[], Awaitable[Any]],
    offload: Callable[[Any], Any] | None,
) -> Any:
    """Run ``flow`` to its end with awaitable operations; return its value.

    ``offload`` may be a plain function or return an awaitable (e.g. an ``async def``).
    """
    result: Any = None
    error: BaseException | None = None
    try:
        while True:
            try:
                op = flow.send(result) if error is None else flow.throw(error)
            except StopIteration as stop:
                return stop.value
            result, error = None, None
            try:
                if isinstance(op, Http):
                    result = await send(op)
                elif isinstance(op, Offload):
                    assert offload is not None
                    result = offload(op.value)
                    if inspect.isawaitable(result):
                        result = await result
                elif isinstance(op, Pause):
                    await asyncio.sleep(op.seconds)
                else:
                    async with heartbeats_in_task(op.heartbeat, send):
                        result = await invoke()
            except BaseException as exc:  # handed to the flow, which decides
                error = exc
    finally:
        flow.close()
        del error


def check_lease(lease_seconds: int | None) -> int | None:
    if lease_seconds is None:
        return None
    if (
        isinstance(lease_seconds, bool)
        or not isinstance(lease_seconds, int)
        or not 1 <= lease_seconds <= LEASE_CAP
    ):
        raise ValueError(
            f"lease_seconds must be an int from 1 to {LEASE_CAP}, not {lease_seconds!r}"
        )
    return lease_seconds


def check_retries(retries: int) -> int:
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise ValueError(f"retries must be a non-negative int, not {retries!r}")
    return retries


def headers(token: str | None) -> dict[str, str]:
    result = {"Accept": "application/json", "User-Agent": f"steprecord-client/{__version__}"}
    if token is not None:
        result["Authorization"] = f"Bearer {token}"
    return result


def request_kwargs(op: Http) -> dict[str, Any]:
    """httpx's arguments for ``op``; with OpenTelemetry's API installed, the headers carry the
    current trace context (W3C ``traceparent``, through the configured propagators), so the
    service's spans join the caller's trace and the attempt a ``start`` begins keeps its id."""
    kwargs: dict[str, Any] = {"params": op.params}
    headers: dict[str, str] = {}
    if op.body is not None:
        kwargs["content"] = encode_body(op.body)
        headers["Content-Type"] = "application/json"
    if TRACE_CONTEXT:
        otel_propagate.inject(headers)  # nothing when no span is current
    if headers:
        kwargs["headers"] = headers
    return kwargs


@contextlib.contextmanager
def carried_trace(get: Callable[[str], object]) -> Iterator[None]:
    """While no span is current: the trace context that ``get`` finds (a message's W3C headers,
    by name) is made current, so the requests sent meanwhile carry it. A current span, or no
    OpenTelemetry API, leaves everything as it is."""
    if not TRACE_CONTEXT or otel_trace.get_current_span().get_span_context().is_valid:
        yield
        return
    carrier = {}
    for name in otel_propagate.get_global_textmap().fields:
        value = get(name)
        if isinstance(value, str):
            carrier[name] = value
    token = otel_context.attach(otel_propagate.extract(carrier))
    try:
        yield
    finally:
        otel_context.detach(token)


def make_async_wrapper(
    fn: Callable[..., Any],
    slug: str,
    retries: int,
    send: Callable[[Http], Awaitable[httpx.Response]],
    offload: Callable[[Any], Any] | None,
    lease_seconds: int | None = None,
    pause: RetryBackoff = NO_PAUSE,
    labels: Mapping[str, str] | None = None,
) -> Callable[..., Coroutine[Any, Any, Any]]:
    """Wrap ``fn`` (``async def`` or plain) into a coroutine function running :func:`step_flow`.

    A plain function runs in a worker thread (:func:`asyncio.to_thread`, which carries the
    context along). Each call runs in its own task, hence in its own copy of the context.
    """
    is_coroutine = inspect.iscoroutinefunction(fn)

    async def invoke_plain(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        result = await asyncio.to_thread(fn, *args, **kwargs)
        return await result if inspect.isawaitable(result) else result

    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        key = require_instance(slug)
        if is_coroutine:
            invoke: Callable[[], Awaitable[Any]] = lambda: fn(*args, **kwargs)  # noqa: E731
        else:
            invoke = lambda: invoke_plain(args, kwargs)  # noqa: E731
        flow = step_flow(key, slug, retries, offload is not None, lease_seconds, pause, labels)
        return await asyncio.create_task(drive_async(flow, send, invoke, offload))

    return wrapper
