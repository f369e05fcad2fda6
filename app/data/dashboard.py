"""The dashboard's own reads: an instance's steps with every attempt, for the timeline (its
list of instances is the API's, `reads.list_instances`)."""

from typing import Any

from app.db import AsyncConn

# An error message's first line (the step page shows it whole), cut to 300 characters.
ERROR_LINE = "left(split_part({m}, E'\\n', 1), 300) AS error_line"

# Everything the instance page shows of its steps, without outputs and with only the first
# line of an error message (the step page shows both whole): one statement for the records,
# one for every attempt of the instance.
INSTANCE_STEPS = f"""
SELECT r.id, r.step_slug, r.ordinal, r.status, r.attempt_count, r.started_at, r.completed_at,
       r.error_code, {ERROR_LINE.format(m="r.error_message")}, r.lease_expires_at, r.updated_at
FROM workflow_step_record r
WHERE r.instance_id = %(instance_id)s
ORDER BY r.ordinal
LIMIT %(limit)s
"""
INSTANCE_ATTEMPTS = f"""
SELECT a.record_id, a.attempt, a.status, a.started_at, a.completed_at, a.error_code,
       {ERROR_LINE.format(m="a.error_message")}
FROM workflow_step_record r
JOIN workflow_step_attempt a ON a.record_id = r.id
WHERE r.instance_id = %(instance_id)s AND r.ordinal <= %(last_ordinal)s
ORDER BY a.record_id, a.attempt
"""


async def instance_steps(
    conn: AsyncConn, instance_id: int, *, limit: int
) -> tuple[list[dict[str, Any]], bool]:
    """The first `limit` records of an instance in ordinal order, each with `attempts` (every
    attempt, oldest first); True when the instance has more."""
    cur = await conn.execute(INSTANCE_STEPS, {"instance_id": instance_id, "limit": limit + 1})
    records = await cur.fetchall()
    more = len(records) > limit
    records = records[:limit]
    if not records:
        return [], more
    by_id: dict[int, dict[str, Any]] = {}
    for record in records:
        record["attempts"] = []
        by_id[record["id"]] = record
    cur = await conn.execute(
        INSTANCE_ATTEMPTS,
        {"instance_id": instance_id, "last_ordinal": records[-1]["ordinal"]},
    )
    for attempt in await cur.fetchall():
        owner = by_id.get(attempt.pop("record_id"))
        if owner is not None:
            owner["attempts"].append(attempt)
    return records, more
