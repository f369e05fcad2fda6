"""Add `api_token`: bearer tokens with a read or write scope.

Why each statement is here:

1. `api_token` keeps one row per named token. Only the SHA-256 of the token is stored
   (`token_sha256`, exactly 32 bytes, unique), so a copy of the database grants no access;
   the token itself is printed once by `steprecord token create`. `name` follows the same
   format as instance keys so it is safe on a command line; `scope` is a closed set, `write`
   implying `read` in the service. `last_used_at` is written at most every few seconds by
   the service, so a token check costs no write per request. Revoking deletes the row.

Downgrade drops the table, which ends token checks: the service then accepts anonymous
requests only on a loopback address, as before the table existed. It refuses, unless
forced, while any token exists, naming them (`app/data/migrating.py`).

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02
"""

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

LOST = """
SELECT 'the tokens ' || string_agg(name, ', ' ORDER BY name) || ' would be deleted, and with'
       || ' no token left anonymous requests on a loopback address would be accepted'
FROM api_token
"""


def upgrade() -> None:
    op.execute("""
        CREATE TABLE api_token (
            id bigint GENERATED ALWAYS AS IDENTITY,
            name text NOT NULL,
            scope text NOT NULL,
            token_sha256 bytea NOT NULL,
            created_at timestamptz NOT NULL DEFAULT now(),
            last_used_at timestamptz,
            CONSTRAINT pk_api_token PRIMARY KEY (id),
            CONSTRAINT uq_api_token_name UNIQUE (name),
            CONSTRAINT uq_api_token_token_sha256 UNIQUE (token_sha256),
            CONSTRAINT ck_api_token_name_format
                CHECK (name ~ '^[A-Za-z0-9][A-Za-z0-9._:-]{0,199}$'),
            CONSTRAINT ck_api_token_scope_known CHECK (scope IN ('read', 'write')),
            CONSTRAINT ck_api_token_token_sha256_size CHECK (octet_length(token_sha256) = 32)
        )
    """)


def downgrade() -> None:
    op.refuse_losing("0002", op.found(LOST))
    op.execute("DROP TABLE api_token")
