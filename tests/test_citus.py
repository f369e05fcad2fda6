"""On a Citus cluster: a coordinator and two workers of the tests' own (the `citus` fixture)."""

import uuid
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

from app.cli.migrate import migrate
from app.data.judge import APPLY_EVENT
from app.data.repairs import REOPEN
from tests.support.citus import CitusCluster, add_citus_nodes, on_node, rows_on_worker
from tests.support.databases import create_database, drop_database
from tests.support.servers import steprecord


def test_a_database_made_on_the_cluster_spreads_a_distributed_table_over_both_workers(
    citus: CitusCluster,
) -> None:
    name = f"steprecord_citus_{uuid.uuid4().hex[:8]}"
    url = create_database(citus.url, name)
    try:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("CREATE TABLE spread (key text PRIMARY KEY)")
            conn.execute("SELECT create_distributed_table('spread', 'key')")
            conn.execute("INSERT INTO spread SELECT 'k' || g FROM generate_series(1, 200) g")
        on_workers = [
            rows_on_worker(psycopg.conninfo.make_conninfo(worker.url, dbname=name), "spread")
            for worker in citus.workers
        ]
        assert sum(on_workers) == 200
        assert all(count > 0 for count in on_workers), on_workers
    finally:
        drop_database(citus.url, name)


# --- distribution by `steprecord migrate` ----------------------------------------------------

TABLES = """
SELECT logicalrelid::text, partmethod, column_to_column_name(logicalrelid, partkey), colocationid
FROM pg_dist_partition ORDER BY 1
"""
FUNCTION = """
SELECT distribution_argument_index, colocationid FROM pg_dist_object
WHERE objid = %s::regproc
"""


def worker_catalog(worker_url: str, query: str) -> set[tuple[Any, ...]]:
    with psycopg.connect(worker_url, autocommit=True) as conn:
        conn.execute("SET citus.override_table_visibility TO off")
        return {tuple(row) for row in conn.execute(query).fetchall()}


def test_migrate_distributes_the_fact_tables_by_instance_and_the_judge_with_them(
    citus: CitusCluster,
) -> None:
    name = f"steprecord_citus_{uuid.uuid4().hex[:8]}"
    url = create_database(citus.url, name)
    try:
        migrate(url)
        migrate(url)  # again: already distributed, nothing to do
        with psycopg.connect(url) as conn:
            tables = conn.execute(TABLES).fetchall()
            function = conn.execute(FUNCTION, ("steprecord_apply_event",)).fetchone()
            reopen = conn.execute(FUNCTION, ("steprecord_reopen",)).fetchone()
        by_name = {table: (method, column) for table, method, column, _ in tables}
        assert by_name == {  # the tokens and the access policy stay on the coordinator
            "process_instance": ("h", "id"),
            "workflow_step_attempt": ("h", "instance_id"),
            "workflow_step_record": ("h", "instance_id"),
            "workflow_step_repair": ("h", "instance_id"),
        }
        colocation = {colocated for table, _, _, colocated in tables if by_name[table][0] == "h"}
        assert len(colocation) == 1
        # The one-event judge, and an operator's reopen, are delegated by their first
        # argument, the instance's id.
        assert function == reopen == (0, colocation.pop())
        # Every shard on every worker carries the CHECKs and the guard triggers (as many
        # instance shards as record shards: co-located).
        for worker in citus.workers:
            shards = worker_catalog(
                on_node(worker.url, name),
                "SELECT c.relname FROM pg_class c WHERE c.relkind = 'r'"
                " AND c.relname ~ '^workflow_step_record_[0-9]+$'",
            )
            guarded = worker_catalog(
                on_node(worker.url, name),
                "SELECT c.relname FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid"
                " WHERE t.tgname ~ '^tr_workflow_step_record_transition_[0-9]+$'",
            )
            checked = worker_catalog(
                on_node(worker.url, name),
                "SELECT count(*) FROM pg_constraint"
                " WHERE conname = 'ck_process_instance_id_derived'"
                " AND conrelid::regclass::text ~ '^process_instance_[0-9]+$'",
            )
            assert shards
            assert guarded == shards
            assert checked == {(len(shards),)}
    finally:
        drop_database(citus.url, name)


@pytest.mark.parametrize(
    ("options", "shards"), [(None, 8), ("-c citus.shard_count=4", 4)], ids=["unset", "set"]
)
def test_migrate_gives_the_instances_eight_shards_unless_the_operator_set_a_count(
    citus: CitusCluster, options: str | None, shards: int
) -> None:
    name = f"steprecord_citus_{uuid.uuid4().hex[:8]}"
    url = create_database(citus.url, name)
    try:
        migrate(url if options is None else psycopg.conninfo.make_conninfo(url, options=options))
        with psycopg.connect(url) as conn:
            counts = conn.execute(
                "SELECT logicalrelid::text, count(*) FROM pg_dist_shard GROUP BY 1"
            ).fetchall()
        assert dict(counts) == {
            table: shards
            for table in (
                "process_instance",
                "workflow_step_record",
                "workflow_step_attempt",
                "workflow_step_repair",
            )
        }
    finally:
        drop_database(citus.url, name)


# At one node: 40 instances, each with a completed step and a running one.
WRITE_ROWS = """
SELECT count(*) FROM steprecord_apply_events(
    (SELECT array_agg(g) FROM generate_series(0, 79) g),
    (SELECT array_agg('run-' || (g / 2)) FROM generate_series(0, 79) g),
    (SELECT array_agg(CASE WHEN g % 2 = 0 THEN 'done' ELSE 'busy' END)
     FROM generate_series(0, 79) g),
    (SELECT array_fill('start'::text, ARRAY[80])),
    (SELECT array_fill(1::bigint, ARRAY[80])),
    NULL::timestamptz[], NULL::timestamptz[], NULL::text[], NULL::text[], NULL::text[],
    NULL::text[], NULL::bigint[], NULL::int[])
"""
COMPLETE_DONE = """
UPDATE workflow_step_record SET status = 'completed', completed_at = started_at,
       output = '{"n": 1}'
WHERE step_slug = 'done'
"""
SNAPSHOT = """
SELECT p.id, p.instance_key, r.step_slug, r.status, r.attempt_count, r.output::text,
       a.attempt, a.status
FROM process_instance p
JOIN workflow_step_record r ON r.instance_id = p.id
JOIN workflow_step_attempt a ON a.instance_id = r.instance_id AND a.record_id = r.id
ORDER BY 2, 3, 7
"""


def test_a_database_with_rows_that_gets_citus_is_distributed_by_the_next_migrate(
    citus: CitusCluster,
) -> None:
    name = f"steprecord_citus_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(citus.url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = on_node(citus.url, name)
    try:
        migrate(url)  # one node: no extension yet
        with psycopg.connect(url) as conn:
            conn.execute(WRITE_ROWS)
            conn.execute(COMPLETE_DONE)
            before = conn.execute(SNAPSHOT).fetchall()
        assert len(before) == 80
        # The operator adds Citus as its guide says: the extension on every node, the
        # workers added; then `steprecord migrate`.
        for worker in citus.workers:
            with psycopg.connect(worker.url, autocommit=True) as conn:
                conn.execute(f'CREATE DATABASE "{name}"')
            with psycopg.connect(on_node(worker.url, name), autocommit=True) as conn:
                conn.execute("CREATE EXTENSION citus")
        add_citus_nodes(url, [worker.url for worker in citus.workers])
        migrate(url)
        with psycopg.connect(url) as conn:
            assert conn.execute(SNAPSHOT).fetchall() == before
            assert (
                len(conn.execute(TABLES).fetchall()) == 4
            )  # the fact tables and the repair log; the tokens stay on the coordinator
        on_workers = [
            rows_on_worker(on_node(worker.url, name), "workflow_step_record")
            for worker in citus.workers
        ]
        assert sum(on_workers) == 80
        assert all(on_workers), on_workers
        # Raw SQL through the coordinator is refused as on one node: a completed record
        # never changes within its attempt.
        with psycopg.connect(url) as conn:
            with pytest.raises(psycopg.errors.CheckViolation) as caught:
                conn.execute(
                    "UPDATE workflow_step_record SET output = '2'"
                    " WHERE instance_id = steprecord_instance_id('run-7') AND step_slug = 'done'"
                )
            # The worker's refusal, its SQLSTATE and message (Citus does not forward the
            # constraint's name to the coordinator's client).
            assert "a finished attempt never changes" in str(caught.value)
    finally:
        drop_database(citus.url, name)


def test_the_coordinator_delegates_the_one_event_judge_to_the_worker_holding_the_instance(
    citus: CitusCluster,
) -> None:
    """The service's own statement (app/data/judge.py) with its parameters, on a connection in
    autocommit as the service's are: the plan is one task on one worker, the whole function
    call sent there. (Inside an explicit transaction block Citus 13 does not delegate.)"""
    name = f"steprecord_citus_{uuid.uuid4().hex[:8]}"
    url = create_database(citus.url, name)
    try:
        migrate(url)
        params = [0, "run-1", "a", "declare", *([None] * 10), "anonymous", None]
        with (
            psycopg.connect(url, autocommit=True) as conn,
            psycopg.RawCursor(conn) as cur,
        ):
            cur.execute(f"EXPLAIN (VERBOSE) {APPLY_EVENT}", params)
            plan = "\n".join(str(row[0]) for row in cur.fetchall())
        assert "Custom Scan (Citus Adaptive)" in plan
        assert "Task Count: 1" in plan
        assert "Function Call: steprecord_apply_event(" in plan
    finally:
        drop_database(citus.url, name)


def test_a_reopen_runs_on_the_worker_holding_the_instance_and_its_log_stays_there(
    citus: CitusCluster,
) -> None:
    """The service's reopen statement (app/data/repairs.py) is delegated whole to the worker
    holding the instance; the record is reopened there and its repair log written beside it,
    refused to hand-written SQL through the coordinator, and deleted with the instance. The
    rows are written at one node first (the judge's new-record path on Citus is not this
    test's subject), then the database gets Citus."""
    name = f"steprecord_citus_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(citus.url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = on_node(citus.url, name)
    try:
        migrate(url)
        with psycopg.connect(url) as conn:
            conn.execute(WRITE_ROWS)
            conn.execute(COMPLETE_DONE)
        for worker in citus.workers:
            with psycopg.connect(worker.url, autocommit=True) as conn:
                conn.execute(f'CREATE DATABASE "{name}"')
            with psycopg.connect(on_node(worker.url, name), autocommit=True) as conn:
                conn.execute("CREATE EXTENSION citus")
        add_citus_nodes(url, [worker.url for worker in citus.workers])
        migrate(url)
        ask = {"instance_key": "run-7", "step_slug": "done", "attempt": 1, "reason": "why"}
        with psycopg.connect(url, autocommit=True) as conn:
            plan = "\n".join(
                str(row[0])
                for row in conn.execute(f"EXPLAIN (VERBOSE) {REOPEN}", {**ask, "by": "ops"})
            )
            assert "Task Count: 1" in plan
            assert "Function Call: steprecord_reopen(" in plan
            # The service's statement as it sends it: delegated whole to the worker.
            with conn.cursor(row_factory=dict_row) as cur:
                row = cur.execute(REOPEN, {**ask, "by": "ops"}).fetchone()
                assert row is not None
                assert (row["outcome"], row["status"], row["attempt_count"]) == (
                    "reopened",
                    "pending",
                    2,
                )
                again = cur.execute(REOPEN, {**ask, "by": "ops"}).fetchone()
                assert again is not None
                assert again["outcome"] == "stale_attempt"
            logged = conn.execute(
                "SELECT step_slug, attempt, reason, repaired_by FROM workflow_step_repair"
                " WHERE instance_id = steprecord_instance_id('run-7')"
            ).fetchall()
            assert logged == [("done", 1, "why", "ops")]
            for statement in (
                "UPDATE workflow_step_repair SET reason = 'rewritten'"
                " WHERE instance_id = steprecord_instance_id('run-7')",
                "DELETE FROM workflow_step_repair"
                " WHERE instance_id = steprecord_instance_id('run-7')",
            ):
                with pytest.raises(psycopg.errors.CheckViolation) as caught:
                    conn.execute(statement)
                assert "the repair log is append-only" in str(caught.value)
        on_workers = [
            rows_on_worker(on_node(worker.url, name), "workflow_step_repair")
            for worker in citus.workers
        ]
        assert sorted(on_workers) == [0, 1]
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(
                "DELETE FROM workflow_step_record"
                " WHERE instance_id = steprecord_instance_id('run-7')"
            )
            conn.execute("DELETE FROM process_instance WHERE id = steprecord_instance_id('run-7')")
            assert conn.execute("SELECT count(*) FROM workflow_step_repair").fetchone() == (0,)
    finally:
        drop_database(citus.url, name)


def test_token_commands_work_on_a_distributed_database(citus: CitusCluster) -> None:
    """The tokens and the access policy stay on the coordinator: a first token makes tokens
    required (the policy's trigger), a prefixed token is made, listed and revoked, and
    anonymous access is refused back while a token exists."""
    name = f"steprecord_citus_{uuid.uuid4().hex[:8]}"
    url = create_database(citus.url, name)
    try:
        migrate(url)
        for args in (
            ("token", "allow-anonymous"),
            ("token", "create", "ci", "--scope", "write"),
            ("token", "create", "acme", "--scope", "read", "--prefix", "acme:"),
            ("token", "revoke", "acme"),
        ):
            done = steprecord(url, *args)
            assert done.returncode == 0, (args, done.stderr)
        listed = steprecord(url, "token", "list")
        assert listed.returncode == 0, listed.stderr
        assert [line.split("\t")[:2] for line in listed.stdout.splitlines() if "\t" in line] == [
            ["ci", "write"]
        ]
        again = steprecord(url, "token", "allow-anonymous")
        assert again.returncode == 1
        assert "tokens exist" in again.stdout + again.stderr
        with psycopg.connect(url) as conn:
            assert conn.execute("SELECT tokens_required FROM access_policy").fetchone() == (True,)
    finally:
        drop_database(citus.url, name)


# Hand-written writes of a guarded row, each refused on the cluster: by the history's guard
# (only the record's trigger writes the history) and by a record's CHECK (a completed record
# has its times).
REFUSED_BY_VALUES = (
    "INSERT INTO workflow_step_attempt (instance_id, record_id, attempt, status, started_at,"
    " created_at, updated_at) VALUES (steprecord_instance_id('run-1'), 1, 5, 'running', now(),"
    " now(), now())",
    "INSERT INTO workflow_step_record (instance_id, step_slug, ordinal, status, attempt_count,"
    " created_at, updated_at) VALUES (steprecord_instance_id('run-1'), 'z', 99, 'completed', 1,"
    " now(), now())",
)
REFUSED_BY_SELECT = (
    "INSERT INTO workflow_step_attempt (instance_id, record_id, attempt, status, started_at,"
    " created_at, updated_at) SELECT instance_id, id, 5, 'running', now(), now(), now()"
    " FROM workflow_step_record",
    "INSERT INTO workflow_step_record (instance_id, step_slug, ordinal, status, attempt_count,"
    " created_at, updated_at) SELECT instance_id, 'z', 99, 'completed', 1, now(), now()"
    " FROM workflow_step_record",
)


def test_a_refusal_keeps_its_sqlstate_except_in_rows_citus_copies(citus: CitusCluster) -> None:
    """An `INSERT … VALUES` refused by a guard or a CHECK answers `23514` on the cluster as on
    one node; an `INSERT … SELECT` over many instances, whose rows Citus sends to the shards by
    COPY, answers `XX000` with the same words: Citus relays a shard's refusal of a COPY by its
    message alone (what docs/operations.md tells a script writer). Nothing is written."""
    name = f"steprecord_citus_{uuid.uuid4().hex[:8]}"
    url = create_database(citus.url, name)
    try:
        migrate(url)
        with psycopg.connect(url, autocommit=True) as conn, psycopg.RawCursor(conn) as cur:
            for key in ("run-1", "run-2", "run-3"):
                cur.execute(APPLY_EVENT, [0, key, "a", "start", *([None] * 10), "x", None])
            for statement in REFUSED_BY_VALUES:
                with pytest.raises(psycopg.errors.CheckViolation) as refused:
                    conn.execute(statement)
                assert "violates" in str(refused.value)
            for statement in REFUSED_BY_SELECT:
                with pytest.raises(psycopg.errors.InternalError) as copied:
                    conn.execute(statement)
                assert "violates" in str(copied.value)
            counts = conn.execute(
                "SELECT (SELECT count(*) FROM workflow_step_record),"
                " (SELECT count(*) FROM workflow_step_attempt)"
            ).fetchone()
        assert counts == (3, 3)
    finally:
        drop_database(citus.url, name)
