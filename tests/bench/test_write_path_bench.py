"""bench/write_path.py: submit + cancel pairs through the service on PostgreSQL, one store and
two alternating stores, print their time, statement counts and CPU; and attestation rounds
(nonce + evidence) through the service, their time and statements, one at a time and from
several threads at once (group commit: at most one write transaction a round)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from ci import REPO
from dbtest import PG_ADMIN


def test_bench_write_path_prints_both_phases(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROOFPLANE_")}
    out = subprocess.run(
        [sys.executable, str(REPO / "bench" / "write_path.py"), "--json", "--pairs", "4",
         "--warmup", "1", "--rounds", "6", "--concurrency", "3", "--db", PG_ADMIN],
        capture_output=True, text=True, timeout=300, check=True,
        env={**env, "HOME": str(tmp_path)},
    )  # fmt: skip
    data = json.loads(out.stdout)
    for name, stores in (("one", 1), ("two", 2)):
        run = data[name]
        assert run["stores"] == stores and run["pairs"] == 4
        assert run["ms_per_pair_p50"] > 0 and run["statements_per_pair"] > 10
        assert run["python_calls_per_pair"] > 1000
        cpu = run["cpu_ms_per_pair"]
        assert cpu["service"] > 0 and cpu["postgres"] >= 0  # PostgreSQL is local here
    assert data["two_over_one"] == round(
        data["two"]["ms_per_pair_p50"] / data["one"]["ms_per_pair_p50"], 2
    )
    # pairs from 3 threads at once on one store: 4 // 3 each; every submit and cancel a write
    # of some group transaction, which carries at most one write per thread
    grouped = data["pairs_concurrent"]
    assert grouped["threads"] == 3 and grouped["pairs"] == 3 and grouped["pairs_per_s"] > 0
    assert 0 < grouped["write_transactions"] <= 6
    assert grouped["writes_per_transaction"] == round(6 / grouped["write_transactions"], 2)
    assert 1 <= grouped["writes_per_transaction"] <= 3
    assert grouped["statements_per_transaction"] > 5
    assert grouped["cpu_ms_per_pair"]["service"] > 0
    # attestation rounds through the service: the nonce a read of 2 statements, the evidence
    # one write transaction of 12 (tests/service/test_attestation_rounds.py's budget; a 13th
    # when the new leaf completes a Merkle subtree)
    rounds = data["attestation"]
    assert rounds["nodes"] == 20 and rounds["rounds"] == 6
    assert rounds["nonce_ms_p50"] > 0 and rounds["evidence_ms_p50"] > 0
    assert rounds["nonce_statements"] == 2 and rounds["evidence_statements"] <= 13
    assert rounds["postgres_cpu_ms_per_round"] >= 0
    together = data["attestation_concurrent"]
    assert together["threads"] == 3 and together["rounds"] == 6
    assert together["rounds_per_s"] > 0
    assert 0 < together["evidence_ms_p50"] <= together["evidence_ms_p99"]
    assert 0 < together["writes_per_round"] <= 1  # a group commits one or more rounds
    assert together["lock_held_ms_per_round"] > 0


def test_bench_write_path_refuses_sizes_it_cannot_measure() -> None:
    """Too few rounds for the threads (each sends rounds // threads), or nothing to time:
    a usage error before any database is made, not a traceback after."""
    for args in (["--rounds", "5"], ["--rounds", "6", "--concurrency", "4"], ["--pairs", "0"]):
        out = subprocess.run(
            [sys.executable, str(REPO / "bench" / "write_path.py"), "--json", *args,
             "--db", "postgresql://127.0.0.1:1/none"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert out.returncode == 2, (args, out.stderr)
        assert "error: --" in out.stderr and "Traceback" not in out.stderr
