"""Benchmark: change requests end to end through the HTTP API on SQLite (issue 12).

Setup (not timed): a SQLite database with ``--nodes`` admitted nodes and three people, each
with an API token issued by the service (``service.access.issue_token`` as the user): the
requester ``alice`` (admin) and the approvers ``bob`` (admin) and ``sec`` (security-officer).
A real ``proofplane serve`` process on loopback with ``PROOFPLANE_CHANGE_CONTROL=enforce``
(the default of serve) and serve's own default of one worker process per core (``--workers``
to choose), its log (access log included) to a file beside the database.

Timed: for every node, one ``certification.grant`` (``hipaa=true``) change: ``POST
/api/v1/changes`` as alice, ``POST …/approve`` as bob, ``POST …/approve`` as sec, ``POST
…/apply`` as alice, each person on their own keep-alive HTTP/1.1 connection; each step waits
for the previous answer (the latency a person sees). The requests go out through the standard
library's ``http.client`` (one ``send`` per request, ``TCP_NODELAY``): the load generator
shares the two cores with the server, and httpx spent about three times its CPU per change
(2.1–3.7 ms against 1.2, in ``cpu_ms_per_change.client``), CPU the server then lacked.
``--concurrency`` requesters (default 4) work side by side, each one change at a time;
``--concurrency 1`` is one change after the other, which measures four round trips' latency
more than the server's throughput.
``changes_per_s`` is changes fully applied per second of wall time; p50/p99 latency per step.
Each run uses a fresh database; the figures are the medians over ``--runs`` runs.

Beside the wall-clock figure, the CPU each change costs: the server's (user+system, /proc;
the supervisor and its worker processes together) and this load generator's
(``getrusage``), in ms per change over the timed phase, and the CPU-bound rates: 1000 /
(server + client ms), what one core could carry, and that times the usable cores, what the
machine could. On a shared machine the wall-clock figure follows the load; the CPU per change
much less.

``in_process``: the same four steps as service calls in this process, one at a time, no HTTP
(``--in-process`` changes, default 200; 0: skipped): what each step's transaction costs, nearly
all of it under the write slot, p50/p99 per step.

    .venv/bin/python bench/governance.py --json [--quick] [--concurrency 1] [--workers 1]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _server import (
    free_port,
    own_cpu_seconds,
    pct,
    positive,
    tree_cpu_seconds,
    usable_cores,
    write_lock,
    write_lock_delta,
)
from proofplane.access import SYSTEM, Actor, Role
from proofplane.machine import machine
from proofplane.model import Gpu, Node, NodeState
from proofplane.service.access import create_user, issue_token
from proofplane.service.context import Store
from proofplane.service.nodes import register_node, set_node_state
from proofplane.store import migrate

TARGET_CHANGES_PER_S = 100.0
STEPS = ("create", "approve_1", "approve_2", "apply")
PEOPLE = {"alice": Role.ADMIN, "bob": Role.ADMIN, "sec": Role.SECURITY_OFFICER}


def prepare(db: Path, nodes: int) -> dict[str, str]:
    """The nodes (admitted) and the three people's tokens."""
    store = Store(f"sqlite:///{db}")
    try:
        migrate.upgrade(store.engine)
        for i in range(nodes):
            name = f"gpu-{i:04d}"
            gpus = (Gpu(0, f"GPU-{name}-0", "H100-80GB", 81920),)
            register_node(store, SYSTEM, Node(name, "r1", "z1", gpus=gpus))
            set_node_state(store, SYSTEM, name, NodeState.ADMITTED, "bench")
        tokens = {}
        for name, role in PEOPLE.items():
            create_user(store, SYSTEM, name, None, [role.value], [])
            actor = Actor(name, frozenset({role}), token_id="bench-setup")
            tokens[name] = issue_token(
                store, actor, roles=None, tenants=None, expires_in=3600, name="bench"
            ).token
        return tokens
    finally:
        store.dispose()


def start(db: Path, port: int, workers: int | None) -> subprocess.Popen[bytes]:
    args = [sys.executable, "-m", "proofplane.cli.main", "serve", "--db", f"sqlite:///{db}",
            "--port", str(port)]  # fmt: skip
    if workers is not None:  # else serve's default: one worker process per core
        args += ["--workers", str(workers)]
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("PROOFPLANE_")},
        "PROOFPLANE_CHANGE_CONTROL": "enforce",
        "PROOFPLANE_SIEM_EXPORT_INTERVAL_SECONDS": "0",
        "PROOFPLANE_EXECUTION_SYNC_SECONDS": "0",
    }
    for name in ("PROOFPLANE_MASTER_KEY_FILE", "PROOFPLANE_AUDIT_KEY_FILE"):
        env[name] = str(db.with_name(name.lower()))
    log = db.with_name("serve.log")
    with log.open("wb") as err:
        return subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=err)


def wait_ready(base: str, proc: subprocess.Popen[bytes], log: Path) -> dict[str, Any]:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:]
            raise SystemExit(f"the server exited with {proc.returncode}:\n{tail}")
        try:
            r = httpx.get(f"{base}/readyz", timeout=1)
            if r.status_code == 200:
                return dict(r.json())
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise SystemExit("the server did not start")


def one_run(
    tmp: Path, nodes: int, warmup: int, concurrency: int, workers: int | None
) -> dict[str, Any]:
    db = tmp / "bench.db"
    tokens = prepare(db, nodes + warmup)
    port = free_port()
    proc = start(db, port, workers)
    base = f"http://127.0.0.1:{port}"
    local = threading.local()  # each requester thread: its own keep-alive client per person
    opened: list[Requester] = []

    def clients() -> dict[str, Requester]:
        if not hasattr(local, "clients"):
            local.clients = {who: Requester(port, token) for who, token in tokens.items()}
            opened.extend(local.clients.values())
        return local.clients  # type: ignore[no-any-return]

    try:
        ready = wait_ready(base, proc, db.with_name("serve.log"))
        lat: dict[str, list[float]] = {s: [] for s in STEPS}

        def call(who: str, path: str, body: dict[str, Any], want: int) -> dict[str, Any]:
            status, data = clients()[who].request("POST", path, body)
            if status != want:
                raise SystemExit(f"{who} POST {path}: {status} {data[:300]!r}")
            return dict(json.loads(data))

        def change(i: int, record: bool) -> None:
            node = f"gpu-{i:04d}"
            body = {"type": "certification.grant", "reason": "bench",
                    "payload": {"node": node, "key": "hipaa", "value": "true"}}  # fmt: skip
            steps = (
                ("create", "alice", "/api/v1/changes", body, 201),
                ("approve_1", "bob", "/api/v1/changes/{id}/approve", {"comment": "ok"}, 200),
                ("approve_2", "sec", "/api/v1/changes/{id}/approve", {"comment": "ok"}, 200),
                ("apply", "alice", "/api/v1/changes/{id}/apply", {}, 200),
            )
            cid = None
            for step, who, path, payload, want in steps:
                t = time.perf_counter()
                out = call(who, path.format(id=cid), payload, want)
                if record:
                    lat[step].append((time.perf_counter() - t) * 1000)
                cid = out["id"] if cid is None else cid
            if out["state"] != "applied":
                raise SystemExit(f"change {cid} ended {out['state']}")

        for i in range(nodes, nodes + warmup):  # connections open, caches warm
            change(i, record=False)

        def lock() -> dict[str, float]:
            status, text = clients()["alice"].request("GET", "/metrics")
            if status != 200:
                raise SystemExit(f"GET /metrics: {status} {text[:300]!r}")
            return write_lock(text.decode())

        lock0 = lock()
        server0, client0 = tree_cpu_seconds(proc.pid), own_cpu_seconds()
        t0 = time.perf_counter()
        if concurrency == 1:
            for i in range(nodes):
                change(i, record=True)
        else:  # requesters working side by side, each one change at a time
            with ThreadPoolExecutor(concurrency) as pool:
                list(pool.map(lambda i: change(i, record=True), range(nodes)))
        elapsed = time.perf_counter() - t0
        server1, client1 = tree_cpu_seconds(proc.pid), own_cpu_seconds()
        lock1 = lock()
        check = json.loads(clients()["alice"].request("GET", "/api/v1/nodes/gpu-0000")[1])
        if check.get("certifications", {}).get("hipaa") != "true":
            raise SystemExit("the grant did not reach the node")
        for c in opened:
            c.close()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
    out: dict[str, Any] = {"changes_per_s": nodes / elapsed, "seconds": elapsed,
                           "change_control": ready.get("change_control")}  # fmt: skip
    out["write_lock"] = write_lock_delta(lock0, lock1, elapsed, nodes)
    server_ms = 1000 * (server1 - server0) / nodes if server0 is not None and server1 else 0.0
    client_ms = 1000 * (client1 - client0) / nodes
    out["server_cpu_ms"], out["client_cpu_ms"] = server_ms, client_ms
    out["cpu_bound_changes_per_s"] = 1000 / (server_ms + client_ms) if server_ms else 0.0
    out["cpu_bound_changes_per_s_machine"] = out["cpu_bound_changes_per_s"] * usable_cores()
    for step in STEPS:
        out[f"{step}_p50_ms"] = pct(lat[step], 0.50)
        out[f"{step}_p99_ms"] = pct(lat[step], 0.99)
    total = [sum(v) for v in zip(*(lat[s] for s in STEPS), strict=True)]
    out["change_p50_ms"], out["change_p99_ms"] = pct(total, 0.50), pct(total, 0.99)
    return out


class Requester:
    """One person's keep-alive HTTP/1.1 connection to the server (``http.client``): the
    request line, headers and JSON body in one ``send``, ``TCP_NODELAY`` on the socket."""

    def __init__(self, port: int, token: str) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        self.headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}

    def request(
        self, method: str, path: str, body: dict[str, Any] | None = None
    ) -> tuple[int, bytes]:
        data = json.dumps(body).encode() if body is not None else None
        fresh = self.conn.sock is None
        try:
            return self._send(method, path, data)
        except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
            if fresh:
                raise
            # the server closed a connection left idle past its keep-alive timeout before
            # this request reached it (as httpx does: reconnect and send it again)
            self.conn.close()
            return self._send(method, path, data)

    def _send(self, method: str, path: str, data: bytes | None) -> tuple[int, bytes]:
        if self.conn.sock is None:
            self.conn.connect()
            self.conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.conn.request(method, path, body=data, headers=self.headers)
        answer = self.conn.getresponse()
        return answer.status, answer.read()

    def close(self) -> None:
        self.conn.close()


def in_process(db: Path, changes: int, warmup: int) -> dict[str, Any]:
    """The same four steps as service calls in this process (no HTTP, one at a time), on a
    database of ``changes`` admitted nodes: what each step's transaction costs, nearly all of
    it under the write slot. Per step p50/p99 in ms."""
    from proofplane.service import changes as svc

    total = changes + warmup
    prepare(db, total)
    store = Store(f"sqlite:///{db}")
    alice, bob, sec = (Actor(name, frozenset({role})) for name, role in PEOPLE.items())
    times: dict[str, list[float]] = {step: [] for step in STEPS}
    try:
        for i in range(total):
            payload = {"node": f"gpu-{i:04d}", "key": "hipaa", "value": "true"}
            t = time.perf_counter()
            change = svc.create_change(store, alice, "certification.grant", payload)
            marks = [t, time.perf_counter()]
            svc.vote(store, bob, change["id"], "approve")
            marks.append(time.perf_counter())
            svc.vote(store, sec, change["id"], "approve")
            marks.append(time.perf_counter())
            applied = svc.apply_change(store, alice, change["id"])
            marks.append(time.perf_counter())
            if applied["state"] != "applied":
                raise SystemExit(f"in process: change {change['id']} ended {applied['state']}")
            if i >= warmup:
                for k, step in enumerate(STEPS):
                    times[step].append((marks[k + 1] - marks[k]) * 1000)
    finally:
        store.dispose()
    per_change = [sum(t) for t in zip(*times.values(), strict=True)]
    return {
        "changes": changes,
        "changes_per_s": round(1000 / statistics.mean(per_change), 1),
        "step_ms": {
            s: {"p50": round(pct(v, 0.5), 3), "p99": round(pct(v, 0.99), 3)}
            for s, v in times.items()
        },  # fmt: skip
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--quick", action="store_true", help="100 nodes, 1 run (smoke test)")
    ap.add_argument("--nodes", type=positive, default=500, help="changes per run (one per node)")
    ap.add_argument("--runs", type=positive, default=3, help="runs (medians reported)")
    ap.add_argument("--warmup", type=int, default=20, help="untimed changes first")
    ap.add_argument(
        "--concurrency", type=positive, default=4, help="requesters side by side (1: one at a time)"
    )
    ap.add_argument(
        "--workers",
        type=positive,
        default=None,
        help="serve --workers (default: serve's, one per core)",
    )
    ap.add_argument(
        "--in-process",
        type=int,
        default=200,
        help="changes run as service calls in this process, no HTTP (0: none)",
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.nodes, args.runs, args.warmup, args.in_process = 100, 1, 5, 20

    runs = []
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="proofplane-bench-governance-") as tmp:
            runs.append(one_run(Path(tmp), args.nodes, args.warmup, args.concurrency, args.workers))

    workers = args.workers if args.workers is not None else os.cpu_count() or 1
    steps = None
    if args.in_process:
        with tempfile.TemporaryDirectory(prefix="proofplane-bench-governance-") as tmp:
            steps = in_process(Path(tmp) / "steps.db", args.in_process, args.warmup)

    def med(key: str) -> float:
        return round(statistics.median(r[key] for r in runs), 2)

    out: dict[str, Any] = {
        "scenario": "certification.grant: create (alice, admin) + approve (bob, admin) + "
        "approve (sec, security-officer) + apply (alice), through the HTTP API",
        "store": f"sqlite (WAL), proofplane serve --workers {workers} on loopback",
        "concurrency": args.concurrency,
        "workers": workers,
        "workers_from": "serve's default (one per core)" if args.workers is None else "--workers",
        "change_control": runs[0]["change_control"],
        "nodes": args.nodes,
        "runs": args.runs,
        "changes_per_s": med("changes_per_s"),
        "changes_per_s_runs": [round(r["changes_per_s"], 1) for r in runs],
        "requests_per_s": round(med("changes_per_s") * len(STEPS), 1),
        "cpu_ms_per_change": {"server": med("server_cpu_ms"), "client": med("client_cpu_ms")},
        "cpu_bound_changes_per_s": med("cpu_bound_changes_per_s"),
        "cpu_bound_changes_per_s_machine": med("cpu_bound_changes_per_s_machine"),
        # from the server's /metrics (proofplane_db_write_lock_seconds), medians over runs
        "write_lock": {
            k: round(statistics.median(r["write_lock"][k] for r in runs), 3)
            for k in runs[0]["write_lock"]
        },
        "write_lock_bound_changes_per_s": round(
            1000
            / statistics.median(
                r["write_lock"]["held_ms_per_write"] * r["write_lock"]["writes_per_unit"]
                for r in runs
            ),
            1,
        )
        if all(r["write_lock"]["held_ms_per_write"] for r in runs)
        else 0.0,
        "latency_ms": {
            step: {"p50": med(f"{step}_p50_ms"), "p99": med(f"{step}_p99_ms")}
            for step in (*STEPS, "change")
        },
        # the service calls alone, one at a time in this process (no HTTP, no other writer)
        "in_process": steps,
        "target_changes_per_s": TARGET_CHANGES_PER_S,
        "meets_target": med("changes_per_s") >= TARGET_CHANGES_PER_S,
        "note": "closed loop: each requester one change at a time (--concurrency of them side "
        "by side), each step after the previous answer; "
        "keep-alive http.client connection per person; client and server share this machine; "
        "every step writes its audit events (Merkle log) in the same transaction; "
        "write_lock_bound_changes_per_s: 1000 / (ms the write slot is held per change), what "
        "the serialised writes allow however many workers",
        "machine": machine(),
    }
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"{out['changes_per_s']:.1f} changes/s (target >= {TARGET_CHANGES_PER_S:.0f})")
        cpu = out["cpu_ms_per_change"]
        print(f"  CPU per change: server {cpu['server']:.2f} ms, client {cpu['client']:.2f} ms "
              f"(CPU-bound {out['cpu_bound_changes_per_s']:.1f} changes/s a core, "
              f"{out['cpu_bound_changes_per_s_machine']:.1f} the machine)")  # fmt: skip
        for step, f in out["latency_ms"].items():
            print(f"  {step:>10}: p50 {f['p50']:.2f} ms  p99 {f['p99']:.2f} ms")
        if steps is not None:
            each = ", ".join(f"{k} p50 {v['p50']:.2f} ms" for k, v in steps["step_ms"].items())
            print(f"  in process, no HTTP: {steps['changes_per_s']:.1f} changes/s; {each}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
