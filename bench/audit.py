"""Benchmark: the tamper-evident audit log (issue 4).

* ``append``: durable appends with group commit on SQLite: ``--writers`` threads each keep up
  to 256 events in flight through ``GroupCommitter`` (``Tx.record``: event row + Merkle
  hashes in one write transaction per batch), each event acknowledged only after its batch
  commits, with
  ``PRAGMA synchronous=FULL`` (WAL fsync at every commit). ``append_per_s`` = events / wall.
* ``proofs``: a Merkle log of ``--size`` (10,000,000) entries built directly in a SQLite
  file in /tmp: leaf hashes of synthetic entries are computed in memory and the
  ``audit_hashes`` table (leaf + complete-subtree hashes, in append order, exactly the rows
  ``Tx.record`` writes) is bulk-inserted with ``executemany`` in one transaction, no
  events table (events do not take part in proofs). Then ``--proofs`` random inclusion and
  consistency proofs through ``proofplane.audit.log`` on a fresh connection (each one a single
  ``SELECT … WHERE id IN`` of O(log n) ids); the medians in ms, each checked with
  ``verify_inclusion``/``verify_consistency``.
* ``verify``: ``service.audit.verify_log`` (what ``proofplane audit verify --db`` runs) on a
  real store of ``--verify-events`` events written through ``Tx.record``: every leaf
  recomputed from the event rows, the tree rebuilt, checked against the signed checkpoint.
* storage: ``bytes_per_event`` = (events + indexes + Merkle hashes) per event of that real
  store; ``hash_bytes_per_event`` and ``hash_db_size_bytes_at_size`` from the 10M file;
  ``db_size_bytes_at_10m_estimate`` = bytes_per_event × 10M.

    .venv/bin/python bench/audit.py --json [--quick]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import event

from proofplane.access import SYSTEM
from proofplane.audit import log, merkle
from proofplane.service import audit as audit_svc
from proofplane.service.context import Store
from proofplane.store import migrate


def machine() -> dict[str, Any]:
    cpu = platform.processor() or None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "load_avg": load,
        "python": platform.python_version(),
        "sqlite": sqlite3.sqlite_version,
        "platform": platform.platform(),
    }


def _store(path: Path, *, full_sync: bool) -> Store:
    store = Store(f"sqlite:///{path}")
    if full_sync:

        @event.listens_for(store.engine, "connect")
        def _full(dbapi_conn, _record) -> None:  # runs after the store's own listener
            dbapi_conn.execute("PRAGMA synchronous=FULL")

    migrate.upgrade(store.engine)
    return store


def bench_append(workdir: Path, events: int, writers: int) -> dict[str, Any]:
    store = _store(workdir / "append.db", full_sync=True)
    committer = audit_svc.GroupCommitter(store, SYSTEM)
    per_writer = events // writers

    def work(w: int) -> None:
        # each writer keeps up to ``window`` events in flight (like an agent streaming its
        # results); every event counts only once its future resolves, i.e. after its commit
        window: list[Any] = []
        for i in range(per_writer):
            window.append(
                committer.submit(
                    "node.heartbeat", "node", f"gpu-{w:03d}", {"seq": i, "gpus": 8, "ok": True}
                )
            )
            if len(window) >= 256:
                for fut in window:
                    fut.result()
                window = []
        for fut in window:
            fut.result()

    threads = [threading.Thread(target=work, args=(w,)) for w in range(writers)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    committer.close()
    total = per_writer * writers
    with store.read() as s:
        assert log.tree_size(s) == total
    store.dispose()
    return {
        "append_per_s": round(total / wall),
        "append_events": total,
        "append_writers": writers,
        "append_in_flight_per_writer": 256,
        "append_batches": committer.batches,
        "append_sync": "WAL, synchronous=FULL",
    }


def build_hash_store(path: Path, size: int) -> float:
    """The audit_hashes table of a ``size``-entry log, bulk-inserted; returns seconds."""
    t0 = time.perf_counter()
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=OFF")
    conn.execute("CREATE TABLE audit_hashes (id INTEGER PRIMARY KEY, hash BLOB NOT NULL)")
    conn.execute("BEGIN")
    sha = hashlib.sha256
    edge: list[tuple[int, bytes]] = []
    rows: list[tuple[int, bytes]] = []
    nid = 0
    for i in range(size):
        cur = sha(b"\x00" + b'{"seq":%d}' % i).digest()
        rows.append((nid, cur))
        nid += 1
        level = 0
        while edge and edge[-1][0] == level:
            cur = sha(b"\x01" + edge.pop()[1] + cur).digest()
            level += 1
            rows.append((nid, cur))
            nid += 1
        edge.append((level, cur))
        if len(rows) >= 200_000:
            conn.executemany("INSERT INTO audit_hashes VALUES (?, ?)", rows)
            rows = []
    conn.executemany("INSERT INTO audit_hashes VALUES (?, ?)", rows)
    conn.execute("COMMIT")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    return time.perf_counter() - t0


def bench_proofs(path: Path, size: int, count: int) -> dict[str, Any]:
    from sqlalchemy import create_engine

    engine = create_engine(f"sqlite:///{path}")
    rng = random.Random(7)
    incl, cons = [], []
    with engine.connect() as conn:
        assert log.tree_size(conn) == size
        root = log.root_at(conn, size)
        for _ in range(count):
            i = rng.randrange(size)
            t0 = time.perf_counter()
            leaf, proof = log.inclusion(conn, i, size)
            incl.append(time.perf_counter() - t0)
            assert merkle.verify_inclusion(leaf, i, size, proof, root)
        for _ in range(count):
            old = rng.randrange(1, size)
            t0 = time.perf_counter()
            proof = log.consistency(conn, old, size)
            cons.append(time.perf_counter() - t0)
            assert merkle.verify_consistency(old, size, log.root_at(conn, old), root, proof)
    engine.dispose()
    return {
        "inclusion_proof_ms": round(statistics.median(incl) * 1000, 3),
        "inclusion_proof_p99_ms": round(sorted(incl)[int(len(incl) * 0.99)] * 1000, 3),
        "consistency_proof_ms": round(statistics.median(cons) * 1000, 3),
        "consistency_proof_p99_ms": round(sorted(cons)[int(len(cons) * 0.99)] * 1000, 3),
    }


def bench_verify(workdir: Path, events: int) -> dict[str, Any]:
    path = workdir / "verify.db"
    store = _store(path, full_sync=False)
    keys = audit_svc.AuditKeys(origin="proofplane/bench", key_file=workdir / "bench.key")
    now = datetime.now(UTC)
    rng = random.Random(3)
    per_tx = 500
    for start in range(0, events, per_tx):
        with store.write(SYSTEM, now=now) as tx:
            for i in range(start, min(events, start + per_tx)):
                tx.record(
                    "workload.place",
                    "workload",
                    f"w-{i}",
                    details={
                        "tenant": f"t{rng.randrange(12)}",
                        "node": f"gpu-{rng.randrange(5000):04d}",
                        "devices": [{"gpu": rng.randrange(8), "mig": "1g.10gb"}],
                        "tags": {"hipaa": "true"},
                        "isolation": "exclusive",
                    },
                )
    audit_svc.sign_checkpoint(store, SYSTEM, keys, now)
    with store.engine.connect() as c:
        c.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
    size = path.stat().st_size
    t0 = time.perf_counter()
    report = audit_svc.verify_log(store, keys.verifier(), "proofplane/bench")
    wall = time.perf_counter() - t0
    assert report.ok, report.problems
    store.dispose()
    return {
        "verify_entries_per_s": round(events / wall),
        "verify_events": events,
        "bytes_per_event": round(size / events, 1),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--quick", action="store_true", help="CI-sized sanity run")
    ap.add_argument("--size", type=int, default=10_000_000)
    ap.add_argument("--append-events", type=int, default=40_000)
    ap.add_argument("--writers", type=int, default=16)
    ap.add_argument("--verify-events", type=int, default=200_000)
    ap.add_argument("--proofs", type=int, default=2000)
    ap.add_argument("--workdir", default=None, help="default: a temporary directory in /tmp")
    args = ap.parse_args(argv)
    if args.quick:
        args.size, args.append_events, args.writers = 5000, 2000, 16
        args.verify_events, args.proofs = 2000, 200
    with tempfile.TemporaryDirectory(prefix="pp-bench-audit-", dir=args.workdir) as tmp:
        work = Path(tmp)
        os.environ.setdefault("PROOFPLANE_AUDIT_KEY_FILE", str(work / "k.key"))
        out: dict[str, Any] = {"machine": machine(), "quick": args.quick}
        out.update(bench_append(work, args.append_events, args.writers))
        out.update(bench_verify(work, args.verify_events))
        hashes = work / "hashes.db"
        build_s = build_hash_store(hashes, args.size)
        out["proof_tree_size"] = args.size
        out["hash_store_build_s"] = round(build_s, 1)
        out.update(bench_proofs(hashes, args.size, args.proofs))
        hsize = hashes.stat().st_size
        out["hash_db_size_bytes_at_size"] = hsize
        out["hash_bytes_per_event"] = round(hsize / args.size, 1)
        out["db_size_bytes_at_10m_estimate"] = round(out["bytes_per_event"] * 10_000_000)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for k, v in out.items():
            print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
