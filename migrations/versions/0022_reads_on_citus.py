"""Reads on Citus: a page of an instance's records finds the instance by its id.

`steprecord_list_page` (app/sql/list_page.sql) found the instance by its key alone and its
records by the instance row's id. On Citus, where the instance's id is the distribution
column, neither names a shard: the function's three reads went to every shard. Now each
names the id derived from the key (`steprecord_instance_id(p_instance_key)`) for the
instance and for its records, so each read goes to the one worker that holds the instance.
On one node the plans are the same range scans of the same indexes; the key is still
compared, so the answer is the same.

Frozen in `0022_reads_on_citus.up.sql` by `python -m app.sql freeze 0022_reads_on_citus`;
the downgrade restores the previous text (`.down.sql`).

Revision ID: 0022
Revises: 0021
Create Date: 2026-12-05
"""

from pathlib import Path

from alembic import op

revision = "0022"
down_revision = "0021"
branch_labels = None
depends_on = None

# The frozen text this revision installs, and the text its downgrade restores, beside this
# file and read by it alone.
UP = Path(__file__).with_suffix(".up.sql")
DOWN = Path(__file__).with_suffix(".down.sql")


def upgrade() -> None:
    op.run_script(UP.read_text())


def downgrade() -> None:
    op.run_script(DOWN.read_text())
