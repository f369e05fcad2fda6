"""Distributable: an instance's id derived from its key, every key scoped by the instance.

Citus shards a table by one column, and keeps a unique key, a primary key or a foreign key
only when it includes that column; it routes a statement, or a whole function call, to the
worker that holds a row only when the statement names that column's value. This revision
makes the schema so on one node, with no change of behaviour, so that `steprecord migrate` can
distribute it on Citus (app/distribution.py):

1. `steprecord_instance_id(key)` (app/sql/instance_id.sql): the first 8 bytes of the key's
   SHA-256, as a bigint. `process_instance.id` is that value, no longer an identity, held by
   the CHECK `ck_process_instance_id_derived`. Two keys with one id never share rows: the
   primary key refuses the second key's instance, and the judge answers its events
   `instance_key_collision` (the service: 409).
2. The existing instances take their derived ids, and their records and attempts follow.
   The rewrite changes `instance_id`, which the record's transition guard refuses and the
   history's guard too; so the user triggers of both tables are disabled for the rewrite,
   inside this migration's transaction, and enabled again before it commits (ALTER TABLE
   ... DISABLE TRIGGER USER: the table's owner may do it, where session_replication_role
   needs a superuser). Nothing else is written meanwhile: the ALTERs hold their tables'
   ACCESS EXCLUSIVE locks until commit.
3. Every key of the per-instance tables includes `instance_id`: `pk_workflow_step_record`
   (instance_id, id), which replaces `uq_workflow_step_record_instance_id_id` as what the
   history's foreign key references; `pk_workflow_step_attempt` (instance_id, id);
   `uq_workflow_step_attempt_instance_id_record_id_attempt` (instance_id, record_id,
   attempt), which replaces `uq_workflow_step_attempt_record_id_attempt`.
   `uq_process_instance_instance_key` stays on one node (it is implied by the primary key
   and the CHECK; on Citus the distribution drops it, which cannot keep it).
4. The judge's functions, frozen in `0020_distributable.up.sql` by
   `python -m app.sql freeze 0020_distributable`: the one-event function takes the
   instance's id first (its distribution argument on Citus), every lookup names the
   instance's id, and no clock is called inside a write (Citus runs only IMMUTABLE functions
   there): each call reads the clock once into a variable.

Downgrade: the previous keys and functions. The instances keep their derived ids (ids are
never reused, and their rows stay where they are): `process_instance.id` becomes an identity
again that starts above the largest id. On a database distributed on Citus it refuses, changing
nothing: Citus keeps no key that leaves out the distribution column, which the previous keys do.

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-05
"""

from pathlib import Path

from alembic import op

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None

UP = Path(__file__).with_suffix(".up.sql")
DOWN = Path(__file__).with_suffix(".down.sql")
CITUS = "SELECT 1 FROM pg_extension WHERE extname = 'citus'"

REKEY = """
ALTER TABLE workflow_step_attempt
    DROP CONSTRAINT fk_workflow_step_attempt_instance_id_workflow_step_record,
    DROP CONSTRAINT uq_workflow_step_attempt_record_id_attempt,
    DROP CONSTRAINT pk_workflow_step_attempt;
ALTER TABLE workflow_step_record
    DROP CONSTRAINT fk_workflow_step_record_instance_id_process_instance,
    DROP CONSTRAINT uq_workflow_step_record_instance_id_id,
    DROP CONSTRAINT pk_workflow_step_record;
ALTER TABLE process_instance ALTER COLUMN id DROP IDENTITY;

ALTER TABLE workflow_step_record DISABLE TRIGGER USER;
ALTER TABLE workflow_step_attempt DISABLE TRIGGER USER;
UPDATE workflow_step_attempt a SET instance_id = steprecord_instance_id(p.instance_key)
FROM process_instance p WHERE p.id = a.instance_id;
UPDATE workflow_step_record r SET instance_id = steprecord_instance_id(p.instance_key)
FROM process_instance p WHERE p.id = r.instance_id;
UPDATE process_instance SET id = steprecord_instance_id(instance_key);
ALTER TABLE workflow_step_record ENABLE TRIGGER USER;
ALTER TABLE workflow_step_attempt ENABLE TRIGGER USER;

ALTER TABLE process_instance ADD CONSTRAINT ck_process_instance_id_derived
    CHECK (id = steprecord_instance_id(instance_key));
ALTER TABLE workflow_step_record
    ADD CONSTRAINT pk_workflow_step_record PRIMARY KEY (instance_id, id),
    ADD CONSTRAINT fk_workflow_step_record_instance_id_process_instance
        FOREIGN KEY (instance_id) REFERENCES process_instance (id);
ALTER TABLE workflow_step_attempt
    ADD CONSTRAINT pk_workflow_step_attempt PRIMARY KEY (instance_id, id),
    ADD CONSTRAINT uq_workflow_step_attempt_instance_id_record_id_attempt
        UNIQUE (instance_id, record_id, attempt),
    ADD CONSTRAINT fk_workflow_step_attempt_instance_id_workflow_step_record
        FOREIGN KEY (instance_id, record_id)
        REFERENCES workflow_step_record (instance_id, id) ON DELETE CASCADE;
"""

UNKEY = """
ALTER TABLE workflow_step_attempt
    DROP CONSTRAINT fk_workflow_step_attempt_instance_id_workflow_step_record,
    DROP CONSTRAINT uq_workflow_step_attempt_instance_id_record_id_attempt,
    DROP CONSTRAINT pk_workflow_step_attempt;
ALTER TABLE workflow_step_record
    DROP CONSTRAINT fk_workflow_step_record_instance_id_process_instance,
    DROP CONSTRAINT pk_workflow_step_record;
ALTER TABLE process_instance DROP CONSTRAINT ck_process_instance_id_derived;

ALTER TABLE workflow_step_record
    ADD CONSTRAINT pk_workflow_step_record PRIMARY KEY (id),
    ADD CONSTRAINT uq_workflow_step_record_instance_id_id UNIQUE (instance_id, id),
    ADD CONSTRAINT fk_workflow_step_record_instance_id_process_instance
        FOREIGN KEY (instance_id) REFERENCES process_instance (id);
ALTER TABLE workflow_step_attempt
    ADD CONSTRAINT pk_workflow_step_attempt PRIMARY KEY (id),
    ADD CONSTRAINT uq_workflow_step_attempt_record_id_attempt UNIQUE (record_id, attempt),
    ADD CONSTRAINT fk_workflow_step_attempt_instance_id_workflow_step_record
        FOREIGN KEY (instance_id, record_id)
        REFERENCES workflow_step_record (instance_id, id) ON DELETE CASCADE;
"""


def upgrade() -> None:
    op.run_script(UP.read_text())
    op.run_script(REKEY)


def downgrade() -> None:
    if op.get_bind().exec_driver_sql(CITUS).first() is not None:
        op.refuse(
            "downgrade of 0020 refused: the database is distributed on Citus, which keeps no"
            " primary or unique key without instance_id, and the revisions before 0020 need such"
            " keys: they cannot run on Citus. Nothing was changed"
        )
    op.run_script(UNKEY)
    start = (
        op.get_bind()
        .exec_driver_sql("SELECT GREATEST(max(id), 0) + 1 FROM process_instance")
        .scalar_one()
    )
    op.execute(
        "ALTER TABLE process_instance ALTER COLUMN id"
        f" ADD GENERATED ALWAYS AS IDENTITY (START WITH {int(start)})"
    )
    op.run_script(DOWN.read_text())
