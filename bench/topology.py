"""Benchmark: topology-aware gangs (issue 17 §4) through the production placement core.

The cluster: ``--nodes`` (5,000) GB200-style compute nodes of 4 GPUs, in racks of 18 nodes;
each rack is one NVL72-style NVLink domain (18 nodes x 4 GPUs = 72 GPUs on one NVLink fabric),
and 8 racks form a block (144 nodes behind one spine). A seeded background of single-node
workloads (1-4 GPUs) first fills ``--fill`` (45 %) of the GPUs at random, so free capacity is
scattered, as in a cluster that has been running for a while.

Then ``--gangs`` gangs arrive, 2 to 64 nodes each (2, 4, 8, 16 weighted towards the small; 18,
32, 64 rarer), 4 GPUs (a whole tray) per member, plus a small share of 2-GPU members. A gang of
up to 18 nodes asks ``{"level": "nvlink_domain", "mode": "preferred"}`` (one NVL72 domain holds
it), a larger one ``{"level": "block", "mode": "preferred"}``; every ``--required-every``-th
asks ``required``. Placed gangs stay until the gang GPUs held pass ``--gang-share`` (25 %) of the
cluster, then the oldest leave (released, not timed), so the cluster stays partly filled.

Each decision is ``Scheduler.schedule`` of the production engine with the production scorer
(``schedule.scoring``'s ``proofplane``, what the server runs), timed with ``perf_counter_ns``.
The same stream runs twice on the same cluster: ``topology`` (the gangs carry their request)
and ``blind`` (the same core, the requests without topology: member by member, best fit).

Figures: ``within_one_domain`` (placed gangs whose members all sit in one domain at the level
they ask, per mode and per size class), ``mean_domains`` (domains per placed gang), the share
placed, and ``gang_decisions_per_s`` (gang decisions / the sum of their latencies; median of
``--rounds`` repetitions of the topology run with different seeds, with p50/p99 ms; also in the
thread's CPU time, ``cpu_gang_decisions_per_s``, which a loaded machine disturbs less).

    .venv/bin/python bench/topology.py --json [--quick] [--seed 11]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from collections import deque
from dataclasses import replace
from typing import Any

from proofplane.machine import machine
from proofplane.model import (
    Gpu,
    GpuRequest,
    IsolationLevel,
    Node,
    NodeState,
    Placement,
    TopologyMode,
    TopologyRequest,
    domain_of,
)
from proofplane.schedule.engine import Held, Job, Scheduler, pool_of
from proofplane.schedule.scoring import DEFAULT_SCORER, make_scorer
from proofplane.schedule.values import Request

RACK = 18  # nodes per rack = one NVL72 NVLink domain
BLOCK = 8  # racks per block
GPUS = 4  # GPUs per node (a GB200 compute tray)
SIZES = (2, 2, 2, 4, 4, 4, 8, 8, 16, 18, 32, 64)


def cluster(n: int) -> list[Node]:
    nodes = []
    for i in range(n):
        rack = i // RACK
        name = f"n{i:05d}"
        nodes.append(
            Node(
                name,
                "r1",
                "z1",
                rack=f"rack{rack:03d}",
                state=NodeState.ADMITTED,
                gpus=tuple(Gpu(g, f"{name}-g{g}", "B200", 192_000) for g in range(GPUS)),
                topology={"nvlink_domain": f"nvl{rack:03d}", "block": f"block{rack // BLOCK:02d}"},
            )
        )
    return nodes


def _request(name: str, gpus: GpuRequest, topology: TopologyRequest | None = None) -> Request:
    return Request(name, "t1", {}, IsolationLevel.EXCLUSIVE_GPU, gpus, topology=topology)


def gang_stream(seed: int, count: int, required_every: int) -> list[Request]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        k = rng.choice(SIZES)
        per = 2 if rng.random() < 0.15 else GPUS
        level = "nvlink_domain" if k <= RACK else "block"
        mode = (
            TopologyMode.REQUIRED
            if required_every and i % required_every == 0
            else TopologyMode.PREFERRED
        )
        out.append(_request(f"gang{i}", GpuRequest(k * per, nodes=k), TopologyRequest(level, mode)))
    return out


def run(
    nodes: list[Node],
    stream: list[Request],
    *,
    seed: int,
    fill: float,
    gang_share: float,
    topology: bool,
) -> dict[str, Any]:
    """One pass of ``stream`` over a freshly filled cluster; ``topology`` False drops the
    requests' topology (the blind baseline)."""
    sched = Scheduler(nodes, scorer=make_scorer(DEFAULT_SCORER))
    rng = random.Random(seed)
    total = len(nodes) * GPUS
    held = 0
    n = 0
    while held < fill * total:  # the background: single-node work at random nodes
        k = rng.choice((1, 1, 2, 4))
        node = nodes[rng.randrange(len(nodes))]
        devices = sched.snapshot.member_fit(node.name, _request("x", GpuRequest(k)))
        if devices is None:
            continue
        n += 1
        sched.hold(
            Held(("bg", n), f"bg{n}", "t1", IsolationLevel.EXCLUSIVE_GPU, 0, pool_of({}),
                 Placement(node.name, devices))
        )  # fmt: skip
        held += k
    by_node = {nd.name: nd for nd in nodes}
    live: deque[tuple[tuple[str, int], int]] = deque()
    gang_gpus = 0
    latencies: list[int] = []
    cpu_ns = 0
    stats: dict[str, dict[str, int]] = {}
    domains_used: list[int] = []
    for i, req in enumerate(stream):
        topo = req.topology
        assert topo is not None
        while live and gang_gpus + req.gpus.count > gang_share * total:
            key, gpus = live.popleft()
            sched.release(key)
            gang_gpus -= gpus
        asked = req if topology else replace(req, topology=None)
        key = ("gang", i)
        c0 = time.thread_time_ns()
        t0 = time.perf_counter_ns()
        out = sched.schedule(Job(key, asked), preempt=False)
        latencies.append(time.perf_counter_ns() - t0)
        cpu_ns += time.thread_time_ns() - c0
        cls = f"{topo.mode.value}:{'le18' if req.gpus.nodes <= RACK else 'gt18'}"
        s = stats.setdefault(cls, {"gangs": 0, "placed": 0, "one_domain": 0})
        s["gangs"] += 1
        if out.placement is None:
            continue
        s["placed"] += 1
        live.append((key, req.gpus.count))
        gang_gpus += req.gpus.count
        used = {domain_of(by_node[p], topo.level) for p in out.placement.nodes}
        domains_used.append(len(used))
        if len(used) == 1:
            s["one_domain"] += 1
    placed = sum(s["placed"] for s in stats.values())
    one = sum(s["one_domain"] for s in stats.values())
    latencies.sort()
    return {
        "gangs": len(stream),
        "placed": placed,
        "placed_share": round(placed / len(stream), 4),
        "within_one_domain": round(one / placed, 4) if placed else None,
        "mean_domains": round(statistics.fmean(domains_used), 3) if domains_used else None,
        "by_class": {
            c: s
            | {
                "within_one_domain": round(s["one_domain"] / s["placed"], 4)
                if s["placed"]
                else None
            }
            for c, s in sorted(stats.items())
        },
        "gang_decisions_per_s": round(len(latencies) / (sum(latencies) / 1e9), 1),
        # in the thread's own CPU time: what other processes on the machine disturb less
        "cpu_gang_decisions_per_s": round(len(latencies) / (cpu_ns / 1e9), 1),
        "p50_ms": round(latencies[len(latencies) // 2] / 1e6, 3),
        "p99_ms": round(latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] / 1e6, 3),
        "background_gpus": held,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object (the default)")
    ap.add_argument("--quick", action="store_true", help="a small CI-sized run")
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--nodes", type=int)
    ap.add_argument("--gangs", type=int)
    ap.add_argument("--rounds", type=int, help="repetitions of the topology run (seeds)")
    ap.add_argument("--fill", type=float, default=0.45, help="GPU share the background holds")
    ap.add_argument("--gang-share", type=float, default=0.25, help="GPU share gangs may hold")
    ap.add_argument("--required-every", type=int, default=5, help="every n-th gang: required")
    args = ap.parse_args(argv)
    n_nodes = args.nodes or (360 if args.quick else 5000)
    n_gangs = args.gangs or (150 if args.quick else 2000)
    rounds = args.rounds or (1 if args.quick else 3)
    nodes = cluster(n_nodes)
    gc.freeze()
    runs = []
    for r in range(rounds):
        seed = args.seed + r
        stream = gang_stream(seed, n_gangs, args.required_every)
        kw = {"seed": seed, "fill": args.fill, "gang_share": args.gang_share}
        runs.append(
            {
                "seed": seed,
                "topology": run(nodes, stream, topology=True, **kw),  # type: ignore[arg-type]
                "blind": run(nodes, stream, topology=False, **kw),  # type: ignore[arg-type]
            }
        )
    first = runs[0]
    rates = [r["topology"]["gang_decisions_per_s"] for r in runs]
    doc = {
        "benchmark": "topology",
        "engine": "proofplane.schedule",
        "scorer": DEFAULT_SCORER,
        "gang_decisions_per_s": statistics.median(rates),
        "gang_decisions_per_s_runs": rates,
        "cpu_gang_decisions_per_s": statistics.median(
            r["topology"]["cpu_gang_decisions_per_s"] for r in runs
        ),
        "cpu_gang_decisions_per_s_runs": [r["topology"]["cpu_gang_decisions_per_s"] for r in runs],
        "blind_gang_decisions_per_s": statistics.median(
            r["blind"]["gang_decisions_per_s"] for r in runs
        ),
        "p50_ms": statistics.median(r["topology"]["p50_ms"] for r in runs),
        "p99_ms": statistics.median(r["topology"]["p99_ms"] for r in runs),
        "within_one_domain": {
            "topology": statistics.median(r["topology"]["within_one_domain"] or 0 for r in runs),
            "blind": statistics.median(r["blind"]["within_one_domain"] or 0 for r in runs),
        },
        "mean_domains": {
            "topology": statistics.median(r["topology"]["mean_domains"] or 0 for r in runs),
            "blind": statistics.median(r["blind"]["mean_domains"] or 0 for r in runs),
        },
        "placed_share": {
            "topology": statistics.median(r["topology"]["placed_share"] for r in runs),
            "blind": statistics.median(r["blind"]["placed_share"] for r in runs),
        },
        "first_run": first,
        "params": {
            "quick": args.quick,
            "seed": args.seed,
            "nodes": n_nodes,
            "gpus_per_node": GPUS,
            "rack_nodes": RACK,
            "nvlink_domain": f"one per rack ({RACK} nodes x {GPUS} GPUs = NVL72)",
            "block_racks": BLOCK,
            "gangs": n_gangs,
            "rounds": rounds,
            "fill": args.fill,
            "gang_share": args.gang_share,
            "required_every": args.required_every,
        },
        "machine": machine(),
    }
    json.dump(doc, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
