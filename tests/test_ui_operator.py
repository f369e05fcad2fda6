"""The dashboard's operator views: the instance list's last activity, total duration and
failing step (read by index), and the Stuck page's running steps without a lease that have
run longer than STEPRECORD_LONG_RUNNING_AFTER, marked "no lease"."""

import re
from typing import Any

import httpx
import psycopg
import pytest

from app.data import dashboard
from tests.support.http import ago, html, post
from tests.support.plans import one_shard


def row_of(page: str, key: str) -> str:
    row = re.search(rf'<tr>\s*<td><a href="/ui/instances/{key}">.*?</tr>', page, re.S)
    assert row is not None, page
    return row.group(0)


def test_the_instance_list_shows_last_activity_duration_and_failing_step(
    client: httpx.Client,
) -> None:
    start = {"attempt": 1, "started_at": ago(hours=2)}
    assert post(client, "start", start, "run-1", "fetch").is_success
    done = {"attempt": 1, "completed_at": ago(hours=1, minutes=30)}
    assert post(client, "complete", done, "run-1", "fetch").is_success
    assert post(client, "start", {"started_at": ago(hours=1)}, "run-1", "charge").is_success
    failed = {"completed_at": ago(minutes=60), "error_code": "CardDeclined"}
    assert post(client, "fail", failed, "run-1", "charge").is_success
    assert post(client, "start", {"started_at": ago(minutes=10)}, "run-2", "render").is_success
    assert post(client, "declare", None, "run-3", "later").is_success

    page = html(client, "/ui")
    assert '<th class="w-step">Failing step</th><th>Last activity</th><th>Duration</th>' in page
    first = row_of(page, "run-1")
    failing = re.search(r'<td class="failing-step">(.*?)</td>', first)
    assert failing is not None
    assert 'href="/ui/instances/run-1/steps/charge"' in failing.group(1)
    assert '<td class="took">1 h</td>' in first  # first start to last end
    assert re.search(r'<td class="last-activity"><time [^>]*>\d+(\.\d)? (ms|s) ago</time>', first)
    running = row_of(page, "run-2")
    assert '<td class="failing-step"></td>' in running
    assert re.search(r'<td class="took">10 min( \d+ s)? so far</td>', running), running
    declared = row_of(page, "run-3")
    assert '<td class="took"></td>' in declared


def test_stuck_shows_a_running_step_without_a_lease_past_the_threshold_as_no_lease(
    client: httpx.Client,
) -> None:
    old = {"attempt": 1, "started_at": ago(hours=3)}
    assert post(client, "start", old, "etl-1", "load").is_success
    assert post(client, "start", {"started_at": ago(minutes=5)}, "etl-2", "load").is_success
    leased = {"started_at": ago(hours=2), "lease_seconds": 600}
    assert post(client, "start", leased, "etl-3", "load").is_success
    page = html(client, "/ui/stuck")
    section = page[page.index('id="no-lease"') :]
    assert "Running longer than 1 h, without a lease" in section
    assert "etl-1" in section
    assert '<span class="badge no-lease">no lease</span>' in section
    assert re.search(r"<td>3 h( \d+ min)?</td>", section)
    assert "etl-2" not in page  # not yet past the threshold
    assert "etl-3" not in page  # it has a lease, and the sweeper watches it
    assert "Nothing is stuck" not in page


@pytest.fixture
def many_records(db: psycopg.Connection[tuple[object, ...]]) -> Any:
    """10^4 instances of 3 steps (rolled back). On Citus all in one shard (see `one_shard`):
    spread over the shards they would be a few hundred or thousand a shard, which the planner
    rightly reads whole for a page of 50 ids; a shard as full as one node's table is planned
    as that table."""
    db.execute(
        """
        INSERT INTO process_instance (id, instance_key, created_at)
        SELECT steprecord_instance_id('run-' || i), 'run-' || i,
               timestamptz '2026-01-01' + i * interval '1 s'
        FROM generate_series(1, 10000 * %(shards)s * 2) i
        WHERE hashint8(steprecord_instance_id('run-' || i)) BETWEEN %(low)s AND %(high)s
        LIMIT 10000
        """,
        vars(one_shard(db)),
    )
    db.execute("""
        INSERT INTO workflow_step_record (instance_id, step_slug, ordinal, status, attempt_count,
                                          started_at, completed_at)
        SELECT p.id, 'step-' || s, s, 'completed', 1, timestamptz '2026-01-01',
               timestamptz '2026-01-02'
        FROM process_instance p, generate_series(0, 2) s
    """)
    db.execute("ANALYZE process_instance")
    db.execute("ANALYZE workflow_step_record")
    return db


def test_the_instance_list_summaries_read_the_listed_instances_by_index(
    many_records: Any,
) -> None:
    # A page of the loaded shard's instances (on Citus the other shards hold a few of the
    # other tests' instances, which the planner rightly reads whole).
    ids = [
        row[0]
        for row in many_records.execute(
            "SELECT id FROM process_instance WHERE hashint8(id) BETWEEN %(low)s AND %(high)s"
            " LIMIT 50",
            vars(one_shard(many_records)),
        )
    ]
    plan = "\n".join(
        str(row[0])
        for row in many_records.execute(
            "EXPLAIN " + dashboard.INSTANCE_SUMMARIES, {"ids": ids}
        ).fetchall()
    )
    assert "Seq Scan" not in plan, plan
    assert "Index" in plan, plan
