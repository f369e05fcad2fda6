"""The judge written once: its rules as small SQL functions, the one-event function on them.

`steprecord_apply_event` re-implemented `steprecord_apply_events` (the same steps, copied), so
one changed rule meant editing both functions and copying both whole into a migration by
hand. Now each rule is stated once, and both functions use it; the frozen files of this
revision are made by `python -m app.sql freeze 0018_judge_once`. Answers do not change.

Why each statement is here (frozen in `0018_judge_once.up.sql`):

1. `judge_rules.sql`, new: the judge's rules as `LANGUAGE sql` functions of one expression
   each (a status's rank, the status an event leads to, the attempt and the start and end
   times an event gives the record, its lease, whether two reports say the same, and the
   judgement itself). PostgreSQL inlines them into the statements that call them when it
   plans those statements, so they cost what the expressions written out in place cost.
2. `DROP FUNCTION` of `steprecord_apply_events` and `steprecord_apply_event`, then their new
   text: the same argument types and result, but named arguments (`p_i`, `p_instance_key`,
   ...), which PostgreSQL changes only by dropping and creating the function. The batch
   statement calls the rules; the one-event function judges the record with the same rule,
   answers a write-free outcome itself, writes an applied event with the rules' values, and
   calls `steprecord_apply_events` for a new record or a late report.
3. `DROP FUNCTION` of `steprecord_heartbeat`, then its new text: named arguments too, and
   the lease from the judge's rule.
4. The record's columns in the answer of the three functions follow the record's one
   definition (`app/record.py`) and so the API's order: `lease_expires_at` after
   `completed_at` (a result's columns also change only by dropping and creating). The
   service reads them by name.
5. `record_guard.sql`: the transition guard ranks statuses with the judge's rule.

The one-event function's cost, against revision 0017's, is measured in tests/bench/README.md
("The levers tried").

Downgrade drops the rules and restores revision 0017's functions (frozen in
`0018_judge_once.down.sql`).

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-05
"""

from pathlib import Path

from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None

# The frozen text this revision installs, and the text its downgrade restores, beside this
# file and read by it alone.
UP = Path(__file__).with_suffix(".up.sql")
DOWN = Path(__file__).with_suffix(".down.sql")


def upgrade() -> None:
    op.execute(UP.read_text())


def downgrade() -> None:
    op.execute(DOWN.read_text())
