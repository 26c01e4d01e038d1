"""bench/usage_report.py --quick --json builds a small history of real-shaped events and times
the usage report over it: the figure, its verdict against the target, the same bytes on every
run, and a history whose events the report reads back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from decimal import Decimal
from pathlib import Path

from ci import REPO


def test_bench_usage_quick(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROOFPLANE_")}
    db = tmp_path / "history.db"
    out = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "usage_report.py"),
            "--json",
            "--quick",
            "--db",
            str(db),
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
        env={**env, "HOME": str(tmp_path)},
    )
    data = json.loads(out.stdout)
    assert data["machine"]["cpu_count"] >= 1 and data["quick"] is True
    history = data["history"]
    assert history["events"] > 20_000 and history["nodes"] == 50 and db.exists()
    assert len(data["report_s_runs"]) == 2 and data["report_s"] > 0
    assert data["report_cpu_s"] > 0 and len(data["report_cpu_s_runs"]) == 2
    assert data["workers"] == 0  # a small log is metered in-process
    assert data["meets"] is (data["report_s"] <= data["target_report_s"])
    assert data["same_bytes_every_run"] is True
    report = data["report"]
    assert report["tenants"] == 50 and report["lines"] > 0
    # the lanes are busy about 80 % of the time: the GPU-hours are of that order
    capacity = history["gpus"] * history["days"] * 24
    assert 0.5 * capacity < Decimal(report["gpu_hours"]) <= capacity


def test_the_usage_section_of_bench_telemetry(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROOFPLANE_")}
    out = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "telemetry.py"),
            "--json",
            "--quick",
            "--only",
            "usage_report",
            "--usage-db",
            str(tmp_path / "history.db"),
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
        env={**env, "HOME": str(tmp_path)},
    )
    data = json.loads(out.stdout)
    assert set(data) == {"machine", "pid", "usage_report"}
    section = data["usage_report"]
    assert section["quick"] is True and section["report_s"] > 0
    assert section["meets"] is (section["report_s"] <= section["target_report_s"])
