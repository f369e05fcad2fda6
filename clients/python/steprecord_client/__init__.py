"""Python client for steprecord: durable, memoised workflow steps recorded over HTTP.

::

    from steprecord_client import Recorder

    rec = Recorder("http://127.0.0.1:8000", token=None)

    @rec.step("charge", retries=2)
    def charge(amount: int) -> dict[str, str]: ...

    with rec.instance("order-123"):
        charge(10)          # runs once; after a crash, a re-run returns the recorded output

:class:`Recorder` uses blocking I/O, :class:`AsyncRecorder` asyncio. Errors from the service
are :class:`StepRecordError` (with ``status``, ``code`` and the ``problem`` dict);
:class:`StaleAttempt` means a newer attempt superseded this worker; :class:`NoInstance`
means a step was called outside ``rec.instance(...)``.
"""

from ._async import AsyncRecorder
from ._core import (
    InstanceScope,
    NoInstance,
    Record,
    StaleAttempt,
    StepRecordError,
    __version__,
    current_instance,
    fit_message,
)
from ._sync import Recorder

__all__ = [
    "AsyncRecorder",
    "InstanceScope",
    "NoInstance",
    "Record",
    "Recorder",
    "StaleAttempt",
    "StepRecordError",
    "__version__",
    "current_instance",
    "fit_message",
]
