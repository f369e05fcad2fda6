"""Live updates: each record carries the transaction that last wrote it, and a commit notifies.

The stream (`GET /v1/instances/{instance_key}/stream`) sends every record change once, in
order, and resumes after a reconnect exactly where it stopped, with no change-log table: the
position of a change is `(changed_xid, id)` of the record it left.

Why each statement is here:

1. `workflow_step_record.changed_xid` (`xid8`, NOT NULL): the id of the transaction that last
   inserted or updated the record. Existing rows get `0`, below every real transaction, so a
   stream's first read (from position 0) includes them. The record's JSON does not show it.
2. `tr_workflow_step_record_changed_xid` (BEFORE INSERT OR UPDATE, per row) sets it to
   `pg_current_xact_id()` on every write, whoever writes: the merge statement, a batch, a
   heartbeat, the sweeper or a hand-written `UPDATE` (a value written by hand is overwritten),
   so no writer can forget it or forge it.
3. `ix_workflow_step_record_instance_id_changed_xid_id` serves a stream's read: the changes of
   one instance after a position, in position order, with no sort.
4. `tr_workflow_step_record_notify_insert` / `_update` (AFTER, per statement, with a transition
   table) call `pg_notify('steprecord_changes', instance_id)` once per instance the statement
   wrote. PostgreSQL delivers a notification only when its transaction commits (never for a
   rollback) and drops duplicates within a transaction, so listeners hear each committed
   write once per instance; a replay or a refused event writes nothing and notifies nothing.

Downgrade drops all of it in reverse order.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-03
"""

from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

CHANNEL = "steprecord_changes"


def upgrade() -> None:
    op.execute("ALTER TABLE workflow_step_record ADD COLUMN changed_xid xid8 NOT NULL DEFAULT '0'")
    op.execute("ALTER TABLE workflow_step_record ALTER COLUMN changed_xid DROP DEFAULT")
    op.execute("""
        CREATE FUNCTION workflow_step_record_set_changed_xid() RETURNS trigger
        LANGUAGE plpgsql AS $$
        BEGIN
            NEW.changed_xid := pg_current_xact_id();
            RETURN NEW;
        END
        $$
    """)
    op.execute("""
        CREATE TRIGGER tr_workflow_step_record_changed_xid
        BEFORE INSERT OR UPDATE ON workflow_step_record
        FOR EACH ROW EXECUTE FUNCTION workflow_step_record_set_changed_xid()
    """)
    op.execute(
        "CREATE INDEX ix_workflow_step_record_instance_id_changed_xid_id"
        " ON workflow_step_record (instance_id, changed_xid, id)"
    )
    op.execute(f"""
        CREATE FUNCTION workflow_step_record_notify() RETURNS trigger
        LANGUAGE plpgsql AS $$
        BEGIN
            PERFORM pg_notify('{CHANNEL}', w.instance_id::text)
            FROM (SELECT DISTINCT instance_id FROM new_rows) w;
            RETURN NULL;
        END
        $$
    """)
    for event in ("insert", "update"):
        op.execute(f"""
            CREATE TRIGGER tr_workflow_step_record_notify_{event}
            AFTER {event.upper()} ON workflow_step_record
            REFERENCING NEW TABLE AS new_rows
            FOR EACH STATEMENT EXECUTE FUNCTION workflow_step_record_notify()
        """)


def downgrade() -> None:
    op.execute("DROP TRIGGER tr_workflow_step_record_notify_update ON workflow_step_record")
    op.execute("DROP TRIGGER tr_workflow_step_record_notify_insert ON workflow_step_record")
    op.execute("DROP FUNCTION workflow_step_record_notify()")
    op.execute("DROP INDEX ix_workflow_step_record_instance_id_changed_xid_id")
    op.execute("DROP TRIGGER tr_workflow_step_record_changed_xid ON workflow_step_record")
    op.execute("DROP FUNCTION workflow_step_record_set_changed_xid()")
    op.execute("ALTER TABLE workflow_step_record DROP COLUMN changed_xid")
