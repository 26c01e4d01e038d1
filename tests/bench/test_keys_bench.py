"""bench/keys.py --quick runs and prints the figures issue 13 asks for: KMS pairs/s through
``Kms`` and the envelope alone, login with TOTP with the seed sealed and in the clear (and the
delta), the seed's open alone, the targets and whether they are met."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from ci import REPO


def test_bench_keys_quick(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROOFPLANE_")}
    out = subprocess.run(
        [sys.executable, str(REPO / "bench" / "keys.py"), "--json", "--quick"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        env={**env, "HOME": str(tmp_path)},
    )
    data = json.loads(out.stdout)
    assert data["machine"]["cpu_count"] >= 1
    local = data["local"]
    assert local["kms_pairs_per_s"] > 0 and local["envelope_pairs_per_s"] > 0
    login = data["login_totp_ms"]
    assert login["logins"] > 0 and login["runs"] >= 1
    for kind in ("kms", "plaintext"):
        assert 0 < login[kind]["p50_ms"] <= login[kind]["p99_ms"]
    for q in ("p50", "p99"):  # a difference: either sign, when noisy
        want = login["kms"][f"{q}_ms"] - login["plaintext"][f"{q}_ms"]
        assert abs(login[f"{q}_delta_ms"] - want) < 0.01, (q, login)
    assert login["seed_open_us"] > 0
    assert data["targets"] == {"local_kms_pairs_per_s": 20_000, "pkcs11_kms_pairs_per_s": 2_000,
                               "login_p99_delta_ms": 1.0}  # fmt: skip
    meets = data["meets"]
    assert meets["local_kms_pairs_per_s"] is (local["kms_pairs_per_s"] >= 20_000)
    assert meets["pkcs11_kms_pairs_per_s"] is None  # --quick: local only, not measured
    assert meets["login_p99_delta_ms"] is (login["p99_delta_ms"] <= 1.0)
    assert isinstance(meets["login_seed_open_ms"], bool)
