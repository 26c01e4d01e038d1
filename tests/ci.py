"""The one rule for what a test needs from outside (a program, a service, the shared data):
outside CI a missing one skips the test, saying what to install; in CI (``CI=true``) it fails
the run, so a missing dependency never hides behind a skip there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn

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


def bench_json(script: str, *args: str, timeout: float = 120) -> dict[str, Any]:
    """Run ``bench/<script>`` with ``args`` in this interpreter and parse the JSON it prints."""
    out = subprocess.run(
        [sys.executable, str(REPO / "bench" / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=True,
    )
    doc: dict[str, Any] = json.loads(out.stdout)
    return doc


def load_script(relative: str, name: str) -> ModuleType:
    """A repository script that is not a package module (``bench/api.py``,
    ``scripts/nvml_check.py``), imported from its file as module ``name``."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / relative)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # a dataclass in it looks its module up there
    spec.loader.exec_module(module)
    return module
