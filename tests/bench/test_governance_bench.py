"""bench/governance.py: change requests created, approved twice and applied through a real
``serve`` (its default worker processes), by four requesters side by side; the figures it prints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from ci import REPO


def _bench(tmp_path: Path, *extra: str) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROOFPLANE_")}
    out = subprocess.run(
        [sys.executable, str(REPO / "bench" / "governance.py"), "--json", "--nodes", "12",
         "--runs", "1", "--warmup", "2", "--in-process", "5", *extra],
        capture_output=True, text=True, timeout=300, check=True,
        env={**env, "HOME": str(tmp_path)},
    )  # fmt: skip
    return dict(json.loads(out.stdout))


def test_default_is_serves_own_workers_and_four_requesters(tmp_path: Path) -> None:
    data = _bench(tmp_path)
    assert data["change_control"] == "enforce"
    assert data["concurrency"] == 4
    assert data["workers"] == (os.cpu_count() or 1)
    assert data["workers_from"] == "serve's default (one per core)"
    assert data["nodes"] == 12 and data["changes_per_s"] > 0  # type: ignore[operator]
    cpu = data["cpu_ms_per_change"]
    assert isinstance(cpu, dict)
    # the worker processes' CPU is counted, not only the supervisor's (which does no requests)
    assert cpu["server"] > 1.0 and cpu["client"] > 0
    latency = data["latency_ms"]
    assert isinstance(latency, dict)
    assert set(latency) == {"create", "approve_1", "approve_2", "apply", "change"}
    assert all(v["p99"] >= v["p50"] > 0 for v in latency.values())
    # the server's own account of its write slot (/metrics): four writes a change (create,
    # two approvals, apply; a batched token "last used" write may add one), each holding it
    lock = data["write_lock"]
    assert isinstance(lock, dict)
    assert 4.0 <= lock["writes_per_unit"] < 4.5
    assert lock["held_ms_per_write"] > 0 and 0 < lock["busy_share"] <= 1.05
    assert data["write_lock_bound_changes_per_s"] > 0  # type: ignore[operator]
    steps = data["in_process"]  # the same steps as service calls, no HTTP
    assert isinstance(steps, dict) and steps["changes"] == 5
    assert set(steps["step_ms"]) == {"create", "approve_1", "approve_2", "apply"}
    assert all(v["p99"] >= v["p50"] > 0 for v in steps["step_ms"].values())
    assert steps["changes_per_s"] > 0


def test_one_requester_one_worker(tmp_path: Path) -> None:
    data = _bench(tmp_path, "--concurrency", "1", "--workers", "1")
    assert data["concurrency"] == 1 and data["workers"] == 1
    assert data["workers_from"] == "--workers"
    assert data["cpu_bound_changes_per_s_machine"] >= data["cpu_bound_changes_per_s"]  # type: ignore[operator]


def test_without_the_in_process_steps(tmp_path: Path) -> None:
    data = _bench(tmp_path, "--workers", "1", "--in-process", "0")
    assert data["in_process"] is None
