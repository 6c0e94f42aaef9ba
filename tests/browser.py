"""Headless Chromium for tests: Debian's /usr/bin/chromium driven by Playwright.

Tests that need it use the ``browser`` fixture (see conftest); it skips with a
clear reason only where Chromium or Playwright truly cannot be had.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import AsyncIterator
from typing import Any

CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def chromium_path() -> str | None:
    for name in (os.environ.get("TIERCHAIN_CHROMIUM"), "chromium", "chromium-browser"):
        if name and (found := shutil.which(name)):
            return found
    return None


@contextlib.asynccontextmanager
async def launch() -> AsyncIterator[Any]:
    """Yield a Playwright Browser on the system Chromium, or raise LookupError."""
    path = chromium_path()
    if path is None:
        raise LookupError("no chromium binary on PATH (apt-get install chromium)")
    try:
        from playwright.async_api import async_playwright
    except ImportError as exc:  # pragma: no cover - dev extra missing
        raise LookupError(f"playwright is not installed: {exc}") from None
    async with async_playwright() as p:
        browser = await p.chromium.launch(executable_path=path, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            await browser.close()
