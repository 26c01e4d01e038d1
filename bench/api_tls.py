"""Benchmark: API latency over TLS against plain HTTP at a fixed request rate, on loopback.

Setup (not timed): a SQLite database with the demo cluster (24 nodes) and an admin token; a
throwaway CA and a server certificate for 127.0.0.1 (``proofplane.pki.tls``, ECDSA P-256).
Two real ``proofplane serve`` processes on the same database: one plain HTTP, one with
``--tls-cert/--tls-key`` (the API's TLS policy: TLS 1.2+, ECDHE+AEAD; the client negotiates
TLS 1.3). Access logs go to /dev/null for both.

Timed: an open-loop load of ``--rate`` requests per second for ``--seconds`` on each server in
turn (after a one-second warm-up), ``GET --path`` with the bearer token, spread over
``--connections`` keep-alive httpx clients (one thread each). Request i is due at
``t0 + i / rate``; its latency is measured from the moment it is sent, and ``late_p99_ms`` says
how far behind the schedule sends fell (a saturated server shows there). p50/p99 per run; the
figures are the medians over ``--runs`` runs, the modes alternating. ``connect`` is the time to
a first answer on a fresh connection (TCP, plus the TLS handshake over TLS), ``--fresh`` times.

    .venv/bin/python bench/api_tls.py --json [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _server import free_port, load_demo, pct
from proofplane.machine import machine
from proofplane.pki import tls

TOKEN = "ppt_bench-api-tls-token-0123456789abcdef"
TARGET_RATIO = 1.2  # the issue: TLS p99 within 20 % of plain HTTP


def prepare(tmp: Path) -> tuple[str, Path, Path, Path]:
    """The database URL, CA, server certificate and key."""
    url = f"sqlite:///{tmp / 'bench.db'}"
    load_demo(url, TOKEN)
    ca, ca_key = tls.make_ca(tmp, "bench-ca")
    cert, key = tls.make_server_cert(ca, ca_key, ["127.0.0.1"], tmp)
    return url, ca, cert, key


def start(db: str, port: int, tls_files: tuple[Path, Path] | None) -> subprocess.Popen[bytes]:
    args = [sys.executable, "-m", "proofplane.cli.main", "serve", "--db", db, "--port", str(port)]
    if tls_files is not None:
        args += ["--tls-cert", str(tls_files[0]), "--tls-key", str(tls_files[1])]
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("PROOFPLANE_")},
        "PROOFPLANE_SIEM_EXPORT_INTERVAL_SECONDS": "0",
        "PROOFPLANE_EXECUTION_SYNC_SECONDS": "0",
    }
    log = Path(db.removeprefix("sqlite:///")).with_name(f"serve-{port}.log")
    with log.open("wb") as err:  # access logs to /dev/null; errors kept to explain a failure
        return subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=err)


def wait_ready(base: str, verify: Any, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            port = base.rsplit(":", 1)[1]
            logs = list(
                Path(tempfile.gettempdir()).glob(f"proofplane-bench-tls-*/serve-{port}.log")
            )
            tail = logs[0].read_text(errors="replace")[-2000:] if logs else ""
            raise SystemExit(f"the server for {base} exited with {proc.returncode}:\n{tail}")
        try:
            if httpx.get(f"{base}/healthz", verify=verify, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"the server for {base} did not start")


def load(
    base: str, verify: Any, path: str, rate: float, seconds: float, connections: int
) -> dict[str, float]:
    """Open-loop: request i due at t0 + i/rate, sent by whichever client thread is free."""
    n = int(rate * seconds)
    lat: list[float] = []
    late: list[float] = []
    errors = 0
    lock = threading.Lock()
    nxt = [0]
    headers = {"Authorization": f"Bearer {TOKEN}"}
    clients = [httpx.Client(base_url=base, verify=verify, timeout=10) for _ in range(connections)]
    for c in clients:  # connections open (and handshakes done) before the clock starts
        c.get("/healthz")
    t0 = time.perf_counter() + 0.05

    def worker(client: httpx.Client) -> None:
        nonlocal errors
        while True:
            with lock:
                i = nxt[0]
                nxt[0] += 1
            if i >= n:
                return
            due = t0 + i / rate
            wait = due - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            sent = time.perf_counter()
            try:
                ok = client.get(path, headers=headers).status_code == 200
            except httpx.HTTPError:
                ok = False
            done = time.perf_counter()
            with lock:
                if ok:
                    lat.append((done - sent) * 1000)
                    late.append(max(0.0, sent - due) * 1000)
                else:
                    errors += 1

    threads = [threading.Thread(target=worker, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    for c in clients:
        c.close()
    return {
        "p50_ms": pct(lat, 0.50),
        "p99_ms": pct(lat, 0.99),
        "late_p99_ms": pct(late, 0.99),
        "achieved_rps": len(lat) / elapsed,
        "errors": errors,
    }


def negotiated(port: int, ctx: ssl.SSLContext) -> str:
    """The TLS version and cipher suite this client and the server agree on."""
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        ctx.wrap_socket(raw, server_hostname="127.0.0.1") as conn,
    ):
        return f"{conn.version()} {conn.cipher()[0]}"  # type: ignore[index]


def connect_ms(base: str, verify: Any, fresh: int) -> float:
    """Median time to a first /healthz answer on a fresh connection."""
    times = []
    for _ in range(fresh):
        t = time.perf_counter()
        with httpx.Client(verify=verify, timeout=10) as c:
            c.get(f"{base}/healthz")
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--quick", action="store_true", help="2 s per run, 1 run (smoke test)")
    ap.add_argument("--rate", type=float, default=200.0, help="requests per second")
    ap.add_argument("--seconds", type=float, default=10.0, help="per run and mode")
    ap.add_argument("--runs", type=int, default=3, help="runs per mode (medians reported)")
    ap.add_argument("--connections", type=int, default=4, help="keep-alive client connections")
    ap.add_argument("--path", default="/api/v1/tenants", help="the endpoint (GET, with the token)")
    ap.add_argument("--fresh", type=int, default=50, help="fresh connections timed per mode")
    args = ap.parse_args(argv)
    if args.quick:
        args.seconds, args.runs, args.fresh = 2.0, 1, 10

    with tempfile.TemporaryDirectory(prefix="proofplane-bench-tls-") as tmp_dir:
        tmp = Path(tmp_dir)
        db, ca, cert, key = prepare(tmp)
        plain_port, tls_port = free_port(), free_port()
        modes = {
            # a context made once: httpx would load its CA bundle for every new client
            "plain": (
                f"http://127.0.0.1:{plain_port}",
                ssl.create_default_context(),
                None,
                plain_port,
            ),
            "tls": (f"https://127.0.0.1:{tls_port}", tls.client_context(ca), (cert, key), tls_port),
        }
        procs: dict[str, subprocess.Popen[bytes]] = {}
        try:
            for m, (base, verify, files, port) in modes.items():  # one at a time: migrations
                procs[m] = start(db, port, files)
                wait_ready(base, verify, procs[m])
            runs: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
            connect: dict[str, float] = {}
            version = negotiated(tls_port, modes["tls"][1])
            for m, (base, verify, _, _) in modes.items():
                connect[m] = connect_ms(base, verify, args.fresh)
                load(base, verify, args.path, args.rate, 1.0, args.connections)  # warm-up
            for _ in range(args.runs):
                for m, (base, verify, _, _) in modes.items():
                    runs[m].append(
                        load(base, verify, args.path, args.rate, args.seconds, args.connections)
                    )
        finally:
            for p in procs.values():
                p.terminate()
            for p in procs.values():
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    p.kill()

    def med(m: str, key: str) -> float:
        return round(statistics.median(r[key] for r in runs[m]), 2)

    out: dict[str, Any] = {
        "endpoint": f"GET {args.path} (bearer token; the demo cluster)",
        "rate_rps": args.rate,
        "seconds_per_run": args.seconds,
        "runs": args.runs,
        "connections": args.connections,
        "tls_negotiated": version,
    }
    for m in modes:
        out[m] = {
            "p50_ms": med(m, "p50_ms"),
            "p99_ms": med(m, "p99_ms"),
            "late_p99_ms": med(m, "late_p99_ms"),
            "achieved_rps": med(m, "achieved_rps"),
            "errors": sum(int(r["errors"]) for r in runs[m]),
            "p99_ms_runs": [round(r["p99_ms"], 2) for r in runs[m]],
            "connect_ms": round(connect[m], 2),
        }
    ratio = out["tls"]["p99_ms"] / out["plain"]["p99_ms"]
    out["p99_ratio_tls_over_plain"] = round(ratio, 3)
    out["p50_ratio_tls_over_plain"] = round(out["tls"]["p50_ms"] / out["plain"]["p50_ms"], 3)
    out["target_p99_ratio"] = TARGET_RATIO
    out["meets_target"] = ratio <= TARGET_RATIO
    out["note"] = (
        "open loop; latency from send; medians over runs, modes alternating; one server "
        "process per mode on the same SQLite database; client and servers share this machine"
    )
    out["machine"] = machine()
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for m in modes:
            f = out[m]
            print(
                f"{m:>5}: p50 {f['p50_ms']:.2f} ms  p99 {f['p99_ms']:.2f} ms  "
                f"({f['achieved_rps']:.0f} req/s, late p99 {f['late_p99_ms']:.2f} ms, "
                f"connect {f['connect_ms']:.2f} ms, {f['errors']} errors)"
            )
        print(f"p99 TLS/plain: {ratio:.3f} (target <= {TARGET_RATIO})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
