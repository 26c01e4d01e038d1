"""bench/console.py on a small cluster: every page timed through the real application, the
verdict against the 300 ms target, and the evidence package's figure."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from ci import REPO


def test_bench_console_small(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROOFPLANE_")}
    out = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "console.py"),
            "--json",
            "--nodes",
            "60",
            "--workloads",
            "120",
            "--requests",
            "2",
            "--evidence",
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        env={**env, "HOME": str(tmp_path)},
        cwd=REPO,
    )
    data = json.loads(out.stdout)
    assert data["setup"]["nodes"] == 60 and data["setup"]["workloads_placed"] > 0
    pages = data["pages"]
    assert {"cluster", "node", "workloads", "workload", "tenants", "tenant", "audit"} <= set(pages)
    assert all(p["server_p50_ms"] > 0 and p["bytes"] > 1000 for p in pages.values())
    assert data["worst_server_p50_ms"] == max(
        p["server_p50_ms"] for k, p in pages.items() if k != "workload_explain_live"
    )
    assert data["meets_target"] == (data["worst_server_p50_ms"] <= data["target_server_p50_ms"])
    assert data["evidence"]["evidence_package_s"] > 0 and data["evidence"]["controls"] >= 10
