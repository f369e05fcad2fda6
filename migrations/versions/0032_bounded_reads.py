"""Reads bounded in bytes in the database: a page and a stream's read stop at a byte budget.

A page of an instance's records (`steprecord_list_page`) and a stream's read
(`steprecord_stream_changes`) answered up to `limit` rows whatever their size: a page of
`limit=1000` over outputs of 1 MiB read a gigabyte into the service before it cut its answer
at 16 MiB, and a stream's first read of such an instance held 500 of them. Each now reads its
rows one by one, counting the bytes of their long values (the output as text, the error
message, the output URL), and stops once they reach the new last argument `p_max_bytes`,
saying so in a new last column `cut` (the caller reads on after that row). Otherwise they
answer as before.

Their arguments and results change, so they are dropped and created (app/distribution.py
distributes the new signatures on Citus at the next migrate). Frozen in
`0032_bounded_reads.up.sql` by `python -m app.sql freeze 0032_bounded_reads`; the downgrade
restores the previous text (`.down.sql`).

Revision ID: 0032
Revises: 0031
Create Date: 2026-12-07
"""

from pathlib import Path

from alembic import op

revision = "0032"
down_revision = "0031"
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
