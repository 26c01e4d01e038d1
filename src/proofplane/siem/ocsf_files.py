"""Reading an OCSF schema directory (a checkout or release of github.com/ocsf/ocsf-schema) for
``proofplane.audit.export.ocsf_schema``, which compiles and validates without I/O."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from proofplane.audit.export.ocsf_schema import Schema, SchemaError, compile_schema


def read_schema_dir(root: str | Path) -> dict[str, Any]:
    """``{path relative to root: parsed JSON}`` for every JSON file under ``root``."""
    base = Path(root)
    if not (base / "dictionary.json").is_file():
        raise SchemaError(f"{base} is not an OCSF schema directory (no dictionary.json)")
    out: dict[str, Any] = {}
    for path in sorted(base.rglob("*.json")):
        try:
            out[path.relative_to(base).as_posix()] = json.loads(path.read_text("utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise SchemaError(f"{path}: {exc}") from None
    return out


def load_schema(root: str | Path) -> Schema:
    """The compiled schema of the directory ``root``."""
    return compile_schema(read_schema_dir(root))
