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
                "readings_per_s", "cpu_us_per_sample", "readings_per_post", "bytes_per_sample",
                "uptime_before"):  # fmt: skip
        assert key in ingest
    assert ingest["samples_per_s"] > 0 and len(ingest["samples_per_s_runs"]) == 3
    assert ingest["target_samples_per_s"] == 20_000
    # a sample is a device's readings: 17 devices (8 GPUs, 9 MIG instances), 181 readings
    assert (ingest["devices_per_post"], ingest["readings_per_post"]) == (17, 181)
    assert ingest["readings_per_s"] > ingest["samples_per_s"]
    # one packed row per device and holder (shared GPUs once per holder and once for the rest)
    assert ingest["devices_per_post"] <= ingest["stored_rows_per_post"] < 40
    assert ingest["stored_readings_per_post"] >= ingest["readings_per_post"]
