"""Debian's Chromium driven by Playwright (PyPI ``playwright``; never ``playwright install``,
whose browser download cannot be fetched here), and axe-core from tests/web/node_modules."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ci import TESTS, unavailable

CHROMIUM_PATHS = ("/usr/lib/chromium/chromium", "/usr/bin/chromium")
ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip
AXE = TESTS / "web" / "node_modules" / "axe-core" / "axe.min.js"


def chromium_path() -> str:
    """The Chromium binary (skip locally, fail in CI when it is missing)."""
    for path in CHROMIUM_PATHS:
        if Path(path).exists():
            return path
    found = shutil.which("chromium")
    if found:
        return found
    unavailable("chromium is not installed (apt-get install chromium; scripts/test-deps.sh)")


@contextmanager
def chromium() -> Iterator[Any]:
    """A headless Chromium (a Playwright ``Browser``)."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        unavailable("the playwright package is not installed (pip install -e '.[dev]')")
    path = chromium_path()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=path, args=ARGS)
        try:
            yield browser
        finally:
            browser.close()


def axe_violations(page: Any, impacts: frozenset[str] = frozenset({"serious", "critical"})) -> list:
    """axe-core's violations of ``impacts`` on ``page`` (its context must bypass the CSP, which
    forbids the injected script), as (rule id, impact, help, first target)."""
    if not AXE.exists():
        unavailable("axe-core is missing: npm ci in tests/web (scripts/test-deps.sh)")
    page.add_script_tag(path=str(AXE))
    result = page.evaluate("async () => await axe.run(document)")
    return [
        (v["id"], v["impact"], v["help"], v["nodes"][0]["target"] if v["nodes"] else None)
        for v in result["violations"]
        if v["impact"] in impacts
    ]
