"""The judge's copy per shard on a Citus cluster (app/sql/shard_judge.sql): the service judges
each event in its shard's copy on the node that holds the shard; a copy writes its shard's
tables only while the shard is on its node and the instance in the shard, and is otherwise the
distributed judge's call; a copy gone is asked for again; its callers are the judge's; `migrate`
drops every node's copies before it changes the schema."""

import uuid
from collections.abc import Iterator

import httpx
import psycopg
import pytest
from alembic import command

from app.data import roles
from app.data.judge import APPLY_EVENT_WITH
from app.main import alembic_config
from tests.support.citus import CitusCluster, on_node, one_key_per_worker, rows_on_worker
from tests.support.databases import login_role, migrated_database
from tests.support.http import post, record
from tests.support.servers import start_server, stop

# The copies on a node, by name.
COPIES = """
SELECT p.proname FROM pg_proc p
WHERE p.pronamespace = 'public'::regnamespace
  AND p.proname ~ '^steprecord_apply_event_[0-9]+_[0-9a-f]+$'
ORDER BY 1
"""
SHARD_OF = """
SELECT get_shard_id_for_distribution_column('process_instance', steprecord_instance_id(%s))
"""
MOVE = """
SELECT citus_move_shard_placement(%s, %s, %s, %s, %s, shard_transfer_mode => 'block_writes')
"""


@pytest.fixture(scope="module")
def cluster_database(citus: CitusCluster) -> Iterator[str]:
    with migrated_database(citus.url, "steprecord_shard_judge_") as url:
        yield url


def name_of(url: str) -> str:
    name = psycopg.conninfo.conninfo_to_dict(url)["dbname"]
    assert isinstance(name, str)
    return name


def workers_of(citus: CitusCluster, url: str) -> list[str]:
    return [on_node(worker.url, name_of(url)) for worker in citus.workers]


def copies(url: str) -> list[str]:
    with psycopg.connect(url, autocommit=True) as conn:
        return [str(name) for (name,) in conn.execute(COPIES).fetchall()]


def shard_of(url: str, key: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(SHARD_OF, (key,)).fetchone()
    assert row is not None
    return int(row[0])


def make_copy(worker_url: str, shard: int) -> str | None:
    with psycopg.connect(worker_url, autocommit=True) as conn:
        row = conn.execute("SELECT steprecord_shard_judge(%s)", (shard,)).fetchone()
    assert row is not None
    return None if row[0] is None else str(row[0])


def start_on(worker_url: str, function: str, key: str, step: str) -> tuple[str, str]:
    """A `start` of attempt 1 called on `function` (the judge or a copy) on a node, as the
    service calls it: the outcome and the record's status."""
    statement = APPLY_EVENT_WITH.format(function)
    params = [0, key, step, "start", 1, None, None, None, None, None, None, None, None]
    params += [None, "test", None]
    with psycopg.connect(worker_url, autocommit=True) as conn, psycopg.RawCursor(conn) as cur:
        row = cur.execute(statement, params).fetchone()
    assert row is not None
    return str(row[1]), str(row[6])


def test_the_service_judges_each_event_in_its_shard_s_copy_on_the_node_holding_the_shard(
    citus: CitusCluster, cluster_database: str
) -> None:
    """Events and a batch of instances on both workers are answered as on one node, and each
    worker then holds the copies of its own shards, made when the service first called them,
    and none of the other worker's."""
    keys = one_key_per_worker(cluster_database, citus)
    workers = workers_of(citus, cluster_database)
    base, proc = start_server(cluster_database, env={"STEPRECORD_SWEEP_SECONDS": "0"})
    try:
        with httpx.Client(base_url=base, timeout=30) as client:
            for key in keys:
                assert post(client, "start", {"attempt": 1}, key, "a").status_code == 201
                assert post(client, "start", {"attempt": 1}, key, "a").status_code == 200
                done = post(client, "complete", {"attempt": 1, "output": {"n": 1}}, key, "a")
                assert done.status_code == 200, done.text
            events = [{"instance_key": key, "step_slug": "b", "kind": "declare"} for key in keys]
            answer = client.post("/v1/events", json={"events": events})
            assert [r["status"] for r in answer.json()["results"]] == [201, 201]
            for key in keys:
                assert record(client, key, "a")["status"] == "completed"
                assert record(client, key, "b")["status"] == "pending"
    finally:
        stop(proc)
    for key, worker, other in zip(keys, workers, reversed(workers), strict=True):
        shard = shard_of(cluster_database, key)
        assert [name for name in copies(worker) if f"_{shard}_" in name] != []
        assert [name for name in copies(other) if f"_{shard}_" in name] == []


def test_a_copy_writes_only_its_own_shard_and_judges_anything_else_through_citus(
    citus: CitusCluster, cluster_database: str
) -> None:
    """A copy called with an instance of another shard (one of the other worker's) is the
    distributed judge's call: the record lands on the worker that holds that instance, as a
    coordinator's read shows, and no row on the copy's node. A node asked for a copy of a
    shard it does not hold makes none."""
    here, there = one_key_per_worker(cluster_database, citus)
    workers = workers_of(citus, cluster_database)
    shard = shard_of(cluster_database, here)
    copy = make_copy(workers[0], shard)
    assert copy is not None
    assert make_copy(workers[1], shard) is None
    before = rows_on_worker(workers[0], "workflow_step_record")
    assert start_on(workers[0], copy, there, "elsewhere") == ("created", "running")
    assert start_on(workers[0], copy, there, "elsewhere") == ("replay", "running")
    assert rows_on_worker(workers[0], "workflow_step_record") == before
    with psycopg.connect(cluster_database, autocommit=True) as conn:
        row = conn.execute(
            "SELECT r.status FROM workflow_step_record r"
            " WHERE r.instance_id = steprecord_instance_id(%s) AND r.step_slug = 'elsewhere'",
            (there,),
        ).fetchone()
    assert row == ("running",)
    assert start_on(workers[0], copy, here, "own") == ("created", "running")
    assert rows_on_worker(workers[0], "workflow_step_record") == before + 1


def test_a_copy_whose_shard_moved_away_judges_where_the_shard_is_now(
    citus: CitusCluster,
) -> None:
    """A copy made before its shard moved to the other worker (and the old placement's tables
    cleaned up) writes nothing on its node: its calls are the distributed judge's, on the
    shard's new node, and every write before and after the move is there."""
    with migrated_database(citus.url, "steprecord_shard_moved_") as url:
        key = f"moved-{uuid.uuid4().hex[:8]}"
        workers = workers_of(citus, url)
        ports = [int(worker.port or 0) for worker in citus.workers]
        shard = shard_of(url, key)
        source = next(n for n, worker in enumerate(workers) if make_copy(worker, shard))
        copy = make_copy(workers[source], shard)
        assert copy is not None
        assert start_on(workers[source], copy, key, "before") == ("created", "running")
        target = 1 - source
        host = psycopg.conninfo.conninfo_to_dict(citus.workers[0].url)["host"]
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(MOVE, (shard, host, ports[source], host, ports[target]))
            conn.execute("CALL citus_cleanup_orphaned_resources()")
        assert start_on(workers[source], copy, key, "after") == ("created", "running")
        assert start_on(workers[source], copy, key, "before") == ("replay", "running")
        assert rows_on_worker(workers[source], "workflow_step_record") == 0
        assert rows_on_worker(workers[target], "workflow_step_record") == 2
        assert make_copy(workers[source], shard) is None


def test_a_copy_gone_is_made_again_and_the_event_still_succeeds(
    citus: CitusCluster, cluster_database: str
) -> None:
    """The service keeps each copy's name per connection; a copy dropped meanwhile (as a
    revision that changes the template leaves it) answers undefined_function, and the service
    judges the event through the judge and asks for the copy again: nothing is refused."""
    keys = one_key_per_worker(cluster_database, citus)
    workers = workers_of(citus, cluster_database)
    base, proc = start_server(
        cluster_database, env={"STEPRECORD_SWEEP_SECONDS": "0", "STEPRECORD_POOL_SIZE": "1"}
    )
    try:
        with httpx.Client(base_url=base, timeout=30) as client:
            for key in keys:
                assert post(client, "start", {"attempt": 1}, key, "gone").status_code == 201
            for worker in workers:
                with psycopg.connect(worker, autocommit=True) as conn:
                    conn.execute("SELECT steprecord_drop_shard_judges()")
                assert copies(worker) == []
            for key in keys:
                answer = post(client, "complete", {"attempt": 1}, key, "gone")
                assert answer.status_code == 200, answer.text
                assert post(client, "start", {"attempt": 1}, key, "again").status_code == 201
    finally:
        stop(proc)
    for key, worker in zip(keys, workers, strict=True):
        shard = shard_of(cluster_database, key)
        assert [name for name in copies(worker) if f"_{shard}_" in name] != []


def test_migrate_drops_every_node_s_copies_before_it_changes_the_schema(
    citus: CitusCluster,
) -> None:
    """Copies name the judge's answer type, which a revision may drop: a downgrade and an
    upgrade run with copies on both workers, which are gone afterwards."""
    with migrated_database(citus.url, "steprecord_shard_migrate_") as url:
        keys = one_key_per_worker(url, citus)
        workers = workers_of(citus, url)
        for key, worker in zip(keys, workers, strict=True):
            assert make_copy(worker, shard_of(url, key)) is not None
            assert copies(worker) != []
        config = alembic_config()
        config.attributes["database_url"] = url
        command.downgrade(config, "0039")
        assert [copies(worker) for worker in workers] == [[], []]
        command.upgrade(config, "head")
        for key, worker in zip(keys, workers, strict=True):
            assert make_copy(worker, shard_of(url, key)) is not None
        command.downgrade(config, "0039")
        assert [copies(worker) for worker in workers] == [[], []]


def test_the_copies_follow_the_judge_s_grants_made_or_revoked_after_them(
    citus: CitusCluster,
) -> None:
    """A runtime role granted (`steprecord grant`) after a node made a copy calls it once it
    asks for it; revoked the judge, it is revoked the copy when the copy is next asked for."""
    with (
        login_role(citus.url, "steprecord_late_") as role,
        migrated_database(citus.url, "steprecord_shard_grant_") as url,
    ):
        key = one_key_per_worker(url, citus)[0]
        worker = workers_of(citus, url)[0]
        shard = shard_of(url, key)
        copy = make_copy(worker, shard)
        assert copy is not None
        with psycopg.connect(url, autocommit=True) as conn:
            for statement in roles.grants(role):
                conn.execute(statement)
        as_role = psycopg.conninfo.make_conninfo(worker, user=role)
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            start_on(as_role, copy, key, "before-asking")
        assert make_copy(as_role, shard) == copy
        assert start_on(as_role, copy, key, "granted") == ("created", "running")
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(f"REVOKE EXECUTE ON FUNCTION steprecord_apply_event FROM {role}")
        assert make_copy(worker, shard) == copy
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            start_on(as_role, copy, key, "revoked")
