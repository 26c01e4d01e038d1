"""Benchmark: the write path of a submit and its cancel on PostgreSQL, in process (issue 20:
where a replica's time under the write lock goes).

Setup (not timed): a fresh throwaway database (``--db``: the server to make it on) with the
demo cluster (``_server.load_demo``). Timed: ``--pairs`` pairs of
``service.workloads.submit_workload`` (one GPU, tenant research-lab) then ``cancel_workload``,
the calls the API routes make, after ``--warmup`` untimed pairs, in two phases:

* ``one``: one ``Store`` (one engine, one scheduler and network cache) does both;
* ``two``: two ``Store`` objects on the same database take turns (pair i submits through store
  i mod 2 and cancels through the other), as two API replicas would: each transaction first
  catches its caches up on the other's writes;
* ``pairs_concurrent``: ``--pairs`` pairs from ``--concurrency`` threads at once on one store,
  as an API worker's threads send them, so that writes queued behind the lock commit together
  (``Store.write_grouped``, a run of one actor's applied at once): pairs/s, write transactions,
  ``writes_per_transaction``, ``statements_per_transaction`` and the CPU a pair.

Each write transaction holds the database's one write lock from its first statement to its
commit, so ``ms_per_pair`` is lock time. ``statements_per_pair`` counts SQL statements;
``python_calls_per_pair`` the Python function calls of up to 50 more pairs run under cProfile
(deterministic, where a busy machine moves the times).
``cpu_ms_per_pair`` is the CPU that time is made of, which a busy machine does not inflate as
it does the wall time: this process's (``service``: the service code, SQLAlchemy, the driver)
and that of the PostgreSQL backends serving its connections (``postgres``, from /proc).

``attestation``: ``--rounds`` attestation rounds of 20 demo nodes enrolled with the demo's
simulated attester, one at a time: ``issue_nonce`` (a read) and ``submit_evidence`` (a round's
one write transaction: its time is the lock's, with nothing else running), their p50 ms and
statements, and the PostgreSQL backends' CPU per round. ``attestation_concurrent``: the same
rounds from ``--concurrency`` threads at once (each its own nodes), as an API worker's threads
send them: rounds/s, evidence p50/p99 ms, write transactions per round (rounds waiting while
one holds the lock commit as one group, ``Store.write_grouped``) and the lock held per round.

    .venv/bin/python bench/write_path.py --json [--pairs 200] [--rounds 200] [--concurrency 8]
        [--db postgresql://…/test]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from sqlalchemy import event, select, text

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _server import load_demo, throwaway_postgres
from proofplane.access import SYSTEM, Actor
from proofplane.attest.simulate import SimulatedAttester, demo_boot_log
from proofplane.demo.attester import BOOTLOADERS, DEMO_POLICY, GOOD_KERNEL
from proofplane.machine import machine
from proofplane.model import GpuRequest
from proofplane.service import attestation as att
from proofplane.service import instruments
from proofplane.service.context import Store
from proofplane.service.workloads import WorkloadSpec, cancel_workload, submit_workload
from proofplane.store.tables import NodeRow

TOKEN = "ppt_bench-write-path-token-0123456789abc"
TENANT = "research-lab"


def instrument(opened: list[Store]) -> tuple[list[int], set[int]]:
    """Count the SQL statements the stores run (``[count]``, reset by the caller) and collect
    the PostgreSQL backends serving their connections (for their CPU)."""
    count = [0]

    def counted(*_args: Any) -> None:
        count[0] += 1

    backends: set[int] = set()

    def connected(dbapi_connection: Any, _record: Any) -> None:
        cur = dbapi_connection.cursor()
        cur.execute("SELECT pg_backend_pid()")
        backends.add(int(cur.fetchone()[0]))
        cur.close()

    for s in opened:
        event.listen(s.engine, "connect", connected)
        with s.engine.connect() as conn:  # the pool's first connection, its backend known
            conn.execute(text("SELECT 1"))
        event.listen(s.engine, "before_cursor_execute", counted)
    return count, backends


def phase(url: str, stores: int, pairs: int, warmup: int, prefix: str) -> dict[str, Any]:
    opened = [Store(url) for _ in range(stores)]
    count, backends = instrument(opened)
    try:

        def pair(i: int) -> None:
            name = f"{prefix}{i}"
            spec = WorkloadSpec(name=name, tenant=TENANT, gpus=GpuRequest(count=1))
            submit_workload(opened[i % stores], SYSTEM, spec)
            cancel_workload(opened[(i + 1) % stores], SYSTEM, name, tenant=TENANT)

        for i in range(warmup):
            pair(i)
        count[0] = 0
        ms = []
        cpu0, pg0 = time.process_time(), backend_cpu_seconds(backends)
        for i in range(warmup, warmup + pairs):
            t0 = time.perf_counter()
            pair(i)
            ms.append((time.perf_counter() - t0) * 1000)
        cpu, pg = time.process_time() - cpu0, backend_cpu_seconds(backends) - pg0
        statements = count[0]
        # Python function calls a pair, under cProfile after the timed pairs: a count that a
        # busy machine does not change, as it does the times above
        counted = min(pairs, 50)
        profile = cProfile.Profile()
        profile.enable()
        for i in range(warmup + pairs, warmup + pairs + counted):
            pair(i)
        profile.disable()
        calls = pstats.Stats(profile).total_calls  # type: ignore[attr-defined]
        return {
            "stores": stores,
            "pairs": pairs,
            "ms_per_pair_p50": round(statistics.median(ms), 2),
            "ms_per_pair_mean": round(statistics.fmean(ms), 2),
            "statements_per_pair": round(statements / pairs, 1),
            "python_calls_per_pair": round(calls / counted),
            "cpu_ms_per_pair": {
                "service": round(cpu * 1000 / pairs, 2),
                "postgres": round(pg * 1000 / pairs, 2),
            },
        }
    finally:
        for s in opened:
            s.dispose()


Agents = list[tuple[str, Actor, SimulatedAttester]]


def _agents(url: str, nodes: int) -> Agents:
    """``nodes`` demo nodes enrolled with the demo's simulated attester, under its policy."""
    store = Store(url)
    try:
        return _enrolled(store, nodes)
    finally:
        store.dispose()


def _enrolled(store: Store, nodes: int) -> Agents:
    att.set_policy(store, SYSTEM, DEMO_POLICY, enforce=True)
    with store.read() as session:
        names = sorted(session.scalars(select(NodeRow.name)))[:nodes]
    agents = []
    for name in names:
        a = SimulatedAttester.create()
        a.boot(demo_boot_log(GOOD_KERNEL, bootloaders=BOOTLOADERS))
        actor = Actor(f"node:{name}")
        challenge = att.enroll(store, actor, name, a.ek_public, a.ak_public, simulated=True,
                               allow_simulated=True)  # fmt: skip
        att.activate(store, actor, name, a.activate(challenge.credential))
        agents.append((name, actor, a))
    return agents


def _round(store: Store, agent: tuple[str, Actor, SimulatedAttester]) -> tuple[float, float]:
    """One round as the routes make it: (nonce seconds, evidence seconds)."""
    name, actor, a = agent
    t0 = time.perf_counter()
    issued = att.issue_nonce(store, actor, name)
    t1 = time.perf_counter()
    ev = a.evidence(issued.nonce, list(issued.pcrs), issued.pcr_bank)  # the agent's
    t2 = time.perf_counter()
    out = att.submit_evidence(store, actor, name, issued.nonce, ev, allow_simulated=True)
    t3 = time.perf_counter()
    if not out.verdict["ok"]:
        raise SystemExit(f"a round failed: {out.verdict['reasons']}")
    return t1 - t0, t3 - t2


def rounds_phase(url: str, agents: Agents, rounds: int, warmup: int) -> dict[str, Any]:
    """Attestation rounds as the routes make them, in process, one at a time: ``issue_nonce``
    (a read) then ``submit_evidence`` (the round's one write transaction, under the write
    lock), for the ``agents`` (``_agents``), round-robin."""
    store = Store(url)
    count, backends = instrument([store])  # before its pool opens any other connection
    try:
        timed: dict[str, list[float]] = {"nonce": [], "evidence": []}
        statements = {"nonce": 0, "evidence": 0}
        for i in range(warmup):
            _round(store, agents[i % len(agents)])
        pg0 = backend_cpu_seconds(backends)
        for i in range(warmup, warmup + rounds):
            name, actor, a = agents[i % len(agents)]
            count[0], t0 = 0, time.perf_counter()
            issued = att.issue_nonce(store, actor, name)
            timed["nonce"].append((time.perf_counter() - t0) * 1000)
            statements["nonce"] += count[0]
            ev = a.evidence(issued.nonce, list(issued.pcrs), issued.pcr_bank)
            count[0], t0 = 0, time.perf_counter()
            out = att.submit_evidence(store, actor, name, issued.nonce, ev, allow_simulated=True)
            timed["evidence"].append((time.perf_counter() - t0) * 1000)
            statements["evidence"] += count[0]
            if not out.verdict["ok"]:
                raise SystemExit(f"a round failed: {out.verdict['reasons']}")
        pg = backend_cpu_seconds(backends) - pg0
        return {
            "nodes": len(agents),
            "rounds": rounds,
            **{f"{k}_ms_p50": round(statistics.median(v), 2) for k, v in timed.items()},
            **{f"{k}_statements": round(n / rounds, 1) for k, n in statements.items()},
            "postgres_cpu_ms_per_round": round(pg * 1000 / rounds, 2),
        }
    finally:
        store.dispose()


def concurrent_rounds_phase(
    url: str, agents: Agents, threads: int, rounds: int, warmup: int
) -> dict[str, Any]:
    """``rounds`` attestation rounds from ``threads`` threads at once, thread k attesting
    agents k, k + threads, … (a node's rounds one after another, as its agent sends them)."""
    from concurrent.futures import ThreadPoolExecutor

    if not 0 < threads <= len(agents):
        raise SystemExit(f"--concurrency must be 1..{len(agents)}")
    store = Store(url)
    writes = [0, 0.0]  # write transactions, seconds the lock was held
    observe = instruments.observe_write

    def counted(wait: float, held: float) -> None:
        writes[0] += 1
        writes[1] += held
        observe(wait, held)

    def run(k: int, n: int, out: list[float]) -> None:
        mine = agents[k::threads]
        for i in range(n):
            out.append(_round(store, mine[i % len(mine)])[1] * 1000)

    try:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda k: run(k, warmup, []), range(threads)))
            instruments.observe_write = counted
            timed: list[list[float]] = [[] for _ in range(threads)]
            t0 = time.perf_counter()
            list(pool.map(lambda k: run(k, rounds // threads, timed[k]), range(threads)))
            seconds = time.perf_counter() - t0
    finally:
        instruments.observe_write = observe
        store.dispose()
    done = [ms for t in timed for ms in t]
    q = statistics.quantiles(done, n=100)
    return {
        "threads": threads,
        "rounds": len(done),
        "rounds_per_s": round(len(done) / seconds, 1),
        "evidence_ms_p50": round(statistics.median(done), 2),
        "evidence_ms_p99": round(q[98], 2),
        "writes_per_round": round(writes[0] / len(done), 3),
        "lock_held_ms_per_round": round(writes[1] * 1000 / len(done), 2),
    }


def concurrent_pairs_phase(url: str, threads: int, pairs: int, warmup: int) -> dict[str, Any]:
    """``pairs`` submit + cancel pairs from ``threads`` threads at once on one store, as an API
    worker's threads send them: the writes that queue while one transaction holds the lock
    commit together (``Store.write_grouped``), a run of one actor's applied at once."""
    from concurrent.futures import ThreadPoolExecutor

    store = Store(url)
    opened = [store]
    count, backends = instrument(opened)
    writes = [0]
    observe = instruments.observe_write

    def counted(wait: float, held: float) -> None:
        writes[0] += 1
        observe(wait, held)

    def run(k: int, n: int, prefix: str) -> None:
        for i in range(n):
            name = f"{prefix}{k}-{i}"
            spec = WorkloadSpec(name=name, tenant=TENANT, gpus=GpuRequest(count=1))
            submit_workload(store, SYSTEM, spec)
            cancel_workload(store, SYSTEM, name, tenant=TENANT)

    each = max(1, pairs // threads)
    try:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda k: run(k, max(1, warmup // threads), "cw"), range(threads)))
            instruments.observe_write = counted
            count[0] = 0
            cpu0, pg0 = time.process_time(), backend_cpu_seconds(backends)
            t0 = time.perf_counter()
            list(pool.map(lambda k: run(k, each, "ct"), range(threads)))
            seconds = time.perf_counter() - t0
            cpu, pg = time.process_time() - cpu0, backend_cpu_seconds(backends) - pg0
    finally:
        instruments.observe_write = observe
        store.dispose()
    done = each * threads
    return {
        "threads": threads,
        "pairs": done,
        "pairs_per_s": round(done / seconds, 1),
        "write_transactions": writes[0],
        "writes_per_transaction": round(2 * done / max(writes[0], 1), 2),
        "statements_per_transaction": round(count[0] / max(writes[0], 1), 1),
        "cpu_ms_per_pair": {
            "service": round(cpu * 1000 / done, 2),
            "postgres": round(pg * 1000 / done, 2),
        },
    }


def backend_cpu_seconds(pids: set[int]) -> float:
    """user+system CPU seconds of these (local) PostgreSQL backends, from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # a server on another machine, or the backend is gone
        total += int(fields[11]) + int(fields[12])  # utime, stime (after the state field)
    return total / tick


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--db", default="postgresql://127.0.0.1:5432/test")
    ap.add_argument("--pairs", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=200, help="attestation rounds")
    ap.add_argument("--concurrency", type=int, default=8, help="threads sending rounds at once")
    args = ap.parse_args()
    if args.pairs < 1 or args.warmup < 0 or args.rounds < 1:
        ap.error("--pairs and --rounds must be at least 1, --warmup at least 0")
    if args.rounds < 2 * args.concurrency:  # each thread sends rounds // concurrency of them
        ap.error(f"--rounds must be at least twice --concurrency ({2 * args.concurrency})")
    with throwaway_postgres(args.db) as url:
        load_demo(url, TOKEN)
        one = phase(url, 1, args.pairs, args.warmup, "a")
        two = phase(url, 2, args.pairs, args.warmup, "b")
        grouped = concurrent_pairs_phase(url, args.concurrency, args.pairs, args.warmup)
        agents = _agents(url, 20)
        rounds = rounds_phase(url, agents, args.rounds, args.warmup)
        together = concurrent_rounds_phase(url, agents, args.concurrency, args.rounds, args.warmup)
    out = {
        "benchmark": "write path: submit_workload + cancel_workload on PostgreSQL, in process",
        "one": one,
        "two": two,
        "two_over_one": round(two["ms_per_pair_p50"] / one["ms_per_pair_p50"], 2),
        "pairs_concurrent": grouped,
        "attestation": rounds,
        "attestation_concurrent": together,
        "machine": machine(),
    }
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(
            f"one store {one['ms_per_pair_p50']} ms a pair ({one['statements_per_pair']} "
            f"statements, CPU {one['cpu_ms_per_pair']}), two alternating "
            f"{two['ms_per_pair_p50']} ms"
        )


if __name__ == "__main__":
    main()
