"""The one rule for what a test needs from outside (a program, a service, the shared data):
outside CI a missing one skips the test, saying what to install; in CI (``CI=true``) it fails
the run, so a missing dependency never hides behind a skip there."""

from __future__ import annotations

import os
from pathlib import Path
from typing import NoReturn

import pytest

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
# ../shared beside the checkout: the openb trace, the TCG event logs, the OCSF schema, …
SHARED = REPO / ".." / "shared"


def unavailable(reason: str) -> NoReturn:
    """Skip (a developer's machine) or fail (CI) because ``reason`` is missing."""
    if IN_CI:
        pytest.fail(f"{reason} (required in CI)", pytrace=False)
    pytest.skip(reason, allow_module_level=True)
