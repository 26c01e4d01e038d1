"""``bench/defrag.py --json`` on a small cluster runs and prints what the README states (never
speed, which CI machines vary in): every decision planned or refused with a code, times sane."""

from __future__ import annotations

import json
import subprocess
import sys

from ci import REPO

BENCH = REPO / "bench" / "defrag.py"


def test_small_run_prints_the_figures() -> None:
    out = subprocess.run(
        [sys.executable, str(BENCH), "--nodes", "200", "--decisions", "10", "--apply", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    doc = json.loads(out.stdout)
    assert doc["benchmark"] == "defrag" and doc["nodes"] == 200 and doc["gpus"] == 1600
    assert sum(doc["outcomes"].values()) == doc["decisions"] == 10
    assert doc["outcomes"].get("plan", 0) > 0 and doc["moves_per_plan_mean"] >= 1
    assert 0 < doc["p50_ms"] <= doc["p99_ms"] <= doc["max_ms"]
    assert {"cpu", "cores", "python", "platform"} <= doc["machine"].keys()
