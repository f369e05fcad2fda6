"""Debian's chromium driven by Playwright, and the dashboard's screenshots."""

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from playwright.sync_api import Browser, sync_playwright

from tests.support import ROOT

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


SCREENSHOTS = ROOT / "tests" / "screenshots"


ARTIFACTS = ROOT / "tests" / "artifacts"


def screenshot(page: Any, name: str, *, full_page: bool = True) -> Path:
    """A browser test's screenshot: into tests/artifacts/ (ignored by git), or, with
    STEPRECORD_SCREENSHOTS=1, into tests/screenshots/, the committed pictures of the dashboard."""
    folder = SCREENSHOTS if os.environ.get("STEPRECORD_SCREENSHOTS") == "1" else ARTIFACTS
    folder.mkdir(exist_ok=True)
    target = folder / f"{name}.png"
    page.screenshot(path=str(target), full_page=full_page)
    return target


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
