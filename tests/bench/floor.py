"""The floor of the page read: a bare ASGI app doing only what the read itself needs.

`tests/bench/cpu.py` serves it with uvicorn (two workers, as the service) on the same
database and loads it as it loads the service. It sends the service's statement
(`steprecord_list_page`, in binary, through psycopg), makes the rows dicts and renders them
with the service's own functions, so its answer is the service's, byte for byte (cpu.py
checks). It has nothing else: no framework, routing, parameter parsing, access control, log
line, metrics or connection pool. What the service spends beyond it is what those cost.
It answers only `GET /v1/instances/{key}/steps?order=ordinal&limit=100` (what reads.lua
asks), and `/readyz`.
"""

import os
from itertools import repeat
from typing import Any

import psycopg
from psycopg.rows import tuple_row

from app import cursors
from app.data.reads import LIST_PAGE, PAGE_COLUMNS
from app.serialize import dumps, page_json

LIMIT = 100
HEADERS = [(b"content-type", b"application/json")]
_idle: list[psycopg.AsyncConnection[Any]] = []


async def _connection() -> psycopg.AsyncConnection[Any]:
    if _idle:
        return _idle.pop()
    conn = await psycopg.AsyncConnection.connect(os.environ["DATABASE_URL"], autocommit=True)
    await conn.execute("SET TimeZone TO 'UTC'")
    conn.prepare_threshold = None  # as the service: no prepared statements (PgBouncer)
    return conn


async def page(instance_key: str) -> bytes:
    conn = await _connection()
    try:
        async with psycopg.AsyncRawCursor(conn, row_factory=tuple_row) as cur:
            params = [instance_key, "ordinal", -1, "-infinity", 0, None, LIMIT + 1]
            await cur.execute(LIST_PAGE, params, binary=True)
            rows = await cur.fetchall()
    finally:
        _idle.append(conn)
    items = list(map(dict, map(zip, repeat(PAGE_COLUMNS), rows[:LIMIT])))
    next_cursor = cursors.steps_cursor("ordinal", items[-1]) if len(rows) > LIMIT else None
    return dumps({"items": page_json(items), "next_cursor": next_cursor})


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        await receive()  # startup
        await send({"type": "lifespan.startup.complete"})
        await receive()  # shutdown
        await send({"type": "lifespan.shutdown.complete"})
        return
    path = scope["path"]
    body = b"{}" if path == "/readyz" else await page(path.split("/")[3])
    await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
    await send({"type": "http.response.body", "body": body})
