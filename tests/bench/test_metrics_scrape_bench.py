"""bench/telemetry.py --quick --only metrics_scrape: the /metrics scrape figure's section runs
and says what it measured."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ci import REPO


def test_bench_metrics_scrape_quick(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(REPO / "bench" / "telemetry.py"), "--json", "--quick",
         "--only", "metrics_scrape"],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
        env={"PROOFPLANE_AUDIT_KEY_FILE": str(tmp_path / "k.key"),
             "PROOFPLANE_MASTER_KEY_FILE": str(tmp_path / "m.key"), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    data = json.loads(out.stdout)
    s = data["metrics_scrape"]
    keys = ("scrape_ms", "scrape_after_writes_ms", "first_scrape_ms", "telemetry_query_ms",
            "series", "exposition_bytes", "workloads_placed", "target_ms", "meets")  # fmt: skip
    for key in keys:
        assert key in s, key
    assert s["nodes"] == 100 and s["workloads_placed"] > 0 and s["series"] > 50
    assert s["scrape_ms"] > 0 and s["meets"] is (s["scrape_ms"] <= s["target_ms"])
    assert "ingest" not in data  # --only
