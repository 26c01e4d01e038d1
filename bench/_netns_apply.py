"""The agent's side of bench/network.py (issue 14's "Figures"): applying a node's desired
network state in a real network namespace, and the convergence after a failover in the
3-node namespace scenario. Not a benchmark itself: bench/network.py puts these sections in
its JSON. Both need root and the kernel's netns/veth/bridge/vxlan plus ``ip`` and ``nft``
(tests/netns.py says what is missing); without them a section says so and holds no figure.

* ``apply``: one node namespace with an underlay device, and the desired state the render
  section renders (``--render-segments`` segments, one local workload each and endpoints on
  8 other nodes): the time from the server's JSON to a passing self-check, i.e. the agent's
  whole round (parse and check, read the running state, diff and render the batches and
  the ruleset, create the workloads' namespaces and links with their addresses, FDB entries,
  ``nft -f``, read everything back) — then the idle round that follows (nothing to do);
* ``convergence``: tests/netns_cluster.py's scenario (a real server, three node namespaces
  with one agent each, two tenants in the same subnet): a node fails, its work is re-placed,
  and the time until every live agent reported the new state with a passing self-check
  (control plane) and until the moved workload answered its tenant's probe (data plane).
"""

from __future__ import annotations

import secrets
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from proofplane.agent.network import NetworkAgent
from proofplane.network.desired import (
    Endpoint,
    NetworkIndex,
    NodeDesired,
    NodeNet,
    Segment,
    desired_to_json,
    endpoint_mac,
)

PEERS = 8


def node_state(n_segments: int, tag: str) -> NodeDesired:
    """The render section's node: ``n_segments`` segments, each with a local workload and one
    on each of 8 other nodes (workload names carry ``tag``: their namespaces are unique)."""
    nodes = [NodeNet(f"n{i}", f"10.250.0.{i + 1}") for i in range(PEERS + 1)]
    segments = [Segment(f"t{i:03d}", 10_000 + i, i + 1) for i in range(n_segments)]
    endpoints = []
    for s in segments:
        for j, n in enumerate(nodes):
            key = f"{s.tenant}/{n.name}-{tag}"
            endpoints.append(
                Endpoint(
                    key, s.tenant, n.name, s.vni, f"10.10.0.{j + 1}", endpoint_mac(s.tenant, key)
                )
            )
    return NetworkIndex(nodes, segments, {}, endpoints).desired("n0")


def _missing() -> list[str]:
    try:
        import netns
    except ImportError as exc:  # pytest (tests/ci.py) is a dev dependency
        return [f"tests/netns.py ({exc})"]
    return netns.missing()


def _sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=60)


def _settle(limit_s: float = 60.0) -> None:
    """Wait for the kernel to finish tearing down the namespaces an earlier run deleted: it
    does so afterwards (``cleanup_net``, under the rtnl lock), and a run started meanwhile
    measured that teardown too (~0.4 s fresh against ~3.9 s right after a run). Settled: a
    veth add + delete in the root namespace answers within 50 ms twice in a row."""
    deadline = time.monotonic() + limit_s
    quick = 0
    while quick < 2 and time.monotonic() < deadline:
        t0 = time.perf_counter()
        _link = ["ip", "link"]
        subprocess.run([*_link, "add", "ppsettle0", "type", "veth", "peer", "name", "ppsettle1"],
                       capture_output=True, check=False)  # fmt: skip
        subprocess.run([*_link, "del", "ppsettle0"], capture_output=True, check=False)
        quick = quick + 1 if time.perf_counter() - t0 < 0.05 else 0
        time.sleep(0.2)


def apply_section(n_segments: int, runs: int) -> dict[str, Any]:
    """Median of ``runs`` applies of :func:`node_state` to a fresh node namespace."""
    lacking = _missing()
    if lacking:
        return {"apply_ms": None, "segments": n_segments, "note": "needs " + ", ".join(lacking)}
    applies: list[float] = []
    idles: list[float] = []
    detail: dict[str, Any] = {}
    for _ in range(max(1, runs)):
        _settle()
        tag = secrets.token_hex(3)
        ns = f"ppb{tag}"
        d = node_state(n_segments, tag)
        doc = {**desired_to_json(d), "generation": 1}
        workloads = sorted({e.netns for s in d.segments for e in s.local})
        try:
            _sh("ip", "netns", "add", ns)
            _sh("ip", "-n", ns, "link", "add", "ul0", "type", "veth", "peer", "name", "ulx")
            _sh("ip", "-n", ns, "addr", "add", "10.250.0.1/24", "dev", "ul0")
            _sh("ip", "-n", ns, "link", "set", "ul0", "up")
            agent = NetworkAgent(ns)
            t0 = time.perf_counter()
            _gen, result = agent.apply_document(doc)
            applies.append((time.perf_counter() - t0) * 1000)
            if not result.ok:
                return {
                    "apply_ms": None,
                    "segments": n_segments,
                    "note": "the self-check failed",
                    "self_check": result.self_check,
                }
            t0 = time.perf_counter()
            _gen, idle = agent.apply_document(doc)
            idles.append((time.perf_counter() - t0) * 1000)
            detail = {"changes": result.changes, "idle_changes": idle.changes}
        finally:
            subprocess.run(
                ["ip", "-batch", "-"],
                input="".join(f"netns del {n}\n" for n in [ns, *workloads]),
                text=True,
                capture_output=True,
                check=False,
            )
    return {
        "segments": n_segments,
        "apply_ms": round(statistics.median(applies), 1),
        "apply_ms_runs": [round(x, 1) for x in applies],
        "idle_round_ms": round(statistics.median(idles), 1),
        "workload_namespaces": n_segments,
        "remote_nodes": PEERS,
        **detail,
        "note": "from the server's JSON to a passing self-check, in a fresh node namespace "
        "(workload namespaces made by the agent); idle_round_ms: the next round, nothing to do",
    }


def convergence_section() -> dict[str, Any]:
    """The failover convergence of tests/netns_cluster.py's scenario (one run)."""
    lacking = _missing()
    if lacking:
        return {"convergence_s": None, "note": "needs " + ", ".join(lacking)}
    try:
        import netns_cluster
    except ImportError as exc:
        return {"convergence_s": None, "note": f"tests/netns_cluster.py: {exc}"}
    try:
        report = netns_cluster.run_scenario()
    except Exception as exc:  # a benchmark reports what went wrong and goes on
        return {"convergence_s": None, "note": f"the scenario failed: {exc}"}
    return {
        "convergence_s": report["convergence"]["control_plane_s"],
        **report["convergence"],
        "matrix_ok": report["ok"],
        "agent_interval_s": report["agent_interval_s"],
        "scenario_s": report["seconds"],
    }
