"""Reads, DELETE and pruning on a Citus cluster (the `citus` fixture): a read of one instance
goes to the one shard that holds it, a read across instances asks every shard with its LIMIT
and answers what one node answers, and deletions work across workers.

The rows are written directly (`tests/bench/plans.py`'s load, the triggers off): these tests
are about the reads, not the judge."""

import asyncio
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import make_conninfo
from psycopg.rows import dict_row

from app.cli.migrate import migrate
from app.core.db import Pool
from app.data import dashboard, placement, reads, retention, running, stats
from tests.bench.plans import NOW, load
from tests.support.citus import CitusCluster
from tests.support.databases import create_database, drop_database

KEY = "r7"
RECENT = {"before": "infinity", "before_id": 0, "updated_after": None, "limit": 21}


@pytest.fixture(scope="module")
def cluster_url(citus: CitusCluster) -> Iterator[str]:
    """A database on the cluster, migrated (so distributed), with 8 instances of rows."""
    name = f"steprecord_citus_reads_{uuid.uuid4().hex[:8]}"
    url = create_database(citus.url, name)
    try:
        migrate(url)
        load(url, 8)
        yield url
    finally:
        drop_database(citus.url, name)


@pytest.fixture
def conn(cluster_url: str) -> Iterator[psycopg.Connection[dict[str, Any]]]:
    with psycopg.connect(cluster_url, autocommit=True, row_factory=dict_row) as connection:
        yield connection


def shards_asked(conn: psycopg.Connection[Any], statement: str, params: Any) -> int:
    """How many shard statements the coordinator sends for `statement` (run, not explained)."""
    sent: list[str] = []
    conn.add_notice_handler(lambda notice: sent.append(notice.message_primary or ""))
    conn.execute("SET citus.log_remote_commands = on")
    conn.execute("SET client_min_messages = log")
    try:
        conn.execute(statement, params).fetchall()
    finally:
        conn.execute("RESET client_min_messages")
        conn.execute("RESET citus.log_remote_commands")
    shard_statements = [m for m in sent if m.startswith(("issuing SELECT", "issuing WITH"))]
    return len(shard_statements)


def instance_id(conn: psycopg.Connection[Any], key: str) -> int:
    row = conn.execute("SELECT steprecord_instance_id(%s) AS id", (key,)).fetchone()
    assert row is not None
    return int(row["id"])


def one_instance_reads(conn: psycopg.Connection[Any]) -> list[tuple[str, dict[str, Any]]]:
    the_id = instance_id(conn, KEY)
    slug = {"instance_key": KEY, "step_slug": "step-3"}
    page = (
        "SELECT * FROM steprecord_list_page(%(key)s, %(order)s, -1, %(at)s, 0, NULL, 11, 1000000)"
    )
    return [
        (reads.GET_STEP, slug),
        (reads.GET_INSTANCE, {"instance_key": KEY}),
        (reads.LIST_ATTEMPTS, {**slug, "after_attempt": 0, "limit": 11}),
        (page, {"key": KEY, "order": "ordinal", "at": "-infinity"}),
        (page, {"key": KEY, "order": "started_at", "at": "-infinity"}),
        (page, {"key": KEY, "order": "started_at", "at": None}),
        (dashboard.INSTANCE_STEPS, {"instance_id": the_id, "limit": 11}),
        (dashboard.INSTANCE_ATTEMPTS, {"instance_id": the_id, "last_ordinal": 10, "lane": 50}),
    ]


def test_each_read_of_one_instance_asks_only_the_shard_that_holds_it(
    conn: psycopg.Connection[dict[str, Any]],
) -> None:
    for statement, params in one_instance_reads(conn):
        rows = conn.execute(statement, params).fetchall()
        assert rows, statement
        assert shards_asked(conn, statement, params) == 1, statement


def test_a_read_of_one_instance_answers_its_rows(
    conn: psycopg.Connection[dict[str, Any]],
) -> None:
    step = conn.execute(reads.GET_STEP, {"instance_key": KEY, "step_slug": "step-3"}).fetchone()
    assert step is not None
    assert step["step_slug"] == "step-3"
    instance = conn.execute(reads.GET_INSTANCE, {"instance_key": KEY}).fetchone()
    assert instance is not None
    assert instance["instance_key"] == KEY
    assert (
        sum(instance[s] for s in reads.COUNTED) == 900
    )  # r7: mod(7, 4) = 3, the 4th size: 900 steps
    attempts = conn.execute(
        reads.LIST_ATTEMPTS,
        {"instance_key": KEY, "step_slug": "step-3", "after_attempt": 0, "limit": 11},
    ).fetchall()
    assert [a["attempt"] for a in attempts] == [1]


def newest(conn: psycopg.Connection[Any], where: str, limit: int) -> list[int]:
    """The reference: record ids newest `updated_at` first, read by the simplest statement."""
    rows = conn.execute(
        f"SELECT id, updated_at FROM workflow_step_record r WHERE {where}"
        " ORDER BY updated_at DESC, id DESC"
    ).fetchall()
    return [row["id"] for row in rows[:limit]]


def test_the_lists_across_instances_answer_what_one_node_answers(
    conn: psycopg.Connection[dict[str, Any]],
) -> None:
    query = reads.list_recent_query(["failed", "running"], updated_after=False, lease_expired=False)
    rows = conn.execute(query, RECENT).fetchall()
    assert [r["id"] for r in rows] == newest(conn, "status IN ('failed', 'running')", 21)
    keys = {row["instance_id"]: row["instance_key"] for row in rows}
    assert all(instance_id(conn, key) == id_ for id_, key in keys.items())

    stuck = reads.list_recent_query(["running"], updated_after=False, lease_expired=True)
    rows = conn.execute(stuck, RECENT).fetchall()
    expired = "status = 'running' AND lease_expires_at < clock_timestamp()"
    assert rows
    assert [r["id"] for r in rows] == newest(conn, expired, 21)

    failing = dashboard.failed_of_step_query(prefix=False)
    params = {"name": "step-23", "grouped_like": "step-23:%", "limit": 50}
    rows = conn.execute(failing, params).fetchall()
    assert rows
    assert [r["id"] for r in rows] == newest(
        conn, "status = 'failed' AND step_slug = 'step-23'", 50
    )

    long_running = running.long_running_query(prefix=False, no_lease=False)
    after = {"older_than": 0, "after_started_at": "-infinity", "after_id": 0, "limit": 21}
    rows = conn.execute(long_running, after).fetchall()
    oldest = conn.execute(
        "SELECT id FROM workflow_step_record WHERE status = 'running'"
        " ORDER BY started_at, id LIMIT 21"
    ).fetchall()
    assert [r["id"] for r in rows] == [r["id"] for r in oldest]

    prefix = reads.list_recent_query(
        ["failed", "running"], updated_after=False, lease_expired=False, prefix=True
    )
    rows = conn.execute(prefix, RECENT | reads.prefix_params("r1")).fetchall()
    r1 = instance_id(conn, "r1")
    assert [r["id"] for r in rows] == newest(
        conn, f"status IN ('failed', 'running') AND instance_id = {r1}", 21
    )


def test_the_instances_and_the_statistics_are_read_from_every_shard(
    conn: psycopg.Connection[dict[str, Any]],
) -> None:
    query = reads.list_instances_query(prefix=False, has="failed")
    first = {"before_created_at": "infinity", "before_id": 0, "limit": 5}
    assert len(conn.execute(query, first).fetchall()) == 5
    assert shards_asked(conn, query, first) > 1

    window = {"since": NOW.replace(year=2025), "until": NOW, "limit": 1000}
    items = conn.execute(stats.step_stats_query(prefix=False), window).fetchall()
    row = conn.execute(
        "SELECT count(*) AS n FROM workflow_step_attempt WHERE started_at < %s", (NOW,)
    ).fetchone()
    assert row is not None
    outcomes = ("completed", "failed", "superseded", "running")
    assert sum(i[outcome] for i in items for outcome in outcomes) == row["n"] > 0


def test_failing_now_s_sparkline_of_one_step_counts_what_a_join_counts(
    conn: psycopg.Connection[dict[str, Any]],
) -> None:
    window = {"since": NOW - timedelta(days=2), "until": NOW, "name": "step-23"}
    query = stats.FAILURES_PER_HOUR_OF_STEP.format(within="")
    hours = conn.execute(query, window).fetchall()
    row = conn.execute(
        "SELECT count(*) AS n FROM workflow_step_attempt a JOIN workflow_step_record r"
        " ON r.instance_id = a.instance_id AND r.id = a.record_id"
        " WHERE a.status = 'failed' AND r.step_slug = 'step-23'"
        " AND a.started_at >= %(since)s AND a.started_at < %(until)s",
        window,
    ).fetchone()
    assert row is not None
    assert sum(h["failed"] for h in hours) == row["n"] > 0


def test_the_service_reads_many_shards_over_its_kept_connections_unless_the_operator_chose(
    cluster_url: str,
) -> None:
    async def setting(url: str) -> str:
        pool = Pool(url, size=1, timeout=5, statement_timeout=5, prepare_threshold=None,
                    configure=placement.configure)  # fmt: skip
        try:
            async with pool.connection() as conn:
                cur = await conn.execute("SHOW citus.max_adaptive_executor_pool_size")
                row = await cur.fetchone()
                assert row is not None
                return str(row["citus.max_adaptive_executor_pool_size"])
        finally:
            await pool.close()

    assert asyncio.run(setting(cluster_url)) == "1"
    chosen = make_conninfo(cluster_url, options="-c citus.max_adaptive_executor_pool_size=4")
    assert asyncio.run(setting(chosen)) == "4"


def test_delete_removes_the_instance_on_its_worker_and_notifies_the_coordinator(
    cluster_url: str,
) -> None:
    async def delete() -> tuple[retention.Deletion, list[str]]:
        async with await psycopg.AsyncConnection.connect(cluster_url, autocommit=True) as ear:
            await ear.execute("LISTEN steprecord_changes")
            async with await psycopg.AsyncConnection.connect(
                cluster_url, autocommit=True, row_factory=dict_row
            ) as writer:
                refused = await retention.delete_instance(
                    writer, "r2", force=False, erase_repairs=True
                )
                assert not refused.deleted
                assert refused.running > 0
                deleted = await retention.delete_instance(
                    writer, "r2", force=True, erase_repairs=True
                )
            heard = [n.payload async for n in ear.notifies(timeout=5, stop_after=1)]
        return deleted, heard

    deleted, heard = asyncio.run(delete())
    assert deleted.deleted
    with psycopg.connect(cluster_url, row_factory=dict_row) as conn:
        the_id = instance_id(conn, "r2")
        assert heard == [str(the_id)]
        for table, column in (
            ("process_instance", "id"),
            ("workflow_step_record", "instance_id"),
            ("workflow_step_attempt", "instance_id"),
        ):
            row = conn.execute(
                f"SELECT count(*) AS n FROM {table} WHERE {column} = %s", (the_id,)
            ).fetchone()
            assert row is not None
            assert row["n"] == 0, table


def test_a_prune_batch_over_both_workers_deletes_what_is_due_and_keeps_the_rest(
    cluster_url: str,
) -> None:
    cutoff = datetime(2100, 1, 1, tzinfo=UTC)

    async def prune() -> retention.Due:
        async with await psycopg.AsyncConnection.connect(cluster_url, row_factory=dict_row) as conn:
            found = await retention.candidates(conn, cutoff, None, 100)
            ids = [row["id"] for row in found]
            due = await retention.lock_due(
                conn, ids, cutoff=cutoff, include_unfinished=False, with_contents=True
            )
            assert due.ids == []  # every instance has pending steps
            due = await retention.lock_due(
                conn, ids, cutoff=cutoff, include_unfinished=True, with_contents=True
            )
            await retention.delete_due(conn, due.ids)
            await conn.commit()  # the batch's one transaction
        return due

    with psycopg.connect(cluster_url, row_factory=dict_row) as conn:
        before = conn.execute("SELECT count(*) AS n FROM process_instance").fetchone()
        records = conn.execute("SELECT count(*) AS n FROM workflow_step_record").fetchone()
    due = asyncio.run(prune())
    assert before is not None
    assert records is not None
    assert len(due.ids) == before["n"] > 1
    assert due.records == records["n"] == sum(len(i["records"]) for i in due.instances)
    with psycopg.connect(cluster_url, row_factory=dict_row) as conn:
        for table in ("process_instance", "workflow_step_record", "workflow_step_attempt"):
            row = conn.execute(f"SELECT count(*) AS n FROM {table}").fetchone()
            assert row is not None
            assert row["n"] == 0, table
