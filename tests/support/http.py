"""Requests to the service under test and the answers they check: steps, records, problems."""

from datetime import UTC, datetime, timedelta
from typing import Any

import httpx

T0 = "2026-12-02T10:00:00Z"


T1 = "2026-12-02T10:00:01Z"


T2 = "2026-12-02T10:00:02Z"


T3 = "2026-12-02T10:00:03Z"


T4 = "2026-12-02T10:00:04Z"


def asgi_scope(method: str, path: str, body: bytes | None = None) -> dict[str, Any]:
    """The ASGI scope of a direct request (loopback, no token: anonymous access) to call an app
    in-process; with `body`, a JSON body of that length."""
    headers = [(b"host", b"127.0.0.1")]
    if body is not None:
        headers += [(b"content-type", b"application/json")]
        headers += [(b"content-length", str(len(body)).encode())]
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
        "state": {},
    }


def step_path(instance: str = "order-1", step: str = "charge") -> str:
    return f"/v1/instances/{instance}/steps/{step}"


def post(
    client: httpx.Client,
    kind: str,
    body: Any = None,
    instance: str = "order-1",
    step: str = "charge",
) -> httpx.Response:
    url = f"{step_path(instance, step)}/{kind}"
    if body is None:
        return client.post(url)
    return client.post(url, json=body)


def record(client: httpx.Client, instance: str = "order-1", step: str = "charge") -> Any:
    response = client.get(step_path(instance, step))
    assert response.status_code == 200, response.text
    return response.json()


def exists(client: httpx.Client, key: str) -> bool:
    return client.get(f"/v1/instances/{key}").status_code == 200


def problem(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    body: dict[str, Any] = response.json()
    assert body["code"] == code, body
    assert body["status"] == status
    assert {"type", "title", "detail"} <= body.keys()
    return body


def attempts(client: httpx.Client, instance: str = "order-1", step: str = "charge") -> Any:
    """Every attempt of a step's history, in attempt order."""
    response = client.get(f"{step_path(instance, step)}/attempts", params={"limit": 1000})
    assert response.status_code == 200, response.text
    return response.json()["items"]


def history(client: httpx.Client, instance: str = "order-1", step: str = "charge") -> Any:
    """The history in short: `(attempt, status)` of each attempt."""
    return [(a["attempt"], a["status"]) for a in attempts(client, instance, step)]


def ago(**delta: float) -> str:
    """The moment `timedelta(**delta)` before now, as an RFC 3339 timestamp."""
    return (datetime.now(UTC) - timedelta(**delta)).isoformat()


def html(client: httpx.Client, path: str, status: int = 200) -> str:
    """A dashboard page's HTML, checked to answer `status` as text/html."""
    response = client.get(path)
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("text/html")
    return response.text
