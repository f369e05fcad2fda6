"""On Citus, each instance's node: the service sends an instance's events and heartbeats straight
to the node that holds it, so the coordinator leaves the write path.

`Nodes` keeps the coordinator's shard map (the node holding each shard of the instances, read
again every `refresh` seconds), each key's shard (asked of the coordinator once per key, for
the most recent `KEYS` keys), and a pool per node, opened on first use with the primary's
credentials and database (Citus's own requirement of its nodes). Every node holds Citus's
metadata, so a map gone stale (a shard moved since it was read) is still correct: the node
that no longer holds the shard runs the call's statements where the shard is now, only slower.
A node this service cannot reach (a network that lets only the coordinator through) is left
out for a minute at a time: its instances' calls go to the coordinator, which delegates them.
Without Citus there is no `Nodes`: everything goes to the primary.
"""

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable

import psycopg

from ..core.db import NODE_UNREACHABLE, DatabaseUnavailable, Pool
from ..data import placement

log = logging.getLogger("steprecord.nodes")

KEYS = 100_000  # instance keys whose shard is kept
UNREACHABLE_SECONDS = 60.0  # how long a node this service could not reach is left out

Node = tuple[str, int]  # host, port


class Nodes:
    def __init__(self, primary: Pool, make_pool: Callable[[str, str], Pool], refresh: float):
        self._primary = primary
        self._make_pool = make_pool
        self._refresh = refresh
        self._map: dict[int, Node] = {}
        self._shards: OrderedDict[str, int] = OrderedDict()
        self._pools: dict[Node, Pool] = {}
        self._unreachable: dict[Node, float] = {}

    async def load(self) -> None:
        """Read the shard map; forget the keys' shards when the shards themselves changed (a
        table distributed again with another shard count)."""
        async with self._primary.connection(name="shard_nodes") as conn:
            found = await placement.shard_nodes(conn)
        if found.keys() != self._map.keys():
            self._shards.clear()
        self._map = found

    async def keep_loading(self) -> None:
        while True:
            await asyncio.sleep(self._refresh)
            try:
                await self.load()
            except DatabaseUnavailable as exc:
                log.warning("the shard map was not read again: %s", exc)

    async def pools_of(self, keys: list[str]) -> list[Pool]:
        """The pool to send each key's calls to: its node's, else the primary's."""
        return [pool for pool, _ in await self.places_of(keys)]

    async def places_of(self, keys: list[str]) -> list[tuple[Pool, int | None]]:
        """Each key's pool (its node's, else the primary's) and shard (None: not known, or the
        primary's pool)."""
        missing = [key for key in dict.fromkeys(keys) if key not in self._shards]
        if missing:
            try:
                async with self._primary.connection(name="shards_of") as conn:
                    shards = await placement.shards_of(conn, missing)
            except DatabaseUnavailable:
                return [(self._primary, None)] * len(keys)
            for key, shard in zip(missing, shards, strict=True):
                self._shards[key] = shard
            while len(self._shards) > KEYS:
                self._shards.popitem(last=False)
        places = []
        for key in keys:
            known = self._shards.get(key)
            if known is not None:
                self._shards.move_to_end(key)
            node = None if known is None else self._map.get(known)
            pool = self._primary if node is None else await self._pool(node)
            # The shard only with its node's pool: the node `DATABASE_URL` names, standing in
            # for one it does not know or cannot reach, holds no copy of the judge for it.
            places.append((pool, None if pool is self._primary else known))
        return places

    async def _pool(self, node: Node) -> Pool:
        pool = self._pools.get(node)
        if pool is not None:
            return pool
        if time.monotonic() < self._unreachable.get(node, 0.0):
            return self._primary
        host, port = node
        pool = self._make_pool(
            psycopg.conninfo.make_conninfo(self._primary.conninfo, host=host, port=port),
            f"node {host}:{port}",
        )
        pool.unreachable = NODE_UNREACHABLE
        try:  # reachable from here at all: else the coordinator serves its instances
            async with pool.connection(name="node_check") as conn:
                await conn.execute("SELECT 1")
        except DatabaseUnavailable as exc:
            log.warning("Citus node %s:%s cannot be reached from here: %s", host, port, exc)
            self._unreachable[node] = time.monotonic() + UNREACHABLE_SECONDS
            await pool.close()
            return self._primary
        kept = self._pools.setdefault(node, pool)  # another request may have opened one
        if kept is not pool:
            await pool.close()
        return kept

    async def close(self) -> None:
        for pool in self._pools.values():
            await pool.close()
