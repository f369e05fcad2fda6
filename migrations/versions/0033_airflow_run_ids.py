"""Instance keys may hold `+` and `~`: an Airflow run id is a key as it stands.

Airflow names a dag run `scheduled__2026-12-06T00:00:00+00:00`, and its default run-id
pattern (`[scheduler] allowed_run_id_pattern`, `^[A-Za-z0-9_.~:+-]+$`) allows `+` and `~`
beyond the name alphabet `[A-Za-z0-9._:-]`. The Airflow plugin makes the instance key
`{dag_id}:{run_id}` (docs/airflow.md), so the key alphabet takes both characters:
`ck_process_instance_instance_key_format` becomes
`instance_key ~ '^[A-Za-z0-9][A-Za-z0-9._:+~-]{0,199}$'` (still 1-200 characters, the first
a letter or a digit). Step slugs, error codes, writer and token names and token prefixes keep
the name alphabet.

The constraint is dropped and added again under the same name, each in an ALTER TABLE of its
own (Citus adds a constraint to a distributed table only so). Widening a CHECK needs no scan
of what is stored: every key already matches the narrower pattern.

Downgrade narrows it back, and refuses (changing nothing) while a key holds `+` or `~`,
naming how many and the first few: delete those instances first
(`DELETE /v1/instances/{instance_key}`, or `steprecord prune`), then migrate down again.

Revision ID: 0033
Revises: 0032
Create Date: 2026-12-07
"""

from alembic import op

revision = "0033"
down_revision = "0032"
branch_labels = None
depends_on = None

KEY_PATTERN = "^[A-Za-z0-9][A-Za-z0-9._:+~-]{0,199}$"
NAME_PATTERN = "^[A-Za-z0-9][A-Za-z0-9._:-]{0,199}$"

WIDER_KEYS = """
SELECT count(*) || ' instance keys hold ''+'' or ''~'' (e.g. '
       || string_agg(instance_key, ', ') FILTER (WHERE n <= 3) || ')'
FROM (SELECT instance_key, row_number() OVER (ORDER BY instance_key) AS n
      FROM process_instance WHERE instance_key ~ '[+~]') k
HAVING count(*) > 0
"""


def _key_format(pattern: str) -> None:
    op.execute(
        "ALTER TABLE process_instance DROP CONSTRAINT ck_process_instance_instance_key_format"
    )
    op.execute(
        "ALTER TABLE process_instance ADD CONSTRAINT ck_process_instance_instance_key_format"
        f" CHECK (instance_key ~ '{pattern}')"
    )


def upgrade() -> None:
    _key_format(KEY_PATTERN)


def downgrade() -> None:
    keys = op.found(WIDER_KEYS)
    if keys is not None:
        op.refuse(
            f"downgrade of 0033 refused: {keys}, which the key format before 0033 refuses."
            " Nothing was changed. Delete those instances first (DELETE"
            " /v1/instances/{instance_key}, or `steprecord prune`), then migrate down again."
        )
    _key_format(NAME_PATTERN)
