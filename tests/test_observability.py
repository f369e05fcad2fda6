"""Gaps in what the service reports: the request id on a 500, refusals in the event counts."""

import asyncio
import re
import uuid

import httpx
from fastapi import FastAPI
from pydantic import SecretStr

from app.core.config import Settings
from app.main import create_app
from tests.support.http import T1, T2, post, problem


def failing_app(database_url: str) -> FastAPI:
    # In-process requests reach no socket, so they cannot be direct: let them in anonymously.
    app = create_app(Settings(database_url=SecretStr(database_url), insecure_no_auth=True))

    async def boom() -> None:
        raise RuntimeError("a bug")

    app.add_api_route("/v1/boom", boom)
    return app


async def get_boom(app: FastAPI, headers: dict[str, str]) -> httpx.Response:
    transport = httpx.ASGITransport(app, raise_app_exceptions=False)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client,
    ):
        return await client.get("/v1/boom", headers=headers)


def test_unhandled_error_is_a_problem_500_with_the_request_id(database_url: str) -> None:
    app = failing_app(database_url)
    mine = "trace-" + uuid.uuid4().hex[:12]
    response = asyncio.run(get_boom(app, {"X-Request-ID": mine}))
    body = problem(response, 500, "internal_error")
    assert "a bug" not in body["detail"]
    assert response.headers["x-request-id"] == mine
    generated = asyncio.run(get_boom(app, {}))
    problem(generated, 500, "internal_error")
    assert re.fullmatch(r"[A-Za-z0-9._:-]{1,128}", generated.headers["x-request-id"])


def refused(client: httpx.Client, kind: str) -> float:
    text = client.get("/metrics").text
    pattern = rf'^steprecord_events_total\{{kind="{kind}",outcome="refused"\}} (\S+)$'
    found = re.search(pattern, text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def test_database_refusal_on_a_single_endpoint_is_counted_as_refused(
    client: httpx.Client,
) -> None:
    assert post(client, "start", {"attempt": 1, "started_at": T2}).status_code == 201
    before = refused(client, "complete")
    # Only the database knows the record's start is after this completion.
    answer = post(client, "complete", {"attempt": 1, "completed_at": T1, "output": 1})
    problem(answer, 422, "invalid_timing")
    assert refused(client, "complete") == before + 1
