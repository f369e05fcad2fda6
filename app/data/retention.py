"""Deleting instances: one on request (`DELETE /v1/instances/{key}`), or every instance last
written before a cutoff (`steprecord prune`, `STEPRECORD_RETENTION`).

An instance goes with its records, in the same statement, and their history and its repair
log follow them by `ON DELETE CASCADE`.
"""

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from app.data.common import RECORD
from app.data.reads import ATTEMPT, THE_INSTANCE
from app.db import AsyncConn
from app.domain import InstanceNotFound

# Lock, then judge: two statements in one transaction. The first locks the instance (FOR
# UPDATE: a writer creating a step of it waits from then on, and then finds it gone); the
# second, whose snapshot is taken after that lock was granted, sees every step committed
# before it, also one created by a writer that held the instance's lock while the first
# waited (one statement that locked and judged would judge on its own older snapshot, miss
# that step, and then fail on it, or delete it unjudged). The second locks the records too (in
# id order: a writer updating one finishes first, and the check of what is running reads the
# newest versions). Without `force` an instance with a running step stays; with it, it goes
# regardless.
#
# On Citus each statement names the instance's id, so it runs on the one worker that holds the
# instance. The notification is a statement of its own, after the deletion: it runs on the
# node the service listens on (inside a statement routed to a worker, it would be sent there).
LOCK_INSTANCE = f"""
SELECT p.id FROM process_instance p WHERE {THE_INSTANCE} FOR UPDATE
"""
DELETE_LOCKED = """
WITH records AS (
    SELECT r.status FROM workflow_step_record r WHERE r.instance_id = %(id)s
    ORDER BY r.id
    FOR UPDATE OF r
),
repairs AS (
    SELECT count(*) AS n FROM workflow_step_repair WHERE instance_id = %(id)s
),
allowed AS (
    SELECT WHERE (%(force)s OR NOT EXISTS (SELECT 1 FROM records WHERE status = 'running'))
             AND (%(erase_repairs)s OR (SELECT n FROM repairs) = 0)
),
gone_records AS (
    DELETE FROM workflow_step_record r
    WHERE r.instance_id = %(id)s AND EXISTS (SELECT FROM allowed)
),
gone AS (
    DELETE FROM process_instance p
    WHERE p.id = %(id)s AND EXISTS (SELECT FROM allowed) RETURNING p.id
)
SELECT (SELECT count(*) FROM records WHERE status = 'running') AS running,
       (SELECT n FROM repairs) AS repairs,
       (SELECT count(*) FROM gone) AS deleted
"""
TELL_DELETED = "SELECT pg_notify('steprecord_changes', %(id)s::bigint::text)"


@dataclass(frozen=True, slots=True)
class Deletion:
    # False: the instance stays: it has running steps (and force was not given), or repairs
    # (and erase_repairs was not given)
    deleted: bool
    running: int  # its running steps when it was judged
    repairs: int  # the repairs in its log when it was judged


async def delete_instance(
    conn: AsyncConn, instance_key: str, *, force: bool, erase_repairs: bool
) -> Deletion:
    """Lock the instance, then judge and delete it (see `LOCK_INSTANCE`). Its repair log goes
    with it, so an instance with repairs goes only with `erase_repairs`. A reopen writing the
    log holds the instance's key share (the log's foreign key) until it commits, so the lock
    waits for it, and the judgement sees its repair."""
    async with conn.transaction():
        cur = await conn.execute(LOCK_INSTANCE, {"instance_key": instance_key})
        locked = await cur.fetchone()
        if locked is None:
            raise InstanceNotFound(instance_key)
        cur = await conn.execute(
            DELETE_LOCKED, {"id": locked["id"], "force": force, "erase_repairs": erase_repairs}
        )
        row = await cur.fetchone()
        assert row is not None
        if row["deleted"] > 0:
            await conn.execute(TELL_DELETED, {"id": locked["id"]})
    return Deletion(
        deleted=row["deleted"] > 0, running=int(row["running"]), repairs=int(row["repairs"])
    )


# --- pruning: every instance whose last write is before a cutoff -----------------------------

# Candidates: instances created before the cutoff (an instance's last write is never before
# its creation), walked in (created_at, id) order on their index, a batch at a time.
CANDIDATES = """
SELECT p.id, p.created_at FROM process_instance p
WHERE p.created_at < %(cutoff)s AND (p.created_at, p.id) > (%(after_at)s, %(after_id)s)
ORDER BY p.created_at, p.id
LIMIT %(limit)s
"""

# A batch: lock, then judge, each instance in a statement of its own naming its id (on Citus,
# so, on the one worker that holds it: Citus locks rows only in a statement routed to one
# shard), sent together in one pipeline. `LOCK_ONE` locks the instances (in id order; a writer
# creating a step of one waits from then on). Every `DUE_ONE` comes after all the locks were
# granted, so its snapshot sees every step committed before, also one created by a writer
# that held an instance's lock while `LOCK_ONE` waited for it (a statement that locked and
# judged at once would judge on its own older snapshot and delete that step unjudged). It
# locks the instance's records too, in id order (a writer updating one finishes first, and the
# check reads the newest versions). An instance goes when its last write (its records'
# greatest updated_at, else its own created_at) is before the cutoff, and, unless unfinished
# ones are included, none of its records is pending or running. So an instance written after
# the cutoff stays, even when it was selected as a candidate before that write.
LOCK_ONE = "SELECT p.id FROM process_instance p WHERE p.id = %(id)s FOR UPDATE"
DUE_ONE = """
WITH records AS (
    SELECT r.updated_at, r.status FROM workflow_step_record r WHERE r.instance_id = %(id)s
    ORDER BY r.id
    FOR UPDATE
)
SELECT p.id, p.instance_key, p.created_at FROM process_instance p
WHERE p.id = %(id)s
  AND COALESCE((SELECT max(r.updated_at) FROM records r), p.created_at) < %(cutoff)s
  AND (%(include_unfinished)s
       OR NOT EXISTS (SELECT 1 FROM records r WHERE r.status IN ('pending', 'running')))
"""
ARCHIVED_RECORDS = f"""
SELECT r.instance_id, {RECORD.format(r="r")} FROM workflow_step_record r
WHERE r.instance_id = ANY(%(ids)s)
ORDER BY r.instance_id, r.ordinal
"""
ARCHIVED_ATTEMPTS = f"""
SELECT a.record_id, {ATTEMPT} FROM workflow_step_attempt a
WHERE a.instance_id = ANY(%(ids)s)
ORDER BY a.record_id, a.attempt
"""
ARCHIVED_REPAIRS = """
SELECT x.instance_id, x.step_slug, x.action, x.attempt, x.reason, x.repaired_by AS by, x.at
FROM workflow_step_repair x
WHERE x.instance_id = ANY(%(ids)s)
ORDER BY x.instance_id, x.at DESC, x.id DESC
"""
COUNTS = """
SELECT (SELECT count(*) FROM workflow_step_record WHERE instance_id = ANY(%(ids)s)) AS records,
       (SELECT count(*) FROM workflow_step_attempt WHERE instance_id = ANY(%(ids)s)) AS attempts
"""
DELETE_DUE = """
WITH gone_records AS (
    DELETE FROM workflow_step_record WHERE instance_id = ANY(%(ids)s)
)
DELETE FROM process_instance WHERE id = ANY(%(ids)s)
"""
# One pruner at a time across workers and service instances: each batch's transaction takes
# this lock or skips the round.
PRUNE_LOCK = "SELECT pg_try_advisory_xact_lock(hashtext('steprecord'), hashtext('prune')) AS got"
DATABASE_NOW = "SELECT now() AS now"


@dataclass(frozen=True, slots=True)
class Due:
    """The instances of a batch that go, as the archive shows them, with what goes with them."""

    instances: list[dict[str, Any]]  # instance_key, created_at, records (each with attempts)
    ids: list[int]
    records: int
    attempts: int


async def database_now(conn: AsyncConn) -> datetime:
    cur = await conn.execute(DATABASE_NOW)
    row = await cur.fetchone()
    assert row is not None
    return row["now"]  # type: ignore[no-any-return]


async def candidates(
    conn: AsyncConn, cutoff: datetime, after: tuple[datetime, int] | None, limit: int
) -> list[dict[str, Any]]:
    """The next candidates after `after` = (created_at, id) of the last one seen."""
    after_at, after_id = after if after is not None else ("-infinity", 0)
    params = {"cutoff": cutoff, "after_at": after_at, "after_id": after_id, "limit": limit}
    cur = await conn.execute(CANDIDATES, params)
    return await cur.fetchall()


async def take_prune_lock(conn: AsyncConn) -> bool:
    """Inside a transaction: whether this one is the pruner (until the transaction ends)."""
    cur = await conn.execute(PRUNE_LOCK)
    row = await cur.fetchone()
    return bool(row and row["got"])


async def lock_due(
    conn: AsyncConn,
    ids: list[int],
    *,
    cutoff: datetime,
    include_unfinished: bool,
    with_contents: bool,
) -> Due:
    """Inside a transaction: lock a batch, then keep the instances that go (see `LOCK_ONE`),
    with their records and attempts as the API renders them when `with_contents`."""
    one_by_one = [{"id": id_} for id_ in sorted(ids)]
    async with conn.cursor() as cur:
        await cur.executemany(LOCK_ONE, one_by_one)
        judged = [
            {**one, "cutoff": cutoff, "include_unfinished": include_unfinished}
            for one in one_by_one
        ]
        await cur.executemany(DUE_ONE, judged, returning=True)
        due = await cur.fetchall()
        while cur.nextset():
            due += await cur.fetchall()
    due_ids = [row["id"] for row in due]
    cur = await conn.execute(COUNTS, {"ids": due_ids})
    counts = await cur.fetchone()
    assert counts is not None
    instances: list[dict[str, Any]] = []
    if with_contents and due_ids:
        by_id = {row["id"]: {**row, "records": [], "repairs": []} for row in due}
        records: dict[int, dict[str, Any]] = {}
        cur = await conn.execute(ARCHIVED_RECORDS, {"ids": due_ids})
        for record in await cur.fetchall():
            owner = by_id[record.pop("instance_id")]
            record["instance_key"] = owner["instance_key"]
            record["attempts"] = []
            records[record["id"]] = record
            owner["records"].append(record)
        cur = await conn.execute(ARCHIVED_ATTEMPTS, {"ids": due_ids})
        for attempt in await cur.fetchall():
            records[attempt.pop("record_id")]["attempts"].append(attempt)
        cur = await conn.execute(ARCHIVED_REPAIRS, {"ids": due_ids})
        for repair in await cur.fetchall():
            by_id[repair.pop("instance_id")]["repairs"].append(repair)
        instances = list(by_id.values())
    return Due(instances, due_ids, int(counts["records"]), int(counts["attempts"]))


async def delete_due(conn: AsyncConn, ids: list[int]) -> None:
    """Inside the transaction that locked them: delete the instances with their records (the
    history follows by cascade)."""
    await conn.execute(DELETE_DUE, {"ids": ids})
