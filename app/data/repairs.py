"""Repairs: an operator's reopen of a finished step, and the repair log that keeps them.

The reopen is a database function (app/sql/reopen.sql) that judges and writes under the
record's row lock, as the judge's functions do: one statement per repair, nothing decided in
Python. The log is written by that function alone and read here, newest first.
"""

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg

from ..core.db import AsyncConn
from ..core.domain import InstanceNotFound, Page, StepNotFound
from .common import violation, with_key
from .reads import THE_INSTANCE

# Its first argument is the instance's id, derived from the key in the statement itself
# (app/sql/instance_id.sql): on Citus the coordinator sends the call to the worker holding it.
REOPEN = (
    "SELECT * FROM steprecord_reopen(steprecord_instance_id(%(instance_key)s),"
    " %(instance_key)s, %(step_slug)s, %(attempt)s, %(reason)s, %(by)s)"
)


@dataclass(frozen=True, slots=True)
class Reopened:
    """What a reopen did: `outcome` is `reopened`, or why not (`not_finished`,
    `stale_attempt`, `no_attempt_left`); `record` is the record as it stands after the call."""

    outcome: str
    record: dict[str, Any]
    repair: dict[str, Any] | None  # the repair log's entry, when one was written


async def reopen(
    conn: AsyncConn,
    instance_key: str,
    step_slug: str,
    *,
    attempt: int | None,
    reason: str,
    by: str,
) -> Reopened:
    """Reopen a finished step at its next attempt; raise for an unknown instance or step."""
    params = {
        "instance_key": instance_key,
        "step_slug": step_slug,
        "attempt": attempt,
        "reason": reason,
        "by": by,
    }
    try:
        cur = await conn.execute(REOPEN, params)
    except psycopg.errors.IntegrityError as exc:
        raise violation(exc) from exc
    row = await cur.fetchone()
    assert row is not None
    outcome = row.pop("outcome")
    if outcome == "instance_not_found":
        raise InstanceNotFound(instance_key)
    if outcome == "step_not_found":
        raise StepNotFound(step_slug)
    repair_id, repair_at = row.pop("repair_id"), row.pop("repair_at")
    record = with_key(row, instance_key)
    repair = None
    if repair_id is not None:
        repair = {
            "id": repair_id,
            "step_slug": step_slug,
            "action": "reopen",
            "attempt": record["attempt_count"] - 1,
            "reason": reason,
            "by": by,
            "at": repair_at,
        }
    return Reopened(outcome, record, repair)


# A page of an instance's repair log, newest first: the index (instance_id, at, id) scanned
# backwards from the cursor's position. The instance is found by its id (on Citus, one shard);
# a row with a NULL id: it exists and has no (more) repairs.
LIST_REPAIRS = f"""
SELECT x.*
FROM process_instance p
LEFT JOIN LATERAL (
    SELECT x.id, x.step_slug, x.action, x.attempt, x.reason, x.repaired_by AS by, x.at
    FROM workflow_step_repair x
    WHERE x.instance_id = steprecord_instance_id(%(instance_key)s)
      AND (x.at, x.id) < (%(before_at)s, %(before_id)s)
      AND (%(step_slug)s::text IS NULL OR x.step_slug = %(step_slug)s::text)
    ORDER BY x.at DESC, x.id DESC
    LIMIT %(limit)s
) x ON true
WHERE {THE_INSTANCE}
"""


async def list_repairs(
    conn: AsyncConn,
    instance_key: str,
    *,
    before: tuple[datetime, int] | None,
    limit: int,
    step_slug: str | None = None,
) -> Page:
    """One page of an instance's repairs, newest first; `before` is (at, id) of the last
    one seen. `step_slug` keeps one step's (the dashboard's step page)."""
    before_at, before_id = before if before is not None else ("infinity", 0)
    cur = await conn.execute(
        LIST_REPAIRS,
        {
            "instance_key": instance_key,
            "before_at": before_at,
            "before_id": before_id,
            "step_slug": step_slug,
            "limit": limit + 1,
        },
    )
    rows = await cur.fetchall()
    if not rows:
        raise InstanceNotFound(instance_key)
    items = [row for row in rows if row["id"] is not None]
    if len(items) > limit:
        return Page(items[:limit], items[limit - 1])
    return Page(items, None)
