"""Live updates and the sweeper on a Citus cluster (the `citus` fixture): the record's
notifications come from the worker holding the instance, a stream's read runs on that worker,
and the sweeper writes one worker per transaction.

The records are written with plain SQL through the coordinator, one instance per statement,
as the judge writes them.
"""

import time
from collections.abc import Iterator

import psycopg
import pytest

from tests.support.citus import CitusCluster, one_key_per_worker
from tests.support.databases import migrated_database
from tests.support.servers import start_server, stop
from tests.support.streams import Stream
from tests.support.waits import eventually

NEW_INSTANCE = """
INSERT INTO process_instance (id, instance_key) VALUES (steprecord_instance_id(%(key)s), %(key)s)
"""
NEW_STEP = """
INSERT INTO workflow_step_record (instance_id, step_slug, ordinal, status, attempt_count,
                                  started_at, lease_expires_at)
VALUES (steprecord_instance_id(%(key)s), %(step)s, %(ordinal)s, 'running', 1,
        now() - interval '1 hour', now() + make_interval(secs => %(lease)s))
"""


@pytest.fixture
def cluster_database(citus: CitusCluster) -> Iterator[str]:
    """A database on the cluster, migrated (so distributed)."""
    with migrated_database(citus.url, "steprecord_citus_live_") as url:
        yield url


def write(url: str, statement: str, **params: object) -> float:
    """Run one statement in its own transaction; the moment it committed."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(statement, params)
    return time.monotonic()


def test_a_stream_of_an_instance_on_each_worker_gets_each_write_within_a_second(
    citus: CitusCluster, cluster_database: str
) -> None:
    keys = one_key_per_worker(cluster_database, citus)
    for key in keys:
        write(cluster_database, NEW_INSTANCE, key=key)
        write(cluster_database, NEW_STEP, key=key, step="first", ordinal=0, lease=600)
    # Keepalives far apart: only a notification delivers a write within a second.
    base, proc = start_server(cluster_database, env={"STEPRECORD_SWEEP_SECONDS": "0"})
    streams = [Stream(f"{base}/v1/instances/{key}/stream") for key in keys]
    try:
        for stream in streams:
            assert stream.next_event().record["step_slug"] == "first"
        for key, stream in zip(keys, streams, strict=True):
            committed = write(cluster_database, NEW_STEP, key=key, step="next", ordinal=1, lease=60)
            event = stream.next_event(timeout=5)
            assert event.record["step_slug"] == "next"
            assert time.monotonic() - committed < 1.0
    finally:
        for stream in streams:
            stream.close()
        stop(proc)


def test_a_sweep_closes_the_expired_leases_on_both_workers(
    citus: CitusCluster, cluster_database: str
) -> None:
    keys = one_key_per_worker(cluster_database, citus)
    for key in keys:
        write(cluster_database, NEW_INSTANCE, key=key)
        write(cluster_database, NEW_STEP, key=key, step="stuck", ordinal=0, lease=-60)
        write(cluster_database, NEW_STEP, key=key, step="alive", ordinal=1, lease=600)
    _, proc = start_server(cluster_database, env={"STEPRECORD_SWEEP_SECONDS": "0.2"})
    try:

        def statuses() -> set[tuple[str, str, str, str | None]]:
            with psycopg.connect(cluster_database, autocommit=True) as conn:
                rows = conn.execute(
                    "SELECT p.instance_key, r.step_slug, r.status, r.error_code"
                    " FROM workflow_step_record r JOIN process_instance p ON p.id = r.instance_id"
                ).fetchall()
            return {(str(k), str(s), str(t), e) for k, s, t, e in rows}

        expected = {
            *((key, "stuck", "failed", "lease_expired") for key in keys),
            *((key, "alive", "running", None) for key in keys),
        }
        eventually(lambda: statuses() == expected, what="both workers swept")
    finally:
        stop(proc)


def test_a_position_from_another_node_gets_the_whole_instance_again(
    citus: CitusCluster, cluster_database: str
) -> None:
    """A Last-Event-ID beyond anything the instance's worker has assigned (as after the
    instance's shard moved to another worker, whose transaction ids are its own) reads the
    instance from the start, rather than waiting for that worker's ids to get there."""
    (key, *_) = one_key_per_worker(cluster_database, citus)
    write(cluster_database, NEW_INSTANCE, key=key)
    write(cluster_database, NEW_STEP, key=key, step="first", ordinal=0, lease=600)
    base, proc = start_server(cluster_database, env={"STEPRECORD_SWEEP_SECONDS": "0"})
    stream = Stream(f"{base}/v1/instances/{key}/stream", headers={"Last-Event-ID": f"{2**40}-1"})
    try:
        first = stream.next_event()
        assert first.record["step_slug"] == "first"
        write(cluster_database, NEW_STEP, key=key, step="next", ordinal=1, lease=60)
        assert stream.next_event().record["step_slug"] == "next"
    finally:
        stream.close()
        stop(proc)
