"""bench/replicas.py --quick --json: one and two ``serve`` replicas on one PostgreSQL answer
the submit/cancel loop, allocate no device twice, leave a gap-free log that verifies against
a signed checkpoint, and print the speedup with its verdict against issue 20's target."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ci import REPO
from dbtest import PG_ADMIN


def test_bench_replicas_quick(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROOFPLANE_")}
    out = subprocess.run(
        [sys.executable, str(REPO / "bench" / "replicas.py"), "--json", "--quick",
         "--clients", "2", "--db", PG_ADMIN],
        capture_output=True, text=True, timeout=300, check=True,
        env={**env, "HOME": str(tmp_path)},
    )  # fmt: skip
    data = json.loads(out.stdout)
    assert data["store"] == "postgresql" and data["runs"] == 1
    for name, replicas in (("one", 1), ("two", 2)):
        (run,) = data[name]["runs"]
        assert run["replicas"] == replicas and len(run["server_cpu_s"]) == replicas
        assert run["submits"] > 0 and run["submits_per_s"] == data[name]["submits_per_s"]
        assert set(run["status_codes"]) <= {"200", "201"}, run["status_codes"]
        assert run["double_allocations"] == 0 and run["placements_checked"] > 0
        assert run["gap_free"] and run["audit_verify_ok"] and run["verified_against_checkpoint"]
        assert run["samples"] > 0 and 0 <= run["write_lock_busy"] <= 1
        # every submit and its cancel was a write in some transaction (the background loops'
        # few transactions counted too); a group carries at most as many as there are clients
        assert run["write_transactions"] > 0
        writes = run["submits"] + run["status_codes"].get("200", 0)
        assert run["writes_per_transaction"] == pytest.approx(
            writes / run["write_transactions"], abs=0.01
        )
        assert 0 < run["writes_per_transaction"] <= run["clients"]
        # PostgreSQL's backends and the load generator did work, and it is counted per submit
        assert run["postgres_cpu_s"] > 0 and run["load_generator_cpu_s"] > 0
        per = run["cpu_ms_per_submit"]
        # both figures are printed rounded (seconds to 0.01, ms per submit to 0.01): the
        # per-submit figure comes from the unrounded seconds, so allow their rounding apart
        slack = 0.005 * 1000 / run["submits"] + 0.005
        for key in ("postgres", "load_generator"):
            expected = run[f"{key}_cpu_s"] * 1000 / run["submits"]
            assert per[key] == pytest.approx(expected, abs=slack), key
    (one,) = data["one"]["runs"]
    total_ms = sum(one["cpu_ms_per_submit"].values())
    assert data["cores"] >= 1
    # printed to one decimal: a small figure (a quick run on a busy box) moves by more than 1 %
    ceiling = data["cores"] * 1000 / total_ms
    assert data["cpu_bound_submits_per_s"] == pytest.approx(ceiling, rel=0.01, abs=0.05)
    # the lock's ceiling: one replica's share of the time holding the write lock, inverted
    assert data["one_write_lock_busy"] == one["write_lock_busy"]
    if one["write_lock_busy"]:
        assert data["lock_bound_speedup"] == round(1 / one["write_lock_busy"], 2)
    else:  # no sample caught a write (a quick run): no ceiling to state
        assert data["lock_bound_speedup"] is None
    speedup = data["two"]["submits_per_s"] / data["one"]["submits_per_s"]
    assert data["speedup"] == round(speedup, 2)
    assert data["target_speedup"] == 1.5 and data["meets"] is (speedup >= 1.5)
    assert data["double_allocations"] == 0 and data["log_ok"] is True
