"""Token prefixes end with a separator, so a tenant's prefix never reaches another's keys.

A prefix is compared with `startswith`: a token made with `--prefix acme` also reached
`acmeevil-1`. From this revision a prefix ends with `:`, `-` or `.` (`acme:` or `acme-`),
which no other tenant's prefix can extend without the same separator.

Why each statement is here:

1. The check before the constraint: a token whose prefix does not end with a separator may
   reach instances its owner never meant it to. Rewriting its prefix would guess which
   separator the tenant's keys use (and break its clients if the guess is wrong), and
   revoking it would end a team's access without anyone deciding so. So the upgrade refuses,
   naming each such token and its prefix, and changes nothing; the operator re-scopes each
   token (`UPDATE api_token SET key_prefix = 'acme-' WHERE name = 'NAME'`, the token keeps
   working for the keys under `acme-`) or revokes it (`steprecord token revoke NAME`), then
   migrates again.
2. `ck_api_token_key_prefix_separated`: the last character of a prefix is `:`, `-` or `.`
   (named to sort after `ck_api_token_key_prefix_format`, which PostgreSQL checks first, so a
   prefix outside the key alphabet is refused as such).
   The CLI checks the same first, with a message suggesting the delimited prefix; this
   refuses a hand-written token row that breaks it.

Downgrade drops the constraint; the prefixes stay as they are (all delimited).

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-05
"""

from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None

UNDELIMITED = """
SELECT string_agg(name || ' (prefix ' || key_prefix || ')', ', ' ORDER BY name)
FROM api_token WHERE key_prefix !~ '[.:-]$'
"""


def upgrade() -> None:
    tokens = op.found(UNDELIMITED)
    if tokens is not None:
        op.refuse(
            f"migration 0019 refused: the tokens {tokens} have a prefix that does not end with"
            " ':', '-' or '.', so they also reach keys that merely start the same way"
            " (prefix 'acme' reaches 'acmeevil-1'). Nothing was changed. Re-scope each token"
            " to a delimited prefix, e.g."
            " UPDATE api_token SET key_prefix = 'acme-' WHERE name = 'NAME'"
            " (the token keeps working for keys under 'acme-'), or revoke it with"
            " `steprecord token revoke NAME`; then migrate again."
        )
    op.execute("""
        ALTER TABLE api_token ADD CONSTRAINT ck_api_token_key_prefix_separated
            CHECK (key_prefix ~ '[.:-]$')
    """)


def downgrade() -> None:
    op.execute("ALTER TABLE api_token DROP CONSTRAINT ck_api_token_key_prefix_separated")
