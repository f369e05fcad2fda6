"""Small helpers shared by the HTTP tests."""

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from playwright.sync_api import Browser, sync_playwright

from app.embedded import EmbeddedPostgres

T0 = "2026-12-02T10:00:00Z"
T1 = "2026-12-02T10:00:01Z"
T2 = "2026-12-02T10:00:02Z"
T3 = "2026-12-02T10:00:03Z"
T4 = "2026-12-02T10:00:04Z"


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


def make_replica(primary: EmbeddedPostgres, data_dir: Path) -> EmbeddedPostgres:
    """A hot standby streaming from `primary`: a base backup with its recovery settings."""
    replica = EmbeddedPostgres(data_dir)
    replica._prepare_dirs()
    replica._run(
        "pg_basebackup",
        "-D",
        str(replica.pgdata),
        "-d",
        primary.url,
        "-R",
        "-X",
        "stream",
        "-c",
        "fast",
    )
    replica.start()
    return replica


CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@contextmanager
def chromium_browser() -> Iterator[Browser]:
    """Debian's chromium driven by Playwright (never a downloaded browser), closed on exit;
    FileNotFoundError when it is not installed."""
    chromium = shutil.which("chromium")
    if chromium is None:
        raise FileNotFoundError("Debian's chromium is not installed: apt-get install chromium")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()
