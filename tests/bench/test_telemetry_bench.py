"""bench/telemetry.py --quick runs and prints the ingest figure in its section."""

from __future__ import annotations

import json
import subprocess
import sys

from ci import REPO


def test_bench_telemetry_quick(tmp_path):
    out = subprocess.run(
        [sys.executable, str(REPO / "bench" / "telemetry.py"), "--json", "--quick",
         "--only", "ingest"],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
        env={"PROOFPLANE_AUDIT_KEY_FILE": str(tmp_path / "k.key"),
             "PROOFPLANE_MASTER_KEY_FILE": str(tmp_path / "m.key"), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    data = json.loads(out.stdout)
    assert "machine" in data and data["machine"]["sqlite"]
    ingest = data["ingest"]
    for key in ("samples_per_s", "samples_per_s_runs", "samples_per_cpu_s", "posts_per_s",
                "cpu_us_per_sample", "readings_per_post", "bytes_per_sample"):  # fmt: skip
        assert key in ingest
    assert ingest["samples_per_s"] > 0 and len(ingest["samples_per_s_runs"]) == 3
    # readings of shared GPUs are stored once per holder
    assert ingest["stored_rows_per_post"] >= ingest["readings_per_post"]
