"""Indexes for the operator's view: step statistics over a window, and long-running steps.

Why each statement is here:

1. `ix_workflow_step_attempt_started_at` on `workflow_step_attempt (started_at)`, covering
   `instance_id, record_id, status, completed_at`: `GET /v1/stats/steps` reads the attempts
   that started in a window. The range of the index is exactly those attempts, and what the
   statistics need of each (its outcome, its end, its record and instance) is in the index,
   so the statement reads the window's part of the index and nothing else of the history:
   its cost grows with the attempts in the window, not with the table. The record's slug
   comes from its primary key.
2. `ix_workflow_step_record_running_started_at_id`, a partial index of the running records
   by `(started_at, id)`: `GET /v1/steps?running_longer_than=S` lists running records
   started more than S seconds ago, longest-running first, keyset-paginated, as one range of
   it read forwards (no sort); the dashboard's Stuck page and the
   `steprecord_long_running_steps` gauge read the same range. Partial, so pending and
   finished records (most of a table) cost it nothing to write.

Each costs every write of an attempt (1.) or of a running record (2.) one more index entry.

Downgrade drops both; nothing else reads them.

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-05
"""

from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        "CREATE INDEX ix_workflow_step_attempt_started_at ON workflow_step_attempt (started_at)"
        " INCLUDE (instance_id, record_id, status, completed_at)"
    )
    op.execute(
        "CREATE INDEX ix_workflow_step_record_running_started_at_id"
        " ON workflow_step_record (started_at, id) WHERE status = 'running'"
    )


def downgrade() -> None:
    op.execute("DROP INDEX ix_workflow_step_record_running_started_at_id")
    op.execute("DROP INDEX ix_workflow_step_attempt_started_at")
