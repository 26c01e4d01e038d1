"""KMS throughput and the cost of a sealed TOTP seed at login (issue 13).

* ``<backend>.kms_pairs_per_s``: encrypt+decrypt pairs per second of a 1 KiB secret through
  ``service.keys.Kms`` as the services use it (the key inventory read in the caller's
  session, a fresh AES-256-GCM data key per secret wrapped by the backend), one thread;
  ``<backend>.envelope_pairs_per_s``: the envelope alone (``keys.envelope`` with the backend's
  wrap/unwrap), without the inventory lookups. Backends: ``local`` always; ``pkcs11`` when
  tests/kms_pkcs11.py and SoftHSM2 are there; ``openbao`` when tests/kms_openbao.py and the
  bao binary are there (otherwise a note says why it was skipped).
* ``login_totp_ms``: p50/p99 of ``service.access.login`` with password and TOTP (the seed
  opened through the local KMS) on SQLite.

Medians of ``--runs`` runs. ``python bench/keys.py --json``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import suppress
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from sqlalchemy import select

from proofplane.access import SYSTEM, Actor, totp
from proofplane.keys import ENCRYPT, envelope
from proofplane.kms.local import LocalBackend
from proofplane.machine import machine
from proofplane.service import access as access_svc
from proofplane.service import keys as keys_svc
from proofplane.service.context import Store
from proofplane.store import migrate
from proofplane.store.tables import KmsKeyRow, KmsKeyVersionRow

SECRET = os.urandom(1024)
AAD = b"users/1/totp_secret"
PASSWORD = "correct horse battery staple"


def _rate(fn: Callable[[], None], n: int, runs: int) -> float:
    rates = []
    for _ in range(runs):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        rates.append(n / (time.perf_counter() - t0))
    return round(statistics.median(rates))


def bench_backend(backend: Any, work: Path, n: int, runs: int) -> dict[str, Any]:
    store = Store(f"sqlite:///{work / f'kms-{backend.kind}.db'}")
    migrate.upgrade(store.engine)
    kms = keys_svc.Kms(backend)
    store.kms = kms
    with store.write(SYSTEM) as tx:
        kms.ensure_key(tx, "bench", ENCRYPT)
    out: dict[str, Any] = {}
    with store.read() as s:

        def pair() -> None:
            c = kms.encrypt(s, "bench", SECRET, AAD)
            assert kms.decrypt(s, c, AAD) == SECRET

        pair()
        out["kms_pairs_per_s"] = _rate(pair, n, runs)
        h = s.scalar(
            select(KmsKeyVersionRow.handle).join(KmsKeyRow).where(KmsKeyRow.name == "bench")
        )
    assert h is not None

    def raw_pair() -> None:
        sealed = envelope.seal(SECRET, AAD, key="bench", version=1,
                               wrap=lambda dk, a: backend.wrap(h, dk, a))  # fmt: skip
        env = envelope.parse(sealed.text())
        envelope.open_envelope(env, AAD, unwrap=lambda w, a: backend.unwrap(h, w, a))

    out["envelope_pairs_per_s"] = _rate(raw_pair, n, runs)
    store.dispose()
    return out


def _harness(kind: str, tmp: Path) -> tuple[Any, Any]:
    """(backend, generator to close) from tests/kms_<kind>.py's make_backend."""
    import importlib

    module = importlib.import_module(f"kms_{kind}")
    made = module.make_backend(tmp)
    if hasattr(made, "__next__"):
        return next(made), made
    return made, None


def bench_login(work: Path, logins: int) -> dict[str, Any]:
    os.environ.setdefault("PROOFPLANE_MASTER_KEY_FILE", str(work / "master.key"))
    store = Store(f"sqlite:///{work / 'login.db'}")
    migrate.upgrade(store.engine)
    store.kms = keys_svc.Kms(LocalBackend.from_file(work / "login-master.key", create=True))
    admin = Actor("bench-admin", frozenset({"admin"}), token_id="bench")  # type: ignore[arg-type]
    access_svc.create_user(store, admin, "alice", PASSWORD, ["operator"], [])
    alice = Actor("alice", token_id="bench")
    seed, _ = access_svc.mfa_begin(store, alice)
    access_svc.mfa_confirm(store, alice, totp.code_at_step(seed, totp.step_at(time.time())))
    t = datetime.now(UTC) + timedelta(minutes=1)
    times = []
    for i in range(logins):
        now = t + timedelta(seconds=30 * i)  # a new TOTP step each login (no code replay)
        code = totp.code_at_step(seed, totp.step_at(now.timestamp()))
        t0 = time.perf_counter()
        access_svc.login(store, "alice", PASSWORD, code, session_ttl=timedelta(hours=1), now=now)
        times.append(time.perf_counter() - t0)
    store.dispose()
    times.sort()
    return {
        "logins": logins,
        "p50_ms": round(statistics.median(times) * 1000, 2),
        "p99_ms": round(times[min(len(times) - 1, int(len(times) * 0.99))] * 1000, 2),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--pairs", type=int, default=5000, help="pairs per run (local)")
    ap.add_argument("--hsm-pairs", type=int, default=1000, help="pairs per run (pkcs11/openbao)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--logins", type=int, default=300)
    ap.add_argument("--backends", default="local,pkcs11,openbao")
    args = ap.parse_args(argv)
    out: dict[str, Any] = {"machine": machine(), "secret_bytes": len(SECRET), "notes": []}
    with tempfile.TemporaryDirectory(prefix="pp-bench-keys-") as tmp:
        work = Path(tmp)
        for kind in args.backends.split(","):
            if kind == "local":
                backend = LocalBackend.from_file(work / "master.key", create=True)
                out["local"] = bench_backend(backend, work, args.pairs, args.runs)
                continue
            if not (Path(__file__).resolve().parent.parent / f"tests/kms_{kind}.py").exists():
                out["notes"].append(f"{kind}: skipped (no tests/kms_{kind}.py harness)")
                continue
            closer = None
            try:
                (work / kind).mkdir()
                backend, closer = _harness(kind, work / kind)
                out[kind] = bench_backend(backend, work, args.hsm_pairs, args.runs)
            except BaseException as exc:  # a harness skips with pytest's Skipped
                if isinstance(exc, KeyboardInterrupt):
                    raise
                out["notes"].append(f"{kind}: skipped ({type(exc).__name__}: {exc})")
            finally:
                if closer is not None:
                    with suppress(StopIteration):
                        next(closer)
        out["login_totp_ms"] = bench_login(work, args.logins)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for key, value in out.items():
            print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
