"""bench/network.py --quick runs and prints the figures issue 14 asks for: the full recompute
of every node's desired network state, the incremental update after 1 % of the nodes fail,
rendering, the targets and whether they are met (apply: the agent's namespace test's)."""

from __future__ import annotations

import json
import subprocess
import sys

from ci import REPO


def test_bench_network_quick() -> None:
    out = subprocess.run(
        [sys.executable, str(REPO / "bench" / "network.py"), "--json", "--quick"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    data = json.loads(out.stdout)
    assert data["machine"]["cpu_count"] >= 1
    assert data["scenario"]["quick"] is True and data["runs"] == 1
    full, inc = data["full"], data["incremental"]
    assert full["full_ms"] > 0 and full["node_segments"] > 0 and full["remote_fdb_entries"] > 0
    assert inc["failed_nodes"] == 5 and inc["affected_nodes"] >= inc["failed_nodes"]
    assert 0 < inc["update_ms"] <= inc["incremental_ms"] <= inc["with_states_ms"]
    assert data["render"]["segments"] == 200 and data["render"]["render_ms"] > 0
    assert data["render"]["links"] == 600  # bridge, vxlan and a veth per segment
    assert data["targets"] == {"full_ms": 1000.0, "incremental_ms": 100.0, "apply_ms": 2000.0}
    meets = data["meets"]
    assert meets["full_ms"] is (full["full_ms"] <= 1000.0)
    assert meets["incremental_ms"] is (inc["incremental_ms"] <= 100.0)
    apply_ms = data["apply"]["apply_ms"]
    assert meets["apply_ms"] is (None if apply_ms is None else apply_ms <= 2000.0)
