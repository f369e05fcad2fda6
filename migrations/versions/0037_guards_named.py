"""A guard's refusal names its guard in its message, so raw SQL on Citus reads which one.

The record's transition guard, the history's guard and the repair log's guard raise
`check_violation` with their trigger's name in the error's constraint field, as a CHECK
does. Citus relays a worker's SQLSTATE and message to the coordinator's client, but not that
field: on a cluster a hand-written statement refused by a guard said why but not which guard,
where one node names it (and a CHECK's own message names the CHECK on both). Now each guard's
message says it as a CHECK's does, `<table> violates constraint "<guard>": <why>`, on one node
and on every worker; the service reads the name from the field or, on a cluster, from the
message (app/data/common.py), one rule for constraints and guards.

The three trigger functions (app/sql/record_guard.sql, attempt_history.sql, repair_log.sql),
frozen in `0037_guards_named.up.sql` by `python -m app.sql freeze 0037_guards_named`; only
their messages change. Downgrade: the messages as revision 0036 left them (`.down.sql`).

Revision ID: 0037
Revises: 0036
Create Date: 2026-12-07
"""

from pathlib import Path

from alembic import op

revision = "0037"
down_revision = "0036"
branch_labels = None
depends_on = None

UP = Path(__file__).with_suffix(".up.sql")
DOWN = Path(__file__).with_suffix(".down.sql")


def upgrade() -> None:
    op.run_script(UP.read_text())


def downgrade() -> None:
    op.run_script(DOWN.read_text())
