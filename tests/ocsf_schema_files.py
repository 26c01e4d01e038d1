"""The published OCSF schema the exports are validated against: the unmodified 1.1.0 files in
``../shared/data/ocsf-schema-1.1.0`` (Apache-2.0), read once per test process and compiled by
``proofplane.audit.export.ocsf_schema``. Missing files skip locally and fail in CI."""

from __future__ import annotations

import functools

from ci import SHARED, unavailable
from proofplane.audit.export import ocsf_schema
from proofplane.siem.ocsf_files import load_schema

SCHEMA_DIRS = {"1.1.0": SHARED / "data" / "ocsf-schema-1.1.0"}


@functools.cache
def schema(version: str = "1.1.0") -> ocsf_schema.Schema:
    root = SCHEMA_DIRS[version]
    if not (root / "dictionary.json").is_file():
        unavailable(f"the OCSF {version} schema is not at {root}")
    return load_schema(root)
