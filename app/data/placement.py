"""Where each instance lives on Citus: the coordinator's shard map, and an instance key's shard.

Both are Citus's own answers, asked of the coordinator: the node holding each shard of
`process_instance` (the instance's co-located shards live there too), and the shard of a key
as Citus computes it (`get_shard_id_for_distribution_column` on the key's id), so nothing of
Citus's hashing is repeated here.
"""

from app.db import AsyncConn

HAS_CITUS = "SELECT EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'citus') AS citus"

# Each shard of the instances, with the node that holds it (its active primary placement).
SHARD_NODES = """
SELECT p.shardid AS shard, n.nodename AS host, n.nodeport AS port
FROM pg_dist_shard s
JOIN pg_dist_placement p ON p.shardid = s.shardid
JOIN pg_dist_node n ON n.groupid = p.groupid
WHERE s.logicalrelid = 'process_instance'::regclass
  AND n.isactive AND n.noderole = 'primary' AND p.shardstate = 1
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


async def shard_nodes(conn: AsyncConn) -> dict[int, tuple[str, int]]:
    """The node (host, port) holding each shard of the instances."""
    cur = await conn.execute(SHARD_NODES)
    return {int(r["shard"]): (str(r["host"]), int(r["port"])) for r in await cur.fetchall()}


async def shards_of(conn: AsyncConn, keys: list[str]) -> list[int]:
    """Each key's shard, in order."""
    cur = await conn.execute(SHARDS_OF_KEYS, (keys,), prepare=False)
    return [int(row["shard"]) for row in await cur.fetchall()]
