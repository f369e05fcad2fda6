"""`steprecord prune` and `STEPRECORD_RETENTION`: instances last written before a cutoff are
deleted with their records and history, in short batches, optionally archived first; an
instance written after the cutoff is never deleted; bad input is refused before anything is
read."""

import asyncio
import gzip
import json
import os
import random
import resource
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from psycopg.rows import dict_row

from app.core.config import Settings
from app.data import retention
from app.ops import pruning
from tests.support.databases import migrated_database
from tests.support.http import T1, T2, T3, exists, post
from tests.support.metrics import counter, metrics
from tests.support.rows import age
from tests.support.servers import start_server, steprecord, stop
from tests.support.waits import eventually

# Nothing listens here: a command that tried to read the database would fail differently.
NOWHERE = "postgresql://postgres@127.0.0.1:9/none"


def finished(client: httpx.Client, key: str) -> None:
    post(client, "start", {"attempt": 1, "started_at": T1}, instance=key)
    post(client, "fail", {"attempt": 1, "completed_at": T2, "error_code": "E"}, instance=key)
    post(client, "start", {"attempt": 2, "started_at": T2}, instance=key)
    post(client, "complete", {"attempt": 2, "completed_at": T3, "output": {"k": key}}, instance=key)
    post(client, "complete", {"started_at": T1, "output": [1]}, instance=key, step="other")


def as_archived(client: httpx.Client, key: str) -> dict[str, Any]:
    """What the archive line of `key` must hold: the API's own renderings."""
    instance = client.get(f"/v1/instances/{key}").json()
    records = client.get(f"/v1/instances/{key}/steps", params={"limit": 1000}).json()["items"]
    for record in records:
        path = f"/v1/instances/{key}/steps/{record['step_slug']}/attempts"
        record["attempts"] = client.get(path).json()["items"]
    repairs = client.get(f"/v1/instances/{key}/repairs", params={"limit": 1000}).json()["items"]
    return {
        "instance_key": key,
        "created_at": instance["created_at"],
        "records": records,
        "repairs": repairs,
    }


@pytest.fixture
def aged(client: httpx.Client, database_url: str) -> dict[str, str]:
    """old-done (finished 3 days ago), old-open (a running step, 3 days ago), fresh (now)."""
    finished(client, "old-done")
    age(database_url, "old-done", 3)
    post(client, "start", {"attempt": 1, "started_at": T1}, instance="old-open")
    age(database_url, "old-open", 3)
    finished(client, "fresh")
    return {"old-done": "old-done", "old-open": "old-open", "fresh": "fresh"}


@pytest.mark.usefixtures("aged")
def test_prune_deletes_finished_instances_last_written_before_the_cutoff(
    client: httpx.Client, database_url: str
) -> None:
    done = steprecord(database_url, "prune", "--older-than", "2d")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("deleted 1 instances, 2 records and 3 attempts last written")
    assert len(done.stdout.splitlines()) == 1
    assert not exists(client, "old-done")
    assert exists(client, "old-open")
    assert exists(client, "fresh")
    with psycopg.connect(database_url) as conn:
        orphans = conn.execute(
            "SELECT count(*) FROM workflow_step_attempt a"
            " LEFT JOIN workflow_step_record r"
            " ON r.instance_id = a.instance_id AND r.id = a.record_id WHERE r.id IS NULL"
        ).fetchone()
    assert orphans == (0,)


@pytest.mark.usefixtures("aged")
def test_include_unfinished_and_before_take_the_rest(
    client: httpx.Client, database_url: str
) -> None:
    done = steprecord(database_url, "prune", "--before", "2999-01-01T00:00:00Z")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("deleted 2 instances")  # old-done and fresh
    assert exists(client, "old-open")
    done = steprecord(database_url, "prune", "--older-than", "1d", "--include-unfinished")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("deleted 1 instances, 1 records and 1 attempts")
    assert not exists(client, "old-open")


@pytest.mark.usefixtures("aged")
def test_a_dry_run_deletes_nothing_and_says_what_would_go(
    client: httpx.Client, database_url: str
) -> None:
    done = steprecord(database_url, "prune", "--older-than", "2d", "--dry-run")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("would delete 1 instances, 2 records and 3 attempts")
    assert exists(client, "old-done")


@pytest.mark.usefixtures("aged")
def test_a_dry_run_with_an_archive_writes_no_file_and_says_what_it_would_archive(
    client: httpx.Client, database_url: str, tmp_path: Path
) -> None:
    path = tmp_path / "archive.jsonl.gz"
    done = steprecord(
        database_url, "prune", "--older-than", "2d", "--dry-run", "--archive", str(path)
    )
    assert done.returncode == 0, done.stderr
    assert not path.exists()
    assert done.stdout.startswith("would delete 1 instances, 2 records and 3 attempts")
    assert f"would archive them to {path} (a dry run writes no archive)" in done.stdout
    assert exists(client, "old-done")
    # The path is still checked as a real run would check it.
    path.write_text("kept\n")
    again = steprecord(
        database_url, "prune", "--older-than", "2d", "--dry-run", "--archive", str(path)
    )
    assert again.returncode == 2
    assert "is never overwritten" in again.stderr
    assert path.read_text() == "kept\n"


@pytest.mark.parametrize("name", ["archive.jsonl", "archive.jsonl.gz"])
def test_the_archive_holds_each_deleted_instance_with_its_records_and_attempts(
    client: httpx.Client, database_url: str, tmp_path: Path, name: str
) -> None:
    keys = [f"arch-{i}" for i in range(5)]
    for key in keys:
        finished(client, key)
        age(database_url, key, 3)
    expected = {key: as_archived(client, key) for key in keys}
    path = tmp_path / name
    done = steprecord(
        database_url, "prune", "--older-than", "1d", "--archive", str(path), "--batch-size", "2"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.rstrip().endswith(f"archived to {path}")
    raw = path.read_bytes()
    text = (gzip.decompress(raw) if name.endswith(".gz") else raw).decode()
    lines = [json.loads(line) for line in text.splitlines()]
    assert sorted(line["instance_key"] for line in lines) == keys
    for line in lines:
        assert line == expected[line["instance_key"]]
    assert not any(exists(client, key) for key in keys)


def test_a_write_error_mid_archive_deletes_nothing_of_its_batch(
    client: httpx.Client, database_url: str, tmp_path: Path
) -> None:
    """A real write error: the file size limit of the process (RLIMIT_FSIZE)."""
    keys = [f"full-{i:02d}" for i in range(12)]
    for key in keys:
        finished(client, key)
        age(database_url, key, 3)
    path = tmp_path / "archive.jsonl"

    def small_files() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write over the limit fails instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (6000, 6000))

    done = steprecord(
        database_url,
        *("prune", "--older-than", "1d", "--archive", str(path), "--batch-size", "2"),
        preexec_fn=small_files,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "writing the archive failed" in done.stderr
    assert "nothing of the next batch was deleted" in done.stderr
    archived = {json.loads(line)["instance_key"] for line in path.read_text().splitlines()}
    assert archived  # some batches made it before the limit
    for key in keys:  # exactly the archived instances are gone
        assert exists(client, key) == (key not in archived), key
    assert f"after {len(archived)} instances" in done.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--older-than", "30x"], "is not a duration"),
        (["--older-than=-3d"], "is not a duration"),
        (["--before", "2026-11-01T00:00:00"], "is not a timestamp with an offset"),
        (["--before", "yesterday"], "is not a timestamp with an offset"),
        ([], "one of the arguments --older-than --before is required"),
        (["--older-than", "1d", "--before", "2026-11-01T00:00:00Z"], "not allowed with"),
        (["--older-than", "1d", "--archive", "out.json"], "a .jsonl or .jsonl.gz file"),
        (["--older-than", "1d", "--batch-size", "0"], "from 1 to 10000"),
    ],
)
def test_bad_input_is_refused_before_anything_is_read(args: list[str], message: str) -> None:
    done = steprecord(NOWHERE, "prune", *args)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr
    assert done.stdout == ""


def test_an_archive_that_cannot_be_written_is_refused_before_anything_is_read(
    tmp_path: Path,
) -> None:
    missing = tmp_path / "no-such-dir" / "a.jsonl"
    done = steprecord(NOWHERE, "prune", "--older-than", "1d", "--archive", str(missing))
    assert done.returncode == 2
    assert "cannot write the archive" in done.stderr
    existing = tmp_path / "old.jsonl"
    existing.write_text("kept\n")
    done = steprecord(NOWHERE, "prune", "--older-than", "1d", "--archive", str(existing))
    assert done.returncode == 2
    assert "is never overwritten" in done.stderr
    assert existing.read_text() == "kept\n"


def test_writers_racing_a_prune_lose_no_acknowledged_write(
    client: httpx.Client, database_url: str, server_url: str
) -> None:
    """Every instance is old and finished when the prune starts; writers add steps to them
    meanwhile. Whatever the interleaving, each write that was acknowledged is readable
    afterwards: its instance survived (written after the cutoff), or the write came after
    the deletion and started a new instance."""
    keys = [f"race-{i:03d}" for i in range(60)]
    for key in keys:
        post(client, "complete", {"started_at": T1}, instance=key, step="first")
        age(database_url, key, 3)
    acknowledged: list[tuple[str, str]] = []
    stopped = threading.Event()

    def write() -> None:
        chooser = random.Random(7)
        with httpx.Client(base_url=server_url, timeout=30) as writer:
            while not stopped.is_set():
                key, step = chooser.choice(keys), f"s-{uuid.uuid4().hex[:8]}"
                answer = writer.post(f"/v1/instances/{key}/steps/{step}/start")
                assert answer.status_code == 201, answer.text
                acknowledged.append((key, step))

    writer = threading.Thread(target=write)
    writer.start()
    try:
        eventually(lambda: len(acknowledged) >= 5)
        done = steprecord(database_url, "prune", "--older-than", "1d", "--batch-size", "3")
    finally:
        stopped.set()
        writer.join(30)
    assert done.returncode == 0, done.stderr
    assert acknowledged
    for key, step in acknowledged:
        assert client.get(f"/v1/instances/{key}/steps/{step}").status_code == 200, (key, step)
    written = {key for key, _ in acknowledged}
    assert not any(exists(client, key) for key in set(keys) - written)


def test_a_pruner_giving_way_to_another_still_counts_what_it_deleted(
    client: httpx.Client, database_url: str
) -> None:
    for key in ("first", "second"):
        finished(client, key)
        age(database_url, key, 2)
    other = psycopg.connect(database_url)  # the other pruner, mid-batch: it holds the lock
    calls = 0

    @asynccontextmanager
    async def connect() -> AsyncIterator[psycopg.AsyncConnection[dict[str, Any]]]:
        nonlocal calls
        calls += 1
        if calls == 2:  # this pruner's second batch
            other.execute(retention.PRUNE_LOCK)
        async with await psycopg.AsyncConnection.connect(
            database_url, autocommit=True, row_factory=dict_row
        ) as conn:
            yield conn

    try:
        cutoff = datetime.now(UTC) - timedelta(days=1)
        pruned = asyncio.run(pruning.prune(connect, cutoff, exclusive=True, batch=1, pause=0))
    finally:
        other.close()
    assert calls == 2
    assert pruned.instances == 1
    assert pruned.batches == 1
    assert [exists(client, key) for key in ("first", "second")].count(True) == 1


@pytest.fixture
def retained(server_dsn: str) -> Iterator[tuple[str, str]]:
    """A service of its own (two workers) that keeps finished instances for one day."""
    with migrated_database(server_dsn, "steprecord_retention_") as url:
        env = {"STEPRECORD_RETENTION": "1d", "STEPRECORD_SWEEP_SECONDS": "0.2"}
        base, proc = start_server(url, "--workers", "2", env=env)
        try:
            yield base, url
        finally:
            stop(proc)


def test_retention_prunes_finished_instances_in_the_background(
    retained: tuple[str, str],
) -> None:
    base, url = retained
    with httpx.Client(base_url=base, timeout=30) as client:
        for key in ("keep-recent", "drop-1", "drop-2"):
            finished(client, key)
        post(client, "start", {"attempt": 1, "started_at": T1}, instance="keep-running")
        for key in ("drop-1", "drop-2", "keep-running"):
            age(url, key, 2)
        eventually(lambda: not exists(client, "drop-1") and not exists(client, "drop-2"))
        assert exists(client, "keep-recent")
        assert exists(client, "keep-running")
        # Both workers prune, one at a time: each instance is counted once.
        eventually(lambda: counter(metrics(base), "steprecord_pruned_instances_total") == 2)


def test_an_unparseable_retention_stops_the_service_with_a_clear_error(
    database_url: str,
) -> None:
    env = {**os.environ, "DATABASE_URL": database_url, "STEPRECORD_RETENTION": "30 days"}
    done = subprocess.run(
        [sys.executable, "-m", "app.cli", "serve", "--port", "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert "STEPRECORD_RETENTION" in done.stderr
    assert "is not a duration" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("retention", ["30s", "59m"])
def test_a_retention_shorter_than_an_hour_stops_the_service_with_a_clear_error(
    database_url: str, retention: str
) -> None:
    env = {**os.environ, "DATABASE_URL": database_url, "STEPRECORD_RETENTION": retention}
    done = subprocess.run(
        [sys.executable, "-m", "app.cli", "serve", "--port", "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert "invalid setting STEPRECORD_RETENTION" in done.stderr
    assert "shorter than the 1 hour" in done.stderr
    assert "Traceback" not in done.stderr
    assert "listening" not in done.stderr


def test_a_retention_of_an_hour_or_more_is_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    for text, hours in [("1h", 1), ("60m", 1), ("30d", 720)]:
        monkeypatch.setenv("STEPRECORD_RETENTION", text)
        assert Settings().retention == timedelta(hours=hours)
