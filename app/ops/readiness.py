"""Readiness: one check of the primary per worker, shared by every `/readyz` of that second.

A check takes a connection of the primary's pool and reads the schema revision. Were each
`/readyz` to run its own, a flood of them (it needs no token) would hold the pool the writes
need. Instead concurrent callers await the same check in flight, and its result (the
revision, or the database being unavailable) answers every caller for `MAX_AGE` seconds from
when the check began (on the monotonic clock): at most about one check per second per worker,
and an outage or a recovery shows within a second.
"""

import asyncio
import time
from dataclasses import dataclass

from ..core.db import DatabaseUnavailable, Pool
from ..data import revision
from . import observe

MAX_AGE = 1.0


@dataclass(frozen=True, slots=True)
class Outcome:
    """What a check found: the revision (None: never migrated), or why it could not tell."""

    began: float
    revision: str | None = None
    unavailable: DatabaseUnavailable | None = None


class Readiness:
    def __init__(self, pool: Pool) -> None:
        self._pool = pool
        self._last: Outcome | None = None
        self._in_flight: asyncio.Future[Outcome] | None = None

    async def schema_revision(self) -> str | None:
        """The database's schema revision as a check at most `MAX_AGE` s old found it; raises
        `DatabaseUnavailable` (a new one each time) when that check could not reach it."""
        outcome = await self._outcome()
        if outcome.unavailable is not None:
            cause = outcome.unavailable
            raise DatabaseUnavailable(str(cause), cause.public)
        return outcome.revision

    async def _outcome(self) -> Outcome:
        last = self._last
        if last is not None and time.monotonic() - last.began < MAX_AGE:
            return last
        if self._in_flight is None:
            self._in_flight = asyncio.ensure_future(self._check())
        # Shielded: a caller that goes away does not cancel the check the others await.
        return await asyncio.shield(self._in_flight)

    async def _check(self) -> Outcome:
        began = time.monotonic()
        observe.READINESS_CHECKS.inc()
        try:
            async with self._pool.connection(name=revision.schema_revision) as conn:
                outcome = Outcome(began, revision=await revision.schema_revision(conn))
        except DatabaseUnavailable as exc:
            outcome = Outcome(began, unavailable=exc)
        finally:
            self._in_flight = None
        self._last = outcome
        return outcome
