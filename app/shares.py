"""Each principal's share of a worker's database pool, so that no one token can take every
connection (`STEPRECORD_POOL_SHARE_PER_TOKEN`).

A request's principal is its token (a dashboard session counts as its token; anonymous access
is one principal), set by the access check (app/access.py) for the rest of the request. A
principal holds at most its share of a pool's connections at once; its next request waits
for one of them briefly (the pool's timeout), then answers 429 `token_busy` with
`Retry-After`, while other principals' requests take the rest of the pool. Work that is no
request's (the sweeper, pruning and retention, the token reload, the live-update listener)
has no principal and no share: it takes connections as before.
"""

import asyncio
from contextvars import ContextVar

# Whose request this task serves; None: no request's (exempt from shares).
PRINCIPAL: ContextVar[str | None] = ContextVar("steprecord_principal", default=None)
ANONYMOUS = "anonymous"


def principal_of(token_id: int | None) -> str:
    """The principal of a request let in with this token (None: anonymous)."""
    return ANONYMOUS if token_id is None else f"token {token_id}"


def default_share(pool_size: int) -> int:
    """Half the pool, at least one connection."""
    return max(1, pool_size // 2)


class Share:
    """One principal's part of a pool: `size` slots, and how many hold an open connection."""

    __slots__ = ("connected", "principal", "size", "slots", "users")

    def __init__(self, principal: str, size: int) -> None:
        self.principal = principal
        self.size = size
        self.slots = asyncio.Semaphore(size)
        self.users = 0  # holding or waiting: the share is forgotten when none is left
        self.connected = 0  # holding a connection (not still waiting for one, or opening it)

    @property
    def saturated(self) -> bool:
        """Every slot holds a connection: the principal keeps them busy, the database is not
        the cause (a slot still opening a connection, or waiting for the pool, would be)."""
        return self.connected >= self.size


class Shares:
    """The shares of one pool, by principal."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._by_principal: dict[str, Share] = {}

    def of(self, principal: str) -> Share:
        """The principal's share, counted as used until `leave`."""
        share = self._by_principal.get(principal)
        if share is None:
            share = self._by_principal[principal] = Share(principal, self.size)
        share.users += 1
        return share

    def leave(self, share: Share) -> None:
        share.users -= 1
        if share.users == 0:
            del self._by_principal[share.principal]

    @staticmethod
    async def take(share: Share, wait: float) -> bool:
        """A slot of the share: at once when one is free, else within `wait` seconds; False
        when none came free (`wait` 0: none free now)."""
        if not share.slots.locked():
            await share.slots.acquire()  # without yielding
            return True
        if wait <= 0:
            return False
        try:
            await asyncio.wait_for(share.slots.acquire(), wait)
        except TimeoutError:
            return False
        return True
