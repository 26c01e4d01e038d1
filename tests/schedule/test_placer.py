"""The placement engine: one test per rule, then a property test over random clusters."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proofplane.hardware.skus import SKUS, layout_errors
from proofplane.model import (
    Gpu,
    GpuRequest,
    IsolationLevel,
    MigInstance,
    Node,
    NodeState,
    PlacedDevice,
    Placement,
    missing_tags,
)
from proofplane.schedule.placer import (
    COMPLIANCE_FILTERS,
    Allocation,
    Decision,
    Request,
    place,
)

# the test's own notion of one whole GPU, independent of the module under test
ONE_GPU = 1000
TWO_3G = (MigInstance("3g.40gb", 0), MigInstance("3g.40gb", 4))
SEVEN_1G = tuple(MigInstance("1g.10gb", s) for s in range(7))


def make_node(
    name: str,
    n: int = 8,
    *,
    model: str = "H100-80GB",
    state: NodeState = NodeState.ADMITTED,
    certs: Mapping[str, str] | None = None,
    mig: Mapping[int, Sequence[MigInstance]] | None = None,
    gpus: Sequence[Gpu] | None = None,
) -> Node:
    mig = mig or {}
    if gpus is None:
        gpus = [
            Gpu(
                index=i,
                uuid=f"GPU-{name}-{i}",
                model=model,
                memory_mb=SKUS[model].memory_mb,
                mig_enabled=i in mig,
                mig_instances=tuple(mig.get(i, ())),
            )
            for i in range(n)
        ]
    return Node(
        name, "eu", "eu-1a", certifications=dict(certs or {}), state=state, gpus=tuple(gpus)
    )


def make_request(
    tenant: str = "t1",
    *,
    name: str = "w",
    tags: Mapping[str, str] | None = None,
    isolation: IsolationLevel | None = None,
    count: int = 1,
    model: str | None = None,
    mig_profile: str | None = None,
    share: int | None = None,
) -> Request:
    g = GpuRequest(count, model, mig_profile, share)
    return Request(name, tenant, dict(tags or {}), isolation or g.natural_isolation, g)


def as_alloc(req: Request, decision: Decision) -> Allocation:
    assert decision.placement is not None, decision
    return Allocation(req.workload, req.tenant, req.isolation, decision.placement)


def place_all(reqs: Sequence[Request], nodes: Sequence[Node]) -> tuple[list[Decision], list]:
    allocs: list[Allocation] = []
    decisions = []
    for r in reqs:
        d = place(r, nodes, allocs)
        decisions.append(d)
        if d.placement is not None:
            allocs.append(as_alloc(r, d))
    return decisions, allocs


def whole(node: str, *indexes: int) -> Placement:
    return Placement(node, tuple(PlacedDevice(i, f"GPU-{node}-{i}") for i in indexes))


def alloc(tenant: str, isolation: IsolationLevel, placement: Placement) -> Allocation:
    return Allocation(f"{tenant}-work", tenant, isolation, placement)


# --------------------------------------------------------------------------- node state


@pytest.mark.parametrize("state", [s for s in NodeState if s is not NodeState.ADMITTED])
def test_node_not_admitted(state):
    nodes = [make_node("a", state=state), make_node("b", state=state)]
    d = place(make_request(), nodes, [])
    assert d.placement is None
    assert d.reason == "no_compliant_capacity"
    assert d.rejections == {"node_not_admitted": 2}


def test_only_admitted_node_is_used():
    nodes = [
        make_node("a", state=NodeState.CORDONED),
        make_node("b", state=NodeState.QUARANTINED),
        make_node("c"),
        make_node("d", state=NodeState.REGISTERED),
    ]
    d = place(make_request(count=8), nodes, [])
    assert d.placement is not None
    assert d.placement.node == "c"
    assert d.reason is None
    assert d.rejections == {}


def test_no_nodes_at_all():
    d = place(make_request(), [], [])
    assert d.placement is None
    assert d.reason == "no_compliant_capacity"
    assert d.rejections == {}


# --------------------------------------------------------------------------- certification


def test_hipaa_request_never_lands_on_uncertified_node():
    nodes = [make_node("empty-uncertified"), make_node("other", certs={"gdpr-zone": "paris"})]
    d = place(make_request(tags={"hipaa": "true"}), nodes, [])
    assert d.placement is None
    assert d.reason == "no_compliant_capacity"
    assert d.rejections == {"missing_certification": 2}
    assert "2 nodes" in d.message


def test_certification_must_match_value_and_every_tag():
    nodes = [
        make_node("a", certs={"hipaa": "false"}),
        make_node("b", certs={"gdpr-zone": "paris", "hipaa": "true"}),
        make_node("c", certs={"gdpr-zone": "frankfurt"}),
    ]
    d = place(make_request(tags={"hipaa": "true", "gdpr-zone": "frankfurt"}), nodes, [])
    assert d.placement is None
    assert d.reason == "no_compliant_capacity"
    assert d.rejections == {"missing_certification": 3}


def test_certified_node_wins_over_better_fitting_uncertified_one():
    # best fit would prefer the 1-GPU node; it lacks the certification
    nodes = [make_node("a-small", 1), make_node("z-big", 8, certs={"hipaa": "true", "x": "y"})]
    d = place(make_request(tags={"hipaa": "true"}), nodes, [])
    assert d.placement is not None
    assert d.placement.node == "z-big"
    # without tags the better fit wins
    d = place(make_request(), nodes, [])
    assert d.placement.node == "a-small"


def test_compliance_and_state_rejections_both_mean_no_compliant_capacity():
    nodes = [
        make_node("a", state=NodeState.CORDONED, certs={"hipaa": "true"}),
        make_node("b"),
    ]
    d = place(make_request(tags={"hipaa": "true"}), nodes, [])
    assert d.reason == "no_compliant_capacity"
    assert d.rejections == {"node_not_admitted": 1, "missing_certification": 1}


# --------------------------------------------------------------------------- GPU model


def test_gpu_model_unavailable():
    nodes = [make_node("a"), make_node("b", model="A100-80GB")]
    d = place(make_request(model="B200-180GB"), nodes, [])
    assert d.placement is None
    assert d.reason == "insufficient_capacity"
    assert d.rejections == {"gpu_model_unavailable": 2}


def test_gpu_model_pin_picks_matching_gpus_on_mixed_node():
    gpus = [
        Gpu(0, "GPU-m-0", "A100-80GB", 81_920),
        Gpu(1, "GPU-m-1", "H100-80GB", 81_920),
        Gpu(2, "GPU-m-2", "A100-80GB", 81_920),
        Gpu(3, "GPU-m-3", "H100-80GB", 81_920),
    ]
    nodes = [make_node("m", gpus=gpus)]
    d = place(make_request(count=2, model="H100-80GB"), nodes, [])
    assert d.placement is not None
    assert {dev.gpu_index for dev in d.placement.devices} == {1, 3}
    d = place(make_request(count=3, model="H100-80GB"), nodes, [])
    assert d.placement is None
    assert d.rejections == {"insufficient_gpu_capacity": 1}
    d = place(make_request(share=100, model="A100-80GB"), nodes, [])
    assert d.placement.devices[0].gpu_index in (0, 2)


# --------------------------------------------------------------------------- tenancy


def test_node_dedicated_to_other_tenant():
    nodes = [make_node("a")]
    allocs = [alloc("t1", IsolationLevel.DEDICATED_NODE, whole("a", 0))]
    for req in [
        make_request("t2"),
        make_request("t2", share=10),
        make_request("t2", isolation=IsolationLevel.DEDICATED_NODE),
    ]:
        d = place(req, nodes, allocs)
        assert d.placement is None
        assert d.reason == "insufficient_capacity"
        assert d.rejections == {"node_dedicated_to_other_tenant": 1}
    # the owner may add more work
    d = place(make_request("t1"), nodes, allocs)
    assert d.placement is not None
    assert d.placement.devices[0].gpu_index != 0


def test_dedicated_request_refuses_node_shared_with_other_tenant():
    nodes = [make_node("a")]
    allocs = [
        alloc("t1", IsolationLevel.SHARED, Placement("a", (PlacedDevice(0, "x", None, None, 10),)))
    ]
    d = place(make_request("t2", isolation=IsolationLevel.DEDICATED_NODE), nodes, allocs)
    assert d.placement is None
    assert d.reason == "insufficient_capacity"
    assert d.rejections == {"node_shared_with_other_tenant": 1}
    # same tenant: fine
    d = place(make_request("t1", isolation=IsolationLevel.DEDICATED_NODE), nodes, allocs)
    assert d.placement is not None
    # non-dedicated request from another tenant: fine
    d = place(make_request("t2"), nodes, allocs)
    assert d.placement is not None


def test_dedicated_request_goes_to_node_without_other_tenants():
    nodes = [make_node("a"), make_node("b")]
    allocs = [alloc("t1", IsolationLevel.EXCLUSIVE_GPU, whole("a", 0))]
    d = place(make_request("t2", isolation=IsolationLevel.DEDICATED_NODE), nodes, allocs)
    assert d.placement is not None
    assert d.placement.node == "b"
    # and once b is dedicated to t2, t1 can only use a
    allocs.append(as_alloc(make_request("t2", isolation=IsolationLevel.DEDICATED_NODE), d))
    d = place(make_request("t1", count=7), nodes, allocs)
    assert d.placement.node == "a"
    d = place(make_request("t1", count=2), nodes, [*allocs, as_alloc(make_request("t1"), d)])
    assert d.placement is None
    assert d.rejections == {"insufficient_gpu_capacity": 1, "node_dedicated_to_other_tenant": 1}


# --------------------------------------------------------------------------- capacity


def test_whole_gpus_are_not_given_twice():
    nodes = [make_node("a", 3)]
    reqs = [make_request(name=f"w{i}") for i in range(4)]
    decisions, allocs = place_all(reqs, nodes)
    assert [d.placement is not None for d in decisions] == [True, True, True, False]
    used = [dev.gpu_index for a in allocs for dev in a.placement.devices]
    assert sorted(used) == [0, 1, 2]
    assert decisions[3].reason == "insufficient_capacity"
    assert decisions[3].rejections == {"insufficient_gpu_capacity": 1}


def test_multi_gpu_request_needs_enough_idle_gpus_on_one_node():
    nodes = [make_node("a", 2), make_node("b", 2)]
    d = place(make_request(count=3), nodes, [])
    assert d.placement is None
    assert d.rejections == {"insufficient_gpu_capacity": 2}
    d = place(make_request(count=2), nodes, [])
    assert len(d.placement.devices) == 2
    assert len({dev.gpu_index for dev in d.placement.devices}) == 2
    assert all(dev.mig_start is None and dev.share_milli is None for dev in d.placement.devices)


def test_devices_carry_the_gpu_uuid():
    nodes = [make_node("a", 2)]
    d = place(make_request(count=2), nodes, [])
    assert {(dev.gpu_index, dev.gpu_uuid) for dev in d.placement.devices} == {
        (0, "GPU-a-0"),
        (1, "GPU-a-1"),
    }


def test_mig_instances_are_not_given_twice():
    nodes = [make_node("a", 2, mig={0: TWO_3G})]
    reqs = [make_request(name=f"w{i}", mig_profile="3g.40gb") for i in range(3)]
    decisions, allocs = place_all(reqs, nodes)
    assert [d.placement is not None for d in decisions] == [True, True, False]
    used = [(dev.gpu_index, dev.mig_start) for a in allocs for dev in a.placement.devices]
    assert sorted(used) == [(0, 0), (0, 4)]
    assert all(dev.mig_profile == "3g.40gb" for a in allocs for dev in a.placement.devices)
    assert decisions[2].reason == "insufficient_capacity"


def test_mig_request_for_several_instances():
    nodes = [make_node("a", 2, mig={0: SEVEN_1G, 1: SEVEN_1G})]
    d = place(make_request(mig_profile="1g.10gb", count=9), nodes, [])
    devs = d.placement.devices
    assert len(devs) == 9
    assert len({(x.gpu_index, x.mig_start) for x in devs}) == 9
    d = place(make_request(mig_profile="1g.10gb", count=15), nodes, [])
    assert d.placement is None
    d = place(make_request(mig_profile="2g.20gb"), nodes, [])
    assert d.placement is None  # no such instance carved out


def test_mig_packs_onto_busy_gpu():
    nodes = [make_node("a", 2, mig={0: SEVEN_1G, 1: SEVEN_1G})]
    busy = Placement("a", (PlacedDevice(1, "GPU-a-1", "1g.10gb", 3),))
    d = place(make_request(mig_profile="1g.10gb"), nodes, [alloc("t2", IsolationLevel.MIG, busy)])
    (dev,) = d.placement.devices
    assert dev.gpu_index == 1
    assert dev.mig_start != 3


def test_shares_never_exceed_one_gpu_and_best_fit_picks_fuller_gpu():
    nodes = [make_node("a", 2)]
    allocs = [
        alloc(
            "t1",
            IsolationLevel.SHARED,
            Placement("a", (PlacedDevice(0, "GPU-a-0", share_milli=300),)),
        ),
        alloc(
            "t2",
            IsolationLevel.SHARED,
            Placement("a", (PlacedDevice(1, "GPU-a-1", share_milli=600),)),
        ),
    ]
    d = place(make_request(share=400), nodes, allocs)
    assert d.placement.devices == (PlacedDevice(1, "GPU-a-1", share_milli=400),)
    d = place(make_request(share=300), nodes, allocs)
    assert d.placement.devices[0].gpu_index == 1  # fuller GPU, still fits
    d = place(make_request(share=500), nodes, allocs)
    assert d.placement.devices[0].gpu_index == 0  # GPU 1 would exceed 1000
    d = place(make_request(share=701), nodes, allocs)
    assert d.placement is None
    assert d.rejections == {"insufficient_gpu_capacity": 1}


def test_share_fills_exactly_one_gpu():
    nodes = [make_node("a", 1)]
    reqs = [make_request(name=f"w{i}", share=250) for i in range(5)]
    decisions, allocs = place_all(reqs, nodes)
    assert [d.placement is not None for d in decisions] == [True, True, True, True, False]
    assert sum(dev.share_milli for a in allocs for dev in a.placement.devices) == ONE_GPU


def test_mig_enabled_gpu_is_never_whole_or_shared():
    nodes = [make_node("a", 2, mig={0: TWO_3G, 1: SEVEN_1G})]
    for req in [make_request(), make_request(share=1)]:
        d = place(req, nodes, [])
        assert d.placement is None
        assert d.rejections == {"insufficient_gpu_capacity": 1}
    nodes = [make_node("a", 2, mig={0: TWO_3G})]
    assert place(make_request(), nodes, []).placement.devices[0].gpu_index == 1
    assert place(make_request(share=5), nodes, []).placement.devices[0].gpu_index == 1
    assert place(make_request(count=2), nodes, []).placement is None


def test_gpu_with_shares_is_not_given_whole():
    nodes = [make_node("a", 2)]
    shared = alloc(
        "t1", IsolationLevel.SHARED, Placement("a", (PlacedDevice(0, "GPU-a-0", share_milli=1),))
    )
    d = place(make_request(), nodes, [shared])
    assert d.placement.devices[0].gpu_index == 1
    d = place(make_request(count=2), nodes, [shared])
    assert d.placement is None


def test_whole_gpu_is_not_shared():
    nodes = [make_node("a", 2)]
    taken = alloc("t1", IsolationLevel.EXCLUSIVE_GPU, whole("a", 1))
    d = place(make_request(share=100), nodes, [taken])
    assert d.placement.devices[0].gpu_index == 0
    taken2 = alloc("t1", IsolationLevel.EXCLUSIVE_GPU, whole("a", 0))
    d = place(make_request(share=100), nodes, [taken, taken2])
    assert d.placement is None


def test_insufficient_capacity_when_compliant_nodes_are_full():
    nodes = [
        make_node("a", 1, certs={"hipaa": "true"}),
        make_node("b", 1, certs={"hipaa": "true"}),
        make_node("c", 8),  # empty, uncertified
        make_node("d", 8, state=NodeState.CORDONED, certs={"hipaa": "true"}),
    ]
    allocs = [
        alloc("t1", IsolationLevel.EXCLUSIVE_GPU, whole("a", 0)),
        alloc("t2", IsolationLevel.EXCLUSIVE_GPU, whole("b", 0)),
    ]
    d = place(make_request(tags={"hipaa": "true"}), nodes, allocs)
    assert d.placement is None
    assert d.reason == "insufficient_capacity"
    assert d.rejections == {
        "insufficient_gpu_capacity": 2,
        "missing_certification": 1,
        "node_not_admitted": 1,
    }
    assert d.message.startswith("2 node(s) are admitted and certified")
    assert "insufficient_gpu_capacity on 2" in d.message


def test_allocations_on_unknown_nodes_are_ignored():
    nodes = [make_node("a", 1)]
    d = place(make_request(), nodes, [alloc("t1", IsolationLevel.EXCLUSIVE_GPU, whole("zz", 0))])
    assert d.placement is not None


# --------------------------------------------------------------------------- best fit


def test_best_fit_prefers_node_with_fewer_idle_gpus_left():
    nodes = [make_node("a", 8), make_node("b", 8), make_node("c", 4)]
    allocs = [alloc("t9", IsolationLevel.EXCLUSIVE_GPU, whole("b", 0, 1, 2, 3, 4, 5))]
    d = place(make_request(), nodes, allocs)
    assert d.placement.node == "b"  # 1 idle GPU left there, 3 on c, 7 on a
    d = place(make_request(count=2), nodes, allocs)
    assert d.placement.node == "b"  # 0 idle left
    d = place(make_request(count=3), nodes, allocs)
    assert d.placement.node == "c"  # b cannot, c leaves 1


def test_best_fit_counts_partly_used_gpus_as_not_idle():
    # z: 3 GPUs, one carries a share, one carries a MIG instance → after placing, 0 idle left;
    # a: 3 idle GPUs → 2 left. Counting busy GPUs as idle would tie them and pick "a" by name.
    nodes = [make_node("a", 3, mig={2: TWO_3G}), make_node("z", 3, mig={2: TWO_3G})]
    busy = [
        alloc(
            "t1",
            IsolationLevel.SHARED,
            Placement("z", (PlacedDevice(0, "GPU-z-0", share_milli=10),)),
        ),
        alloc(
            "t2", IsolationLevel.MIG, Placement("z", (PlacedDevice(2, "GPU-z-2", "3g.40gb", 0),))
        ),
    ]
    d = place(make_request(), nodes, busy)
    assert d.placement.node == "z"
    assert d.placement.devices[0].gpu_index == 1


def test_best_fit_ties_break_by_name():
    nodes = [make_node("zeta", 4), make_node("alpha", 4), make_node("mid", 4)]
    d = place(make_request(), nodes, [])
    assert d.placement.node == "alpha"
    assert d.message == "placed on alpha"


# --------------------------------------------------------------------------- property test

CERT_CHOICES = {
    "hipaa": ["true"],
    "gdpr-zone": ["frankfurt", "paris"],
    "pci-dss": ["isolated"],
}
TENANTS = ["t1", "t2", "t3"]
# Valid layouts by position in a SKU's profile family (1g, 1g+me, 1g-2x, 2g, 3g, 4g, 7g).
LAYOUTS_BY_POSITION = [
    [(4, 0), (4, 4)],
    [(0, s) for s in range(7)],
    [(5, 0), (3, 4), (0, 6)],
    [(6, 0)],
    [(2, 0), (2, 2), (2, 4), (2, 6)],
    [(1, 0), (0, 1), (3, 2), (4, 4)],
    [(3, 0), (3, 2), (3, 4)],
]


def _layout(sku_name: str, which: int) -> tuple[MigInstance, ...]:
    profiles = SKUS[sku_name].mig_profiles
    return tuple(MigInstance(profiles[p].name, s) for p, s in LAYOUTS_BY_POSITION[which])


def test_property_layouts_are_valid():
    for sku in SKUS:
        for k in range(len(LAYOUTS_BY_POSITION)):
            assert layout_errors(SKUS[sku], _layout(sku, k)) == [], (sku, k)


certs_st = st.fixed_dictionaries(
    {},
    optional={k: st.sampled_from(v) for k, v in CERT_CHOICES.items()},
)


@st.composite
def gpu_st(draw, node: str, index: int):
    model = draw(st.sampled_from(sorted(SKUS)))
    mig_layout = draw(st.none() | st.integers(0, len(LAYOUTS_BY_POSITION) - 1))
    layout = () if mig_layout is None else _layout(model, mig_layout)
    return Gpu(
        index,
        f"GPU-{node}-{index}",
        model,
        SKUS[model].memory_mb,
        mig_enabled=mig_layout is not None,
        mig_instances=layout,
    )


@st.composite
def node_st(draw, name: str):
    n = draw(st.integers(0, 4))
    gpus = tuple(draw(gpu_st(name, i)) for i in range(n))
    state = draw(
        st.sampled_from([NodeState.ADMITTED] * 3 + [s for s in NodeState if s != "admitted"])
    )
    return Node(name, "r", "z", certifications=draw(certs_st), state=state, gpus=gpus)


@st.composite
def cluster_st(draw):
    n = draw(st.integers(1, 8))
    return [draw(node_st(f"n{i}")) for i in range(n)]


@st.composite
def request_st(draw, index: int, nodes: Sequence[Node]):
    tenant = draw(st.sampled_from(TENANTS))
    # Tags: often none, often copied from a node (satisfiable), sometimes random.
    node_certs = [dict(n.certifications) for n in nodes]
    tags = draw(st.just({}) | st.sampled_from(node_certs) | certs_st)
    models = sorted({g.model for n in nodes for g in n.gpus} | {"B200-180GB"})
    model = draw(st.none() | st.none() | st.sampled_from(models))
    shape = draw(st.sampled_from(["whole", "mig", "share"]))
    if shape == "whole":
        g = GpuRequest(draw(st.integers(1, 3)), model)
        iso = draw(st.sampled_from([IsolationLevel.EXCLUSIVE_GPU, IsolationLevel.DEDICATED_NODE]))
    elif shape == "mig":
        # mostly profiles carved out somewhere in the cluster, sometimes any profile
        carved = sorted({i.profile for n in nodes for g in n.gpus for i in g.mig_instances})
        any_profile = sorted({p.name for sku in SKUS.values() for p in sku.mig_profiles})
        profile = draw(st.sampled_from(carved or any_profile) | st.sampled_from(any_profile))
        g = GpuRequest(draw(st.integers(1, 3)), model, mig_profile=profile)
        iso = IsolationLevel.MIG
    else:
        share = draw(st.sampled_from([100, 250, 400, 500, 600, 999]) | st.integers(1, 999))
        g = GpuRequest(1, model, share_milli=share)
        iso = IsolationLevel.SHARED
    return Request(f"w{index}", tenant, tags, iso, g)


@st.composite
def scenario_st(draw):
    nodes = draw(cluster_st())
    n = draw(st.integers(1, 30))
    return nodes, [draw(request_st(i, nodes)) for i in range(n)]


def _feasible(node: Node, allocs: Sequence[Allocation], req: Request) -> bool:
    """An independent model of "this node could take the request now"."""
    if node.state is not NodeState.ADMITTED or missing_tags(req.tags, node.certifications):
        return False
    mine = [a for a in allocs if a.placement.node == node.name]
    if any(a.isolation is IsolationLevel.DEDICATED_NODE and a.tenant != req.tenant for a in mine):
        return False
    if req.isolation is IsolationLevel.DEDICATED_NODE and any(a.tenant != req.tenant for a in mine):
        return False
    devs = [d for a in mine for d in a.placement.devices]
    whole_used = {d.gpu_index for d in devs if d.mig_start is None and d.share_milli is None}
    mig_used = {(d.gpu_index, d.mig_start) for d in devs if d.mig_start is not None}
    shares = Counter()
    for d in devs:
        if d.share_milli is not None:
            shares[d.gpu_index] += d.share_milli
    g = req.gpus
    gpus = [x for x in node.gpus if g.model is None or x.model == g.model]
    if g.mig_profile is not None:
        free = sum(
            1
            for x in gpus
            if x.mig_enabled
            for i in x.mig_instances
            if i.profile == g.mig_profile and (x.index, i.start) not in mig_used
        )
        return free >= g.count
    plain = [x for x in gpus if not x.mig_enabled and x.index not in whole_used]
    if g.share_milli is not None:
        return any(shares[x.index] + g.share_milli <= ONE_GPU for x in plain)
    return sum(1 for x in plain if not shares[x.index]) >= g.count


def _check_invariants(nodes: Sequence[Node], allocs: Sequence[Allocation]) -> None:
    by_name = {n.name: n for n in nodes}
    whole_used: Counter[tuple[str, int]] = Counter()
    mig_used: Counter[tuple[str, int, int]] = Counter()
    shares: Counter[tuple[str, int]] = Counter()
    tenants_on: dict[str, set[str]] = {}
    dedicated: dict[str, set[str]] = {}
    for a in allocs:
        node = by_name[a.placement.node]
        tenants_on.setdefault(node.name, set()).add(a.tenant)
        if a.isolation is IsolationLevel.DEDICATED_NODE:
            dedicated.setdefault(node.name, set()).add(a.tenant)
        gpus = {g.index: g for g in node.gpus}
        for d in a.placement.devices:
            gpu = gpus[d.gpu_index]
            assert d.gpu_uuid == gpu.uuid
            if d.mig_start is not None:
                assert gpu.mig_enabled
                assert MigInstance(d.mig_profile, d.mig_start) in gpu.mig_instances
                mig_used[(node.name, d.gpu_index, d.mig_start)] += 1
            elif d.share_milli is not None:
                assert not gpu.mig_enabled
                shares[(node.name, d.gpu_index)] += d.share_milli
            else:
                assert not gpu.mig_enabled
                whole_used[(node.name, d.gpu_index)] += 1
    assert all(n == 1 for n in whole_used.values()), whole_used
    assert all(n == 1 for n in mig_used.values()), mig_used
    assert all(v <= ONE_GPU for v in shares.values()), shares
    assert not set(whole_used) & set(shares)
    for node, owners in dedicated.items():
        assert len(owners) == 1
        assert tenants_on[node] == owners, (node, tenants_on[node], owners)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario_st())
def test_placement_properties(scenario):
    nodes, stream = scenario
    allocs: list[Allocation] = []
    for req in stream:
        feasible = [n.name for n in nodes if _feasible(n, allocs, req)]
        d = place(req, nodes, allocs)
        if d.placement is None:
            assert d.reason in {"no_compliant_capacity", "insufficient_capacity"}
            assert sum(d.rejections.values()) == len(nodes)
            assert not feasible, (req, feasible)
            compliant = [
                n
                for n in nodes
                if n.state is NodeState.ADMITTED and not missing_tags(req.tags, n.certifications)
            ]
            if d.reason == "no_compliant_capacity":
                assert not compliant
                assert set(d.rejections) <= COMPLIANCE_FILTERS
            else:
                assert compliant
            continue
        assert d.reason is None
        node = next(n for n in nodes if n.name == d.placement.node)
        assert node.state is NodeState.ADMITTED
        assert set(req.tags.items()) <= set(node.certifications.items())
        assert node.name in feasible
        g = req.gpus
        assert len(d.placement.devices) == (1 if g.share_milli is not None else g.count)
        for dev in d.placement.devices:
            gpu = next(x for x in node.gpus if x.index == dev.gpu_index)
            assert g.model is None or gpu.model == g.model
            assert dev.mig_profile == g.mig_profile
            assert dev.share_milli == g.share_milli
        assert len({(x.gpu_index, x.mig_start) for x in d.placement.devices}) == len(
            d.placement.devices
        )
        allocs.append(as_alloc(req, d))
        _check_invariants(nodes, allocs)
