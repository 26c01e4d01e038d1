"""Benchmark: the API as a console and automation see it (issue 20), against a real
``proofplane serve`` process over HTTP on loopback.

Setup (not timed): a fresh database (SQLite file by default; ``--db postgresql://…/postgres``:
a throwaway database created on that server and dropped afterwards) with the demo cluster (24
nodes, five tenants, its workloads) and an admin token. One ``proofplane serve`` on it, access
logs to /dev/null, the SIEM exporter and engine sync off. ``--workers N`` is passed to serve
when serve takes it (``serve --help`` says so); otherwise the report says ``workers: 1``.

Timed:

1. **sequential** — one keep-alive client, one request at a time (``--requests`` per endpoint
   after a warm-up): ``GET /healthz``, ``/api/v1/auth/me``, ``/api/v1/nodes/{name}``,
   ``/api/v1/nodes?limit=100``, ``/api/v1/workloads``, ``/api/v1/events?limit=50``, with the
   bearer token. p50/p99 per endpoint per run; the figures are medians over ``--runs`` runs.
2. **mixed** — open loop: request i is due at ``t0 + i/rate`` whatever the answers before it
   (asyncio keep-alive connections sending prebuilt requests, at most ``--pool`` at once, in
   ``--clients`` processes each taking every K-th request). 70 % reads (node, node list,
   workloads, events), 30 % writes (workload submits, and cancels of workloads this client
   submitted). Latency from the moment a request is sent; ``late`` is how far behind its due
   time the generator sent it (a saturated client, or requests queued behind ``--pool`` busy
   connections, show there, not as server latency; one more than 10 s late is not sent:
   ``not_sent_late``). Per class p50/p95/p99, status counts (429/503 included), timeouts,
   achieved rate; ``write_lock``: the server's write slot over the phase (from its
   ``/metrics``: ms held and waited for per write, the share of the time it was held, writes
   answered per second), the one resource every worker's writes queue for.
3. **overload** — the same mix at 5× the rate for ``--overload-seconds``: how many 429s and how
   fast they come back (p50/p99 of a 429's latency; none: the server queues instead of shedding).

``generator_loop_lag_ms``: how late the generator's own loop ran a timer due every 5 ms
(its p99 against a latency's p99 says how much of that latency is the generator's).
For the mixed and overload phases, ``event_loop_lag``: how late the workers' event loops ran
a timer due every 50 ms (``proofplane_event_loop_lag_seconds`` in ``/metrics``): probes, the
share more than 10 ms late, p50/p99 as histogram bucket bounds. A request, a refusal included,
arriving at such a moment waits that long before its loop can read it.

    .venv/bin/python bench/api.py --json [--quick] [--db postgresql://127.0.0.1:5432/test]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterable
from contextlib import ExitStack
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _server import (
    RawConn,
    Server,
    cpu_delta,
    gc_pauses,
    gc_pauses_delta,
    histogram_delta,
    http_head,
    load_demo,
    loop_lag,
    loop_lag_delta,
    metrics_text,
    own_cpu_seconds,
    pct,
    refusals,
    serve_supports_workers,
    throwaway_postgres,
    write_lock,
    write_lock_delta,
)
from proofplane.machine import machine

TOKEN = "ppt_bench-api-token-0123456789abcdef0123"
NODE = "fra-h100-01"  # a demo node
TARGETS: dict[str, float] = {
    "nodes_get_p50_ms": 2.0,  # sequential, one keep-alive connection
    "nodes_list_p50_ms": 10.0,
    "mixed_rate_rps": 500.0,  # the open-loop 70/30 mix, sent in full (98 %) at this rate...
    "mixed_read_p99_ms": 25.0,  # ...its reads' p99 (the worst of the four kinds)
    "mixed_write_p99_ms": 50.0,  # ...its submits' and cancels' p99
    "mixed_timeouts": 0,
    "overload_429_p99_ms": 10.0,  # at 5x that rate, the refusals' p99
}
SEQUENTIAL = {
    "healthz": "/healthz",
    "auth_me": "/api/v1/auth/me",
    "nodes_get": f"/api/v1/nodes/{NODE}",
    "nodes_list": "/api/v1/nodes?limit=100",
    "workloads_list": "/api/v1/workloads",
    "events_list": "/api/v1/events?limit=50",
}
READS = (  # class, path, weight within the 70 % of reads
    ("read_node", f"/api/v1/nodes/{NODE}", 0.25),
    ("read_nodes", "/api/v1/nodes?limit=100", 0.25),
    ("read_workloads", "/api/v1/workloads", 0.25),
    ("read_events", "/api/v1/events?limit=50", 0.25),
)
WRITE_SHARE = 0.30
CANCEL_SHARE = 0.40  # of the writes, when this client has a workload to cancel
# How often the generator's own loop probe is due (``generator_loop_lag_ms``)
LOOP_PROBE_S = 0.005
DROP_LATE_S = 10.0  # a request that could not be sent within this of its due time is not sent


def prepare(url: str) -> None:
    load_demo(url, TOKEN)


# --- sequential ----------------------------------------------------------------------------


def sequential(base: str, requests: int) -> dict[str, dict[str, float]]:
    out = {}
    with httpx.Client(base_url=base, timeout=10, headers={"Authorization": f"Bearer {TOKEN}"}) as c:
        for name, path in SEQUENTIAL.items():
            for _ in range(max(10, requests // 10)):  # warm-up
                c.get(path)
            lat = []
            for _ in range(requests):
                t = time.perf_counter()
                r = c.get(path)
                lat.append((time.perf_counter() - t) * 1000)
                if r.status_code != 200:
                    raise SystemExit(f"GET {path}: {r.status_code} {r.text[:300]}")
            out[name] = {"p50_ms": pct(lat, 0.5), "p99_ms": pct(lat, 0.99)}
    return out


# --- open loop -----------------------------------------------------------------------------


def _plan(n: int, seed: int) -> list[str]:
    """The class of each request: a read (by weight) or a write (submit / cancel decided
    when it is sent, from what this client has submitted)."""
    rnd = random.Random(seed)
    names = [r[0] for r in READS]
    weights = [r[2] for r in READS]
    return [
        "write" if rnd.random() < WRITE_SHARE else rnd.choices(names, weights)[0] for _ in range(n)
    ]


def _head(method: str, path: str, host: str, body: bytes | None = None) -> bytes:
    return http_head(method, path, host, TOKEN, body)


Records = list[tuple[str, int, float, float]]


async def _client(
    base: str, rate: float, seconds: float, k: int, clients: int, tag: str, pool: int
) -> tuple[Records, list[float]]:
    """Requests k, k+K, k+2K… of the schedule: (class, status or -1 timeout / -2 error,
    latency ms, late ms); and how late this generator's own loop ran a timer due every
    ``LOOP_PROBE_S`` meanwhile (ms): an answer that arrives while the loop is late waits
    that long to be timed, so this is the share of a latency that is the generator's."""
    n = int(rate * seconds)
    plan = _plan(n, seed=hash(tag) & 0xFFFF)
    url = urlsplit(base)
    host, port = url.hostname or "127.0.0.1", url.port or 80
    netloc = url.netloc
    heads = {r[0]: _head("GET", r[1], netloc) for r in READS}
    rnd = random.Random(k)
    mine: list[str] = []  # workloads this client submitted and may cancel
    out: list[tuple[str, int, float, float]] = []
    idle: asyncio.Queue[RawConn] = asyncio.Queue()
    for _ in range(min(pool, 8)):
        conn = await RawConn.open(host, port)
        await conn.request(_head("GET", "/healthz", netloc))
        idle.put_nowait(conn)
    opened = idle.qsize()
    clock = time.perf_counter  # not loop.time(): uvloop's counts whole milliseconds
    t0 = clock() + 0.2
    tasks = []
    sem = asyncio.Semaphore(pool)  # at most ``pool`` requests (and connections) at once

    async def one(i: int, cls: str, due: float) -> None:
        async with sem:
            await send(i, cls, due)

    async def send(i: int, cls: str, due: float) -> None:
        nonlocal opened
        sent = clock()
        if sent - due > DROP_LATE_S:  # a backlog a saturated server cannot drain in time
            out.append((cls if cls != "write" else "submit", -3, 0.0, (sent - due) * 1000))
            return
        body = b""
        if cls == "write":
            if mine and rnd.random() < CANCEL_SHARE:
                cls, body = "cancel", b"{}"
                head = _head("POST", f"/api/v1/workloads/{mine.pop(0)}/cancel", netloc, body)
            else:
                cls = "submit"
                name = f"b{tag}-{k}-{i}"
                body = json.dumps({"name": name, "tenant": "research-lab", "gpus": {"count": 1},
                                   "priority": -10}).encode()  # fmt: skip
                head = _head("POST", "/api/v1/workloads", netloc, body)
        else:
            head = heads[cls]
        conn: RawConn | None = None
        counted = False  # this sender counted a connection in ``opened``
        try:
            if idle.empty() and opened < pool:
                opened += 1
                counted = True
                conn = await asyncio.wait_for(RawConn.open(host, port), 10)
            else:
                conn = idle.get_nowait()  # the semaphore leaves one for every sender
            code, _, close = await asyncio.wait_for(conn.request(head, body), 10)
            if close:
                conn.close()
                opened -= 1
            else:
                idle.put_nowait(conn)
            if cls == "submit" and code == 201:
                mine.append(name)
        except TimeoutError:
            code = -1
        except (OSError, ValueError, IndexError, asyncio.IncompleteReadError, asyncio.QueueEmpty):
            code = -2
        if code < 0 and (conn is not None or counted):  # one in an unknown state: not reused
            if conn is not None:
                conn.close()
            opened -= 1
        done = clock()
        out.append((cls, code, (done - sent) * 1000, max(0.0, sent - due) * 1000))

    lags: list[float] = []
    probing = [True]

    async def probe() -> None:
        while probing[0]:
            t = clock()
            await asyncio.sleep(LOOP_PROBE_S)
            lags.append(max(0.0, clock() - t - LOOP_PROBE_S) * 1000)

    prober = asyncio.create_task(probe())
    for i in range(k, n, clients):
        due = t0 + i / rate
        wait = due - clock()
        if wait > 0:
            await asyncio.sleep(wait)
        tasks.append(asyncio.create_task(one(i, plan[i], due)))
    await asyncio.gather(*tasks)
    probing[0] = False
    await prober
    while not idle.empty():
        idle.get_nowait().close()
    return out, lags


def _client_proc(args: tuple[str, float, float, int, int, str, int]) -> tuple[Records, list[float]]:
    # uvloop, the loop the server's workers run on: the generator shares the two cores and
    # times every answer on its own loop, so the less that loop costs, the less its own lag
    # counts in the latencies (and the less CPU it takes from the server)
    return uvloop.run(_client(*args))


def open_loop(
    base: str, rate: float, seconds: float, clients: int, tag: str, pool: int
) -> dict[str, Any]:
    jobs = [(base, rate, seconds, k, clients, tag, pool) for k in range(clients)]
    t = time.perf_counter()
    if clients == 1:
        records, lags = _client_proc(jobs[0])
    else:
        with multiprocessing.get_context("spawn").Pool(clients) as p:
            parts = p.map(_client_proc, jobs)
        records = [r for part, _lags in parts for r in part]
        lags = [lag for _part, part_lags in parts for lag in part_lags]
    wall = time.perf_counter() - t - 0.2
    classes: dict[str, dict[str, Any]] = {}
    for cls in sorted({r[0] for r in records}):
        rs = [r for r in records if r[0] == cls]
        ok = [r[2] for r in rs if 200 <= r[1] < 300]
        refused = [r[2] for r in rs if r[1] == 429]
        statuses: dict[str, int] = {}
        for r in rs:
            key = {-1: "timeout", -2: "error", -3: "not_sent_late"}.get(r[1], str(r[1]))
            statuses[key] = statuses.get(key, 0) + 1
        classes[cls] = {
            "requests": len(rs),
            "p50_ms": round(pct(ok, 0.5), 2),
            "p95_ms": round(pct(ok, 0.95), 2),
            "p99_ms": round(pct(ok, 0.99), 2),
            "status": statuses,
            # how fast this class's refusals came back (a write may wait in its level's queue)
            "p99_429_ms": round(pct(refused, 0.99), 2) if refused else None,
        }
    lat429 = [r[2] for r in records if r[1] == 429]
    late = [r[3] for r in records]
    count = len(records)
    return {
        "rate_rps": rate,
        "seconds": seconds,
        "requests": count,
        # answers (any status) per second of the run; the requests not sent do not count
        "achieved_rps": round(sum(1 for r in records if r[1] >= 0) / wall, 1) if wall > 0 else 0.0,
        "answered_2xx": sum(1 for r in records if 200 <= r[1] < 300),
        "status_429": len(lat429),
        "status_503": sum(1 for r in records if r[1] == 503),
        "status_5xx": sum(1 for r in records if 500 <= r[1] < 600),
        "timeouts": sum(1 for r in records if r[1] == -1),
        "errors": sum(1 for r in records if r[1] == -2),
        "not_sent_late": sum(1 for r in records if r[1] == -3),
        "latency_429_ms": (
            {"p50": round(pct(lat429, 0.5), 2), "p99": round(pct(lat429, 0.99), 2)}
            if lat429
            else None
        ),
        "generator_late_ms": {
            "p50": round(pct(late, 0.5), 2),
            "p99": round(pct(late, 0.99), 2),
            "max": round(max(late, default=0.0), 2),
        },
        "generator_loop_lag_ms": {
            "probes": len(lags),
            "p50": round(pct(lags, 0.5), 2),
            "p99": round(pct(lags, 0.99), 2),
            "max": round(max(lags, default=0.0), 2),
        },
        "classes": classes,
    }


def _with_cpu(server: Server, phase: Any, *args: Any) -> dict[str, Any]:
    """A load phase, with the CPU seconds the server and the generator spent in it (on a
    two-core box the generator's share is the capacity the server did not have) and what the
    write slot did meanwhile: ms held and waited for per write, and the share of the phase's
    wall time it was held (writes of every worker queue for that one slot)."""
    text0, before = metrics_text(server.base, TOKEN), server.cpu_seconds()
    own = own_cpu_seconds(children=True)
    t0 = time.perf_counter()
    out: dict[str, Any] = phase(*args)
    elapsed = time.perf_counter() - t0
    out["cpu_s"] = {
        "server": cpu_delta(before, server.cpu_seconds())["total"],
        "generator": round(own_cpu_seconds(children=True) - own, 2),
    }
    text1 = metrics_text(server.base, TOKEN)
    slot = write_lock_delta(write_lock(text0), write_lock(text1), elapsed, 1)
    slot.pop("writes_per_unit")
    slot["writes_per_s"] = round(
        sum(out["classes"].get(c, {}).get("status", {}).get(ok, 0)
            for c, ok in (("submit", "201"), ("cancel", "200"))) / elapsed, 1
    )  # fmt: skip
    out["write_lock"] = slot
    # how late the workers' event loops woke meanwhile: a refusal waits for its loop too
    out["event_loop_lag"] = loop_lag_delta(loop_lag(text0), loop_lag(text1))
    # and their garbage collections, which stop a worker's every thread and its loop
    out["gc"] = gc_pauses_delta(gc_pauses(text0), gc_pauses(text1), elapsed)
    # the refusals as the server timed them (arrival at the application to the last byte
    # sent): what the client's ``latency_429_ms`` adds beyond it is the loop, kernel, generator
    out["server_429_ms"] = histogram_delta(refusals(text0), refusals(text1))
    return out


# --- main ----------------------------------------------------------------------------------


def worst_p99(phase: dict[str, Any], classes: Iterable[str]) -> float:
    """The highest p99 among ``classes`` of an open-loop phase (every answer counted); infinite
    when none of them was sent (no figure meets a target)."""
    found = [phase["classes"][c]["p99_ms"] for c in classes if c in phase["classes"]]
    return max(found, default=math.inf)


def verdicts(seq: dict[str, Any], mixed: dict[str, Any], over: dict[str, Any]) -> dict[str, bool]:
    """Each target of ``TARGETS`` against its figure. The mix's verdicts hold only for a mix
    run at the target's rate (or above) and sent in full: a slower run meets nothing."""
    at_rate = (
        mixed["rate_rps"] >= TARGETS["mixed_rate_rps"]
        and mixed["achieved_rps"] >= 0.98 * mixed["rate_rps"]
    )
    refused = over["latency_429_ms"]["p99"] if over["status_429"] else None
    return {
        "nodes_get_p50_ms": seq["nodes_get"]["p50_ms"] <= TARGETS["nodes_get_p50_ms"],
        "nodes_list_p50_ms": seq["nodes_list"]["p50_ms"] <= TARGETS["nodes_list_p50_ms"],
        "mixed_rate_rps": at_rate,
        "mixed_read_p99_ms": at_rate
        and worst_p99(mixed, (r[0] for r in READS)) <= TARGETS["mixed_read_p99_ms"],
        "mixed_write_p99_ms": at_rate
        and worst_p99(mixed, ("submit", "cancel")) <= TARGETS["mixed_write_p99_ms"],
        "mixed_timeouts": at_rate and mixed["timeouts"] <= TARGETS["mixed_timeouts"],
        "overload_429_p99_ms": at_rate
        and refused is not None
        and refused <= TARGETS["overload_429_p99_ms"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    ap.add_argument("--db", default=None, help="postgresql://… server to make a database on")
    ap.add_argument("--runs", type=int, default=3, help="sequential runs (medians reported)")
    ap.add_argument("--requests", type=int, default=1000, help="sequential, per endpoint")
    ap.add_argument("--rate", type=float, default=500.0, help="mixed load, requests/s")
    ap.add_argument("--duration", type=float, default=20.0, help="mixed load, seconds")
    ap.add_argument("--overload-seconds", type=float, default=5.0)
    ap.add_argument("--workers", type=int, default=1, help="serve --workers (when serve takes it)")
    ap.add_argument("--clients", type=int, default=1, help="load-generator processes")
    ap.add_argument("--pool", type=int, default=64, help="connections per generator")
    args = ap.parse_args(argv)
    if args.quick:
        args.runs, args.requests, args.rate = 1, 50, 50.0
        args.duration, args.overload_seconds = 2.0, 1.0

    supports = serve_supports_workers()
    workers = args.workers if supports else None
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="proofplane-bench-api-")))
        if args.db:
            url = stack.enter_context(throwaway_postgres(args.db))
        else:
            url = f"sqlite:///{tmp / 'bench.db'}"
        prepare(url)
        server = Server(url, tmp, workers=workers)
        try:
            server.wait_ready()
            runs = [sequential(server.base, args.requests) for _ in range(args.runs)]
            mixed = _with_cpu(
                server, open_loop, server.base, args.rate, args.duration, args.clients, "m",
                args.pool,
            )  # fmt: skip
            over = _with_cpu(
                server, open_loop, server.base, args.rate * 5, args.overload_seconds,
                args.clients, "o", args.pool,
            )  # fmt: skip
            if server.proc.poll() is not None:
                raise SystemExit(f"the server died:\n{server.errors_tail()}")
        finally:
            server.stop()

    seq = {
        name: {
            "p50_ms": round(statistics.median(r[name]["p50_ms"] for r in runs), 3),
            "p99_ms": round(statistics.median(r[name]["p99_ms"] for r in runs), 3),
            "p50_ms_runs": [round(r[name]["p50_ms"], 3) for r in runs],
        }
        for name in SEQUENTIAL
    }
    meets = verdicts(seq, mixed, over)
    out: dict[str, Any] = {
        "database": "postgresql" if args.db else "sqlite",
        "workers": workers or 1,
        "serve_supports_workers": supports,
        "runs": args.runs,
        "requests_per_endpoint": args.requests,
        "sequential": seq,
        "mixed": mixed,
        "overload": over,
        "targets": TARGETS,
        "meets": meets,
        "note": (
            "real proofplane serve over loopback HTTP/1.1 keep-alive, demo cluster (24 nodes); "
            "sequential figures are medians of per-run p50/p99; mixed/overload are open loop "
            "from the due time's send, one run each; client and server share this machine"
        ),
        "machine": machine(),
    }
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for name, f in seq.items():
            print(f"{name:>15}: p50 {f['p50_ms']:.2f} ms  p99 {f['p99_ms']:.2f} ms")
        for label, m in (("mixed", mixed), ("overload", over)):
            print(
                f"{label}: {m['achieved_rps']} req/s of {m['rate_rps']}, 2xx {m['answered_2xx']},"
                f" 429 {m['status_429']}, 5xx {m['status_5xx']}, timeouts {m['timeouts']}, "
                f"late p99 {m['generator_late_ms']['p99']} ms"
            )
            for cls, f in m["classes"].items():
                print(f"   {cls:>15}: p50 {f['p50_ms']} p95 {f['p95_ms']} p99 {f['p99_ms']} ms")
            lag = m["event_loop_lag"]
            print(f"   event loop late: p50 {lag['p50_ms']} p99 {lag['p99_ms']} ms, "
                  f"over 10 ms {lag['over_10ms_share']} of {lag['probes']} probes")  # fmt: skip
        print(f"meets: {meets}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
