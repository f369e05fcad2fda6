"""An instance's labels, set and removed by `PATCH /v1/instances/{instance_key}`.

Events merge their labels in the judge's own statement (app/sql/apply_event.sql); a PATCH is
one call of `steprecord_patch_labels` (app/sql/labels.sql), one UPDATE of the instance's row
merged on its newest version (JSON Merge Patch: the keys with a value take it, the keys with
null go), so two concurrent PATCHes never lose each other's keys. The labels' CHECKs
(`ck_process_instance_labels_*`) refuse what exceeds a limit.
"""

import json
from typing import Any

import psycopg

from ..core.db import AsyncConn
from ..core.domain import InstanceNotFound
from .common import violation
from .reads import get_instance

# The merge is a function in the database (app/sql/labels.sql): one UPDATE of the row.
PATCH_LABELS = (
    "SELECT * FROM steprecord_patch_labels(%(instance_key)s::text, %(set)s::jsonb,"
    " %(remove)s::text[])"
)


async def patch_labels(
    conn: AsyncConn, instance_key: str, patch: dict[str, str | None]
) -> dict[str, Any]:
    """Merge `patch` into the instance's labels (a None value removes its key); the instance
    as `GET /v1/instances/{instance_key}` shows it after. Raise `InstanceNotFound`, or the
    `ConstraintViolation` of a limit."""
    params = {
        "instance_key": instance_key,
        "set": json.dumps({key: value for key, value in patch.items() if value is not None}),
        "remove": [key for key, value in patch.items() if value is None],
    }
    async with conn.transaction():
        try:
            cur = await conn.execute(PATCH_LABELS, params)
        except psycopg.errors.IntegrityError as exc:
            raise violation(exc) from None
        if await cur.fetchone() is None:
            raise InstanceNotFound(instance_key)
        return await get_instance(conn, instance_key)
