"""Benchmark: per-node desired network state (issue 14), full and incremental, and rendering.

The scenario of issue 14 ("Figures"): 5,000 nodes, 1,000 tenants (one segment each: a VNI
and a PKey), 50,000 placed workloads. Tenants differ in size (a seeded Pareto draw, the
largest a few thousand workloads, most a few dozen) and, as a packing scheduler places them,
each tenant's workloads share a set of nodes (about 4 of its workloads per node it uses), so
a node runs the work of a few tenants and a segment spans a few to a few hundred nodes. A
third of the tenants carry a policy of their own (an allow-list and egress rules).

Phases (one thread, the code the server runs: ``proofplane.network``):

* ``full``: :func:`~proofplane.network.desired.compute_all`: the index built from nodes,
  segments, policies and endpoints, then every node's desired state with its sha256;
* ``incremental``: on the index of ``full`` (every node's state cached), 1 % of the nodes
  fail (``node_failed``) and their workloads move to other nodes of the same tenants
  (``place``; the new nodes are drawn before the clock starts): ``update_ms`` is the index
  update, which returns the affected nodes; ``incremental_ms`` adds the new sha256 of every
  affected node (``NetworkIndex.sha256``: what the server needs to bump their generations),
  and is the figure held against the target; ``with_states_ms`` also builds every affected
  node's whole desired state (which otherwise happens when each agent fetches its own);
* ``render``: one node carrying ``--render-segments`` (200) segments, each with a local
  workload and remote endpoints on 8 other nodes: the ``ip``/``bridge`` batches (diff against
  an empty node) and the nftables ruleset, pure rendering;
* ``apply``: applying such a state in a fresh network namespace with the agent's code
  (bench/_netns_apply.py: from the server's JSON to a passing self-check, then the idle
  round); needs root and the kernel's netns/veth/bridge/vxlan, else it says what is missing;
* ``convergence`` (with ``--convergence``): the 3-node namespace scenario of the agent's test
  (tests/netns_cluster.py: a real server, an agent per node namespace): the seconds from a
  node marked failed to every live agent reporting the new state (and to the moved
  workload's first answered ping).

Each figure is the median of ``--runs`` runs (each on a freshly built index).

    .venv/bin/python bench/network.py --json [--quick] [--seed 14]
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import math
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from proofplane.machine import machine
from proofplane.network.desired import (
    Endpoint,
    NetworkIndex,
    NodeNet,
    Segment,
    compute_all,
    endpoint_mac,
)
from proofplane.network.policy import NetworkPolicy, parse_policy
from proofplane.network.render.iproute2 import RunningState, diff, render_diff
from proofplane.network.render.nftables import render_nftables

TARGETS = {"full_ms": 1000.0, "incremental_ms": 100.0, "apply_ms": 2000.0}
WORKLOADS_PER_NODE_PER_TENANT = 4


def scenario(
    rng: random.Random, n_nodes: int, n_tenants: int, n_workloads: int
) -> tuple[list[NodeNet], list[Segment], dict[str, NetworkPolicy], list[Endpoint]]:
    nodes = [
        NodeNet(f"gpu-{i:05d}", f"10.{250 + i // 65536}.{i // 256 % 256}.{i % 256}", "ul0",
                (f"0x0002c903{i:08x}",))
        for i in range(n_nodes)
    ]  # fmt: skip
    tenants = [f"t{i:04d}" for i in range(n_tenants)]
    segments = [Segment(t, 10_000 + i, i + 1) for i, t in enumerate(tenants)]
    known = frozenset(tenants)
    policies = {
        t: parse_policy(
            {
                "subnet": "10.0.0.0/8",
                "allow": [
                    {"proto": "tcp", "ports": 29500, "source": "tenant"},
                    {"proto": "tcp", "ports": 22, "source": "10.255.0.0/24"},
                    {"proto": "icmp"},
                ],
                "egress": [{"proto": "tcp", "ports": 443, "destination": "192.0.2.0/24"}],
            },
            tenant=t,
            known_tenants=known,
        )
        for t in tenants[::3]
    }
    # tenant sizes: Pareto(1.2), scaled to n_workloads, each at least 1
    weights = [rng.paretovariate(1.2) for _ in tenants]
    scale = (n_workloads - n_tenants) / sum(weights)
    sizes = [1 + int(w * scale) for w in weights]
    for i in range(n_workloads - sum(sizes)):  # the rounding remainder
        sizes[i % n_tenants] += 1
    endpoints = []
    net = ipaddress.ip_network("10.0.0.0/8")
    for seg, size in zip(segments, sizes, strict=True):
        spread = min(n_nodes, max(1, math.ceil(size / WORKLOADS_PER_NODE_PER_TENANT)))
        homes = rng.sample(range(n_nodes), spread)
        for k in range(size):
            w = f"{seg.tenant}-w{k:05d}"
            node = nodes[homes[k % spread]].name
            ip = str(net.network_address + k + 1)
            endpoints.append(
                Endpoint(w, seg.tenant, node, seg.vni, ip, endpoint_mac(seg.tenant, w))
            )
    return nodes, segments, policies, endpoints


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000


def one_run(
    rng: random.Random,
    data: tuple[list[NodeNet], list[Segment], dict[str, NetworkPolicy], list[Endpoint]],
    fail_fraction: float,
) -> dict[str, Any]:
    nodes, segments, policies, endpoints = data
    t0 = time.perf_counter()
    ix = NetworkIndex(nodes, segments, policies, endpoints)
    states = ix.desired_all()
    full_ms = _ms(t0)
    # FDB entries all nodes carry in all (counted, not materialised: (holders - 1) * endpoints)
    sizes = {vni: len(ix.nodes_of(vni)) for vni in ix.segments}
    counts: dict[int, int] = {}
    for e in endpoints:
        counts[e.vni] = counts.get(e.vni, 0) + 1
    remote = sum((sizes[vni] - 1) * n for vni, n in counts.items())
    widest = max(counts, key=lambda vni: (sizes[vni], vni))
    # the same through compute_all (what a cold server start does), for the record
    t0 = time.perf_counter()
    compute_all(nodes, segments, policies, endpoints)
    compute_all_ms = _ms(t0)

    # incremental: 1 % of the nodes fail; their endpoints move (targets drawn before timing)
    failed = rng.sample([n.name for n in nodes], max(1, int(len(nodes) * fail_fraction)))
    down = set(failed)
    tenant_nodes: dict[str, list[str]] = {}
    for e in endpoints:
        tenant_nodes.setdefault(e.tenant, []).append(e.node)
    alive = [n.name for n in nodes if n.name not in down]
    moved = []
    for e in endpoints:
        if e.node in down:
            choices = [n for n in tenant_nodes[e.tenant] if n not in down]
            target = rng.choice(choices) if choices else rng.choice(alive)
            moved.append(Endpoint(e.workload, e.tenant, target, e.vni, e.ip, e.mac))
    t0 = time.perf_counter()
    affected: set[str] = set()
    for name in failed:
        affected |= ix.node_failed(name)
    affected |= ix.place(moved)
    update_ms = _ms(t0)
    for name in affected:
        ix.sha256(name)
    incremental_ms = _ms(t0)
    for name in affected:
        ix.desired(name)
    with_states_ms = _ms(t0)
    return {
        "full_ms": full_ms,
        "compute_all_ms": compute_all_ms,
        "update_ms": update_ms,
        "incremental_ms": incremental_ms,
        "with_states_ms": with_states_ms,
        "failed_nodes": len(failed),
        "moved_endpoints": len(moved),
        "affected_nodes": len(affected),
        "node_segments": sum(len(d.segments) for d in states.values()),
        "remote_fdb_entries": remote,
        "widest_segment": {"nodes": sizes[widest], "endpoints": counts[widest]},
    }


def render_section(n_segments: int, runs: int) -> dict[str, Any]:
    """One node with ``n_segments`` segments, one local workload each and remote endpoints on
    8 other nodes: the ``ip``/``bridge`` batches and the ruleset, rendered."""
    peers = 8
    nodes = [NodeNet(f"n{i}", f"10.250.0.{i + 1}") for i in range(peers + 1)]
    segments = [Segment(f"t{i:03d}", 10_000 + i, i + 1) for i in range(n_segments)]
    endpoints = [
        Endpoint(f"{s.tenant}-{n.name}", s.tenant, n.name, s.vni, f"10.10.0.{j + 1}",
                 endpoint_mac(s.tenant, f"{s.tenant}-{n.name}"))
        for s in segments
        for j, n in enumerate(nodes)
    ]  # fmt: skip
    d = NetworkIndex(nodes, segments, {}, endpoints).desired("n0")
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        batches = render_diff(diff(d, RunningState()))
        ruleset = render_nftables(d)
        times.append(_ms(t0))
    return {
        "segments": n_segments,
        "links": sum(1 for b in batches if b.tool == "ip" for line in b.lines if " add " in line),
        "ip_lines": sum(len(b.lines) for b in batches if b.tool == "ip"),
        "bridge_lines": sum(len(b.lines) for b in batches if b.tool == "bridge"),
        "batches": len(batches),
        "ruleset_lines": ruleset.count("\n"),
        "render_ms": round(statistics.median(times), 2),
    }


def apply_section(args: argparse.Namespace) -> dict[str, Any]:
    """Applying ``--render-segments`` segments on one node in a network namespace (issue 14:
    <= 2 s), by the agent's code (bench/_netns_apply.py)."""
    import _netns_apply

    return _netns_apply.apply_section(args.render_segments, runs=1 if args.quick else 3)


def convergence_section(args: argparse.Namespace) -> dict[str, Any]:
    """The failover convergence of the agent's 3-node namespace scenario (``--convergence``)."""
    if not args.convergence:
        return {"convergence_s": None, "note": "run with --convergence (root; ~20 s)"}
    import _netns_apply

    return _netns_apply.convergence_section()


SECTIONS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "apply": apply_section,
    "convergence": convergence_section,
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--quick", action="store_true", help="a tenth of the scenario, 1 run")
    ap.add_argument("--nodes", type=int, default=5000)
    ap.add_argument("--tenants", type=int, default=1000)
    ap.add_argument("--workloads", type=int, default=50_000)
    ap.add_argument("--fail-fraction", type=float, default=0.01)
    ap.add_argument("--render-segments", type=int, default=200)
    ap.add_argument("--runs", type=int, default=5, help="runs (medians reported)")
    ap.add_argument("--seed", type=int, default=14)
    ap.add_argument("--convergence", action="store_true",
                    help="also run the 3-node namespace failover scenario (root)")  # fmt: skip
    args = ap.parse_args(argv)
    if args.quick:
        args.nodes, args.tenants, args.workloads, args.runs = 500, 100, 5000, 1

    rng = random.Random(args.seed)
    data = scenario(rng, args.nodes, args.tenants, args.workloads)
    runs = [one_run(random.Random(args.seed + r), data, args.fail_fraction)
            for r in range(args.runs)]  # fmt: skip

    def med(key: str) -> float:
        return round(statistics.median(r[key] for r in runs), 2)

    full = {"full_ms": med("full_ms"), "compute_all_ms": med("compute_all_ms"),
            "full_ms_runs": [round(r["full_ms"], 1) for r in runs],
            "node_segments": runs[0]["node_segments"],
            "remote_fdb_entries": runs[0]["remote_fdb_entries"],
            "widest_segment": runs[0]["widest_segment"]}  # fmt: skip
    incremental = {
        "incremental_ms": med("incremental_ms"),
        "update_ms": med("update_ms"),
        "with_states_ms": med("with_states_ms"),
        "incremental_ms_runs": [round(r["incremental_ms"], 1) for r in runs],
        "failed_nodes": runs[0]["failed_nodes"],
        "moved_endpoints": int(med("moved_endpoints")),
        "affected_nodes": int(med("affected_nodes")),
    }
    out: dict[str, Any] = {
        "benchmark": "per-node desired network state (proofplane.network), one thread",
        "scenario": {
            "nodes": args.nodes,
            "tenants": args.tenants,
            "workloads": args.workloads,
            "fail_fraction": args.fail_fraction,
            "seed": args.seed,
            "workloads_per_node_per_tenant": WORKLOADS_PER_NODE_PER_TENANT,
            "quick": args.quick,
        },  # fmt: skip
        "runs": args.runs,
        "full": full,
        "incremental": incremental,
        "render": render_section(args.render_segments, max(3, args.runs)),
    }
    for name, section in SECTIONS.items():
        out[name] = section(args)
    apply_ms = out["apply"].get("apply_ms")
    out["targets"] = TARGETS
    out["meets"] = {
        "full_ms": full["full_ms"] <= TARGETS["full_ms"],
        "incremental_ms": incremental["incremental_ms"] <= TARGETS["incremental_ms"],
        "apply_ms": None if apply_ms is None else apply_ms <= TARGETS["apply_ms"],
    }
    out["machine"] = machine()
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"full recompute {full['full_ms']:.0f} ms (target <= {TARGETS['full_ms']:.0f})")
        print(f"incremental after {incremental['failed_nodes']} node failures "
              f"{incremental['incremental_ms']:.1f} ms (index {incremental['update_ms']:.1f} ms, "
              f"{incremental['affected_nodes']} nodes affected; target <= 100)")  # fmt: skip
        print(f"render {out['render']['segments']} segments {out['render']['render_ms']} ms")
        ap_ = out["apply"]
        print(
            f"apply {ap_['segments']} segments in a namespace: "
            + (
                f"{ap_['apply_ms']} ms (idle round {ap_['idle_round_ms']} ms; target <= 2000)"
                if ap_.get("apply_ms") is not None
                else ap_.get("note", "not measured")
            )
        )
        cv = out["convergence"]
        if cv.get("convergence_s") is not None:
            print(f"convergence after a node failure: {cv['convergence_s']} s (data plane "
                  f"{cv['data_plane_s']} s, agents every {cv['agent_interval_s']} s)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
