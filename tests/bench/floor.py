"""The floor of a single event and of a page read: a bare ASGI app doing only what they need.

`tests/bench/cpu.py` serves it with uvicorn (two workers, as the service) on the same
database and loads it as it loads the service. It calls the service's own functions for the
work itself: the event's body is parsed and checked by `app.api.bodies`, judged by
`app.data.judge` (`steprecord_apply_event`, prepared, through the service's connection pool)
and answered by `app.api.routes.refusals.judged`; the page is read with the service's statement
(`steprecord_list_page`, in binary) and rendered by `app.core.serialize`. So its answers are the
service's, byte for byte (cpu.py checks). It has nothing else: no framework, routing,
parameter parsing, access control, log line, metrics, tracing or request id. What the
service spends beyond it is what those cost.

It answers `POST /v1/instances/{key}/steps/{slug}/start` and `.../complete` (what
events.lua sends), `GET /v1/instances/{key}/steps?order=ordinal&limit=100` (what reads.lua
asks), and `/readyz`.
"""

import os
from itertools import repeat
from typing import Any

import psycopg
from psycopg.rows import tuple_row

from app.api.bodies import parse_event
from app.api.routes.refusals import judged
from app.core import cursors
from app.core.config import Settings
from app.core.db import Pool
from app.core.serialize import dumps, loads, page_json
from app.data import judge
from app.data.reads import LIST_PAGE, PAGE_COLUMNS, PAGE_READ_BYTES

LIMIT = 100
HEADERS = [(b"content-type", b"application/json")]
_pools: list[Pool] = []


def _pool() -> Pool:
    if not _pools:
        settings = Settings()
        _pools.append(
            Pool(
                os.environ["DATABASE_URL"],
                size=settings.pool_size,
                timeout=settings.db_timeout,
                statement_timeout=settings.statement_timeout,
                prepare_threshold=settings.prepare_threshold,
            )
        )
    return _pools[0]


async def event(key: str, slug: str, kind: Any, body: bytes) -> tuple[int, bytes]:
    parsed = parse_event(key, slug, kind, loads(body) if body else None)
    async with _pool().connection() as conn:
        result = await judge.apply_event(conn, parsed, writer="anonymous")
    status, record = judged(result, parsed)
    return status, dumps(record)


async def page(instance_key: str) -> bytes:
    params = [instance_key, "ordinal", -1, "-infinity", 0, None, LIMIT + 1, PAGE_READ_BYTES]
    async with (
        _pool().connection() as conn,
        psycopg.AsyncRawCursor(conn, row_factory=tuple_row) as cur,
    ):
        await cur.execute(LIST_PAGE, params, binary=True)
        rows = await cur.fetchall()
    items = list(map(dict, map(zip, repeat(PAGE_COLUMNS), rows[:LIMIT])))
    next_cursor = cursors.steps_cursor("ordinal", items[-1]) if len(rows) > LIMIT else None
    return dumps({"items": page_json(items), "next_cursor": next_cursor})


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        await receive()  # startup
        await send({"type": "lifespan.startup.complete"})
        await receive()  # shutdown
        if _pools:
            await _pools[0].close()
        await send({"type": "lifespan.shutdown.complete"})
        return
    path = scope["path"]
    status, body = 200, b"{}"
    if scope["method"] == "POST":
        _, _, _, key, _, slug, kind = path.split("/")
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        status, body = await event(key, slug, kind, b"".join(chunks))
    elif path != "/readyz":
        body = await page(path.split("/")[3])
    await send({"type": "http.response.start", "status": status, "headers": HEADERS})
    await send({"type": "http.response.body", "body": body})
