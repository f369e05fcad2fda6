"""An instance's id is derived from its key, so two keys never share rows, and no tenant can
aim a key at another's id.

The id is the first 8 bytes of the key's HMAC-SHA-256 under the database's own secret
(app/sql/instance_id.sql, the secret made by revision 0036): the database, and so the
service, knows the id of every key, which is what Citus routes by; no client can compute it.
Revision 0020 gave existing instances their derived ids, revision 0036 their keyed ids (and
their records, history and repair log follow); their downgrades keep every row.
"""

import hashlib
import hmac
import uuid
from typing import Any

import httpx
import psycopg
import pytest
from alembic import command
from psycopg import sql

from app.cli.migrate import migrate
from app.main import alembic_config
from tests.support.citus import has_citus
from tests.support.databases import migrated_database
from tests.support.http import problem
from tests.support.servers import start_server, stop

KEYS = ("order-1", "run-2", "fetch:3", "Z", "a" * 200)


def sha256_prefix(key: str) -> int:
    """The id revisions 0020 to 0035 gave a key."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big", signed=True)


def database_secret(url: str) -> bytes:
    """The secret K behind the padded keys the database keeps, checked to be HMAC's pads."""
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT steprecord_instance_id_key()").fetchone()
    assert row is not None
    pads = bytes(row[0])
    assert len(pads) == 128
    secret = bytes(b ^ 0x36 for b in pads[:64])
    assert pads[64:] == bytes(b ^ 0x5C for b in secret)
    return secret


def hmac_prefix(secret: bytes, key: str) -> int:
    digest = hmac.new(secret, key.encode(), hashlib.sha256).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def test_an_instance_id_is_the_first_8_bytes_of_its_key_s_hmac_under_the_database_s_secret(
    scratch_database: str,
) -> None:
    migrate(scratch_database)
    secret = database_secret(scratch_database)
    with psycopg.connect(scratch_database) as conn:
        for key in KEYS:
            row = conn.execute("SELECT steprecord_instance_id(%s)", (key,)).fetchone()
            assert row == (hmac_prefix(secret, key),)
            assert row != (sha256_prefix(key),)


def test_the_id_function_is_inlined_and_gives_the_hmac_of_any_text_s_utf8_bytes(
    scratch_database: str,
) -> None:
    """Revision 0039 reads the key's bytes by `decode(..., 'escape')` of the key with its
    backslashes doubled, not by the STABLE `convert_to`, so that PostgreSQL inlines the
    function: the same bytes, also for a text with backslashes (an escape's look-alikes) or
    beyond ASCII, computed in a statement's kept plan (a parameter) as when the planner folds
    a constant."""
    migrate(scratch_database)
    secret = database_secret(scratch_database)
    texts = (*KEYS, "a\\b", "\\x41", "\\101", "\\\\", "é-ü-日本", "tab\there")
    with psycopg.connect(scratch_database) as conn:
        conn.execute("PREPARE by_key(text) AS SELECT steprecord_instance_id($1)")
        conn.execute("SET plan_cache_mode = force_generic_plan")
        for text in texts:
            expected = (hmac_prefix(secret, text),)
            assert conn.execute("SELECT steprecord_instance_id(%s)", (text,)).fetchone() == expected
            execute = sql.SQL("EXECUTE by_key({})").format(sql.Literal(text))
            assert conn.execute(execute).fetchone() == expected
        plan = conn.execute("EXPLAIN (VERBOSE, COSTS OFF) EXECUTE by_key('k')").fetchall()
    # Inlined: the plan computes the HMAC itself (sha256), not a call of the function.
    assert "sha256" in str(plan), plan
    assert "steprecord_instance_id" not in str(plan), plan


def test_each_database_makes_a_secret_of_its_own_so_a_key_s_id_cannot_be_known_outside_it(
    scratch_database: str, server_dsn: str
) -> None:
    """Two databases migrated the same way give one key two ids: the secret is made at
    random when the database is migrated, not shipped with the code."""
    migrate(scratch_database)
    with migrated_database(server_dsn, "steprecord_other_") as other:
        assert database_secret(scratch_database) != database_secret(other)
        ids_of = []
        for url in (scratch_database, other):
            with psycopg.connect(url) as conn:
                ids_of.append(conn.execute("SELECT steprecord_instance_id('order-1')").fetchone())
        assert ids_of[0] != ids_of[1]


# --- revision 0020 -----------------------------------------------------------------------

# At revision 0019: two instances, one with a finished step and one whose attempt 1 was
# superseded by attempt 2 (so the history holds two rows of one record).
EVENTS_0019 = """
SELECT count(*) FROM steprecord_apply_events(
    ARRAY[0, 1, 2], ARRAY['order-1', 'order-2', 'order-1'], ARRAY['a', 'b', 'c'],
    ARRAY['start', 'start', 'declare'], ARRAY[1, 1, NULL]::bigint[],
    ARRAY[now(), now(), NULL], NULL::timestamptz[], NULL::text[], NULL::text[],
    NULL::text[], NULL::text[], NULL::bigint[], NULL::int[])
"""
EVENTS_0019_AGAIN = """
SELECT count(*) FROM steprecord_apply_events(
    ARRAY[0, 1], ARRAY['order-1', 'order-2'], ARRAY['a', 'b'], ARRAY['complete', 'start'],
    ARRAY[1, 2]::bigint[], ARRAY[NULL, now()]::timestamptz[], NULL::timestamptz[],
    ARRAY['{"ok": true}', NULL], NULL::text[], NULL::text[], NULL::text[], NULL::bigint[],
    NULL::int[])
"""
ROWS = """
SELECT p.instance_key, r.step_slug, r.status, r.attempt_count, a.attempt, a.status,
       r.instance_id = p.id AND (a.id IS NULL OR a.instance_id = p.id)
FROM process_instance p
JOIN workflow_step_record r ON r.instance_id = p.id
LEFT JOIN workflow_step_attempt a ON a.record_id = r.id
ORDER BY 1, 2, 5
"""
EXPECTED = [
    ("order-1", "a", "completed", 1, 1, "completed", True),
    ("order-1", "c", "pending", 1, None, None, True),
    ("order-2", "b", "running", 2, 1, "superseded", True),
    ("order-2", "b", "running", 2, 2, "running", True),
]


def rows(url: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(url) as conn:
        return conn.execute(ROWS).fetchall()


def ids(url: str) -> dict[str, int]:
    with psycopg.connect(url) as conn:
        return dict(conn.execute("SELECT instance_key, id FROM process_instance").fetchall())


def test_0020_gives_existing_instances_their_derived_ids_and_its_downgrade_keeps_every_row(
    scratch_database: str,
) -> None:
    if has_citus(scratch_database):
        pytest.skip(
            "about revision 0019 and 0020's downgrade to it, which cannot run on Citus: every"
            " migration ends by distributing, and Citus keeps no key without instance_id,"
            " which revisions before 0020 have"
        )
    config = alembic_config()
    config.attributes["database_url"] = scratch_database
    command.upgrade(config, "0019")
    with psycopg.connect(scratch_database) as conn:
        conn.execute(EVENTS_0019)
        conn.execute(EVENTS_0019_AGAIN)
    assert rows(scratch_database) == EXPECTED
    assert ids(scratch_database) == {"order-1": 1, "order-2": 2}

    command.upgrade(config, "0020")
    assert rows(scratch_database) == EXPECTED
    derived = {key: sha256_prefix(key) for key in ("order-1", "order-2")}
    assert ids(scratch_database) == derived
    with psycopg.connect(scratch_database) as conn:
        # The guards are on again: a finished attempt still cannot be changed by hand.
        with pytest.raises(psycopg.errors.CheckViolation) as caught:
            conn.execute("UPDATE workflow_step_record SET output = '2' WHERE step_slug = 'a'")
        assert caught.value.diag.constraint_name == "tr_workflow_step_record_transition"

    command.downgrade(config, "0019")
    assert rows(scratch_database) == EXPECTED
    assert ids(scratch_database) == derived
    with psycopg.connect(scratch_database) as conn:
        # The identity is back, above every id: a new instance takes the next number.
        conn.execute(EVENTS_0019.replace("order-1", "order-3").replace("order-2", "order-4"))
        new = conn.execute(
            "SELECT id FROM process_instance WHERE instance_key IN ('order-3', 'order-4')"
        ).fetchall()
    assert min(new)[0] > max(derived.values())

    command.upgrade(config, "head")
    keyed = hmac_prefix(database_secret(scratch_database), "order-3")
    assert ids(scratch_database)["order-3"] == keyed


# --- revision 0036 -----------------------------------------------------------------------

# At revision 0035, one event per statement (each routed to its instance on Citus): order-1's
# step finished and then reopened by hand (a repair log entry), order-2's attempt 1
# superseded by attempt 2, order-3's step declared; labels on order-1.
EVENT = (
    "SELECT outcome FROM steprecord_apply_event(steprecord_instance_id(%(key)s), 0, %(key)s,"
    " %(step)s, %(kind)s, %(attempt)s, now(), now(), %(output)s, NULL, NULL, NULL, NULL,"
    " CASE WHEN %(kind)s = 'start' THEN 60 END, NULL, 'test', %(labels)s)"
)
EVENTS_0035 = [
    ("order-1", "a", "start", 1, None, '{"env": "prod"}'),
    ("order-1", "a", "complete", 1, '{"ok": true}', None),
    ("order-2", "b", "start", 1, None, None),
    ("order-2", "b", "start", 2, None, None),
    ("order-3", "c", "declare", None, None, None),
]
REOPEN = (
    "SELECT outcome FROM steprecord_reopen(steprecord_instance_id('order-1'), 'order-1', 'a', 1,"
    " 'wrong output', 'test')"
)
# Everything an instance holds, by its key: the rows must come through a rewrite unchanged
# but for their instance id (the foreign keys keep each under its instance's).
EVERYTHING = """
SELECT p.instance_key, p.next_ordinal, p.created_at, p.labels,
       r.id, r.step_slug, r.ordinal, r.status, r.attempt_count, r.output, r.started_at,
       r.completed_at, r.lease_expires_at, r.changed_xid, r.updated_by, r.updated_at,
       (SELECT array_agg(array[a.id::text, a.attempt::text, a.status, a.reported_by]
                         ORDER BY a.id)
        FROM workflow_step_attempt a
        WHERE a.instance_id = r.instance_id AND a.record_id = r.id),
       (SELECT array_agg(array[x.id::text, x.action, x.reason, x.repaired_by] ORDER BY x.id)
        FROM workflow_step_repair x
        WHERE x.instance_id = r.instance_id AND x.record_id = r.id)
FROM process_instance p JOIN workflow_step_record r ON r.instance_id = p.id
ORDER BY 1, 6
"""
TRIGGERS_OFF = """
SELECT tgname FROM pg_trigger WHERE NOT tgisinternal AND tgenabled <> 'O'
"""


def everything(url: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(url) as conn:
        return conn.execute(EVERYTHING).fetchall()


def test_0036_gives_every_instance_its_keyed_id_and_its_downgrade_the_plain_one_back(
    scratch_database: str,
) -> None:
    """On one node and on Citus (where the id is the distribution column, so each row moves
    to its new id's shard): every row kept, with its history and repair log, under the new
    id; the guards and live updates on again; the instances take their next events; and the
    downgrade puts every row back under the plain SHA-256 id."""
    config = alembic_config()
    config.attributes["database_url"] = scratch_database
    command.upgrade(config, "0035")
    with psycopg.connect(scratch_database, autocommit=True) as conn:
        for key, step, kind, attempt, output, labels in EVENTS_0035:
            params = {"key": key, "step": step, "kind": kind, "attempt": attempt}
            conn.execute(EVENT, {**params, "output": output, "labels": labels})
        assert conn.execute(REOPEN).fetchone() == ("reopened",)
    before = everything(scratch_database)
    assert [(row[0], len(row[16] or []), len(row[17] or [])) for row in before] == [
        ("order-1", 1, 1),
        ("order-2", 2, 0),
        ("order-3", 0, 0),
    ]

    command.upgrade(config, "head")
    assert everything(scratch_database) == before
    secret = database_secret(scratch_database)
    assert ids(scratch_database) == {
        k: hmac_prefix(secret, k) for k in ("order-1", "order-2", "order-3")
    }
    with psycopg.connect(scratch_database, autocommit=True) as conn:
        assert conn.execute(TRIGGERS_OFF).fetchall() == []
        # The guards are on again: a record's identities still never change.
        with pytest.raises(psycopg.errors.CheckViolation) as caught:
            conn.execute("UPDATE workflow_step_record SET ordinal = 7 WHERE step_slug = 'b'")
        assert "ordinal and created_at never change" in str(caught.value)
        # The judge finds each instance under its new id: a replay is a replay.
        params = {"key": "order-2", "step": "b", "kind": "start", "attempt": 2}
        row = conn.execute(EVENT, {**params, "output": None, "labels": None}).fetchone()
        assert row == ("replay",)
    assert everything(scratch_database) == before

    command.downgrade(config, "0035")
    assert everything(scratch_database) == before
    assert ids(scratch_database) == {k: sha256_prefix(k) for k in ("order-1", "order-2", "order-3")}
    with psycopg.connect(scratch_database, autocommit=True) as conn:
        assert conn.execute(TRIGGERS_OFF).fetchall() == []
        gone = "SELECT 1 FROM pg_proc WHERE proname = 'steprecord_instance_id_key'"
        assert conn.execute(gone).fetchall() == []


# --- two keys, one id ----------------------------------------------------------------------


def test_events_of_a_key_whose_id_another_key_holds_are_refused_and_write_nothing(
    scratch_database: str,
) -> None:
    """No second key with the first's SHA-256 prefix can be found, so the test makes one: with
    the CHECK that ties an id to its key dropped (in this test's own database only), an
    instance of key 'impostor' takes the id of key 'victim'. Every event of 'victim' is then
    a 409 instance_key_collision, alone or in a batch, and nothing is written to either."""
    migrate(scratch_database)
    with psycopg.connect(scratch_database) as conn:
        conn.execute("ALTER TABLE process_instance DROP CONSTRAINT ck_process_instance_id_derived")
        conn.execute(
            "INSERT INTO process_instance (id, instance_key)"
            " VALUES (steprecord_instance_id('victim'), 'impostor')"
        )
    url, proc = start_server(scratch_database)
    try:
        with httpx.Client(base_url=url, timeout=30) as client:
            for kind, body in (("declare", None), ("start", {"attempt": 1})):
                response = client.post(f"/v1/instances/victim/steps/a/{kind}", json=body)
                body_ = problem(response, 409, "instance_key_collision")
                assert "use another instance key" in body_["detail"]
            batch = client.post(
                "/v1/events",
                json={
                    "events": [
                        {"instance_key": "victim", "step_slug": "b", "kind": "start"},
                        {"instance_key": "other", "step_slug": "b", "kind": "start"},
                        {"instance_key": "victim", "step_slug": "c", "kind": "complete"},
                    ]
                },
            )
            assert batch.status_code == 200, batch.text
            results = batch.json()["results"]
            assert [r["status"] for r in results] == [409, 201, 409]
            assert results[0]["problem"]["code"] == "instance_key_collision"
            assert results[2]["problem"]["code"] == "instance_key_collision"
    finally:
        stop(proc)
    with psycopg.connect(scratch_database) as conn:
        instances = conn.execute(
            "SELECT instance_key, (SELECT count(*) FROM workflow_step_record r"
            " WHERE r.instance_id = p.id) FROM process_instance p ORDER BY 1"
        ).fetchall()
    assert instances == [("impostor", 0), ("other", 1)]


def test_an_instance_is_written_where_the_search_path_is_empty(database_url: str) -> None:
    """pg_restore, and the apply worker of the logical replication that moves a shard on Citus,
    write rows with an empty search_path, and the CHECK ck_process_instance_id_derived calls
    steprecord_instance_id there: its body must find the database's secret by its schema."""
    key = f"restored-{uuid.uuid4().hex[:8]}"
    with psycopg.connect(database_url) as conn:
        conn.execute("SET LOCAL search_path = ''")
        row = conn.execute(
            "INSERT INTO public.process_instance (id, instance_key)"
            " VALUES (public.steprecord_instance_id(%(key)s), %(key)s) RETURNING id",
            {"key": key},
        ).fetchone()
        conn.rollback()
    assert row is not None
    assert row[0] == hmac_prefix(database_secret(database_url), key)
