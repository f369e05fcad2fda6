"""What the database refuses and keeps for the history (raw SQL): `workflow_step_attempt`.

The history is written only by the record's triggers, so every write to the record — even a
hand-written `UPDATE` — keeps it true (docs/api.md, "Attempt history").
"""

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from app.core.tables import STATUSES
from app.data import leases, reads
from app.data.common import constraint_name
from tests.support.citus import has_citus, node_of
from tests.support.http import T1, T2
from tests.support.plans import one_shard, task_plans
from tests.support.rows import BASE, Conn, insert, refused

T3 = "2026-12-02T10:00:03Z"
GUARD = "tr_workflow_step_attempt_guard"


def history(db: Conn, record_id: int) -> list[tuple[Any, ...]]:
    return db.execute(
        "SELECT attempt, status, started_at::text, completed_at::text, output::text,"
        " error_code FROM workflow_step_attempt WHERE record_id = %s ORDER BY attempt",
        (record_id,),
    ).fetchall()


def update(db: Conn, record_id: int, **change: Any) -> None:
    sets = ", ".join(f"{column} = %s" for column in change)
    db.execute(
        f"UPDATE workflow_step_record SET {sets} WHERE id = %s", [*change.values(), record_id]
    )


def test_a_pending_record_has_no_history(db: Conn, instance_id: int) -> None:
    assert history(db, insert(db, instance_id)) == []


def test_a_hand_written_update_keeps_the_history_true(db: Conn, instance_id: int) -> None:
    record_id = insert(db, instance_id)
    update(db, record_id, status="running", started_at=T1)
    assert history(db, record_id) == [(1, "running", "2026-12-02 10:00:01+00", None, None, None)]
    update(db, record_id, status="failed", completed_at=T2, error_code="Boom")
    update(
        db,
        record_id,
        status="running",
        attempt_count=2,
        started_at=T2,
        completed_at=None,
        error_code=None,
    )
    update(db, record_id, attempt_count=3, started_at=T3)
    update(db, record_id, status="completed", completed_at=T3, output='{"a": 1}')
    assert history(db, record_id) == [
        (1, "failed", "2026-12-02 10:00:01+00", "2026-12-02 10:00:02+00", None, "Boom"),
        (2, "superseded", "2026-12-02 10:00:02+00", "2026-12-02 10:00:03+00", None, None),
        (3, "completed", "2026-12-02 10:00:03+00", "2026-12-02 10:00:03+00", '{"a": 1}', None),
    ]


def test_a_record_inserted_finished_starts_its_history_finished(db: Conn, instance_id: int) -> None:
    record_id = insert(db, instance_id, **{**BASE["failed"], "attempt_count": 4})
    assert [row[:2] for row in history(db, record_id)] == [(4, "failed")]


def test_an_update_that_changes_nothing_shown_leaves_the_history_alone(
    db: Conn, instance_id: int
) -> None:
    record_id = insert(db, instance_id, **BASE["completed"])
    before = db.execute("SELECT xmin::text, updated_at FROM workflow_step_attempt").fetchall()
    update(db, record_id, updated_at="2030-01-01T00:00:00Z")
    after = db.execute("SELECT xmin::text, updated_at FROM workflow_step_attempt").fetchall()
    assert before == after


def test_a_running_attempt_mirrors_the_lease_and_a_finished_one_keeps_it(
    db: Conn, instance_id: int
) -> None:
    record_id = insert(db, instance_id, **BASE["running"], lease_expires_at=T2)
    update(db, record_id, lease_expires_at=T3)
    update(db, record_id, status="completed", completed_at=T3, lease_expires_at=None)
    row = db.execute("SELECT status, lease_expires_at::text FROM workflow_step_attempt").fetchone()
    assert row == ("completed", "2026-12-02 10:00:03+00")


def test_deleting_a_record_deletes_its_history(db: Conn, instance_id: int) -> None:
    record_id = insert(db, instance_id, **BASE["running"])
    db.execute("DELETE FROM workflow_step_record WHERE id = %s", (record_id,))
    assert history(db, record_id) == []


@pytest.mark.parametrize(
    "sql",
    [
        "INSERT INTO workflow_step_attempt (instance_id, record_id, attempt, status, started_at)"
        " VALUES (%(instance_id)s, %(record_id)s, 9, 'running', now())",
        "UPDATE workflow_step_attempt SET started_at = timestamptz '2026-12-02T10:00:00Z'",
        "UPDATE workflow_step_attempt SET status = 'failed', completed_at = now(),"
        " error_code = 'Fake'",
        "DELETE FROM workflow_step_attempt",
    ],
    ids=["insert", "update-running", "update-to-failed", "delete"],
)
def test_the_history_refuses_direct_writes(db: Conn, instance_id: int, sql: str) -> None:
    record_id = insert(db, instance_id, **BASE["running"])
    refused(db, GUARD, sql, {"instance_id": instance_id, "record_id": record_id})


def test_a_finished_attempt_never_changes_even_from_a_trigger(db: Conn, instance_id: int) -> None:
    """The guard's second line: a write that comes through a trigger still cannot change a
    finished attempt (a poke table's trigger stands in for a future buggy trigger)."""
    insert(db, instance_id, **BASE["failed"])
    db.execute("CREATE TEMP TABLE poke (x int)")
    db.execute("""
        CREATE FUNCTION pg_temp.poke() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN UPDATE workflow_step_attempt SET error_message = 'rewritten'; RETURN NULL; END $$
    """)
    db.execute(
        "CREATE TRIGGER poke AFTER INSERT ON poke FOR EACH ROW EXECUTE FUNCTION pg_temp.poke()"
    )
    refused(db, GUARD, "INSERT INTO poke VALUES (1)")


VALID_ATTEMPT = {
    "running": {"status": "running", "started_at": T1},
    "completed": {"status": "completed", "started_at": T1, "completed_at": T2, "output": "1"},
    "failed": {"status": "failed", "started_at": T1, "completed_at": T2, "error_code": "E"},
    "superseded": {"status": "superseded", "started_at": T1, "completed_at": T2},
}
FORBIDDEN_ATTEMPTS: list[tuple[str, str, dict[str, Any]]] = [
    ("status_known", "running", {"status": "pending"}),
    ("attempt_positive", "running", {"attempt": 0}),
    ("output_inline_xor_external", "completed", {"external_output_url": "s3://b/k"}),
    ("output_size", "completed", {"output": '"' + "x" * 1048575 + '"'}),
    ("external_output_url_format", "completed", {"output": None, "external_output_url": "x"}),
    ("error_code_format", "failed", {"error_code": "no spaces"}),
    ("error_message_size", "failed", {"error_message": "é" * 32769}),
    ("timing", "completed", {"started_at": T2, "completed_at": T1}),
    ("running_content", "running", {"started_at": None}),
    ("running_content", "running", {"completed_at": T2}),
    ("running_content", "running", {"output": "1"}),
    ("running_content", "running", {"error_code": "E"}),
    ("completed_content", "completed", {"completed_at": None}),
    ("completed_content", "completed", {"error_message": "m"}),
    ("failed_content", "failed", {"error_code": None}),
    ("failed_content", "failed", {"output": "1"}),
    ("failed_content", "failed", {"started_at": None}),
    ("superseded_content", "superseded", {"completed_at": None}),
    ("superseded_content", "superseded", {"error_code": "E"}),
    ("superseded_content", "superseded", {"external_output_url": "s3://b/k"}),
]


def owner_of(db: Conn, record_id: int) -> int:
    row = db.execute("SELECT instance_id FROM workflow_step_record WHERE id = %s", (record_id,))
    found = row.fetchone()
    assert found is not None
    return int(found[0])


def _insert_attempt(db: Conn, record_id: int, fields: dict[str, Any]) -> None:
    """One attempt of the record, its instance given so that on Citus the INSERT goes to the
    one worker holding the instance."""
    values = {"instance_id": owner_of(db, record_id), "record_id": record_id, "attempt": 7}
    values |= fields
    marks = ", ".join(["%s"] * len(values))
    db.execute(
        f"INSERT INTO workflow_step_attempt ({', '.join(values)}) VALUES ({marks})",
        list(values.values()),
    )


@pytest.fixture
def unguarded(db: Conn, instance_id: int) -> int:
    """A record, with the history's write guard off for this (rolled back) transaction, so the
    CHECKs themselves can be tried; returns the record's id."""
    db.execute(f"ALTER TABLE workflow_step_attempt DISABLE TRIGGER {GUARD}")
    return insert(db, instance_id, **BASE["running"])


@pytest.mark.parametrize("status", VALID_ATTEMPT)
def test_valid_attempt_shapes_are_accepted(db: Conn, unguarded: int, status: str) -> None:
    _insert_attempt(db, unguarded, VALID_ATTEMPT[status])


@pytest.mark.parametrize(("constraint", "status", "change"), FORBIDDEN_ATTEMPTS)
def test_forbidden_attempts_are_refused_by_their_named_constraint(
    db: Conn, unguarded: int, constraint: str, status: str, change: dict[str, Any]
) -> None:
    with pytest.raises(psycopg.errors.IntegrityError) as caught, db.transaction():
        _insert_attempt(db, unguarded, {**VALID_ATTEMPT[status], **change})
    assert constraint_name(caught.value) == f"ck_workflow_step_attempt_{constraint}"


def test_an_attempt_belongs_to_a_record_of_its_own_instance(db: Conn, unguarded: int) -> None:
    other = db.execute(
        "INSERT INTO process_instance (id, instance_key)"
        " VALUES (steprecord_instance_id('run-2'), 'run-2') RETURNING id"
    )
    row = other.fetchone()
    assert row is not None
    with pytest.raises(psycopg.errors.IntegrityError) as caught, db.transaction():
        db.execute(
            "INSERT INTO workflow_step_attempt (instance_id, record_id, attempt, status,"
            " started_at) VALUES (%s, %s, 5, 'running', now())",
            (row[0], unguarded),
        )
    assert constraint_name(caught.value) == (
        "fk_workflow_step_attempt_instance_id_workflow_step_record"
    )
    with pytest.raises(psycopg.errors.IntegrityError) as caught, db.transaction():
        _insert_attempt(db, unguarded, {**VALID_ATTEMPT["running"], "attempt": 1})
    assert constraint_name(caught.value) == (
        "uq_workflow_step_attempt_instance_id_record_id_attempt"
    )


@pytest.mark.parametrize("status", ["pending", "completed", "failed"])
def test_only_a_running_record_holds_a_lease(db: Conn, instance_id: int, status: str) -> None:
    values = {"step_slug": "s", "ordinal": 0, "attempt_count": 1, **BASE[status]}
    columns = ", ".join(["instance_id", *values, "lease_expires_at"])
    marks = ", ".join(["%s"] * (len(values) + 2))
    refused(
        db,
        "ck_workflow_step_record_lease_only_running",
        f"INSERT INTO workflow_step_record ({columns}) VALUES ({marks})",
        [instance_id, *values.values(), T2],
    )


def test_the_backfill_gives_every_started_record_its_current_attempt(
    scratch_database: str,
) -> None:
    from alembic import command

    from app.main import alembic_config

    if has_citus(scratch_database):
        pytest.skip(
            "the backfill is revision 0003, for one server: a schema before 0020 cannot be"
            " distributed on Citus (its keys lack the instance's id)"
        )
    config = alembic_config()
    config.attributes["database_url"] = scratch_database
    command.upgrade(config, "0002")
    with psycopg.connect(scratch_database) as conn:
        conn.execute("INSERT INTO process_instance (instance_key) VALUES ('old')")
        for slug, fields in (
            ("p", BASE["pending"]),
            ("r", {**BASE["running"], "attempt_count": 2}),
            ("f", {**BASE["failed"], "attempt_count": 3}),
        ):
            values = {
                "instance_id": 1,
                "step_slug": slug,
                "ordinal": ord(slug),
                "attempt_count": 1,
                **fields,
            }
            conn.execute(
                f"INSERT INTO workflow_step_record ({', '.join(values)})"
                f" VALUES ({', '.join(['%s'] * len(values))})",
                list(values.values()),
            )
    command.upgrade(config, "head")
    with psycopg.connect(scratch_database) as conn:
        rows = conn.execute(
            "SELECT r.step_slug, a.attempt, a.status, a.error_code FROM workflow_step_attempt a"
            " JOIN workflow_step_record r ON r.id = a.record_id ORDER BY r.step_slug"
        ).fetchall()
    assert rows == [("f", 3, "failed", "Boom"), ("r", 2, "running", None)]


# --- indexed reads across instances ---------------------------------------------------


@pytest.fixture
def wide_table(db: Conn) -> Conn:
    """10^5 records of every status over 100 instances (rolled back after the test). On Citus
    all in one shard (see `one_shard`): spread over its shards they would be a few thousand a
    shard, which the planner rightly reads whole."""
    db.execute(
        """
        INSERT INTO process_instance (id, instance_key)
        SELECT DISTINCT ON (i) steprecord_instance_id(k), k
        FROM generate_series(1, 100) i, generate_series(1, 20 * %(shards)s) c,
             LATERAL (SELECT 'run-' || i || '-' || c AS k) x
        WHERE hashint8(steprecord_instance_id(k)) BETWEEN %(low)s AND %(high)s
        ORDER BY i, c
        """,
        vars(one_shard(db)),
    )
    db.execute("""
        INSERT INTO workflow_step_record (instance_id, step_slug, ordinal, status, attempt_count,
            started_at, completed_at, error_code, lease_expires_at, updated_at)
        SELECT p.id, 'step-' || s, s, x.status, 1,
               CASE WHEN x.status <> 'pending' THEN timestamptz '2026-01-01' END,
               CASE WHEN x.status IN ('completed', 'failed') THEN timestamptz '2026-01-02' END,
               CASE WHEN x.status = 'failed' THEN 'E' END,
               CASE WHEN x.status = 'running' AND s % 3 = 0
                    THEN timestamptz '2026-01-01' + s * interval '1 s' END,
               timestamptz '2026-01-01' + (s * 7 % 1000 + n) * interval '1 s'
        FROM process_instance p, generate_series(0, 999) s,
             LATERAL (SELECT split_part(p.instance_key, '-', 2)::int AS n) k,
             LATERAL (SELECT (ARRAY['pending', 'running', 'completed', 'failed'])[1 + s % 4]
                      AS status) x
    """)
    db.execute("ANALYZE workflow_step_record")
    db.execute("ANALYZE process_instance")
    return db


RECENT_FILTERS: list[tuple[tuple[str, ...], bool, bool, str]] = [
    (STATUSES, False, False, "ix_workflow_step_record_status_updated_at_id"),
    (("running", "failed"), False, False, "ix_workflow_step_record_status_updated_at_id"),
    (("failed",), True, False, "ix_workflow_step_record_status_updated_at_id"),
    (STATUSES, True, False, "ix_workflow_step_record_status_updated_at_id"),
    (("running",), False, True, "ix_workflow_step_record_leased_updated_at_id"),
]


def test_each_filter_across_instances_reads_its_index_without_sorting(wide_table: Conn) -> None:
    """All statuses, some, one; with and without `updated_after`; expired leases. One table
    for all (building 10^5 rows is the slow part)."""
    params = {
        "before": "2026-01-01T00:10:00Z",
        "before_id": 50_000,
        "updated_after": "2026-01-01T00:01:00Z",
        "limit": 101,
    }
    citus = has_citus(wide_table.info.dsn)
    for statuses, updated_after, lease_expired, index in RECENT_FILTERS:
        query = reads.list_recent_query(
            statuses, updated_after=updated_after, lease_expired=lease_expired
        )
        rows = wide_table.execute("EXPLAIN " + query, params).fetchall()
        text = task_plans("\n".join(str(r[0]) for r in rows))
        assert index in text, text
        assert "Sort  " not in text, text
        assert "Seq Scan on workflow" not in text, text
        if len(statuses) > 1:
            # One node merges the statuses' index ranges in order. Citus reads each range as a
            # subplan of its own (each shard's in order, under the LIMIT), then sorts at most
            # LIMIT rows of each range to merge them.
            if citus:
                for status in statuses:
                    assert f"Index Cond: ((status = '{status}'::text)" in text, text
            else:
                assert "Merge Append" in text, text
    rows = wide_table.execute("EXPLAIN " + leases.DUE_INSTANCES, {"limit": 500}).fetchall()
    text = "\n".join(str(r[0]) for r in rows)
    assert "ix_workflow_step_record_leased_updated_at_id" in text, text


# --- late reports of superseded attempts -----------------------------------------------------

LATE_FAIL = (
    "SELECT recorded FROM steprecord_apply_event(steprecord_instance_id('run-1'), 0, 'run-1',"
    " %s, 'fail', %s, NULL, %s, NULL,"
    " NULL, 'Late', NULL, NULL, NULL)"
)


@pytest.fixture
def judge_db(database_url: str, db: Conn) -> Iterator[Conn]:
    """Where a test calls the judge inside its own transaction, as `db`: on Citus a connection
    to the worker holding the instance 'run-1' (a call in a transaction block on the
    coordinator is not sent to that worker, and a `SET LOCAL` there would not reach it)."""
    if not has_citus(database_url):
        yield db
        return
    with psycopg.connect(node_of(database_url, "run-1")) as conn:
        try:
            yield conn
        finally:
            conn.rollback()


@pytest.fixture
def judged_instance(judge_db: Conn) -> int:
    """The instance 'run-1', made through `judge_db`."""
    row = judge_db.execute(
        "INSERT INTO process_instance (id, instance_key)"
        " VALUES (steprecord_instance_id('run-1'), 'run-1') RETURNING id"
    ).fetchone()
    assert row is not None
    return int(row[0])


def superseded(db: Conn, instance_id: int) -> int:
    """A record at attempt 2 whose attempt 1 is `superseded` in the history."""
    record_id = insert(db, instance_id, **BASE["running"])
    update(db, record_id, attempt_count=2, started_at=T2)
    assert [row[:2] for row in history(db, record_id)] == [(1, "superseded"), (2, "running")]
    return record_id


def slug_of(db: Conn, record_id: int) -> str:
    row = db.execute("SELECT step_slug FROM workflow_step_record WHERE id = %s", (record_id,))
    found = row.fetchone()
    assert found is not None
    return str(found[0])


def test_the_judge_turns_a_superseded_attempt_into_its_late_report(
    judge_db: Conn, judged_instance: int
) -> None:
    record_id = superseded(judge_db, judged_instance)
    (row,) = judge_db.execute(LATE_FAIL, (slug_of(judge_db, record_id), 1, T2)).fetchall()
    assert row == (True,)
    assert [r[:2] + r[5:] for r in history(judge_db, record_id)] == [
        (1, "failed", "Late"),
        (2, "running", None),
    ]


def test_the_judge_inserts_the_late_report_of_a_missing_attempt(
    judge_db: Conn, judged_instance: int
) -> None:
    record_id = insert(judge_db, judged_instance, **{**BASE["running"], "attempt_count": 3})
    assert judge_db.execute(LATE_FAIL, (slug_of(judge_db, record_id), 2, T2)).fetchall() == [
        (True,)
    ]
    assert [r[:2] for r in history(judge_db, record_id)] == [(2, "failed"), (3, "running")]


def test_a_hand_written_late_report_is_refused(db: Conn, instance_id: int) -> None:
    superseded(db, instance_id)
    refused(
        db,
        GUARD,
        "UPDATE workflow_step_attempt SET status = 'failed', error_code = 'Hand'"
        " WHERE status = 'superseded'",
    )
    late = insert(db, instance_id, **{**BASE["running"], "step_slug": "late", "attempt_count": 3})
    refused(
        db,
        GUARD,
        "INSERT INTO workflow_step_attempt (instance_id, record_id, attempt, status, started_at,"
        " completed_at, error_code) VALUES (%s, %s, 1, 'failed', %s, %s, 'Hand')",
        (instance_id, late, T1, T1),
    )


@pytest.mark.parametrize(
    "sql",
    [
        # A finished entry never changes, not even as the judge's writer.
        "UPDATE workflow_step_attempt SET error_message = 'rewritten' WHERE status = 'failed'",
        # A late report ends an attempt; it never reopens one.
        "UPDATE workflow_step_attempt SET status = 'running', completed_at = NULL"
        " WHERE status = 'superseded'",
        # Only an attempt older than its record's.
        "UPDATE workflow_step_attempt SET status = 'failed', error_code = 'E'"
        " WHERE status = 'running'",
        "INSERT INTO workflow_step_attempt (instance_id, record_id, attempt, status, started_at,"
        " completed_at, error_code) VALUES (%(instance_id)s, %(record_id)s, 5, 'failed',"
        " %(started_at)s, %(started_at)s, 'E')",
        "DELETE FROM workflow_step_attempt",
    ],
    ids=["finished", "reopen", "current-attempt", "newer-attempt", "delete"],
)
def test_even_the_judge_s_writer_may_only_end_an_older_superseded_or_missing_attempt(
    judge_db: Conn, judged_instance: int, sql: str
) -> None:
    """Attempt 1 failed (a late report), attempt 2 superseded, attempt 3 running."""
    record_id = superseded(judge_db, judged_instance)
    update(judge_db, record_id, attempt_count=3, started_at=T2)
    judge_db.execute(LATE_FAIL, (slug_of(judge_db, record_id), 1, T2))
    assert [r[:2] for r in history(judge_db, record_id)] == [
        (1, "failed"),
        (2, "superseded"),
        (3, "running"),
    ]
    judge_db.execute("SET LOCAL steprecord.writer = 'judge'")
    refused(
        judge_db,
        GUARD,
        sql,
        {"instance_id": judged_instance, "record_id": record_id, "started_at": T2},
    )


def test_a_late_report_never_changes_a_terminal_entry(judge_db: Conn, judged_instance: int) -> None:
    record_id = superseded(judge_db, judged_instance)
    slug = slug_of(judge_db, record_id)
    assert judge_db.execute(LATE_FAIL, (slug, 1, T2)).fetchall() == [(True,)]
    assert judge_db.execute(LATE_FAIL, (slug, 1, T2)).fetchall() == [(True,)]  # the same report
    other = LATE_FAIL.replace("'Late'", "'Other'")
    assert judge_db.execute(other, (slug, 1, T2)).fetchall() == [(False,)]
    assert history(judge_db, record_id)[0][:2] + history(judge_db, record_id)[0][5:] == (
        1,
        "failed",
        "Late",
    )
