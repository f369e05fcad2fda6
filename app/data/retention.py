"""Deleting instances: one on request (`DELETE /v1/instances/{key}`), or every instance last
written before a cutoff (`steprecord prune`, `STEPRECORD_RETENTION`).

An instance goes with its records, in the same statement, and their history and its repair
log follow them by `ON DELETE CASCADE`; the writes are functions that run with their owner's
rights (app/sql/deletion.sql), so that a runtime role deletes only through them.
"""

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from ..core.db import AsyncConn
from ..core.domain import InstanceNotFound
from .common import RECORD
from .reads import ATTEMPT

# Lock, then judge, then delete: `steprecord_delete_instance` (app/sql/deletion.sql). The
# notification is a statement of its own, after it in the same transaction: it runs on the
# node the service listens on (inside a statement routed to a Citus worker, it would be sent
# there).
DELETE_INSTANCE = """
SELECT * FROM steprecord_delete_instance(
    steprecord_instance_id(%(instance_key)s), %(instance_key)s, %(force)s, %(erase_repairs)s)
"""
TELL_DELETED = (
    "SELECT pg_notify('steprecord_changes', steprecord_instance_id(%(instance_key)s)::text)"
)


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
    """Lock the instance, then judge and delete it (see `DELETE_INSTANCE`). Its repair log goes
    with it, so an instance with repairs goes only with `erase_repairs`. A reopen writing the
    log holds the instance's key share (the log's foreign key) until it commits, so the lock
    waits for it, and the judgement sees its repair."""
    async with conn.transaction():
        cur = await conn.execute(
            DELETE_INSTANCE,
            {"instance_key": instance_key, "force": force, "erase_repairs": erase_repairs},
        )
        row = await cur.fetchone()
        if row is None or not row["present"]:
            raise InstanceNotFound(instance_key)
        if row["deleted"] > 0:
            await conn.execute(TELL_DELETED, {"instance_key": instance_key})
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

# A batch: lock, then judge, each instance in a call of its own naming its id (on Citus, so,
# on the one worker that holds it: Citus locks rows only in a statement routed to one shard),
# sent together in one pipeline: every `LOCK_ONE` first (in id order), then every `DUE_ONE`,
# whose snapshot so sees every step committed before the locks were granted; see
# app/sql/deletion.sql for the rule.
LOCK_ONE = "SELECT steprecord_prune_lock(%(id)s)"
DUE_ONE = """
SELECT id, instance_key, created_at, records, attempts
FROM steprecord_prune_due(%(id)s, %(cutoff)s, %(include_unfinished)s)
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
DELETE_DUE = "SELECT steprecord_prune_delete(%(ids)s)"
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
    instances: list[dict[str, Any]] = []
    if with_contents and due_ids:
        by_id = {
            row["id"]: {
                "id": row["id"],
                "instance_key": row["instance_key"],
                "created_at": row["created_at"],
                "records": [],
                "repairs": [],
            }
            for row in due
        }
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
    records_due = sum(int(row["records"]) for row in due)
    attempts_due = sum(int(row["attempts"]) for row in due)
    return Due(instances, due_ids, records_due, attempts_due)


async def delete_due(conn: AsyncConn, ids: list[int]) -> None:
    """Inside the transaction that locked them: delete the instances with their records (the
    history follows by cascade)."""
    await conn.execute(DELETE_DUE, {"ids": ids})
