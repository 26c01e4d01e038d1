"""``bench/placement.py --quick --json`` runs and prints what the issue asks for.

Checks the keys and that the figures are sane (placements happened, nothing violated
compliance, the snapshot agrees with the reference); never speed, which CI machines vary in.
"""

from __future__ import annotations

import json
import subprocess
import sys

from ci import REPO

BENCH = REPO / "bench" / "placement.py"


def test_quick_run_prints_the_figures() -> None:
    out = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    doc = json.loads(out.stdout)
    for key in ("decisions_per_s", "p50_ms", "p99_ms", "failover_s", "rss_mb", "e2e_per_s"):
        assert isinstance(doc[key], int | float) and doc[key] > 0, key
    assert doc["p50_ms"] <= doc["p99_ms"]
    assert {"cpu", "cores", "python", "platform"} <= doc["machine"].keys()
    params = doc["params"]
    assert params["quick"] is True and params["nodes"] > 0 and params["seed"] == 7
    assert doc["e2e_cluster_nodes"] > 0
    fill = doc["fill"]
    assert fill["held"] == params["placed_target"] == fill["placed"]
    for rnd in doc["failover"]["rounds"]:
        assert rnd["compliance_violations"] == 0
        assert rnd["replaced"] + sum(rnd["pending"].values()) == rnd["evicted"]
    assert doc["reference"]["agrees_with_snapshot"] is True
    assert doc["e2e"]["workloads"] > 0
