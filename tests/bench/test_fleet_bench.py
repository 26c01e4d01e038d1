"""bench/fleet.py --quick --json: software-TPM agents enroll and attest against a real
``proofplane serve`` on PostgreSQL (its real verifier), with console reads and submissions
beside them, each agent with its own node's credential; every node is admitted by a passing
round, rounds are answered, nothing 5xx, the server's and the generator's CPU time are counted
and the write lock is sampled."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from ci import REPO
from dbtest import pg_url


def test_bench_fleet_quick(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROOFPLANE_")}
    out = subprocess.run(
        [sys.executable, str(REPO / "bench" / "fleet.py"), "--json", "--quick",
         "--db", pg_url("test")],
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
        env={**env, "HOME": str(tmp_path)},
    )  # fmt: skip
    data = json.loads(out.stdout)
    assert data["machine"]["cpu_count"] >= 1 and data["agents"] == 50
    e = data["enrollment"]
    assert e["admitted"] == e["nodes"] == 50 and e["nodes_per_s"] > 0
    assert e["server_cpu_s"]["total"] > 0
    s = data["steady"]
    assert 0 < s["rounds_answered"] <= s["rounds_due"]
    assert s["rounds_passed"] == s["rounds_answered"]
    assert s["evidence_per_s"] > 0 and s["server_cpu_s"]["total"] > 0
    assert s["status_5xx"] == 0 and s["timeouts"] == 0
    for kind in ("nonce", "evidence", "console_nodes", "console_node", "submit"):
        f = s["requests"][kind]
        assert f["requests"] > 0 and 0 < f["p50_ms"] <= f["p99_ms"], (kind, f)
    assert data["nodes_after"].get("admitted", 0) + data["quarantined"] == 50
    assert data["auth"] == "agent"  # each agent presented its own node's credential
    # a round refused for overload is retried as the agent does; what still failed is counted
    assert 0 <= s["rounds_given_up"] <= s["rounds_due"] - s["rounds_answered"]
    assert e["generator_cpu_s"] > 0 and s["generator_cpu_s"] > 0
    # PostgreSQL's CPU too, and the rate the cores could carry at this CPU per round
    assert s["postgres_cpu_s"] > 0 and s["machine_cpu_per_evidence_ms"] > 0
    assert s["cpu_bound_evidence_per_s"] > 0
    lock = s["write_lock"]  # a round writes once (its evidence: a nonce is a read)
    assert lock["samples"] > 0 and 0 <= lock["write_lock_busy"] <= 1, lock
    assert lock["writes_per_round"] >= 1 and lock["write_tx_ms"] > 0, lock
    gc = s["gc"]  # the workers' garbage collections over the phase, by generation
    assert set(gc) == {"0", "1", "2"}, gc
    for g in gc.values():  # (a quick run may see none: serve collects every 10,000 allocations)
        assert g["collections"] >= 0 and 0 <= g["stopped_share"] < 1, gc
        assert (g["longest_within_ms"] == 0.0) == (g["collections"] == 0), gc
    # the fleet target's verdicts: a 50-agent run is not the fleet, so it meets none of them
    assert data["targets"]["agents"] == 10000 and data["targets"]["evidence_p99_ms"] == 200
    assert data["meets"] == {
        "fleet": False, "rounds_unanswered": False, "quarantined": False,
        "evidence_p99_ms": False,
    }  # fmt: skip
