"""Repairs, audited: an `admin` token scope, the operator's reopen, and the repair log.

An operator who fixes a process by hand goes through the judge like any writer, and leaves
a trace: `POST /v1/instances/{key}/steps/{slug}/reopen` (admin scope) turns a finished
record back into a pending one at its next attempt, and the repair log keeps who did it,
when, and why.

1. `ck_api_token_scope_known` admits `admin` beside `read` and `write` (`admin` includes
   `write`; app/access.py).
2. `workflow_step_repair`: the repair log, one row per repair, per instance like the other
   fact tables (its keys include `instance_id`; on Citus it is distributed by it, co-located
   with `process_instance`, app/distribution.py). It goes with its instance (`ON DELETE
   CASCADE` from the instance and from the record) and is read newest first by its index
   (instance_id, at, id), scanned backwards.
3. From the source (`python -m app.sql freeze 0024_repairs`, frozen in `.up.sql`):
   `steprecord_reopen` (app/sql/reopen.sql), the repair log's guard (app/sql/repair_log.sql:
   append-only, written only by the reopen, deleted only by a cascade), and the record's
   transition guard (app/sql/record_guard.sql), which lets a finished record go back to
   pending at the next attempt only while the reopen runs.

Downgrade: the repair log goes (with its guard's trigger), then the frozen downgrade drops
the new functions and restores the record's guard; admin tokens are removed first, since the
narrower CHECK would refuse them. The log is the only account of who reopened what and why,
so it refuses, unless forced, while any repair is logged, saying how many of how many
instances (`app/data/migrating.py`).

Revision ID: 0024
Revises: 0023
Create Date: 2026-12-06
"""

from pathlib import Path

from alembic import op

revision = "0024"
down_revision = "0023"
branch_labels = None
depends_on = None

UP = Path(__file__).with_suffix(".up.sql")
DOWN = Path(__file__).with_suffix(".down.sql")

CREATE = """
ALTER TABLE api_token DROP CONSTRAINT ck_api_token_scope_known;
ALTER TABLE api_token ADD CONSTRAINT ck_api_token_scope_known
    CHECK (scope IN ('read', 'write', 'admin'));

CREATE TABLE workflow_step_repair (
    instance_id bigint NOT NULL,
    id bigint GENERATED ALWAYS AS IDENTITY,
    record_id bigint NOT NULL,
    step_slug text NOT NULL,
    action text NOT NULL,
    attempt integer NOT NULL,
    reason text NOT NULL,
    repaired_by text NOT NULL,
    at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT pk_workflow_step_repair PRIMARY KEY (instance_id, id),
    CONSTRAINT fk_workflow_step_repair_instance_id_process_instance
        FOREIGN KEY (instance_id) REFERENCES process_instance (id) ON DELETE CASCADE,
    CONSTRAINT fk_workflow_step_repair_instance_id_workflow_step_record
        FOREIGN KEY (instance_id, record_id)
        REFERENCES workflow_step_record (instance_id, id) ON DELETE CASCADE,
    CONSTRAINT ck_workflow_step_repair_action_known CHECK (action = 'reopen'),
    CONSTRAINT ck_workflow_step_repair_attempt_positive CHECK (attempt >= 1),
    CONSTRAINT ck_workflow_step_repair_reason_length
        CHECK (char_length(reason) BETWEEN 1 AND 500),
    CONSTRAINT ck_workflow_step_repair_repaired_by_length
        CHECK (char_length(repaired_by) BETWEEN 1 AND 200)
);
CREATE INDEX ix_workflow_step_repair_instance_id_at_id
    ON workflow_step_repair (instance_id, at, id);
"""

DROP = """
DROP TABLE workflow_step_repair;
DELETE FROM api_token WHERE scope = 'admin';
ALTER TABLE api_token DROP CONSTRAINT ck_api_token_scope_known;
ALTER TABLE api_token ADD CONSTRAINT ck_api_token_scope_known
    CHECK (scope IN ('read', 'write'));
"""


def upgrade() -> None:
    op.run_script(CREATE)
    op.run_script(UP.read_text())


# On Citus one statement over every shard.
LOST = """
SELECT n || ' repairs of ' || instances || ' instances (workflow_step_repair: who reopened'
       || ' which step, and why) would be dropped'
FROM (SELECT count(*) AS n, count(DISTINCT instance_id) AS instances
      FROM workflow_step_repair) r
WHERE n > 0
"""


def downgrade() -> None:
    op.refuse_losing("0024", op.found(LOST))
    op.run_script(DROP)
    op.run_script(DOWN.read_text())
