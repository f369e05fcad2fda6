"""Keyed instance ids: no tenant can choose a key whose id is another's future instance's.

An instance's id was the first 8 bytes of its key's SHA-256 (revision 0020), which anyone can
compute. A tenant that can guess N keys another tenant will use (a run id with a date in it)
could search about 2^64/N keys for one whose id equals one of them, create that instance
first, and so block the other's: the primary key refuses the second key's instance (409
`instance_key_collision`). Now the id is the first 8 bytes of the key's HMAC-SHA-256 under a
secret of this database's own, which no client of the service sees: without it the id of a
key cannot be computed, so no key can be aimed.

1. `steprecord_instance_id_key()`: the secret, 64 random bytes made here (Python's
   `secrets`), returned as the HMAC's two padded keys, (K xor 0x36...) || (K xor 0x5c...),
   128 bytes, so that the id is two SHA-256 calls in SQL (PostgreSQL has no XOR of bytea).
   It is this database's value, not source: `app/sql/` does not hold it. PUBLIC keeps
   EXECUTE on it, like on `steprecord_instance_id`, which every role's reads call as
   themselves. Every role that can connect can read it (`pg_proc` is readable by all), as it
   can read the keys themselves; clients of the service cannot.
2. `steprecord_instance_id(key)` (app/sql/instance_id.sql, frozen in
   `0036_keyed_instance_ids.up.sql` by `python -m app.sql freeze 0036_keyed_instance_ids`):
   the HMAC under that secret.
3. Every existing instance takes its new id, and its records, attempts and repair log
   follow (`REKEY` below). On Citus the id is the distribution column, which no UPDATE may
   change, so each row is inserted again under its new id and the old one deleted, on one
   node the same way: one procedure for both. The tables' user triggers are disabled
   meanwhile (the record's and the history's guards refuse a change of `instance_id`, and
   the live-update triggers would NOTIFY, which Citus's two-phase commit refuses), in this
   migration's transaction; `ALTER TABLE` holds each table's ACCESS EXCLUSIVE lock until the
   commit, so nothing else is written meanwhile. The unique key on `instance_key` (one
   node) is dropped for the rewrite and added back. An empty database (a new one) skips it.
   Copied rows keep their values, `changed_xid` included; every row is written twice, so a
   large database should be vacuumed afterwards (docs/operations.md, "Upgrading").

Downgrade: the unkeyed function as revision 0035 left it (`.down.sql`), every instance
rewritten back to it the same way, and the secret dropped. Nothing is lost either way; only
the ids change (a stream's cursor or a page's cursor made before names the old ids, so a
client starts its reads again).

Revision ID: 0036
Revises: 0035
Create Date: 2026-12-07
"""

import secrets
from pathlib import Path

from alembic import op

revision = "0036"
down_revision = "0035"
branch_labels = None
depends_on = None

UP = Path(__file__).with_suffix(".up.sql")
DOWN = Path(__file__).with_suffix(".down.sql")
CITUS = "SELECT 1 FROM pg_extension WHERE extname = 'citus'"
UNIQUE_KEY = (
    "SELECT 1 FROM pg_constraint WHERE conname = 'uq_process_instance_instance_key'"
    " AND conrelid = 'process_instance'::regclass"
)

KEY = """
CREATE FUNCTION steprecord_instance_id_key() RETURNS bytea
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $fn$ SELECT '\\x{pads}'::bytea $fn$;
COMMENT ON FUNCTION steprecord_instance_id_key() IS
    'This database''s secret for instance ids (HMAC-SHA-256 padded keys), made by revision 0036.'
    ' Never change it by hand: every id is derived with it.';
"""

# Each row again under its key's id as steprecord_instance_id now computes it, parents first;
# then the rows under any other id, children first. Column lists as of revision 0035.
REKEY = """
ALTER TABLE workflow_step_record DISABLE TRIGGER USER;
ALTER TABLE workflow_step_attempt DISABLE TRIGGER USER;
ALTER TABLE workflow_step_repair DISABLE TRIGGER USER;

INSERT INTO process_instance (id, instance_key, next_ordinal, created_at, labels)
SELECT steprecord_instance_id(instance_key), instance_key, next_ordinal, created_at, labels
FROM process_instance WHERE id <> steprecord_instance_id(instance_key);

INSERT INTO workflow_step_record (
    id, instance_id, step_slug, ordinal, status, attempt_count, output, external_output_url,
    started_at, completed_at, error_code, error_message, created_at, updated_at,
    lease_expires_at, changed_xid, updated_by)
OVERRIDING SYSTEM VALUE
SELECT r.id, steprecord_instance_id(p.instance_key), r.step_slug, r.ordinal, r.status,
       r.attempt_count, r.output, r.external_output_url, r.started_at, r.completed_at,
       r.error_code, r.error_message, r.created_at, r.updated_at, r.lease_expires_at,
       r.changed_xid, r.updated_by
FROM workflow_step_record r JOIN process_instance p ON p.id = r.instance_id
WHERE p.id <> steprecord_instance_id(p.instance_key);

INSERT INTO workflow_step_attempt (
    id, instance_id, record_id, attempt, status, started_at, completed_at, output,
    external_output_url, error_code, error_message, lease_expires_at, created_at, updated_at,
    trace_id, reported_by)
OVERRIDING SYSTEM VALUE
SELECT a.id, steprecord_instance_id(p.instance_key), a.record_id, a.attempt, a.status,
       a.started_at, a.completed_at, a.output, a.external_output_url, a.error_code,
       a.error_message, a.lease_expires_at, a.created_at, a.updated_at, a.trace_id,
       a.reported_by
FROM workflow_step_attempt a JOIN process_instance p ON p.id = a.instance_id
WHERE p.id <> steprecord_instance_id(p.instance_key);

INSERT INTO workflow_step_repair (
    instance_id, id, record_id, step_slug, action, attempt, reason, repaired_by, at)
OVERRIDING SYSTEM VALUE
SELECT steprecord_instance_id(p.instance_key), x.id, x.record_id, x.step_slug, x.action,
       x.attempt, x.reason, x.repaired_by, x.at
FROM workflow_step_repair x JOIN process_instance p ON p.id = x.instance_id
WHERE p.id <> steprecord_instance_id(p.instance_key);

DELETE FROM workflow_step_repair x USING process_instance p
WHERE p.id = x.instance_id AND p.id <> steprecord_instance_id(p.instance_key);
DELETE FROM workflow_step_attempt a USING process_instance p
WHERE p.id = a.instance_id AND p.id <> steprecord_instance_id(p.instance_key);
DELETE FROM workflow_step_record r USING process_instance p
WHERE p.id = r.instance_id AND p.id <> steprecord_instance_id(p.instance_key);
DELETE FROM process_instance WHERE id <> steprecord_instance_id(instance_key);

ALTER TABLE workflow_step_record ENABLE TRIGGER USER;
ALTER TABLE workflow_step_attempt ENABLE TRIGGER USER;
ALTER TABLE workflow_step_repair ENABLE TRIGGER USER;
"""


def key() -> str:
    """The statements that make this database's secret: 64 random bytes, as padded keys."""
    secret = secrets.token_bytes(64)
    pads = bytes(b ^ 0x36 for b in secret) + bytes(b ^ 0x5C for b in secret)
    return KEY.format(pads=pads.hex())


def rekey() -> None:
    """Every instance under its key's id as `steprecord_instance_id` now computes it."""
    bind = op.get_bind()
    if bind.exec_driver_sql("SELECT 1 FROM process_instance LIMIT 1").first() is None:
        return
    if bind.exec_driver_sql(CITUS).first() is not None:
        # One connection per worker for the whole rewrite: after the ALTERs (sent to every
        # shard at once), Citus refuses a statement that would open more.
        op.execute("SET LOCAL citus.multi_shard_modify_mode TO 'sequential'")
    unique = bind.exec_driver_sql(UNIQUE_KEY).first() is not None
    if unique:
        op.execute("ALTER TABLE process_instance DROP CONSTRAINT uq_process_instance_instance_key")
    op.run_script(REKEY)
    if unique:
        op.execute(
            "ALTER TABLE process_instance"
            " ADD CONSTRAINT uq_process_instance_instance_key UNIQUE (instance_key)"
        )


def upgrade() -> None:
    op.run_script(key())
    op.run_script(UP.read_text())
    rekey()


def downgrade() -> None:
    op.run_script(DOWN.read_text())
    rekey()
    op.execute("DROP FUNCTION steprecord_instance_id_key()")
