"""The sweeper: every few seconds, fail the running attempts whose lease expired.

Every worker of every service instance runs one; the statement skips records another
sweeper holds, so each expired lease is swept exactly once. An error (the database down, a
bug) is logged and the next round tries again: the sweeper never stops by itself.
"""

import asyncio
import logging

from ..core.db import Pool
from ..data import leases
from . import observe

log = logging.getLogger("steprecord.sweeper")


async def sweep_once(pool: Pool) -> int:
    async with pool.connection() as conn:
        swept = await leases.sweep_expired(conn)
    if swept:
        observe.count_event("fail", "swept", swept)
        log.info("swept %d expired leases", swept)
    return swept


async def keep_sweeping(pool: Pool, every: float) -> None:
    while True:
        await asyncio.sleep(every)
        try:
            await sweep_once(pool)
        except Exception:
            log.exception("sweep failed; trying again in %s s", every)
