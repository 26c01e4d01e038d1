"""The incremental snapshot against the scanning reference.

Random sequences of upsert / remove / reserve / release / place run on a ``ClusterSnapshot``;
after every step the snapshot and ``reference_place`` (the first engine, which rebuilds usage
and scans every node) answer the same requests on the same nodes and allocations, and must give
identical decisions: placement, reason, message and rejection counts. Reservations include
the snapshot's own placements and arbitrary ones (over-booked GPUs, unknown nodes, several
dedicated owners), so the indexes are checked in states a correct scheduler never makes too.
Every search strategy is forced in turn through ``Tuning``.
"""

from __future__ import annotations

import random
from collections.abc import Hashable, Iterable

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from proofplane.hardware.skus import SKUS
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
from proofplane.schedule.placer import Allocation, Request
from proofplane.schedule.reference import reference_place
from proofplane.schedule.snapshot import ClusterSnapshot, Tuning

NODE_NAMES = [f"n{i}" for i in range(7)]
TENANTS = ["t1", "t2", "t3"]
CERTS = {"hipaa": ["true", "false"], "gdpr-zone": ["frankfurt", "paris"], "pci-dss": ["isolated"]}
MODELS = sorted(SKUS)
# Valid layouts by position in a SKU's profile family (1g, 1g+me, 1g-2x, 2g, 3g, 4g, 7g).
LAYOUTS = [
    [(4, 0), (4, 4)],
    [(0, s) for s in range(7)],
    [(5, 0), (3, 4), (0, 6)],
    [(6, 0)],
    [(3, 0), (3, 2), (3, 4)],
]
PROFILES = sorted({p.name for sku in SKUS.values() for p in sku.mig_profiles})

TUNINGS = {
    "default": Tuning(),
    "always-walk": Tuning(scan_factor=0.0, walk_budget=10**9, walk_budget_factor=0.0),
    "always-scan": Tuning(scan_factor=float("inf")),
    "walk-gives-up": Tuning(scan_factor=0.0, walk_budget=0, walk_budget_factor=0.0),
}


def _layout(model: str, which: int) -> tuple[MigInstance, ...]:
    profiles = SKUS[model].mig_profiles
    return tuple(MigInstance(profiles[p].name, s) for p, s in LAYOUTS[which])


certs_st = st.fixed_dictionaries({}, optional={k: st.sampled_from(v) for k, v in CERTS.items()})


@st.composite
def node_st(draw, name: str) -> Node:
    gpus = []
    for i in range(draw(st.integers(0, 4))):
        model = draw(st.sampled_from(MODELS))
        layout = draw(st.none() | st.integers(0, len(LAYOUTS) - 1))
        gpus.append(
            Gpu(
                i,
                f"GPU-{name}-{i}",
                model,
                SKUS[model].memory_mb,
                mig_enabled=layout is not None,
                mig_instances=() if layout is None else _layout(model, layout),
            )
        )
    state = draw(st.sampled_from([NodeState.ADMITTED] * 4 + list(NodeState)))
    return Node(name, "r", "z", certifications=draw(certs_st), state=state, gpus=tuple(gpus))


@st.composite
def request_st(draw, nodes: list[Node]) -> Request:
    tenant = draw(st.sampled_from(TENANTS))
    tags = draw(st.just({}) | st.sampled_from([dict(n.certifications) for n in nodes] or [{}]))
    tags = draw(st.just(tags) | certs_st)
    model = draw(st.none() | st.none() | st.sampled_from(MODELS))
    shape = draw(st.sampled_from(["whole", "whole", "mig", "share", "odd"]))
    if shape == "whole":
        g = GpuRequest(draw(st.integers(1, 4)), model)
        iso = draw(
            st.sampled_from([IsolationLevel.EXCLUSIVE_GPU] * 2 + [IsolationLevel.DEDICATED_NODE])
        )
    elif shape == "mig":
        carved = sorted({i.profile for n in nodes for g in n.gpus for i in g.mig_instances})
        profile = draw(st.sampled_from(carved or PROFILES) | st.sampled_from(PROFILES))
        g = GpuRequest(draw(st.integers(1, 3)), model, mig_profile=profile)
        iso = draw(st.sampled_from([IsolationLevel.MIG] * 3 + [IsolationLevel.DEDICATED_NODE]))
    elif shape == "share":
        share = draw(st.sampled_from([100, 250, 500, 999]) | st.integers(1, 1001))
        g = GpuRequest(1, model, share_milli=share)
        iso = draw(st.sampled_from([IsolationLevel.SHARED] * 3 + [IsolationLevel.DEDICATED_NODE]))
    else:  # shapes the service refuses; the engines must still agree
        g = draw(
            st.sampled_from(
                [
                    GpuRequest(0, model),
                    GpuRequest(0, model, mig_profile=draw(st.sampled_from(PROFILES))),
                    GpuRequest(1, model, share_milli=0),
                ]
            )
        )
        iso = draw(st.sampled_from(list(IsolationLevel)))
    return Request(
        "w", tenant, tags, iso, g, co_residency=draw(st.sampled_from([True] * 2 + [False]))
    )


@st.composite
def device_st(draw) -> PlacedDevice:
    index = draw(st.integers(0, 4))
    kind = draw(st.sampled_from(["whole", "mig", "share"]))
    if kind == "mig":
        return PlacedDevice(
            index, "x", draw(st.sampled_from(PROFILES)), mig_start=draw(st.integers(0, 7))
        )
    if kind == "share":
        return PlacedDevice(index, "x", share_milli=draw(st.integers(1, 999)))
    return PlacedDevice(index, "x")


@st.composite
def arbitrary_allocation_st(draw) -> Allocation:
    node = draw(st.sampled_from([*NODE_NAMES, "ghost"]))
    devices = tuple(draw(st.lists(device_st(), max_size=3)))
    return Allocation(
        "arb",
        draw(st.sampled_from(TENANTS)),
        draw(st.sampled_from(list(IsolationLevel))),
        Placement(node, devices),
        draw(st.booleans()),
    )


class SnapshotMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.snap = ClusterSnapshot()
        self.nodes: dict[str, Node] = {}
        self.allocs: dict[Hashable, Allocation] = {}
        self.next_key = 0

    @initialize(tuning=st.sampled_from(sorted(TUNINGS)), data=st.data())
    def start(self, tuning: str, data: st.DataObject) -> None:
        nodes = [data.draw(node_st(n)) for n in NODE_NAMES[: data.draw(st.integers(0, 5))]]
        self.nodes = {n.name: n for n in nodes}
        self.snap = ClusterSnapshot(nodes, tuning=TUNINGS[tuning])

    def _check(self, data: st.DataObject, n: int = 2) -> None:
        nodes = list(self.nodes.values())
        for _ in range(n):
            req = data.draw(request_st(nodes))
            got = self.snap.place(req)
            want = reference_place(req, nodes, self.allocs.values())
            assert got == want, (req, got, want)

    def _reserve(self, key: Hashable, alloc: Allocation) -> None:
        self.snap.reserve(key, alloc)
        self.allocs.pop(key, None)  # a key reserved again moves to the end
        self.allocs[key] = alloc

    @rule(data=st.data())
    def upsert(self, data: st.DataObject) -> None:
        node = data.draw(node_st(data.draw(st.sampled_from(NODE_NAMES))))
        self.snap.upsert_node(node)
        self.nodes[node.name] = node
        self._check(data)

    @rule(data=st.data())
    def change_state_or_certs(self, data: st.DataObject) -> None:
        if not self.nodes:
            return
        name = data.draw(st.sampled_from(sorted(self.nodes)))
        old = self.nodes[name]
        node = Node(
            name,
            "r",
            "z",
            certifications=data.draw(certs_st),
            state=data.draw(st.sampled_from(list(NodeState))),
            gpus=old.gpus,
        )
        self.snap.upsert_node(node)
        self.nodes[name] = node
        self._check(data)

    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(NODE_NAMES))
        self.snap.remove_node(name)
        self.nodes.pop(name, None)
        self._check(data)

    @rule(data=st.data())
    def place_and_reserve(self, data: st.DataObject) -> None:
        """What the scheduler does: place, and take what was given."""
        for _ in range(data.draw(st.integers(1, 4))):
            nodes = list(self.nodes.values())
            req = data.draw(request_st(nodes))
            got = self.snap.place(req)
            assert got == reference_place(req, nodes, self.allocs.values())
            if got.placement is not None:
                key = self.next_key
                self.next_key += 1
                alloc = Allocation(
                    req.workload, req.tenant, req.isolation, got.placement, req.co_residency
                )
                self._reserve(key, alloc)
        self._check(data)

    @rule(data=st.data(), alloc=arbitrary_allocation_st())
    def reserve_arbitrary(self, data: st.DataObject, alloc: Allocation) -> None:
        reuse = self.allocs and data.draw(st.booleans())
        key = data.draw(st.sampled_from(sorted(self.allocs))) if reuse else self.next_key
        self.next_key += 1
        self._reserve(key, alloc)
        self._check(data)

    @precondition(lambda self: bool(self.allocs))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.allocs)))
        assert self.snap.release(key) == self.allocs.pop(key)
        self._check(data)

    @rule(data=st.data())
    def release_unknown(self, data: st.DataObject) -> None:
        assert self.snap.release(("nobody", self.next_key)) is None
        self._check(data, 1)

    @invariant()
    def same_allocations(self) -> None:
        assert list(self.snap.allocations.items()) == list(self.allocs.items())
        for name in NODE_NAMES:
            mine = [k for k, a in self.allocs.items() if a.placement.node == name]
            assert self.snap.allocations_on(name) == mine


SnapshotMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestSnapshotAgainstReference = SnapshotMachine.TestCase


# --------------------------------------------------------------------------- larger clusters


def _random_node(rng: random.Random, name: str) -> Node:
    gpus = []
    mig_node = rng.random() < 0.5
    for i in range(rng.choice([2, 4, 8, 8])):
        model = rng.choice(["H100-80GB", "H100-80GB", "A100-80GB"])
        layout = rng.randrange(len(LAYOUTS)) if mig_node and rng.random() < 0.8 else None
        gpus.append(
            Gpu(
                i,
                f"GPU-{name}-{i}",
                model,
                SKUS[model].memory_mb,
                mig_enabled=layout is not None,
                mig_instances=() if layout is None else _layout(model, layout),
            )
        )
    certs = {}
    if rng.random() < 0.3:
        certs["hipaa"] = "true"
    if rng.random() < 0.4:
        certs["gdpr-zone"] = rng.choice(["frankfurt", "paris"])
    if rng.random() < 0.05:
        certs["pci-dss"] = "isolated"
    state = NodeState.ADMITTED if rng.random() < 0.9 else NodeState.CORDONED
    return Node(name, "r", "z", certifications=certs, state=state, gpus=tuple(gpus))


def assert_co_residency(allocs: Iterable[Allocation]) -> None:
    """No physical GPU holds slices or shares of two tenants unless both allow it."""
    on_gpu: dict[tuple[str, int], list[Allocation]] = {}
    for a in allocs:
        for d in a.placement.devices:
            if d.mig_start is not None or d.share_milli is not None:
                on_gpu.setdefault((a.placement.node, d.gpu_index), []).append(a)
    for where, holders in on_gpu.items():
        for a in holders:
            for b in holders:
                if a.tenant != b.tenant:
                    assert a.co_residency and b.co_residency, (where, a, b)


def _place_as_reference(
    snap: ClusterSnapshot,
    nodes: dict[str, Node],
    allocs: dict[Hashable, Allocation],
    key: int,
    req: Request,
    *context: object,
) -> bool:
    """Place ``req`` on the snapshot, which must answer as ``reference_place`` does; a
    placement is reserved under ``key`` in both the snapshot and ``allocs``."""
    got = snap.place(req)
    assert got == reference_place(req, nodes.values(), allocs.values()), (*context, key, req)
    if got.placement is None:
        return False
    alloc = Allocation(req.workload, req.tenant, req.isolation, got.placement, req.co_residency)
    snap.reserve(key, alloc)
    allocs[key] = alloc
    return True


def _random_request(rng: random.Random, i: int) -> Request:
    tags: dict[str, str] = {}
    if rng.random() < 0.3:
        tags["hipaa"] = "true"
    if rng.random() < 0.2:
        tags["gdpr-zone"] = rng.choice(["frankfurt", "paris"])
    if rng.random() < 0.03:
        tags["pci-dss"] = "isolated"
    model = rng.choice([None, None, None, "H100-80GB", "A100-80GB"])
    r = rng.random()
    if r < 0.4:
        g = GpuRequest(rng.choice([1, 1, 2, 4, 8]), model)
        iso = IsolationLevel.DEDICATED_NODE if rng.random() < 0.05 else IsolationLevel.EXCLUSIVE_GPU
    elif r < 0.75:
        profile = rng.choice(["1g.10gb", "3g.40gb", "2g.20gb", "4g.40gb", "1g.20gb"])
        g = GpuRequest(rng.choice([1, 1, 2]), model, mig_profile=profile)
        iso = IsolationLevel.MIG
    else:
        g = GpuRequest(1, model, share_milli=rng.choice([100, 250, 500, 750]))
        iso = IsolationLevel.SHARED
    tenant = rng.choice(TENANTS + ["t4", "t5"])
    # t4 refuses co-residency for all its work; others now and then for one workload
    private = tenant == "t4" or rng.random() < 0.05
    return Request(f"w{i}", tenant, tags, iso, g, co_residency=not private)


@pytest.mark.parametrize("tuning", sorted(TUNINGS))
@pytest.mark.parametrize("seed", [1, 2])
def test_large_cluster_stream_matches_reference(tuning: str, seed: int) -> None:
    """Hundreds of nodes, so buckets hold many names, levels are pruned and compliant sets
    are large or tiny; placements, releases and node failures interleave."""
    rng = random.Random(seed)
    nodes = {f"node-{i:03d}": _random_node(rng, f"node-{i:03d}") for i in range(150)}
    snap = ClusterSnapshot(nodes.values(), tuning=TUNINGS[tuning])
    allocs: dict[Hashable, Allocation] = {}
    placed = pending = 0
    for i in range(700):
        req = _random_request(rng, i)
        if _place_as_reference(snap, nodes, allocs, i, req):
            placed += 1
            assert_co_residency(allocs.values())
        else:
            pending += 1
        if allocs and rng.random() < 0.15:
            key = rng.choice(list(allocs))
            assert snap.release(key) == allocs.pop(key)
        if rng.random() < 0.02:  # a node fails: its work is released
            name = rng.choice(sorted(nodes))
            node = nodes[name]
            nodes[name] = Node(
                name,
                "r",
                "z",
                certifications=node.certifications,
                state=NodeState.FAILED,
                gpus=node.gpus,
            )
            snap.upsert_node(nodes[name])
            for key in snap.allocations_on(name):
                assert snap.release(key) == allocs.pop(key)
    assert placed > 200 and pending > 20  # both paths were exercised


def test_release_is_the_inverse_of_reserve() -> None:
    rng = random.Random(7)
    nodes = [_random_node(rng, f"node-{i:02d}") for i in range(40)]
    fresh = ClusterSnapshot(nodes)
    snap = ClusterSnapshot(nodes)
    keys = []
    for i in range(200):
        d = snap.place(_random_request(rng, i))
        if d.placement is not None:
            snap.reserve(i, Allocation("w", "t1", IsolationLevel.MIG, d.placement))
            keys.append(i)
    assert keys
    for key in keys:
        snap.release(key)
    for attr in ("_sig", "_vacant", "_occupied", "_owner", "_owned", "_sole", "_usage", "_allocs"):
        assert getattr(snap, attr) == getattr(fresh, attr), attr
    assert snap._buckets.classes == fresh._buckets.classes
    assert snap._vacant_buckets.classes == fresh._vacant_buckets.classes


def test_churn_with_dedicated_tenants_models_and_certification_changes() -> None:
    """The indexes that only matter at scale, under churn: many dedicated-node owners (their
    nodes leave the shared buckets), pinned GPU models that some nodes lack, shares and MIG
    slices packed onto warm GPUs, and certifications granted and revoked, nodes cordoned,
    removed and re-added while cached compliant sets are live."""
    rng = random.Random(11)
    models = ["H100-80GB", "A100-80GB", "H200-141GB"]

    def node(name: str) -> Node:
        gpus = []
        mig_node = rng.random() < 0.5
        model = rng.choice(models)
        for i in range(rng.choice([1, 2, 4, 8])):
            layout = rng.randrange(len(LAYOUTS)) if mig_node else None
            gpus.append(
                Gpu(
                    i,
                    f"GPU-{name}-{i}",
                    model,
                    SKUS[model].memory_mb,
                    mig_enabled=layout is not None,
                    mig_instances=() if layout is None else _layout(model, layout),
                )
            )
        certs = {k: rng.choice(v) for k, v in CERTS.items() if rng.random() < 0.5}
        state = NodeState.ADMITTED if rng.random() < 0.9 else NodeState.CORDONED
        return Node(name, "r", "z", certifications=certs, state=state, gpus=tuple(gpus))

    def request(i: int) -> Request:
        tags = {k: rng.choice(v) for k, v in CERTS.items() if rng.random() < 0.2}
        model = rng.choice([None, None, *models, "B200-180GB"])
        r = rng.random()
        if r < 0.35:
            g = GpuRequest(rng.choice([1, 1, 2, 4]), model)
            iso = (
                IsolationLevel.DEDICATED_NODE
                if rng.random() < 0.4
                else IsolationLevel.EXCLUSIVE_GPU
            )
        elif r < 0.7:
            profile = rng.choice(["1g.10gb", "1g.18gb", "3g.40gb", "2g.20gb", "3g.71gb"])
            g = GpuRequest(rng.choice([1, 1, 2, 3]), model, mig_profile=profile)
            iso = IsolationLevel.DEDICATED_NODE if rng.random() < 0.15 else IsolationLevel.MIG
        else:
            g = GpuRequest(1, model, share_milli=rng.choice([100, 300, 500, 900]))
            iso = IsolationLevel.DEDICATED_NODE if rng.random() < 0.15 else IsolationLevel.SHARED
        tenant = rng.choice([*TENANTS, "t4", "t5", "t6"])
        return Request(f"w{i}", tenant, tags, iso, g, co_residency=tenant not in ("t1", "t6"))

    for tuning in sorted(TUNINGS):
        nodes = {f"node-{i:03d}": node(f"node-{i:03d}") for i in range(90)}
        snap = ClusterSnapshot(nodes.values(), tuning=TUNINGS[tuning])
        allocs: dict[Hashable, Allocation] = {}
        placed = pending = 0
        for i in range(450):
            if _place_as_reference(snap, nodes, allocs, i, request(i), tuning):
                placed += 1
            else:
                pending += 1
            if allocs and rng.random() < 0.2:
                key = rng.choice(list(allocs))
                assert snap.release(key) == allocs.pop(key)
            r = rng.random()
            name = rng.choice(sorted(nodes))
            if r < 0.04:  # a certification granted or revoked, or the state flips
                old = nodes[name]
                certs = dict(old.certifications)
                key_, values = rng.choice(sorted(CERTS.items()))
                if key_ in certs and rng.random() < 0.5:
                    del certs[key_]
                else:
                    certs[key_] = rng.choice(values)
                state = rng.choice([NodeState.ADMITTED, NodeState.ADMITTED, NodeState.CORDONED])
                nodes[name] = Node(name, "r", "z", certifications=certs, state=state, gpus=old.gpus)
                snap.upsert_node(nodes[name])
            elif r < 0.05:  # removed (its work stays reserved) and, later, a new node
                snap.remove_node(name)
                del nodes[name]
            elif r < 0.06:
                fresh = f"node-{100 + i:03d}"
                nodes[fresh] = node(fresh)
                snap.upsert_node(nodes[fresh])
        assert placed > 150 and pending > 30, (tuning, placed, pending)
        assert list(snap.allocations.items()) == list(allocs.items())
