"""Benchmark: the tamper-evident audit log (issue 4).

* ``append``: durable appends with group commit on SQLite: ``--writers`` threads each keep up
  to 256 events in flight through ``GroupCommitter`` (``Tx.record_many``: event rows + Merkle
  hashes in one write transaction per batch), each event acknowledged only after the commit
  of its batch has returned. ``append_per_s`` = events / wall with WAL and
  ``PRAGMA synchronous=FULL`` (the WAL is fsynced at every commit: a returned commit
  survives power loss); ``append_per_s_sync_normal`` is the same with the store's default
  ``synchronous=NORMAL`` (a power loss may lose the last commits; a crash of the process
  loses nothing). ``append_cpu_us_per_event``: process CPU time per event (FULL run).
* ``append_per_s_64_writers_one_in_flight``: 64 threads each recording one event at a
  time (``GroupCommitter.record``: wait for the commit, then the next), FULL sync.
* ``proofs``: a Merkle log of ``--size`` (10,000,000) entries built directly in a SQLite
  file: leaf hashes of synthetic entries computed in memory and the ``audit_hashes`` table
  (leaf + complete-subtree hashes, in append order, exactly the rows ``Tx.record`` writes)
  bulk-inserted in one transaction, no events table (events take no part in proofs). The
  file is kept (``--hash-db``, default in /tmp) and reused by later runs. Then ``--proofs``
  random inclusion and consistency proofs through ``proofplane.store.audit_log`` on one connection
  (each: the tree size from the largest id, then one ``SELECT … WHERE id IN`` of O(log n)
  ids), after as many unmeasured warm-up proofs (``proof_db_warm``: the OS page cache and
  SQLite's own cache hold the upper levels, as on a serving control plane); median and p99
  in ms, each proof checked with ``verify_inclusion``/``verify_consistency``.
* ``verify``: ``service.audit.verify_log`` (what ``proofplane audit verify --db`` runs) on a
  real store of ``--verify-events`` events written through ``Tx.record_many``: every leaf
  recomputed from the event rows, the tree rebuilt, checked against the signed checkpoint
  and the stored tree. ``verify_entries_per_s`` uses one worker process per CPU
  (``verify_workers``; chunks of 2^15–2^16 events, handed out as workers free up): the median
  of three runs (``verify_entries_per_s_runs``, with ``verify_load_avg_before`` as the
  1-minute load average before them: the machine may be shared), and
  ``verify_cpu_us_per_entry`` the CPU time (all processes) per event of those runs;
  ``verify_entries_per_s_one_process`` runs one process, and ``verify_entries_per_cpu_s`` is
  events per CPU-second of it (the per-core figure, less sensitive to other load).
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
from proofplane.audit import merkle
from proofplane.machine import machine as common_machine
from proofplane.service import audit as audit_svc
from proofplane.service.context import Store
from proofplane.store import audit_log, audit_verify, migrate


def machine() -> dict[str, Any]:
    return {**common_machine(), "sqlite": sqlite3.sqlite_version}


def _store(path: Path, *, full_sync: bool) -> Store:
    store = Store(f"sqlite:///{path}")
    if full_sync:

        @event.listens_for(store.engine, "connect")
        def _full(dbapi_conn, _record) -> None:  # runs after the store's own listener
            dbapi_conn.execute("PRAGMA synchronous=FULL")

    migrate.upgrade(store.engine)
    return store


def bench_append(
    workdir: Path, events: int, writers: int, *, full_sync: bool, window: int = 256
) -> dict[str, Any]:
    name = f"append-{'full' if full_sync else 'normal'}-{writers}-{window}.db"
    store = _store(workdir / name, full_sync=full_sync)
    committer = audit_svc.GroupCommitter(store, SYSTEM)
    per_writer = events // writers

    def work(w: int) -> None:
        # each writer keeps up to ``window`` events in flight (like an agent streaming its
        # results); every event counts only once its ack resolves, i.e. after its commit
        acks: list[Any] = []
        for i in range(per_writer):
            acks.append(
                committer.submit(
                    "node.heartbeat", "node", f"gpu-{w:03d}", {"seq": i, "gpus": 8, "ok": True}
                )
            )
            if len(acks) >= window:
                for ack in acks:
                    ack.result()
                acks = []
        for ack in acks:
            ack.result()

    threads = [threading.Thread(target=work, args=(w,)) for w in range(writers)]
    t0, c0 = time.perf_counter(), time.process_time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    committer.close()
    total = per_writer * writers
    with store.read() as s:
        assert audit_log.tree_size(s) == total
    store.dispose()
    return {
        "per_s": round(total / wall),
        "events": total,
        "batches": committer.batches,
        "cpu_us_per_event": round(cpu / total * 1e6, 1),
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
    tree = merkle.CompactRange()  # the appender's edge: the same hashes, in storage order
    nid = 0
    for lo in range(0, size, 100_000):
        leaves = [
            sha(b"\x00" + b'{"seq":%d}' % i).digest() for i in range(lo, min(size, lo + 100_000))
        ]
        stored = tree.extend(leaves)
        conn.executemany("INSERT INTO audit_hashes VALUES (?, ?)", enumerate(stored, nid))
        nid += len(stored)
    conn.execute("COMMIT")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    return time.perf_counter() - t0


def hash_store(path: Path, size: int) -> tuple[float | None, bool]:
    """The 10M file: reused when it holds exactly ``size`` leaves, else (re)built."""
    if path.exists():
        try:
            conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
            last = conn.execute("SELECT max(id) FROM audit_hashes").fetchone()[0]
            conn.close()
            if last is not None and audit_log.size_from_count(last + 1) == size:
                return None, True
        except (sqlite3.Error, audit_log.LogCorrupted):
            pass
        for suffix in ("", "-wal", "-shm"):
            Path(f"{path}{suffix}").unlink(missing_ok=True)
    return build_hash_store(path, size), False


def bench_proofs(path: Path, size: int, count: int) -> dict[str, Any]:
    from sqlalchemy import create_engine

    engine = create_engine(f"sqlite:///{path}")
    rng = random.Random(7)
    incl, cons = [], []
    with engine.connect() as conn:
        assert audit_log.tree_size(conn) == size
        root = audit_log.root_at(conn, size)
        for _ in range(count):  # warm-up, unmeasured
            audit_log.inclusion(conn, rng.randrange(size), size)
            audit_log.consistency(conn, rng.randrange(1, size), size)
        for _ in range(count):
            i = rng.randrange(size)
            t0 = time.perf_counter()
            leaf, proof = audit_log.inclusion(conn, i, size)
            incl.append(time.perf_counter() - t0)
            assert merkle.verify_inclusion(leaf, i, size, proof, root)
        for _ in range(count):
            old = rng.randrange(1, size)
            t0 = time.perf_counter()
            proof = audit_log.consistency(conn, old, size)
            cons.append(time.perf_counter() - t0)
            assert merkle.verify_consistency(old, size, audit_log.root_at(conn, old), root, proof)
    engine.dispose()
    incl.sort()
    cons.sort()
    return {
        "inclusion_proof_ms": round(statistics.median(incl) * 1000, 3),
        "inclusion_proof_p99_ms": round(incl[int(len(incl) * 0.99)] * 1000, 3),
        "consistency_proof_ms": round(statistics.median(cons) * 1000, 3),
        "consistency_proof_p99_ms": round(cons[int(len(cons) * 0.99)] * 1000, 3),
        "proof_db_warm": True,
    }


def bench_verify(workdir: Path, events: int) -> dict[str, Any]:
    path = workdir / "verify.db"
    store = _store(path, full_sync=False)
    keys = audit_svc.AuditKeys(origin="proofplane/bench", key_file=workdir / "bench.key")
    now = datetime.now(UTC)
    rng = random.Random(3)
    per_tx = 2000
    for start in range(0, events, per_tx):
        with store.write(SYSTEM, now=now) as tx:
            tx.record_many(
                (
                    "workload.place",
                    "workload",
                    f"w-{i}",
                    {
                        "tenant": f"t{rng.randrange(12)}",
                        "node": f"gpu-{rng.randrange(5000):04d}",
                        "devices": [{"gpu": rng.randrange(8), "mig": "1g.10gb"}],
                        "tags": {"hipaa": "true"},
                        "isolation": "exclusive",
                    },
                )
                for i in range(start, min(events, start + per_tx))
            )
    audit_svc.sign_checkpoint(store, SYSTEM, keys, now)
    with store.engine.connect() as c:
        c.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
    size = path.stat().st_size
    out: dict[str, Any] = {"verify_events": events, "bytes_per_event": round(size / events, 1)}
    cpus = os.cpu_count() or 1

    def run(workers: int) -> tuple[float, float]:
        """(wall s, CPU s of this process and its worker processes) of one verification."""
        t0, c0 = time.perf_counter(), os.times()
        report = audit_svc.verify_log(
            store, keys.verifier(store), "proofplane/bench", workers=workers
        )
        wall, c1 = time.perf_counter() - t0, os.times()
        assert report.ok, report.problems
        cpu = sum(c1[:4]) - sum(c0[:4])  # user + system, self + reaped children
        return wall, cpu

    wall, cpu = run(1)
    out["verify_entries_per_s_one_process"] = round(events / wall)
    # os.times() ticks in 10 ms: a quick run can take less than one tick (then: null)
    out["verify_entries_per_cpu_s"] = round(events / cpu) if cpu > 0 else None
    # the machine is shared: the median of three runs, each listed
    out["verify_load_avg_before"] = round(os.getloadavg()[0], 2)
    runs = [run(cpus) for _ in range(3)]
    out["verify_entries_per_s"] = round(events / statistics.median(w for w, _ in runs))
    out["verify_entries_per_s_runs"] = [round(events / w) for w, _ in runs]
    out["verify_cpu_us_per_entry"] = round(statistics.median(c for _, c in runs) / events * 1e6, 2)
    # worker processes: one per CPU, at most one per chunk (``audit_verify.chunk_bounds``)
    out["verify_workers"] = min(cpus, len(audit_verify.chunk_bounds(events, cpus)))
    store.dispose()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--quick", action="store_true", help="CI-sized sanity run")
    ap.add_argument("--size", type=int, default=10_000_000)
    ap.add_argument("--append-events", type=int, default=40_000)
    ap.add_argument("--writers", type=int, default=16)
    ap.add_argument("--verify-events", type=int, default=1_000_000)
    ap.add_argument("--proofs", type=int, default=2000)
    ap.add_argument("--workdir", default=None, help="default: a temporary directory in /tmp")
    ap.add_argument(
        "--hash-db",
        default=None,
        help="the hash file of --size entries, kept between runs "
        "(default: /tmp/pp-bench-audit-hashes-SIZE.db)",
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.size, args.append_events, args.writers = 5000, 2000, 16
        args.verify_events, args.proofs = 2000, 200
    with tempfile.TemporaryDirectory(prefix="pp-bench-audit-", dir=args.workdir) as tmp:
        work = Path(tmp)
        os.environ.setdefault("PROOFPLANE_AUDIT_KEY_FILE", str(work / "k.key"))
        out: dict[str, Any] = {"machine": machine(), "quick": args.quick}
        full = bench_append(work, args.append_events, args.writers, full_sync=True)
        normal = bench_append(work, args.append_events, args.writers, full_sync=False)
        out.update(
            {
                "append_per_s": full["per_s"],
                "append_sync": "WAL, synchronous=FULL",
                "append_per_s_sync_normal": normal["per_s"],
                "append_events": full["events"],
                "append_writers": args.writers,
                "append_in_flight_per_writer": 256,
                "append_batches": full["batches"],
                "append_cpu_us_per_event": full["cpu_us_per_event"],
            }
        )
        one = bench_append(work, args.append_events // 4, 64, full_sync=True, window=1)
        out["append_per_s_64_writers_one_in_flight"] = one["per_s"]
        out.update(bench_verify(work, args.verify_events))
        if args.quick:
            hashes = work / "hashes.db"
        else:
            hashes = Path(args.hash_db or f"/tmp/pp-bench-audit-hashes-{args.size}.db")
        build_s, reused = hash_store(hashes, args.size)
        out["proof_tree_size"] = args.size
        out["hash_store_build_s"] = None if build_s is None else round(build_s, 1)
        out["hash_store_reused"] = reused
        out.update(bench_proofs(hashes, args.size, args.proofs))
        hsize = hashes.stat().st_size
        out["hash_db_size_bytes_at_size"] = hsize
        out["hash_bytes_per_event"] = round(hsize / args.size, 1)
        out["db_size_bytes_at_10m_estimate"] = round(out["bytes_per_event"] * 10_000_000)
        out["machine"]["load_avg_after"] = machine()["load_avg"]
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for k, v in out.items():
            print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
