"""An instance's id is derived from its key, so two keys never share rows.

The id is the first 8 bytes of the key's SHA-256 (app/sql/instance_id.sql): whoever knows the
key knows the id, which is what Citus routes by. Revision 0020 gives existing instances their
derived ids (and their records and history follow); its downgrade keeps every row.
"""

import hashlib
from typing import Any

import httpx
import psycopg
import pytest
from alembic import command

from app.cli import migrate
from app.main import alembic_config
from tests.support.citus import has_citus
from tests.support.http import problem
from tests.support.servers import start_server, stop

KEYS = ("order-1", "run-2", "fetch:3", "Z", "a" * 200)


def sha256_prefix(key: str) -> int:
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big", signed=True)


def test_an_instance_id_is_the_first_8_bytes_of_its_key_s_sha256(scratch_database: str) -> None:
    migrate(scratch_database)
    with psycopg.connect(scratch_database) as conn:
        for key in KEYS:
            row = conn.execute("SELECT steprecord_instance_id(%s)", (key,)).fetchone()
            assert row == (sha256_prefix(key),)


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
    assert sha256_prefix("order-3") in ids(scratch_database).values()


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
