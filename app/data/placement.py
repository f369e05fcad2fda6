"""Where each instance lives on Citus: the coordinator's shard map, and an instance key's shard.

Both are Citus's own answers, asked of the coordinator: the node holding each shard of
`process_instance` (the instance's co-located shards live there too), and the shard of a key
as Citus computes it (`get_shard_id_for_distribution_column` on the key's id), so nothing of
Citus's hashing is repeated here.

And how each of the service's connections to a Citus node reads many shards (`configure`,
run once on every new connection): over the one connection the node keeps to each worker,
shard after shard, not over connections opened for the statement. A list across instances
asks every shard for a page's rows (a few index reads each): opening up to 16 connections to
each worker for it, each a new backend that plans its first statements cold, cost the
cluster 3-4 times the list itself (docs/scaling.md, "Citus: how the reads run"). The
operator's own `citus.max_adaptive_executor_pool_size` (for the database, a role, or the
server) is left as it is.
"""

from weakref import WeakKeyDictionary

from ..core.db import AsyncConn

HAS_CITUS = "SELECT EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'citus') AS citus"
# Whether the database has Citus, and whether no one set how many connections a statement
# may open to each worker (so the service may choose).
SESSION = """
SELECT EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'citus') AS citus,
       coalesce((SELECT source = 'default' FROM pg_settings
                 WHERE name = 'citus.max_adaptive_executor_pool_size'), false) AS unset
"""
SHARDS_OVER_KEPT_CONNECTIONS = "SET citus.max_adaptive_executor_pool_size = 1"

# Each shard of the instances, with the node that holds it (its active primary placement).
SHARD_NODES = """
SELECT p.shardid AS shard, n.nodename AS host, n.nodeport AS port
FROM pg_dist_shard s
JOIN pg_dist_placement p ON p.shardid = s.shardid
JOIN pg_dist_node n ON n.groupid = p.groupid
WHERE s.logicalrelid = 'process_instance'::regclass
  AND n.isactive AND n.noderole = 'primary' AND p.shardstate = 1
"""

# When the node asked is a Citus worker, its coordinator (every node has Citus's metadata):
# where the schema's own tables are, its revision and the tokens. No row on the coordinator
# or one node; a row without a host on a worker whose metadata names no coordinator yet.
COORDINATOR = """
SELECT n.nodename AS host, n.nodeport AS port
FROM pg_dist_local_group l
LEFT JOIN pg_dist_node n ON n.groupid = 0 AND n.noderole = 'primary'
WHERE l.groupid <> 0
"""

# The shard of each key, in order.
SHARDS_OF_KEYS = """
SELECT get_shard_id_for_distribution_column('process_instance', steprecord_instance_id(k))
       AS shard
FROM unnest(%s::text[]) WITH ORDINALITY AS u(k, n)
ORDER BY n
"""


async def has_citus(conn: AsyncConn) -> bool:
    row = await (await conn.execute(HAS_CITUS)).fetchone()
    return bool(row and row["citus"])


# Whether each connection's database has Citus, asked once per connection.
_CITUS: WeakKeyDictionary[AsyncConn, bool] = WeakKeyDictionary()


async def configure(conn: AsyncConn) -> None:
    """A new connection's session on a Citus node reads a statement's shards over the
    connections it keeps to the workers (see above); nothing changes on one node."""
    row = await (await conn.execute(SESSION)).fetchone()
    _CITUS[conn] = citus = bool(row and row["citus"])
    if citus and row and row["unset"]:
        await conn.execute(SHARDS_OVER_KEPT_CONNECTIONS)


async def is_citus(conn: AsyncConn) -> bool:
    """Whether the connection's database has Citus (asked once per connection)."""
    citus = _CITUS.get(conn)
    if citus is None:
        citus = _CITUS[conn] = await has_citus(conn)
    return citus


async def coordinator(conn: AsyncConn) -> tuple[str, int] | None:
    """The Citus coordinator (host, port) when `conn` is to a worker; None otherwise."""
    if not await is_citus(conn):
        return None
    row = await (await conn.execute(COORDINATOR)).fetchone()
    if row is None or row["host"] is None:
        return None
    return str(row["host"]), int(row["port"])


async def shard_nodes(conn: AsyncConn) -> dict[int, tuple[str, int]]:
    """The node (host, port) holding each shard of the instances."""
    cur = await conn.execute(SHARD_NODES)
    return {int(r["shard"]): (str(r["host"]), int(r["port"])) for r in await cur.fetchall()}


async def shards_of(conn: AsyncConn, keys: list[str]) -> list[int]:
    """Each key's shard, in order."""
    cur = await conn.execute(SHARDS_OF_KEYS, (keys,), prepare=False)
    return [int(row["shard"]) for row in await cur.fetchall()]
