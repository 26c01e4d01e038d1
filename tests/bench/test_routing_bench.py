"""bench/routing.py: the route FastAPI's whole walk chooses and the one the route index's list
gives are the same, and the index walks fewer routes for a change approval."""

from __future__ import annotations

import json
import subprocess
import sys

from ci import REPO


def test_bench_routing_prints_both_walks() -> None:
    out = subprocess.run(
        [sys.executable, str(REPO / "bench" / "routing.py"), "--json", "--repeat", "20",
         "--runs", "1"],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    data = json.loads(out.stdout)
    rows = {(r["method"], r["path"]): r for r in data["paths"]}
    approve = rows[("POST", "/api/v1/changes/17/approve")]
    assert approve["routes_walked"]["indexed"] < approve["routes_walked"]["whole"]
    for r in rows.values():
        assert r["whole_walk_us"] > 0 and r["indexed_us"] > 0
        assert r["routes_walked"]["indexed"] <= r["routes_walked"]["whole"]
