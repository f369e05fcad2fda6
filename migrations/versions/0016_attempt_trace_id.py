"""Keep the trace id of the event that started each attempt: `workflow_step_attempt.trace_id`.

A service that exports OpenTelemetry traces (or a caller that sends a W3C `traceparent`) can
say which trace an attempt belongs to; the dashboard links the attempt to it. The judge's
functions take the request's trace id and set it for their call; the history's triggers
insert an attempt's row without naming the column, so the row takes it as its default when
it is first written, by the event that started the attempt, and no later write changes it.

Why each statement is here:

1. `ADD COLUMN trace_id text`, nullable and without a default at first: the attempts that
   exist were written before any trace was kept, and stay NULL (adding a column without a
   default rewrites nothing).
2. `ck_workflow_step_attempt_trace_id_format`: 32 lowercase hexadecimal digits, not all
   zeros (W3C trace context's invalid id), so a hand-written or garbled value is refused as
   every other malformed field of the history is.
3. `SET DEFAULT nullif(current_setting('steprecord.trace_id', true), '')`: the value the
   judge's functions set for their call (an empty string when the request had no trace);
   outside them the setting is unset or empty and a row written by hand-written SQL gets
   NULL.
4. `DROP FUNCTION` of `steprecord_apply_events` and `steprecord_apply_event`, then their new
   text from `app/sql/` (frozen in `0016_attempt_trace_id.up.sql`): each takes a trailing
   `p_trace_id text DEFAULT NULL`, and a function's arguments are changed only by dropping
   and creating it (callers that send 13 arguments still reach it through the default).
   Each sets `steprecord.trace_id` first, on every call, and restores it when it returns, so
   a trace id never carries over to a later call or statement of the same transaction.

Downgrade restores revision 0014's functions (frozen in `0016_attempt_trace_id.down.sql`)
and drops the column with its CHECK: the trace ids kept meanwhile are lost, so it refuses,
unless forced, while any attempt has one, saying how many (`app/data/migrating.py`).

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-05
"""

from pathlib import Path

from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None

LOST = """
SELECT count(*) || ' attempts'' trace ids (workflow_step_attempt.trace_id) would be dropped'
FROM workflow_step_attempt WHERE trace_id IS NOT NULL HAVING count(*) > 0
"""

# The frozen text this revision installs, and the text its downgrade restores, beside this
# file and read by it alone.
UP = Path(__file__).with_suffix(".up.sql")
DOWN = Path(__file__).with_suffix(".down.sql")


def upgrade() -> None:
    op.execute(UP.read_text())


def downgrade() -> None:
    op.refuse_losing("0016", op.found(LOST))
    op.execute(DOWN.read_text())
