"""The service may run as a role that writes the records only through the judge.

Any role with write rights on the tables could forge what only the judge or a repair may
write: the guards let a late report's history entry, a reopen and a repair log entry through
when the transaction's `steprecord.writer` says so, and any session may set it (`SET LOCAL
steprecord.writer = 'repair'` and an UPDATE forged a repair by any name). And the service
had to hold those write rights, because the sweeper, the deletion of an instance and pruning
wrote the tables with statements of their own.

Now every write the service makes is a call of a function that runs with its owner's rights
(SECURITY DEFINER, with a fixed search_path) and is revoked from PUBLIC: the judge's four
(apply_event, apply_events, heartbeat, reopen) become so, and the sweeper's write, the
deletion of an instance and pruning's three steps become functions (`sweeper.sql`,
`deletion.sql`) doing what their statements did. A runtime role granted SELECT and EXECUTE
(`steprecord grant ROLE`) serves every route and holds no write right. The guards trust
`steprecord.writer` only from a role that holds the schema owner's rights
(`steprecord_by_owner`, `owner_rights.sql`): a role later granted write rights on a table
still cannot pass for the judge; the owner's own repairs by hand are audited as before.

Two comments of the source are made true on the way, which freezes their files again
unchanged in what they run: `instance_id.sql` (PostgreSQL does not inline the function) and
`attempt_history.sql` (the history's upsert is written twice, not shared).

Frozen in `0034_runtime_role.up.sql` by `python -m app.sql freeze 0034_runtime_role`; the
downgrade drops the new functions and restores the previous text (`.down.sql`), which gives
EXECUTE on the judge's functions back to PUBLIC (a function made again by CREATE OR REPLACE
keeps its rights, so the downgrade grants it).

Revision ID: 0034
Revises: 0033
Create Date: 2026-12-07
"""

from pathlib import Path

from alembic import op

revision = "0034"
down_revision = "0033"
branch_labels = None
depends_on = None

# The frozen text this revision installs, and the text its downgrade restores, beside this
# file and read by it alone.
UP = Path(__file__).with_suffix(".up.sql")
DOWN = Path(__file__).with_suffix(".down.sql")
# CREATE OR REPLACE keeps a function's rights: the judge's functions are given back to every
# role, as before this revision.
GIVEN_BACK = (
    "steprecord_apply_event",
    "steprecord_apply_events",
    "steprecord_heartbeat",
    "steprecord_reopen",
)


def upgrade() -> None:
    op.run_script(UP.read_text())


def downgrade() -> None:
    op.run_script(DOWN.read_text())
    op.run_script("".join(f"GRANT EXECUTE ON FUNCTION {name} TO PUBLIC;\n" for name in GIVEN_BACK))
