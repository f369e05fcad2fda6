"""Indexes for the dashboard's instance list: filter by key prefix and by unfinished trouble.

Why each statement is here:

1. `ix_process_instance_instance_key_prefix` (`text_pattern_ops`): the list filtered by a key
   prefix reads the range `[prefix, prefix with its last character incremented)` of keys
   compared byte by byte (`~>=~`, `~<~`), whatever the database's collation. The unique
   index on `instance_key` uses the collation's order, in which a prefix is not a range.
2. `ix_workflow_step_record_running_failed`: a partial index of the records that are
   `running` or `failed`, keyed by instance. "Has failed steps" and "has running steps" are an
   `EXISTS` probe into it per instance, however many steps the instance has. Partial, so
   pending and completed records (most of a table) cost it nothing to write.

Downgrade drops both; the list then has no index for these filters, and nothing else reads
them.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-03
"""

from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        "CREATE INDEX ix_process_instance_instance_key_prefix"
        " ON process_instance (instance_key text_pattern_ops)"
    )
    op.execute(
        "CREATE INDEX ix_workflow_step_record_running_failed"
        " ON workflow_step_record (instance_id, status)"
        " WHERE status IN ('running', 'failed')"
    )


def downgrade() -> None:
    op.execute("DROP INDEX ix_workflow_step_record_running_failed")
    op.execute("DROP INDEX ix_process_instance_instance_key_prefix")
