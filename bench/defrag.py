"""Benchmark: the defragmentation planner's time per decision on a 5,000-node MIG cluster.

Issue 17 §3. ``--nodes`` (5,000) nodes of 8 H100-80GB, every GPU MIG-enabled in seven 1g.10gb
slices; a fifth of the nodes certified ``hipaa``. Each GPU holds 1 to 6 one-slice workloads on
random slots, one of them always in slots 0-3 (every GPU busy: no 4g fits, no GPU is idle, and
no 4g region is free: nothing but moves can place a 4g); each workload is movable (idle or
restartable) with probability ``--movable`` (0.5), of the node's pool. The scheduler is the
server's (``schedule.engine.Scheduler`` with the production scorer).

A decision is one ``plan_defrag`` call for a waiting 4g.40gb request (a third of them tagged
``hipaa``), timed with ``perf_counter_ns``; ``--apply`` decisions also carry the plan out and
place the request (``apply_plan``), as the server does, so the cluster changes between them.
Printed: decisions, plans found and refusals per code, moves per plan, p50/p99/max ms.

    .venv/bin/python bench/defrag.py --json [--nodes 5000] [--decisions 50] [--seed 7]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections import Counter
from collections.abc import Hashable
from typing import Any

from proofplane.machine import machine
from proofplane.model import (
    Gpu,
    GpuRequest,
    IsolationLevel,
    MigInstance,
    Node,
    NodeState,
    PlacedDevice,
    Placement,
)
from proofplane.schedule.defrag import DefragPlan, apply_plan, plan_defrag
from proofplane.schedule.engine import Held, Job, Scheduler, pool_of
from proofplane.schedule.scoring import DEFAULT_SCORER, make_scorer
from proofplane.schedule.values import Request

H100 = "H100-80GB"
SEVEN_1G = tuple(MigInstance("1g.10gb", s) for s in range(7))
HIPAA = {"hipaa": "true"}


def cluster(n_nodes: int, movable_p: float, rng: random.Random) -> tuple[Scheduler, set[Hashable]]:
    nodes: list[Node] = []
    held: list[Held] = []
    movable: set[Hashable] = set()
    for n in range(n_nodes):
        name = f"node-{n:05d}"
        certs = HIPAA if n % 5 == 0 else {}
        gpus = tuple(
            Gpu(g, f"GPU-{name}-{g}", H100, 81920, mig_enabled=True, mig_instances=SEVEN_1G)
            for g in range(8)
        )
        nodes.append(Node(name, "r", "z", certifications=dict(certs), state=NodeState.ADMITTED,
                          gpus=gpus))  # fmt: skip
        for g in range(8):
            # one slice of the 4g region (slots 0-3) always held: no 4g without a move
            starts = {rng.randrange(4), *rng.sample(range(7), rng.randint(0, 5))}
            for start in sorted(starts):
                key = len(held)
                dev = PlacedDevice(g, f"GPU-{name}-{g}", mig_profile="1g.10gb", mig_start=start)
                tags = certs if certs and rng.random() < 0.5 else {}
                held.append(
                    Held(key, f"w{key}", "t", IsolationLevel.MIG, 0, pool_of(tags),
                         Placement(name, (dev,)))
                )  # fmt: skip
                if rng.random() < movable_p:
                    movable.add(key)
    return Scheduler(nodes, held, scorer=make_scorer(DEFAULT_SCORER)), movable


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=5000)
    ap.add_argument("--decisions", type=int, default=50)
    ap.add_argument("--movable", type=float, default=0.5)
    ap.add_argument("--budget", type=int, default=20)
    ap.add_argument("--apply", action="store_true", help="carry every plan out")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    t0 = time.perf_counter()
    scheduler, movable = cluster(args.nodes, args.movable, rng)
    build_s = time.perf_counter() - t0
    times: list[float] = []
    outcomes: Counter[str] = Counter()
    moves: list[int] = []
    for i in range(args.decisions):
        tags = HIPAA if i % 3 == 0 else {}
        req = Request(f"big{i}", "t", tags, IsolationLevel.MIG, GpuRequest(mig_profile="4g.40gb"))
        job = Job(f"big{i}", req)
        t = time.perf_counter_ns()
        out = plan_defrag(scheduler, job, movable.__contains__, args.budget)
        times.append((time.perf_counter_ns() - t) / 1e6)
        if isinstance(out, DefragPlan):
            outcomes["plan"] += 1
            moves.append(len(out.moves))
            if args.apply:
                apply_plan(scheduler, job, out)
        else:
            outcomes[out.code] += 1
    times.sort()
    result: dict[str, Any] = {
        "benchmark": "defrag",
        "nodes": args.nodes,
        "gpus": args.nodes * 8,
        "held": len(scheduler.held),
        "movable_share": args.movable,
        "build_s": round(build_s, 2),
        "decisions": args.decisions,
        "applied": args.apply,
        "outcomes": dict(outcomes),
        "moves_per_plan_mean": round(statistics.fmean(moves), 2) if moves else None,
        "p50_ms": round(times[len(times) // 2], 2),
        "p99_ms": round(times[min(len(times) - 1, int(len(times) * 0.99))], 2),
        "max_ms": round(times[-1], 2),
        "machine": machine(),
    }
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k}: {v}")


if __name__ == "__main__":
    main()
