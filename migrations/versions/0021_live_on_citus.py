"""Live updates on Citus: a row trigger notifies, and a stream's read is one function call.

On Citus the record's triggers run on the worker's shards, where statement triggers with
transition tables are refused, and the notification is sent by the worker that holds the
instance. The stream's read takes a snapshot and transaction ids, which are each node's own:
it must run on the worker whose transaction ids stamped the records.

1. `workflow_step_record_notify` becomes a row trigger (one `pg_notify` per record written;
   PostgreSQL drops the duplicates of a transaction, so listeners still hear each committed
   write once per instance).
2. `steprecord_stream_changes(instance_id, instance_key, after_xid, after_id, limit)`: the
   stream's read as a PL/pgSQL function whose first argument is the instance's id, which
   `steprecord migrate` makes a Citus distributed function co-located with the instance
   (app/distribution.py), so the whole call runs on that worker. A position beyond anything
   the server has assigned (from another server, e.g. before a shard move) reads from the
   start.

Both frozen in `0021_live_on_citus.up.sql` by `python -m app.sql freeze 0021_live_on_citus`.
Downgrade: the statement triggers back, the function dropped.

Revision ID: 0021
Revises: 0020
Create Date: 2026-12-05
"""

from pathlib import Path

from alembic import op

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None

UP = Path(__file__).with_suffix(".up.sql")
DOWN = Path(__file__).with_suffix(".down.sql")


def upgrade() -> None:
    op.run_script(UP.read_text())


def downgrade() -> None:
    op.run_script(DOWN.read_text())
