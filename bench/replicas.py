"""Benchmark: API replicas on one PostgreSQL (issue 20: two replicas' submit throughput
≥ 1.5× one replica's, no GPU allocated twice, the audit log gap-free and verifying).

Setup (not timed), for each phase on a fresh throwaway PostgreSQL database (``--db``: the
server to make it on): the demo cluster and an admin token (``_server.load_demo``), then
``--replicas-max`` phases: ``one`` runs one ``proofplane serve --workers 1``, ``two`` runs
two of them on the same database (separate processes, as two hosts would; each its own
scheduler cache caught up from the event stream, the background loops on the leader).

Timed: ``--clients`` closed-loop requesters for ``--duration`` s, requester i talking to
replica i mod replicas with an API token of its own (``client_tokens``) on its own keep-alive
connection (coroutines of this process sending prebuilt requests, ``_server.RawConn``: threads
of httpx clients took as much CPU per submit as a replica did, on the cores the replicas share
with it), each repeating: submit a one-GPU
workload (``POST /api/v1/workloads``, placed or pending), then cancel it (``POST
/api/v1/workloads/{name}/cancel``), so the cluster never fills and every submit is a
placement decision. ``submits_per_s`` = answered submits / wall time; latency p50/p99 per
request kind; the server processes' CPU seconds. Meanwhile a sampler reads
``pg_stat_activity`` every 20 ms: ``write_lock_waiters`` is the mean number of this
database's backends waiting on the write lock (``store.db``: every write transaction takes
one transaction-scoped advisory lock, so writes of all replicas queue there) and
``write_lock_busy`` the share of samples with a backend holding or waiting on it.
``write_transactions``: the replicas' write transactions meanwhile (their ``/metrics``
``proofplane_db_write_lock_seconds`` count, the background loops' few included), and
``writes_per_transaction`` the submits and cancels answered over it: how many writes a group
commit (``Store.write_grouped``) carries at once, each transaction paying the lock, the log's
edge, the network's desired state and the commit once for all of them.

After each phase: every placement from ``GET /api/v1/workloads`` is checked against the
others (no GPU or MIG slot holds more than 1000 thousandths: ``double_allocations``); the
event log is gap-free (``seq`` 1..N with N rows); ``proofplane audit verify --db`` recomputes
the whole log against the newest signed checkpoint (``audit_verify``).
``speedup`` = two's ``submits_per_s`` / one's; target ≥ 1.5.

CPU: each phase reports the replicas' CPU seconds, PostgreSQL's (every ``postgres`` process on
this machine, from /proc) and this load generator's, and their milliseconds per submit.
``cpu_bound_submits_per_s`` = cores × 1000 / (one replica phase's total CPU ms per submit):
the most any number of replicas could submit with every core of this machine busy, the load
generator and PostgreSQL sharing them; ``cpu_bound_speedup`` is that over one replica's rate.
When it is under the target, the target is out of reach on this machine whatever the locking.

The lock: ``lock_bound_speedup`` = 1 / one replica's ``write_lock_busy``. Every write of every
replica holds the one write lock, so all of them together hold it at most all of the time:
unless a write holds it for less time, no number of replicas writes faster than one replica's
rate over the share of the time that replica already holds it. When it is under the target,
the target is out of reach with this critical section whatever the cores.

    .venv/bin/python bench/replicas.py --json [--quick] [--db postgresql://127.0.0.1:5432/test]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import create_engine, text

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _server import (
    LockSampler,
    RawConn,
    Server,
    cpu_delta,
    engine_url,
    http_head,
    load_demo,
    metrics_text,
    pct,
    process_cpu_seconds,
    throwaway_postgres,
    write_lock,
)
from proofplane.machine import machine

TOKEN = "ppt_bench-replicas-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
TENANT = "research-lab"  # a demo tenant with no compliance tags
TARGET_SPEEDUP = 1.5


def client_tokens(base: str, clients: int) -> list[str]:
    """An API token of its own for each requester (``POST /api/v1/tokens``): the server gives
    one client at most a share of a worker's write slots (``PROOFPLANE_MAX_INFLIGHT_CLIENT_SHARE``),
    so requesters sharing one token would be one client refused past its share, not several
    automation clients."""
    with httpx.Client(base_url=base, headers=AUTH, timeout=60) as c:
        out = []
        for i in range(clients):
            r = c.post("/api/v1/tokens", json={"expires_in": 3600, "name": f"bench-client-{i}"})
            if r.status_code != 201:
                raise SystemExit(f"POST /api/v1/tokens: {r.status_code} {r.text[:300]}")
            out.append(r.json()["token"])
        return out


def no_device_twice(base: str) -> tuple[int, int]:
    """(placements seen, slots held more than once) from the workloads API."""
    used: Counter[tuple[str, int, object]] = Counter()
    placed = 0
    cursor: str | None = None
    with httpx.Client(base_url=base, headers=AUTH, timeout=60) as c:
        while True:
            params: dict[str, Any] = {"limit": 500}
            if cursor:
                params["cursor"] = cursor
            page = c.get("/api/v1/workloads", params=params).json()
            for w in page["items"]:
                p = w.get("placement")
                if not p:
                    continue
                placed += 1
                for part in p.get("parts") or [p]:
                    for d in part["devices"]:
                        used[(part["node"], d["gpu_index"], d["mig_start"])] += (
                            d["share_milli"] or 1000
                        )
            cursor = page.get("next_cursor")
            if not cursor:
                break
    return placed, sum(1 for v in used.values() if v > 1000)


def log_checks(url: str, workdir: Path) -> dict[str, Any]:
    engine = create_engine(engine_url(url))
    try:
        with engine.connect() as conn:
            n, lo, hi = conn.execute(text("SELECT count(*), min(seq), max(seq) FROM events")).one()
    finally:
        engine.dispose()
    out = subprocess.run(
        [sys.executable, "-m", "proofplane.cli.main", "audit", "verify", "--db", url, "--json",
         "--require-checkpoint"],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=600,
        env={"PROOFPLANE_AUDIT_KEY_FILE": str(workdir / "audit.key"),
             "PROOFPLANE_MASTER_KEY_FILE": str(workdir / "master.key"),
             "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    try:
        verdict = json.loads(out.stdout)
    except json.JSONDecodeError:
        verdict = {"ok": False, "output": (out.stdout + out.stderr)[-500:]}
    return {
        "events": int(n),
        "gap_free": lo == 1 and hi == n,
        "audit_verify_ok": out.returncode == 0 and bool(verdict.get("ok")),
        "audit_verify_exit": out.returncode,
        "verified_against_checkpoint": bool(verdict.get("verified_against_checkpoint")),
    }


def phase(admin_url: str, replicas: int, clients: int, duration: float) -> dict[str, Any]:
    with throwaway_postgres(admin_url) as url, tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        load_demo(url, TOKEN)
        env = {"PROOFPLANE_AUDIT_CHECKPOINT_INTERVAL_SECONDS": "1"}
        servers = [Server(url, workdir, workers=1, env=env) for _ in range(replicas)]
        try:
            for s in servers:
                s.wait_ready()
            lat: dict[str, list[float]] = {"submit": [], "cancel": []}
            codes: Counter[int] = Counter()
            stop = time.monotonic() + duration

            tokens = client_tokens(servers[0].base, clients)

            async def requester(i: int) -> int:
                server, token = servers[i % replicas], tokens[i]
                host = f"127.0.0.1:{server.port}"
                conn = await RawConn.open("127.0.0.1", server.port)
                done = k = 0
                try:
                    while time.monotonic() < stop:
                        name = f"r{replicas}-c{i}-{k}"
                        k += 1
                        body = json.dumps(
                            {"name": name, "tenant": TENANT, "gpus": {"count": 1}}
                        ).encode()
                        head = http_head("POST", "/api/v1/workloads", host, token, body)
                        t = time.perf_counter()
                        status, _, _ = await conn.request(head, body)
                        ms = (time.perf_counter() - t) * 1000
                        codes[status] += 1
                        if status == 429:  # as a client should: wait as long as it says
                            await asyncio.sleep(conn.retry_after or 0.05)
                        if status != 201:
                            continue
                        done += 1
                        path = f"/api/v1/workloads/{name}/cancel"
                        t2 = time.perf_counter()
                        status, _, _ = await conn.request(http_head("POST", path, host, token))
                        lat["submit"].append(ms)
                        lat["cancel"].append((time.perf_counter() - t2) * 1000)
                        codes[status] += 1
                finally:
                    conn.close()
                return done

            async def requesters() -> int:
                return sum(await asyncio.gather(*(requester(i) for i in range(clients))))

            before = {s.port: s.cpu_seconds() for s in servers}
            tx0 = sum(write_lock(metrics_text(s.base, TOKEN))["held_count"] for s in servers)
            pg0, gen0 = process_cpu_seconds("postgres"), time.process_time()
            with LockSampler(url) as sampler:
                t0 = time.perf_counter()
                submits = asyncio.run(requesters())
                wall = time.perf_counter() - t0
            pg_cpu = process_cpu_seconds("postgres") - pg0
            gen_cpu = time.process_time() - gen0
            cpu = {
                f"replica_{k}": cpu_delta(before[s.port], s.cpu_seconds())["total"]
                for k, s in enumerate(servers)
            }
            tx1 = sum(write_lock(metrics_text(s.base, TOKEN))["held_count"] for s in servers)
            placed, twice = no_device_twice(servers[0].base)
        finally:
            for s in servers:
                s.stop()
        return {
            "replicas": replicas,
            "clients": clients,
            "submits": submits,
            "submits_per_s": round(submits / wall, 1),
            "latency_ms": {
                kind: {"p50": round(pct(xs, 0.5), 2), "p99": round(pct(xs, 0.99), 2)}
                for kind, xs in lat.items()
            },
            "status_codes": {str(k): v for k, v in sorted(codes.items())},
            "server_cpu_s": cpu,
            "postgres_cpu_s": round(pg_cpu, 2),
            "load_generator_cpu_s": round(gen_cpu, 2),
            "cpu_ms_per_submit": {
                "replicas": round(sum(cpu.values()) * 1000 / max(submits, 1), 2),
                "postgres": round(pg_cpu * 1000 / max(submits, 1), 2),
                "load_generator": round(gen_cpu * 1000 / max(submits, 1), 2),
            },
            "wall_s": round(wall, 2),
            "write_transactions": int(tx1 - tx0),
            "writes_per_transaction": round((submits + len(lat["cancel"])) / max(tx1 - tx0, 1), 2),
            **sampler.summary(),
            "placements_checked": placed,
            "double_allocations": twice,
            **log_checks(url, workdir),
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--quick", action="store_true", help="CI-sized smoke run")
    ap.add_argument("--db", default="postgresql://127.0.0.1:5432/test")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--runs", type=int, default=3, help="runs of each phase (medians)")
    args = ap.parse_args()
    duration = 3.0 if args.quick else args.duration
    runs = 1 if args.quick else args.runs
    phases: dict[str, list[dict[str, Any]]] = {"one": [], "two": []}
    for _ in range(runs):  # interleaved, so both phases see the same machine
        phases["one"].append(phase(args.db, 1, args.clients, duration))
        phases["two"].append(phase(args.db, 2, args.clients, duration))

    def median(name: str) -> float:
        return statistics.median(r["submits_per_s"] for r in phases[name])

    speedup = median("two") / median("one") if median("one") else 0.0
    # What the machine's cores allow at best, from one replica's CPU per submit (its submit
    # and cancel, the PostgreSQL backends', this load generator's): with every core busy, no
    # number of replicas submits faster than cores / (their sum).
    per = [r["cpu_ms_per_submit"] for r in phases["one"]]
    ms_total = statistics.median(sum(p.values()) for p in per) if per else 0.0
    cores = os.cpu_count() or 1
    ceiling = cores * 1000 / ms_total if ms_total else 0.0
    shares = [r["write_lock_busy"] for r in phases["one"] if r["write_lock_busy"] is not None]
    busy = statistics.median(shares) if shares else None
    out = {
        "machine": machine(),
        "store": "postgresql",
        "duration_s": duration,
        "runs": runs,
        "one": {"submits_per_s": median("one"), "runs": phases["one"]},
        "two": {"submits_per_s": median("two"), "runs": phases["two"]},
        "speedup": round(speedup, 2),
        "cpu_bound_submits_per_s": round(ceiling, 1),
        "cpu_bound_speedup": round(ceiling / median("one"), 2) if median("one") else None,
        "cores": cores,
        "one_write_lock_busy": busy,
        "lock_bound_speedup": round(1 / busy, 2) if busy else None,
        "target_speedup": TARGET_SPEEDUP,
        "meets": speedup >= TARGET_SPEEDUP,
        "double_allocations": sum(r["double_allocations"] for p in phases.values() for r in p),
        "log_ok": all(r["gap_free"] and r["audit_verify_ok"] for p in phases.values() for r in p),
        "note": "closed loop, client and servers share this machine; one replica = one "
        "`serve --workers 1` process",
    }
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(
            f"one replica {median('one')} submits/s, two {median('two')} "
            f"(x{speedup:.2f}); double allocations {out['double_allocations']}; "
            f"log ok {out['log_ok']}"
        )


if __name__ == "__main__":
    main()
