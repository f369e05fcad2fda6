"""Add `api_token.key_prefix`: a token that reaches only the instances whose key starts with it.

One service shared by several teams keeps each team inside its own instances: a token made
with `steprecord token create NAME --prefix PREFIX` reads and writes only instances whose
key starts with `PREFIX`; for it, the others do not exist.

Why each statement is here:

1. `key_prefix` is nullable: the tokens that exist keep reaching every instance, as before
   (null means no prefix).
2. `ck_api_token_key_prefix_format`: 1 to 100 characters of the key alphabet, starting as a
   key starts, so a prefix always names keys that can exist; the CLI checks the same pattern
   first, and this refuses a hand-written token row that breaks it.

The prefix lists read the index `ix_process_instance_instance_key_prefix` (revision 0006);
no index is added. Downgrade drops the column: prefixed tokens would then reach everything,
so the downgrade refuses, unless forced, while any exists, naming them: revoke them
(`steprecord token revoke NAME`) first (`app/data/migrating.py`).

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-04
"""

from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None

LOST = """
SELECT 'the tokens ' || string_agg(name || ' (prefix ' || key_prefix || ')', ', ' ORDER BY name)
       || ' would reach every instance; revoke them first (steprecord token revoke NAME)'
FROM api_token WHERE key_prefix IS NOT NULL
"""


def upgrade() -> None:
    op.execute("""
        ALTER TABLE api_token
            ADD COLUMN key_prefix text,
            ADD CONSTRAINT ck_api_token_key_prefix_format
                CHECK (key_prefix ~ '^[A-Za-z0-9][A-Za-z0-9._:-]{0,99}$')
    """)


def downgrade() -> None:
    op.refuse_losing("0015", op.found(LOST))
    op.execute("ALTER TABLE api_token DROP COLUMN key_prefix")
