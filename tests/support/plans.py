"""Query plans on one node and on Citus: the shard a plan test loads, the shards' plans."""

from dataclasses import dataclass
from typing import Any

import psycopg

from tests.support.rows import Conn


@dataclass(frozen=True)
class OneShard:
    """Where a plan test loads its instances so that one shard holds as many rows as one
    node's table would: on Citus the hashes of the instances' first shard (Citus hashes a
    bigint with `hashint8`), the number of shards, and that shard's table; on one node every
    hash, one "shard" and the table itself."""

    low: int
    high: int
    shards: int
    table: str


def one_shard(conn: psycopg.Connection[Any]) -> OneShard:
    """The first shard of the instances on Citus (see `OneShard`), or the whole table."""
    citus = conn.execute("SELECT 1 FROM pg_extension WHERE extname = 'citus'").fetchone()
    if citus is None:
        return OneShard(-(2**31), 2**31 - 1, 1, "process_instance")
    row = conn.execute(
        "SELECT shardminvalue::int, shardmaxvalue::int, count(*) OVER (),"
        " 'process_instance_' || shardid"
        " FROM pg_dist_shard WHERE logicalrelid = 'process_instance'::regclass"
        " ORDER BY shardminvalue::int LIMIT 1"
    ).fetchone()
    assert row is not None
    return OneShard(*row)


def task_plans(text: str) -> str:
    """The shards' part of an EXPLAIN's text: on Citus the plan of each task shown (the lines
    under a `->  Task`) that reads a shard, without the coordinator's merge of the shards' rows
    above it (a Sort there orders what the shards sent, it sorts no shard) nor a task that
    merges the results of a statement's parts (branches Citus ran as subplans of their own,
    each read under its LIMIT: `read_intermediate_result`); on one server the whole plan."""
    if "Custom Scan (Citus" not in text:
        return text
    tasks: list[list[str]] = []
    task_indent: int | None = None
    for line in text.splitlines():
        indent = len(line) - len(line.lstrip())
        if task_indent is not None and indent <= task_indent:
            task_indent = None
        if line.lstrip().startswith("->  Task"):
            task_indent = indent
            tasks.append([])
        elif task_indent is not None:
            tasks[-1].append(line)
    kept = [
        line
        for task in tasks
        if not any("read_intermediate_result" in line for line in task)
        for line in task
    ]
    assert kept, text
    return "\n".join(kept)


def plan(db: Conn, sql: str, params: dict[str, Any]) -> str:
    """The text of `EXPLAIN sql`."""
    rows = db.execute("EXPLAIN " + sql, params).fetchall()
    return "\n".join(str(r[0]) for r in rows)
