"""The published OCSF schema the exports are validated against: the unmodified 1.1.0 files in
``../shared/data/ocsf-schema-1.1.0`` (Apache-2.0), read once per test process and compiled by
``proofplane.audit.export.ocsf_schema``. Missing files skip locally and fail in CI."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from ci import SHARED, unavailable
from proofplane.audit.export import ocsf_schema

SCHEMA_DIRS = {"1.1.0": SHARED / "data" / "ocsf-schema-1.1.0"}


def read_schema_dir(root: Path) -> dict[str, Any]:
    """``{path relative to root: parsed JSON}`` for every JSON file under ``root``."""
    return {
        p.relative_to(root).as_posix(): json.loads(p.read_text(encoding="utf-8"))
        for p in sorted(root.rglob("*.json"))
    }


@functools.cache
def schema(version: str = "1.1.0") -> ocsf_schema.Schema:
    root = SCHEMA_DIRS[version]
    if not (root / "dictionary.json").is_file():
        unavailable(f"the OCSF {version} schema is not at {root}")
    return ocsf_schema.compile_schema(read_schema_dir(root))
