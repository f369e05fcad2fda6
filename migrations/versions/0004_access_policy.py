"""Add `access_policy`: once a token has existed, having none left does not reopen access.

Why each statement is here:

1. `access_policy` holds exactly one row: its primary key `id` is a boolean that the CHECK
   `ck_access_policy_one_row` keeps `true`. `tokens_required` is true once any token has
   been created; while it is true a service with no token left refuses every request
   instead of becoming anonymous again. Only `steprecord token allow-anonymous` sets it
   back to false, an explicit choice. `updated_at` says when it last changed.
2. The row is inserted with `tokens_required` already true when `api_token` has rows, so a
   database upgraded while tokens exist is closed from the start.
3. The trigger `tr_api_token_requires_tokens` sets `tokens_required` whenever a token is
   inserted, by `steprecord token create` or by hand, so no way of creating a token leaves
   anonymous access to come back when it is revoked. It upserts, so a row deleted by hand
   comes back (the service treats a missing row as `tokens_required`).

Downgrade drops the trigger, its function and the table, in that order: the service then
treats "no token" as anonymous on loopback again, as before this revision. It refuses,
unless forced, while `tokens_required` is true: that would reopen anonymous access at once
(no token left) or when the last token is revoked (`app/data/migrating.py`).

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03
"""

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

LOST = """
SELECT CASE WHEN EXISTS (SELECT FROM api_token)
            THEN 'access_policy would no longer keep access closed: revoking the last token'
                 || ' would then accept anonymous requests on a loopback address'
            ELSE 'no token exists and access_policy refuses every request: anonymous'
                 || ' requests on a loopback address would be accepted at once'
       END
FROM access_policy WHERE tokens_required
"""


def upgrade() -> None:
    op.execute("""
        CREATE TABLE access_policy (
            id boolean NOT NULL DEFAULT true,
            tokens_required boolean NOT NULL DEFAULT false,
            updated_at timestamptz NOT NULL DEFAULT now(),
            CONSTRAINT pk_access_policy PRIMARY KEY (id),
            CONSTRAINT ck_access_policy_one_row CHECK (id)
        )
    """)
    op.execute("""
        INSERT INTO access_policy (tokens_required)
        SELECT EXISTS (SELECT FROM api_token)
    """)
    op.execute("""
        CREATE FUNCTION api_token_require_tokens() RETURNS trigger
        LANGUAGE plpgsql AS $$
        BEGIN
            INSERT INTO access_policy (tokens_required) VALUES (true)
            ON CONFLICT (id) DO UPDATE SET tokens_required = true, updated_at = now()
            WHERE NOT access_policy.tokens_required;
            RETURN NULL;
        END
        $$
    """)
    op.execute("""
        CREATE TRIGGER tr_api_token_requires_tokens
        AFTER INSERT ON api_token
        FOR EACH ROW EXECUTE FUNCTION api_token_require_tokens()
    """)


def downgrade() -> None:
    op.refuse_losing("0004", op.found(LOST))
    op.execute("DROP TRIGGER tr_api_token_requires_tokens ON api_token")
    op.execute("DROP FUNCTION api_token_require_tokens()")
    op.execute("DROP TABLE access_policy")
