"""Pruning: delete every instance last written before a cutoff, in short batches.

Each batch is its own transaction: the candidates (instances created before the cutoff, read
on their index) are locked and judged again (`app.data.retention.DUE_ONE`), so an instance
written after the cutoff stays even when it had been selected; with an archive, the batch's
instances are written as JSON lines, flushed and fsynced, and only then deleted. A write
error deletes nothing of its batch. `steprecord prune` runs it once; with
`STEPRECORD_RETENTION` every worker runs it at the sweeper's cadence, one at a time across
workers and service instances (a transaction-level advisory lock per batch).
"""

import asyncio
import errno
import gzip
import logging
import os
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from ..core.db import AsyncConn, Pool
from ..core.serialize import attempt_json, dumps, record_json
from ..data import retention
from . import observe

log = logging.getLogger("steprecord.pruning")
BATCH = 200
# Seconds a prune pauses between batches per second it worked on the last one: at 1 it works
# at most half the time, so the writes it shares the database (and the CPUs) with keep room.
PAUSE = 1.0
ARCHIVE_SUFFIXES = (".jsonl", ".jsonl.gz")

Connect = Callable[[], AbstractAsyncContextManager[AsyncConn]]


def parse_timestamp(text: str) -> datetime:
    """An RFC 3339 timestamp with its offset (`2026-11-01T00:00:00Z`)."""
    try:
        moment = datetime.fromisoformat(text.strip())
    except ValueError:
        moment = None
    if moment is None or moment.tzinfo is None:
        raise ValueError(
            f"{text!r} is not a timestamp with an offset: write it as RFC 3339, e.g."
            " 2026-11-01T00:00:00Z"
        )
    return moment


@dataclass(slots=True)
class Pruned:
    instances: int = 0
    records: int = 0
    attempts: int = 0
    batches: int = 0

    def summary(self, cutoff: datetime, *, dry_run: bool, archive: Path | None) -> str:
        verb = "would delete" if dry_run else "deleted"
        if archive is None:
            where = ""
        elif dry_run:
            where = f", would archive them to {archive} (a dry run writes no archive)"
        else:
            where = f", archived to {archive}"
        return (
            f"{verb} {self.instances} instances, {self.records} records and {self.attempts}"
            f" attempts last written before {cutoff.isoformat()}{where}"
        )


class ArchiveFailed(Exception):
    """Writing the archive failed; nothing of the batch being written was deleted."""

    def __init__(self, pruned: Pruned, reason: str) -> None:
        super().__init__(
            f"writing the archive failed ({reason}) after {pruned.instances} instances in"
            f" {pruned.batches} batches were archived and deleted; nothing of the next batch"
            " was deleted"
        )
        self.pruned = pruned


def check_archive(path: Path) -> None:
    """Refuse, before anything is read, a path `Archive` could not create: not a .jsonl or
    .jsonl.gz name (ValueError), an existing file (FileExistsError), a directory that is
    missing or not writable (OSError). It creates nothing: a dry run writes no archive."""
    if not path.name.endswith(ARCHIVE_SUFFIXES):
        raise ValueError(f"an archive is a .jsonl or .jsonl.gz file, not {path.name!r}")
    if path.exists():
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(path))
    directory = path.parent
    if not directory.is_dir():
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(directory))
    if not os.access(directory, os.W_OK | os.X_OK):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(directory))


class Archive:
    """A new `.jsonl` or `.jsonl.gz` file (never an existing one), one line per instance.

    Each batch is appended whole and made durable (flushed and fsynced) before its instances
    are deleted; a `.gz` archive gets one gzip member per batch, which gzip reads as one
    stream. A write that fails is cut off again, so the file holds exactly the instances
    deleted."""

    def __init__(self, path: Path) -> None:
        check_archive(path)
        self.path = path
        self._compress = path.name.endswith(".gz")
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        self._end = 0  # the end of the last batch made durable

    def write(self, lines: list[bytes]) -> None:
        data = memoryview(gzip.compress(b"".join(lines)) if self._compress else b"".join(lines))
        try:
            while data:
                data = data[os.write(self._fd, data) :]
            os.fsync(self._fd)
        except OSError:
            os.ftruncate(self._fd, self._end)
            os.lseek(self._fd, self._end, os.SEEK_SET)
            raise
        self._end = os.lseek(self._fd, 0, os.SEEK_CUR)

    def close(self) -> None:
        os.close(self._fd)


def archive_line(instance: dict[str, Any]) -> bytes:
    """An instance as one JSON line: its key, its creation, its records as the API renders
    them, each with its attempts, and its repair log (newest first, as the API renders it)."""
    records = [
        {**record_json(r), "attempts": [attempt_json(a) for a in r["attempts"]]}
        for r in instance["records"]
    ]
    line = {
        "instance_key": instance["instance_key"],
        "created_at": instance["created_at"],
        "records": records,
        "repairs": instance["repairs"],
    }
    return dumps(line) + b"\n"


async def prune(
    connect: Connect,
    cutoff: datetime,
    *,
    include_unfinished: bool = False,
    dry_run: bool = False,
    archive: Archive | None = None,
    exclusive: bool = False,
    batch: int = BATCH,
    pause: float = PAUSE,
) -> Pruned:
    """Delete (or with `dry_run` only count) every instance last written before `cutoff`.

    `exclusive`: one pruner at a time; another pruner's batch in progress makes this one
    stop, answering what its earlier batches deleted (the other goes on from there).
    `pause`: see `PAUSE`.
    """
    pruned = Pruned()
    after: tuple[datetime, int] | None = None
    loop = asyncio.get_running_loop()
    while True:
        began = loop.time()
        async with connect() as conn:
            found = await retention.candidates(conn, cutoff, after, batch)
            if not found:
                return pruned
            after = (found[-1]["created_at"], found[-1]["id"])
            async with conn.transaction():
                if exclusive and not await retention.take_prune_lock(conn):
                    return pruned
                due = await retention.lock_due(
                    conn,
                    [row["id"] for row in found],
                    cutoff=cutoff,
                    include_unfinished=include_unfinished,
                    with_contents=archive is not None,
                )
                if not due.ids:
                    continue
                if archive is not None:
                    try:
                        archive.write([archive_line(i) for i in due.instances])
                    except OSError as exc:
                        raise ArchiveFailed(pruned, exc.strerror or str(exc)) from exc
                if not dry_run:
                    await retention.delete_due(conn, due.ids)
        pruned.instances += len(due.ids)
        pruned.records += due.records
        pruned.attempts += due.attempts
        pruned.batches += 1
        await asyncio.sleep((loop.time() - began) * pause)


async def prune_finished(pool: Pool, keep: timedelta) -> int:
    """The retention rule, once: delete the finished instances last written more than `keep`
    ago (by the database's clock); the number deleted."""
    async with pool.connection() as conn:
        cutoff = await retention.database_now(conn) - keep
    pruned = await prune(pool.connection, cutoff, exclusive=True)
    if not pruned.instances:
        return 0
    observe.PRUNED.inc(pruned.instances)
    log.info(pruned.summary(cutoff, dry_run=False, archive=None))
    return pruned.instances


async def keep_pruning(pool: Pool, every: float, keep: timedelta) -> None:
    """`STEPRECORD_RETENTION`: prune at the sweeper's cadence for as long as the worker runs."""
    while True:
        await asyncio.sleep(every)
        try:
            await prune_finished(pool, keep)
        except Exception:
            log.exception("pruning failed; trying again in %s s", every)
