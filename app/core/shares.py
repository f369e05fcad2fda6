"""Each client's share of a worker's database pool, so that no one token, and no one tenant,
can take every connection (`STEPRECORD_POOL_SHARE_PER_TOKEN`,
`STEPRECORD_POOL_SHARE_PER_TENANT`, `STEPRECORD_POOL_RESERVE`).

A request's principal is its token (a dashboard session counts as its token; anonymous access
is one principal) and, for a token with a key prefix, its tenant: every token of that prefix
together. The access check (app/gate.py) sets it for the rest of the request. A token holds
at most its share of a pool's connections at once, and the tokens of one tenant together at
most the tenant's share; a request beyond either waits for one of them briefly (the pool's
timeout), then answers 429 `token_busy` with `Retry-After`, while other principals' requests
take the rest of the pool.

The last `STEPRECORD_POOL_RESERVE` free connections of a pool go only to a request whose
token and tenant hold none: so two busy tokens (or tenants) whose shares add up to the whole
pool still leave a connection for a third, which then waits no longer than one statement.

Work that is no request's (the sweeper, pruning and retention, the token reload, the
live-update listener) has no principal and no share: it takes connections, the reserve
included, as before.
"""

import asyncio
from contextvars import ContextVar
from dataclasses import dataclass

ANONYMOUS = "anonymous"


@dataclass(frozen=True, slots=True)
class Principal:
    """Whose request it is: its token, and its tenant (None: a token reaching every
    instance, or anonymous access)."""

    token: str
    tenant: str | None = None


# Whose request this task serves; None: no request's (exempt from shares).
PRINCIPAL: ContextVar[Principal | None] = ContextVar("steprecord_principal", default=None)


def principal_of(token_id: int | None, key_prefix: str | None = None) -> Principal:
    """The principal of a request let in with this token (None: anonymous) and its prefix."""
    token = ANONYMOUS if token_id is None else f"token {token_id}"
    return Principal(token, None if key_prefix is None else f"tenant {key_prefix}")


def default_share(pool_size: int) -> int:
    """Half the pool, at least one connection."""
    return max(1, pool_size // 2)


def default_reserve(pool_size: int) -> int:
    """A fifth of the pool, at least one connection, while the pool has two or more."""
    return 0 if pool_size < 2 else max(1, pool_size // 5)


class Share:
    """One principal's part of a pool (a token's or a tenant's): `size` slots, how many hold
    an open connection, and how many hold a slot of the pool itself."""

    __slots__ = ("connected", "key", "pooled", "size", "slots", "users")

    def __init__(self, key: str, size: int) -> None:
        self.key = key
        self.size = size
        self.slots = asyncio.Semaphore(size)
        self.users = 0  # holding or waiting: the share is forgotten when none is left
        self.connected = 0  # holding a connection (not still waiting for one, or opening it)
        self.pooled = 0  # holding a slot of the pool (the reserve is for shares holding none)

    @property
    def saturated(self) -> bool:
        """Every slot holds a connection: the principal keeps them busy, the database is not
        the cause (a slot still opening a connection, or waiting for the pool, would be)."""
        return self.connected >= self.size


class Shares:
    """The shares of one pool, by token and by tenant."""

    def __init__(self, size: int, tenant_size: int) -> None:
        self.size = size
        self.tenant_size = tenant_size
        self._by_key: dict[str, Share] = {}

    def of(self, key: str, size: int) -> Share:
        """The share named `key` (`size` slots when new), counted as used until `leave`."""
        share = self._by_key.get(key)
        if share is None:
            share = self._by_key[key] = Share(key, size)
        share.users += 1
        return share

    def leave(self, share: Share) -> None:
        share.users -= 1
        if share.users == 0:
            del self._by_key[share.key]

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
