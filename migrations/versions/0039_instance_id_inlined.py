"""The instance id's function inlined: the same ids, computed without a query of their own.

`steprecord_instance_id(key)` (revision 0036) read the key's bytes with `convert_to(key,
'UTF8')`, which PostgreSQL declares STABLE; an IMMUTABLE SQL function whose body calls a
STABLE one is not inlined, so every call that the planner could not fold to a constant ran
the body as a query of its own: parsed, analyzed, planned and run, with
`steprecord_instance_id_key()` likewise inside it, on every call. The judge's one-event
function calls it once per event (`v_id`), and a one-node database's kept plan of the
service's statement once more; on Citus every such query also went through Citus's planner
and executor hooks. That was more than a third of a replayed event's CPU on one node
(pgbench, the routed replays of tests/bench/growth.py, the node capped at 0.2 of a core:
medians of four alternating rounds, 333 us per call before, 202 after).

1. `steprecord_instance_id(key)` (app/sql/instance_id.sql, frozen in
   `0039_instance_id_inlined.up.sql` by `python -m app.sql freeze 0039_instance_id_inlined`):
   the same HMAC, written as one expression of IMMUTABLE functions, which PostgreSQL inlines:
   the key's bytes are `decode(replace(key, '\\', '\\\\'), 'escape')`, the text's own bytes
   in the database's encoding (the backslashes doubled, so none is read as an escape). Those
   are the bytes `convert_to(key, 'UTF8')` gave for every text in a UTF8 database, and for
   every ASCII text in any encoding; every stored key is ASCII (the CHECK
   `ck_process_instance_instance_key_format`), so every id stays what it is and nothing is
   rewritten. The secret's function is named twice, inlined too (a constant). On Citus the
   function is distributed, and `CREATE OR REPLACE` changes it on every worker.

Downgrade: the function as revision 0036 left it (`.down.sql`); the ids are the same.

Revision ID: 0039
Revises: 0038
Create Date: 2026-12-07
"""

from pathlib import Path

from alembic import op

revision = "0039"
down_revision = "0038"
branch_labels = None
depends_on = None

UP = Path(__file__).with_suffix(".up.sql")
DOWN = Path(__file__).with_suffix(".down.sql")


def upgrade() -> None:
    op.run_script(UP.read_text())


def downgrade() -> None:
    op.run_script(DOWN.read_text())
