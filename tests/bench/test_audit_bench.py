"""bench/audit.py --quick runs and prints the figures the issue asks for."""

from __future__ import annotations

import json
import subprocess
import sys

from ci import REPO

ROOT = REPO


def test_bench_audit_quick(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "audit.py"), "--json", "--quick"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        env={"PROOFPLANE_AUDIT_KEY_FILE": str(tmp_path / "k.key"), "PATH": "/usr/bin:/bin"},
    )
    data = json.loads(out.stdout)
    for key in (
        "append_per_s",
        "inclusion_proof_ms",
        "consistency_proof_ms",
        "verify_entries_per_s",
        "verify_entries_per_s_runs",
        "verify_cpu_us_per_entry",
        "verify_workers",
        "bytes_per_event",
        "hash_db_size_bytes_at_size",
        "machine",
    ):
        assert key in data
    assert data["append_per_s"] > 0 and data["verify_entries_per_s"] > 0
