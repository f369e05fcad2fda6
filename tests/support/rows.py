"""Rows written and aged straight in SQL, under the service's back."""

import psycopg


def age(database_url: str, instance_key: str, days: int) -> None:
    """Make an instance look last written `days` ago (its creation and every record's
    updated_at; the history does not take part in the rule)."""
    # By the instance's id, derived from its key: on Citus, each update is the shard's.
    with psycopg.connect(database_url) as conn:
        conn.execute(
            "UPDATE process_instance SET created_at = now() - %s * interval '1 day'"
            " WHERE id = steprecord_instance_id(%s)",
            (days, instance_key),
        )
        conn.execute(
            "UPDATE workflow_step_record SET updated_at = now() - %s * interval '1 day'"
            " WHERE instance_id = steprecord_instance_id(%s)",
            (days, instance_key),
        )
