"""Benchmark: placement decisions on a large simulated cluster, failover, memory, end to end.

The scenario of issue 3 ("Figures to reach"): a 5,000-node cluster, 8 H100-80GB per node, half
of the nodes with MIG enabled (a mix of layouts per GPU), 20 zones, mixed certifications
(hipaa, gdpr-zone, pci-dss, soc2); a seeded stream of requests mixing whole GPUs (1/2/4/8), MIG
profiles and shared fractions, with compliance tags, isolation levels and a dozen tenants.

Phases, all on one thread (the decision loop is single-threaded Python, so "one core"):

* ``fill``: place + reserve until ``--placed`` (50,000) workloads hold capacity; then the
  resident memory of the process (``rss_mb``) is read: the snapshot with those workloads.
* ``steady``: ``--rounds`` rounds of ``--decisions`` decisions on the full cluster; before
  each decision a random running workload ends (released, not timed), so occupancy stays put.
  A decision is ``place`` and, when placed, ``reserve``; each one timed with
  ``perf_counter_ns``. ``decisions_per_s`` is the median over rounds of decisions / the sum of
  their latencies; ``p50_ms`` / ``p99_ms`` are medians over rounds.
* ``failover``: 1 % of the nodes fail (``upsert_node`` with state failed), their workloads are
  released and re-placed, on compliant nodes only, or left pending with the decision's reason;
  ``failover_s`` is the median over ``--failover-rounds`` (each failing a different 1 %).
* ``reference``: a few decisions of the scanning reference engine on the same state, for the
  before/after ratio.
* ``e2e``: the service path with persistence: ``submit_workloads`` in batches of
  ``--e2e-batch`` (100) workloads, one write transaction each, to a SQLite file (WAL), on the
  same cluster as the phases above (``--e2e-nodes``, default ``--nodes``), loaded through
  ``load_cluster`` (its bulk path). The first batch, which loads the cluster into the
  service's scheduler cache, is timed apart (``first_batch_s``); ``e2e_per_s`` is the rest.
  ``e2e_single``: ``submit_workload``, one transaction per workload, on a smaller cluster
  (``--e2e-single-nodes``; the JSON says the size).

    .venv/bin/python bench/placement.py --json [--quick] [--seed 7]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from proofplane.hardware.skus import SKUS, layout_errors
from proofplane.machine import machine
from proofplane.model import (
    ComplianceProfile,
    Gpu,
    GpuRequest,
    IsolationLevel,
    MigInstance,
    Node,
    NodeState,
    Tenant,
)
from proofplane.schedule.reference import reference_place
from proofplane.schedule.scoring import DEFAULT_SCORER, SCORERS, make_scorer
from proofplane.schedule.snapshot import ClusterSnapshot
from proofplane.schedule.values import Allocation, Decision, Request

MODEL = "H100-80GB"
GPUS_PER_NODE = 8
ZONES = 20

# MIG layouts an H100-80GB GPU may carry in this cluster (profile@start), with their weights.
LAYOUTS: tuple[tuple[tuple[tuple[str, int], ...], int], ...] = (
    (tuple(("1g.10gb", s) for s in range(7)), 3),
    ((("3g.40gb", 0), ("3g.40gb", 4)), 3),
    ((("4g.40gb", 0), ("3g.40gb", 4)), 1),
    ((("2g.20gb", 0), ("2g.20gb", 2), ("2g.20gb", 4), ("1g.10gb", 6)), 2),
    ((("1g.20gb", 0), ("1g.20gb", 2), ("1g.20gb", 4), ("1g.20gb", 6)), 1),
    ((("3g.40gb", 0), ("2g.20gb", 4), ("1g.10gb", 6)), 2),
    ((("7g.80gb", 0),), 1),
)

# Tenants and what their compliance profiles force (required tags, isolation floor by tag).
TENANTS: tuple[tuple[str, dict[str, str], IsolationLevel], ...] = (
    ("clinic-a", {"hipaa": "true"}, IsolationLevel.MIG),
    ("clinic-b", {"hipaa": "true", "soc2": "type2"}, IsolationLevel.MIG),
    ("bank-eu", {"gdpr-zone": "frankfurt"}, IsolationLevel.MIG),
    ("payments", {"pci-dss": "isolated"}, IsolationLevel.DEDICATED_NODE),
    ("insurer-fr", {"gdpr-zone": "paris"}, IsolationLevel.SHARED),
    ("saas-1", {"soc2": "type2"}, IsolationLevel.SHARED),
    ("saas-2", {"soc2": "type2"}, IsolationLevel.SHARED),
    ("research-1", {}, IsolationLevel.SHARED),
    ("research-2", {}, IsolationLevel.SHARED),
    ("research-3", {}, IsolationLevel.SHARED),
    ("startup-1", {}, IsolationLevel.SHARED),
    ("startup-2", {}, IsolationLevel.SHARED),
)
MIG_PROFILES = (
    ["1g.10gb"] * 4 + ["1g.20gb"] + ["2g.20gb"] * 2 + ["3g.40gb"] * 2 + ["4g.40gb", "7g.80gb"]
)


def _layouts() -> tuple[list[tuple[MigInstance, ...]], list[int]]:
    sku = SKUS[MODEL]
    layouts = []
    for items, _ in LAYOUTS:
        layout = tuple(MigInstance(p, s) for p, s in items)
        errors = layout_errors(sku, layout)
        if errors:
            raise AssertionError(f"invalid layout {items}: {errors}")
        layouts.append(layout)
    return layouts, [w for _, w in LAYOUTS]


def node_certifications(rng: random.Random, zone: int) -> dict[str, str]:
    """Zones 0-3 are in Frankfurt, 4-5 in Paris (GDPR residency); the rest are uneven mixes."""
    certs: dict[str, str] = {}
    if zone < 4:
        certs["gdpr-zone"] = "frankfurt"
    elif zone < 6:
        certs["gdpr-zone"] = "paris"
    if rng.random() < 0.4:
        certs["hipaa"] = "true"
    if rng.random() < 0.7:
        certs["soc2"] = "type2"
    if rng.random() < 0.05:
        certs["pci-dss"] = "isolated"
    return certs


def build_cluster(rng: random.Random, n_nodes: int) -> list[tuple[Node, dict[str, str]]]:
    """(node as registered, certifications it is issued) for ``n_nodes`` nodes; 98 % are
    admitted, 1 % cordoned, 1 % still registered."""
    layouts, weights = _layouts()
    memory = SKUS[MODEL].memory_mb
    out = []
    for i in range(n_nodes):
        name = f"gpu-{i:05d}"
        zone = i % ZONES
        mig = i % 2 == 1
        gpus = []
        for g in range(GPUS_PER_NODE):
            layout = rng.choices(layouts, weights)[0] if mig else ()
            gpus.append(
                Gpu(g, f"GPU-{name}-{g}", MODEL, memory, mig_enabled=mig, mig_instances=layout)
            )
        r = rng.random()
        state = (
            NodeState.ADMITTED
            if r < 0.98
            else NodeState.CORDONED
            if r < 0.99
            else NodeState.REGISTERED
        )
        certs = node_certifications(rng, zone)
        node = Node(
            name,
            "eu-central" if zone < 6 else "us-east",
            f"zone-{zone:02d}",
            certifications=certs,
            state=state,
            gpus=tuple(gpus),
        )
        out.append((node, certs))
    return out


@dataclass(frozen=True, slots=True)
class Ask:
    """One generated submission, before and after the tenant profile is applied."""

    name: str
    tenant: str
    tags: dict[str, str]  # as submitted (the profile adds its required tags)
    gpus: GpuRequest
    isolation: IsolationLevel | None  # as submitted (None: what the GPU request implies)


def make_asks(rng: random.Random, n: int, prefix: str = "w") -> list[Ask]:
    """Whole GPUs (1/2/4/8) 22 %, MIG 43 %, shared fractions 35 %; extra tags on some."""
    asks = []
    for i in range(n):
        tenant, required, floor = rng.choice(TENANTS)
        tags: dict[str, str] = {}
        if rng.random() < 0.15:
            tags["soc2"] = "type2"
        if rng.random() < 0.1 and "gdpr-zone" not in required:
            tags["hipaa"] = "true"
        model = MODEL if rng.random() < 0.1 else None
        r = rng.random()
        isolation = None
        if floor is IsolationLevel.DEDICATED_NODE or r < 0.22:
            gpus = GpuRequest(rng.choice([1, 1, 1, 1, 2, 2, 4, 8]), model)
            if rng.random() < 0.03:
                isolation = IsolationLevel.DEDICATED_NODE
        elif r < 0.65 or floor is IsolationLevel.MIG:
            count = 2 if rng.random() < 0.1 else 1
            gpus = GpuRequest(count, model, mig_profile=rng.choice(MIG_PROFILES))
        else:
            gpus = GpuRequest(1, model, share_milli=rng.choice([100, 250, 250, 500, 500, 750]))
        asks.append(Ask(f"{prefix}{i:06d}", tenant, tags, gpus, isolation))
    return asks


_PROFILES = {
    name: ComplianceProfile(
        required_tags=required,
        min_isolation=floor
        if floor is not IsolationLevel.DEDICATED_NODE
        else IsolationLevel.SHARED,
        isolation_rules={"pci-dss=isolated": IsolationLevel.DEDICATED_NODE},
    )
    for name, required, floor in TENANTS
}


def to_request(ask: Ask) -> Request:
    """What the service hands the placer after applying the tenant's profile."""
    profile = _PROFILES[ask.tenant]
    tags = dict(sorted({**ask.tags, **profile.required_tags}.items()))
    natural = ask.gpus.natural_isolation
    isolation = (ask.isolation or natural).at_least(profile.minimum_for(tags))
    return Request(f"{ask.tenant}/{ask.name}", ask.tenant, tags, isolation, ask.gpus)


def _rss_mb() -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


def _peak_rss_mb() -> float | None:
    try:
        import resource

        return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    except (ImportError, OSError):
        return None


def _pct(sorted_ns: Sequence[int], q: float) -> float:
    """The q-quantile (nearest rank) of sorted nanoseconds, in milliseconds."""
    if not sorted_ns:
        return 0.0
    k = min(len(sorted_ns) - 1, max(0, int(round(q * len(sorted_ns) + 0.5)) - 1))
    return sorted_ns[k] / 1e6


class Bench:
    """The pure-core benchmark: one snapshot, the requests behind every allocation."""

    def __init__(self, nodes: list[Node], seed: int, scorer: str | None = DEFAULT_SCORER) -> None:
        self.rng = random.Random(seed)
        self.nodes = {n.name: n for n in nodes}
        t0 = time.perf_counter()
        # the server's scheduler: the snapshot with the configured scoring plugin (None: the
        # packing best fit of the bucket index, the reference's rule)
        self.snap = ClusterSnapshot(nodes, scorer=make_scorer(scorer) if scorer else None)
        self.build_s = time.perf_counter() - t0
        self.requests: dict[int, Request] = {}  # key → request, for every held allocation
        self.held: list[int] = []  # keys held, for random departures
        self.where: dict[int, int] = {}  # key → position in ``held``
        self.next_key = 0

    def decide(self, req: Request, key: int | None = None) -> tuple[Decision, int, int]:
        """place + reserve, timed; returns the decision, its wall-clock nanoseconds and the
        CPU nanoseconds this thread spent on it (the difference: time the OS ran others)."""
        snap = self.snap
        if key is None:
            key = self.next_key
            self.next_key += 1
        c0 = time.thread_time_ns()
        t0 = time.perf_counter_ns()
        snap.observe(req)  # what Scheduler.schedule does first: the scorer's mix learns
        d = snap.place(req)
        if d.placement is not None:
            snap.reserve(key, Allocation(req.workload, req.tenant, req.isolation, d.placement))
        ns = time.perf_counter_ns() - t0
        cpu = time.thread_time_ns() - c0
        if d.placement is not None:
            assert key is not None
            self.requests[key] = req
            self.where[key] = len(self.held)
            self.held.append(key)
        return d, ns, cpu

    def forget(self, key: int) -> None:
        pos = self.where.pop(key)
        last = self.held.pop()
        if last != key:
            self.held[pos] = last
            self.where[last] = pos
        del self.requests[key]

    def depart(self) -> None:
        """A random running workload ends (not timed)."""
        key = self.held[self.rng.randrange(len(self.held))]
        self.snap.release(key)
        self.forget(key)

    def fill(self, asks: Sequence[Ask], target: int) -> dict[str, Any]:
        lat: list[int] = []
        pending = 0
        used = 0
        t0 = time.perf_counter()
        for ask in asks:
            if len(self.held) >= target:
                break
            used += 1
            d, ns, _ = self.decide(to_request(ask))
            lat.append(ns)
            pending += d.placement is None
        wall = time.perf_counter() - t0
        lat.sort()
        return {
            "requests": used,
            "placed": used - pending,
            "pending": pending,
            "held": len(self.held),
            "wall_s": round(wall, 3),
            "decisions_per_s": round(len(lat) / (sum(lat) / 1e9)) if lat else None,
            "p50_ms": round(_pct(lat, 0.5), 4),
            "p99_ms": round(_pct(lat, 0.99), 4),
            "max_ms": round(lat[-1] / 1e6, 3) if lat else None,
        }

    def steady(self, asks: Sequence[Ask]) -> dict[str, Any]:
        reqs = [to_request(a) for a in asks]
        lat: list[int] = []
        cpu: list[int] = []
        pending = 0
        kinds: dict[str, list[int]] = {"whole": [], "mig": [], "shared": [], "pending": []}
        t0 = time.perf_counter()
        for req in reqs:
            self.depart()
            d, ns, c = self.decide(req)
            lat.append(ns)
            cpu.append(c)
            if d.placement is None:
                pending += 1
                kinds["pending"].append(ns)
            elif req.gpus.mig_profile is not None:
                kinds["mig"].append(ns)
            elif req.gpus.share_milli is not None:
                kinds["shared"].append(ns)
            else:
                kinds["whole"].append(ns)
        wall = time.perf_counter() - t0
        lat.sort()
        cpu.sort()
        return {
            "decisions": len(lat),
            "pending": pending,
            "decisions_per_s": len(lat) / (sum(lat) / 1e9),
            "loop_per_s": len(lat) / wall,
            "p50_ms": _pct(lat, 0.5),
            "p99_ms": _pct(lat, 0.99),
            "max_ms": lat[-1] / 1e6,
            "cpu_decisions_per_s": len(cpu) / (sum(cpu) / 1e9),
            "cpu_p50_ms": _pct(cpu, 0.5),
            "cpu_p99_ms": _pct(cpu, 0.99),
            "p99_ms_by_kind": {k: round(_pct(sorted(v), 0.99), 4) for k, v in kinds.items() if v},
        }

    def failover(self, fraction: float) -> dict[str, Any]:
        """Fail ``fraction`` of the admitted nodes; release and re-place their workloads."""
        admitted = sorted(n for n, node in self.nodes.items() if node.state is NodeState.ADMITTED)
        victims = self.rng.sample(admitted, max(1, round(fraction * len(self.nodes))))
        t0 = time.perf_counter()
        evicted: list[tuple[int, Request]] = []
        snap = self.snap
        for name in victims:
            node = self.nodes[name]
            failed = Node(
                name,
                node.region,
                node.zone,
                certifications=node.certifications,
                state=NodeState.FAILED,
                gpus=node.gpus,
            )
            snap.upsert_node(failed)
            for key in snap.allocations_on(name):
                snap.release(key)
                evicted.append((key, self.requests[key]))
        placed = 0
        reasons: dict[str, int] = {}
        violations = 0
        for key, req in evicted:
            self.forget(key)
            d, _, _ = self.decide(req, key)
            if d.placement is not None:
                placed += 1
                certs = self.nodes[d.placement.node].certifications
                violations += any(certs.get(k) != v for k, v in req.tags.items())
            else:
                assert d.reason is not None
                reasons[d.reason] = reasons.get(d.reason, 0) + 1
        seconds = time.perf_counter() - t0
        # The failed nodes come back (not timed), so the next round starts from the same size.
        for name in victims:
            snap.upsert_node(self.nodes[name])
        return {
            "failed_nodes": len(victims),
            "evicted": len(evicted),
            "replaced": placed,
            "pending": reasons,
            "compliance_violations": violations,
            "seconds": seconds,
        }

    def reference(self, asks: Sequence[Ask]) -> dict[str, Any]:
        """The scanning reference on the same state, and whether it agrees: on the decision
        with the packing best fit (no scorer), on placed-or-pending and the reason with a
        scoring plugin (which chooses among the feasible nodes by its own score)."""
        nodes = list(self.snap.nodes())
        allocs = list(self.snap.allocations.values())
        lat = []
        agree = True
        scored = self.snap.scorer is not None
        for ask in asks:
            req = to_request(ask)
            t0 = time.perf_counter_ns()
            want = reference_place(req, nodes, allocs)
            lat.append(time.perf_counter_ns() - t0)
            got = self.snap.place(req)
            if scored:
                agree = agree and (got.placement is None) == (want.placement is None)
                agree = agree and got.reason == want.reason
            else:
                agree = agree and got == want
        return {
            "decisions": len(lat),
            "decisions_per_s": round(len(lat) / (sum(lat) / 1e9), 2) if lat else None,
            "agrees_with_snapshot": agree,
        }


def cluster_spec(entries: list[tuple[Node, dict[str, str]]]) -> Any:
    """The cluster file (``hardware.cluster_file.ClusterSpec``) of ``entries`` and the
    benchmark's tenants with their profiles, for ``load_cluster`` (bench/console.py too)."""
    from proofplane.hardware.cluster_file import ClusterSpec, NodeSpec

    return ClusterSpec(
        name="bench",
        tenants=tuple(Tenant(name, profile=_PROFILES[name]) for name, *_ in TENANTS),
        nodes=tuple(
            NodeSpec(
                Node(n.name, n.region, n.zone, gpus=n.gpus),
                n.state,
                certs if n.state is not NodeState.REGISTERED else {},
            )
            for n, certs in entries
        ),
        workloads=(),
    )


def _e2e_store(tmp: str, entries: list[tuple[Node, dict[str, str]]]) -> tuple[Any, float]:
    """A fresh SQLite file with ``entries`` loaded through ``load_cluster``; its load time."""
    from proofplane.access import SYSTEM
    from proofplane.service.cluster import load_cluster
    from proofplane.service.context import Store
    from proofplane.store import migrate

    store = Store(f"sqlite:///{Path(tmp) / 'bench.db'}")
    migrate.upgrade(store.engine)
    spec = cluster_spec(entries)
    t0 = time.perf_counter()
    load_cluster(store, SYSTEM, spec)
    return store, time.perf_counter() - t0


def _spec(ask: Ask) -> Any:
    from proofplane.service.workloads import WorkloadSpec

    return WorkloadSpec(ask.name, ask.tenant, ask.tags, ask.isolation, ask.gpus)


def run_e2e(
    entries: list[tuple[Node, dict[str, str]]], asks: Sequence[Ask], batch: int
) -> dict[str, Any]:
    """``submit_workloads`` (one write transaction per ``batch`` asks) against a fresh SQLite
    file holding ``entries``: the whole path, events and Merkle hashes included."""
    from proofplane.access import SYSTEM
    from proofplane.service.workloads import submit_workloads

    with tempfile.TemporaryDirectory(prefix="pp-bench-") as tmp:
        store, load_s = _e2e_store(tmp, entries)
        try:
            # The first transaction loads the cluster into the service's scheduler (a cache
            # miss, reported as full_view_load_ms); it is timed apart from the steady state.
            t0 = time.perf_counter()
            warm = submit_workloads(store, SYSTEM, [_spec(a) for a in asks[:batch]])
            first_s = time.perf_counter() - t0
            lat = []
            placed = sum(w.placement is not None for w in warm)
            t0 = time.perf_counter()
            for at in range(batch, len(asks), batch):
                specs = [_spec(a) for a in asks[at : at + batch]]
                t1 = time.perf_counter_ns()
                out = submit_workloads(store, SYSTEM, specs)
                lat.append(time.perf_counter_ns() - t1)
                placed += sum(w.placement is not None for w in out)
            wall = time.perf_counter() - t0
            rebuild_ms = _view_rebuild_ms(store)
            cache = _scheduler_cache_stats(store)
            db_mb = round((Path(tmp) / "bench.db").stat().st_size / 2**20, 1)
        finally:
            store.dispose()
    lat.sort()
    timed = len(asks) - batch
    return {
        "path": "service.workloads.submit_workloads (one write transaction per batch)",
        "cluster_nodes": len(entries),
        "batch_size": batch,
        "workloads": len(asks),
        "workloads_timed": timed,
        "transactions_timed": len(lat),
        "placed": placed,
        "per_s": round(timed / wall, 1) if wall else None,
        "batch_p50_ms": round(_pct(lat, 0.5), 2) if lat else None,
        "batch_p99_ms": round(_pct(lat, 0.99), 2) if lat else None,
        "first_batch_s": round(first_s, 2),
        "load_cluster_s": round(load_s, 2),
        "db_mb_before_wal_checkpoint": db_mb,
        "full_view_load_ms": rebuild_ms,
        "scheduler_cache": cache,
    }


def run_e2e_single(
    entries: list[tuple[Node, dict[str, str]]], asks: Sequence[Ask]
) -> dict[str, Any]:
    """``submit_workload`` for each ask (one write transaction per workload)."""
    from proofplane.access import SYSTEM
    from proofplane.service.workloads import submit_workload

    with tempfile.TemporaryDirectory(prefix="pp-bench-") as tmp:
        store, load_s = _e2e_store(tmp, entries)
        try:
            lat = []
            placed = 0
            t0 = time.perf_counter()
            for ask in asks:
                t1 = time.perf_counter_ns()
                w = submit_workload(store, SYSTEM, _spec(ask))
                lat.append(time.perf_counter_ns() - t1)
                placed += w.placement is not None
            wall = time.perf_counter() - t0
            cache = _scheduler_cache_stats(store)
        finally:
            store.dispose()
    lat.sort()
    return {
        "path": "service.workloads.submit_workload (one write transaction per workload)",
        "cluster_nodes": len(entries),
        "workloads": len(lat),
        "placed": placed,
        "per_s": round(len(lat) / wall, 1),
        "p50_ms": round(_pct(lat, 0.5), 2),
        "p99_ms": round(_pct(lat, 0.99), 2),
        "load_cluster_s": round(load_s, 2),
        "scheduler_cache": cache,
    }


def _scheduler_cache_stats(store: Any) -> dict[str, int] | None:
    try:
        from proofplane.service.scheduling import scheduler_cache
    except ImportError:
        return None
    cache = scheduler_cache(store.engine)
    return {"hits": getattr(cache, "hits", None), "loads": getattr(cache, "loads", None)}


def _view_rebuild_ms(store: Any) -> float | None:
    """Median time to build the service's ``ClusterView`` from the database on ``store``'s
    state (a cache miss), or None when the service no longer has one."""
    try:
        from proofplane.service.scheduling import ClusterView
    except ImportError:
        return None
    times = []
    for _ in range(5):
        with store.read() as session:
            t0 = time.perf_counter()
            assert ClusterView(session).scheduler is not None  # the view loads on first use
            times.append(time.perf_counter() - t0)
    return round(statistics.median(times) * 1e3, 2)


def _timed(label: str, fn: Callable[[], Any], verbose: bool) -> Any:
    t0 = time.perf_counter()
    out = fn()
    if verbose:
        print(f"[{label}] {time.perf_counter() - t0:.2f}s", file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object (the default)")
    ap.add_argument("--quick", action="store_true", help="a small CI-sized run")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--nodes", type=int)
    ap.add_argument("--placed", type=int, help="workloads to hold before measuring")
    ap.add_argument("--decisions", type=int, help="decisions per steady-state round")
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--failover-rounds", type=int)
    ap.add_argument("--reference", type=int, help="decisions of the scanning reference")
    ap.add_argument("--e2e-nodes", type=int, help="cluster of the batch e2e (default: --nodes)")
    ap.add_argument("--e2e-workloads", type=int)
    ap.add_argument("--e2e-batch", type=int, help="workloads per transaction (default 100)")
    ap.add_argument("--e2e-single-nodes", type=int)
    ap.add_argument("--e2e-single-workloads", type=int)
    ap.add_argument("--no-e2e", action="store_true")
    ap.add_argument(
        "--no-gc-freeze",
        action="store_true",
        help="leave the filled snapshot to the cyclic GC (default: gc.freeze() after the fill, "
        "as a long-lived service would after loading its snapshot; one extra round without "
        "it is always measured)",
    )
    ap.add_argument(
        "--scorer",
        default=DEFAULT_SCORER,
        choices=[*SCORERS, "packing"],
        help="the snapshot's scoring plugin (default: the server's, proofplane); packing: the "
        "bucket index's best fit without a plugin",
    )
    ap.add_argument("-v", "--verbose", action="store_true", help="phase timings on stderr")
    args = ap.parse_args(argv)
    q = args.quick
    n_nodes = args.nodes or (200 if q else 5000)
    target = args.placed or (2000 if q else 50_000)
    n_dec = args.decisions or (1000 if q else 10_000)
    rounds = args.rounds or (2 if q else 5)
    fo_rounds = args.failover_rounds or (2 if q else 5)
    n_ref = args.reference if args.reference is not None else (5 if q else 10)
    e2e_nodes = args.e2e_nodes or n_nodes
    e2e_batch = args.e2e_batch or (50 if q else 100)
    e2e_n = args.e2e_workloads or (300 if q else 10_000)
    single_nodes = args.e2e_single_nodes or (20 if q else 100)
    single_n = args.e2e_single_workloads or (30 if q else 200)
    v = args.verbose

    rng = random.Random(args.seed)
    entries = _timed("cluster", lambda: build_cluster(rng, n_nodes), v)
    nodes = [
        Node(n.name, n.region, n.zone, certifications=c, state=n.state, gpus=n.gpus)
        for n, c in entries
    ]
    rss_before = _rss_mb()
    bench = Bench(nodes, args.seed + 1, None if args.scorer == "packing" else args.scorer)
    # Enough asks for the fill even when many end pending.
    fill = _timed("fill", lambda: bench.fill(make_asks(rng, target * 3, "f"), target), v)
    gc.collect()
    rss = _rss_mb()
    if not args.no_gc_freeze:
        gc.freeze()
    steady = []
    for r in range(rounds):
        asks = make_asks(rng, n_dec, f"s{r}-")
        steady.append(_timed(f"steady {r}", lambda a=asks: bench.steady(a), v))
    gc.unfreeze()
    unfrozen = _timed("steady, no gc.freeze", lambda: bench.steady(make_asks(rng, n_dec, "u")), v)
    failovers = [_timed(f"failover {r}", lambda: bench.failover(0.01), v) for r in range(fo_rounds)]
    ref = _timed("reference", lambda: bench.reference(make_asks(rng, n_ref, "r")), v)
    e2e = e2e_single = None
    if not args.no_e2e:
        e2e_entries = (
            entries if e2e_nodes == n_nodes else build_cluster(random.Random(args.seed), e2e_nodes)
        )
        e2e_asks = make_asks(random.Random(args.seed + 2), e2e_n, "e")
        e2e = _timed("e2e", lambda: run_e2e(e2e_entries, e2e_asks, e2e_batch), v)
        single_entries = build_cluster(random.Random(args.seed), single_nodes)
        single_asks = make_asks(random.Random(args.seed + 3), single_n, "e")
        e2e_single = _timed("e2e single", lambda: run_e2e_single(single_entries, single_asks), v)

    def med(key: str, rows: list[dict[str, Any]]) -> float:
        return statistics.median(row[key] for row in rows)

    dps = med("decisions_per_s", steady)
    doc: dict[str, Any] = {
        "benchmark": "placement decisions (place + reserve) on a ClusterSnapshot, one thread",
        "decisions_per_s": round(dps),
        "p50_ms": round(med("p50_ms", steady), 4),
        "p99_ms": round(med("p99_ms", steady), 4),
        "failover_s": round(med("seconds", failovers), 4),
        "rss_mb": rss,
        "e2e_per_s": e2e["per_s"] if e2e else None,
        "e2e_cluster_nodes": e2e["cluster_nodes"] if e2e else None,
        "e2e_batch_size": e2e["batch_size"] if e2e else None,
        "e2e_single_per_s": e2e_single["per_s"] if e2e_single else None,
        "e2e_single_cluster_nodes": e2e_single["cluster_nodes"] if e2e_single else None,
        "targets": {
            "decisions_per_s": 5000,
            "p99_ms": 2.0,
            "failover_s": 1.0,
            "rss_mb": 1024,
            "e2e_per_s": 1000,
        },
        "params": {
            "quick": q,
            "seed": args.seed,
            "nodes": n_nodes,
            "gpus_per_node": GPUS_PER_NODE,
            "gpu_model": MODEL,
            "mig_nodes": n_nodes // 2,
            "zones": ZONES,
            "tenants": len(TENANTS),
            "placed_target": target,
            "decisions_per_round": n_dec,
            "rounds": rounds,
            "failover_rounds": fo_rounds,
            "failover_fraction": 0.01,
            "gc_freeze": not args.no_gc_freeze,
        },
        "machine": machine(),
        "scorer": args.scorer,
        "snapshot_build_s": round(bench.build_s, 3),
        "rss_mb_before_snapshot": rss_before,
        "peak_rss_mb": _peak_rss_mb(),
        "fill": fill,
        "steady": {
            "decisions_per_s_per_round": [round(s["decisions_per_s"]) for s in steady],
            "loop_per_s_median": round(med("loop_per_s", steady)),
            "p99_ms_per_round": [round(s["p99_ms"], 4) for s in steady],
            "max_ms_per_round": [round(s["max_ms"], 3) for s in steady],
            "pending_per_round": [s["pending"] for s in steady],
            "p99_ms_by_kind_round0": steady[0]["p99_ms_by_kind"],
            "cpu_decisions_per_s": round(med("cpu_decisions_per_s", steady)),
            "cpu_p50_ms": round(med("cpu_p50_ms", steady), 4),
            "cpu_p99_ms": round(med("cpu_p99_ms", steady), 4),
            "without_gc_freeze": {
                k: round(unfrozen[k], 4)
                for k in (
                    "decisions_per_s",
                    "p50_ms",
                    "p99_ms",
                    "cpu_decisions_per_s",
                    "cpu_p99_ms",
                )
            },
        },
        "failover": {
            "seconds_per_round": [round(f["seconds"], 4) for f in failovers],
            "rounds": [{k: v for k, v in f.items() if k != "seconds"} for f in failovers],
        },
        "reference": {
            **ref,
            "speedup": round(dps / ref["decisions_per_s"]) if ref["decisions_per_s"] else None,
        },
        "e2e": e2e,
        "e2e_single": e2e_single,
    }
    print(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
