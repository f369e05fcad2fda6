"""Rows written, refused and aged straight in SQL, under the service's back."""

from typing import Any

import psycopg
import pytest

from app.data.common import constraint_name
from tests.support.http import T1, T2


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


Conn = psycopg.Connection[tuple[Any, ...]]


VALID: dict[str, dict[str, Any]] = {
    "pending": {},
    "running": {"started_at": T1},
    "completed_inline": {
        "status": "completed",
        "started_at": T1,
        "completed_at": T2,
        "output": '{"a": 1}',
    },
    "completed_external": {
        "status": "completed",
        "started_at": T1,
        "completed_at": T2,
        "external_output_url": "s3://b/k",
    },
    "completed_empty": {"status": "completed", "started_at": T1, "completed_at": T2},
    "failed": {
        "status": "failed",
        "started_at": T1,
        "completed_at": T2,
        "error_code": "Boom",
        "error_message": "it broke",
    },
}


BASE: dict[str, dict[str, Any]] = {
    "pending": {"status": "pending"},
    "running": {"status": "running", "started_at": T1},
    "completed": VALID["completed_inline"],
    "failed": VALID["failed"],
}


_counter = iter(range(10**9))


def insert(db: Conn, instance_id: int, **fields: Any) -> int:
    values = {
        "step_slug": f"s{next(_counter)}",
        "ordinal": next(_counter),
        "status": "pending",
        "attempt_count": 1,
        **fields,
    }
    columns = ", ".join(["instance_id", *values])
    marks = ", ".join(["%s"] * (len(values) + 1))
    row = db.execute(
        f"INSERT INTO workflow_step_record ({columns}) VALUES ({marks}) RETURNING id",
        [instance_id, *values.values()],
    ).fetchone()
    assert row is not None
    return int(row[0])


def refused(db: Conn, constraint: str, sql: str, params: Any = ()) -> None:
    """`sql` is refused by `constraint`, named as the service names it (on Citus a worker's
    refusal reaches the client with the name in its message only)."""
    with pytest.raises(psycopg.errors.IntegrityError) as caught, db.transaction():
        db.execute(sql, params)
    assert constraint_name(caught.value) == constraint
