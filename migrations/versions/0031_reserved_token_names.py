"""A token's name is never a name the service writes as itself.

A record's `updated_by` and an attempt's `reported_by` name who wrote them (revision 0025):
a token's name, `anonymous` for access without tokens, `sweeper` for a lease the sweeper
closed, and `cli:` with the operating system's user for a repair made with `steprecord
repair`. A token named `sweeper` (or `cli:root`) wrote under that name, so the record could
not tell a client from the service. From this revision no token may be so named.

Why each statement is here:

1. The check before the constraint: a token that exists with such a name has written under
   it, and renaming it for the operator would change the name its owner revokes it by, while
   revoking it would end a client's access without anyone deciding so. So the upgrade
   refuses, naming each such token, and changes nothing; the operator renames it
   (`UPDATE api_token SET name = 'ci-sweeper' WHERE name = 'sweeper'`: the token keeps
   working, and writes under its new name from then on) or deletes it, then migrates again.
   What such a token wrote before stays as written.
2. `ck_api_token_name_not_reserved`: `anonymous`, `sweeper`, `cli` (the CLI's writer when the
   user has no name) and any name starting with `cli:`, in any case (`Sweeper` reads the same
   on a dashboard). `steprecord token create` meets it first with a message saying so; this
   refuses a hand-written token row too.

Downgrade drops the constraint; nothing is lost.

Revision ID: 0031
Revises: 0030
Create Date: 2026-12-08
"""

from alembic import op

revision = "0031"
down_revision = "0030"
branch_labels = None
depends_on = None

# Written without `%`, which a driver may take for a parameter.
RESERVED = "lower(name) IN ('anonymous', 'sweeper', 'cli') OR starts_with(lower(name), 'cli:')"
TAKEN = f"SELECT string_agg(name, ', ' ORDER BY name) FROM api_token WHERE {RESERVED}"


def upgrade() -> None:
    tokens = op.found(TAKEN)
    if tokens is not None:
        op.refuse(
            f"migration 0031 refused: the tokens {tokens} are named as the service names"
            " itself in the records it writes (anonymous, sweeper, cli, cli:USER), so what they"
            " wrote could not be told from the service's own writes. Nothing was changed."
            " Rename each token, e.g. UPDATE api_token SET name = 'ci-sweeper' WHERE name ="
            " 'sweeper' (it keeps working, under its new name), or delete it"
            " (DELETE FROM api_token WHERE name = 'sweeper'); then migrate again."
        )
    op.execute(
        "ALTER TABLE api_token ADD CONSTRAINT ck_api_token_name_not_reserved"
        f" CHECK (NOT ({RESERVED}))"
    )


def downgrade() -> None:
    op.execute("ALTER TABLE api_token DROP CONSTRAINT ck_api_token_name_not_reserved")
