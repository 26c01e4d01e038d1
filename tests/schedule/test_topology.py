"""Topology-aware gangs (issue 17 §4): the domain choice, the engine's outcomes, and a property
test (hypothesis) that compliance is never traded for topology, nothing is allocated twice and a
``required`` gang never spans domains."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proofplane.model import (
    Gpu,
    GpuRequest,
    IsolationLevel,
    Node,
    NodeState,
    PlacedDevice,
    Placement,
    TopologyMode,
    TopologyRequest,
    domain_of,
    missing_tags,
)
from proofplane.schedule.engine import Held, Job, Scheduler, pool_of
from proofplane.schedule.explain import explain_job
from proofplane.schedule.reasons import (
    INSUFFICIENT_CAPACITY,
    NO_COMPLIANT_CAPACITY,
    REASONS,
    TOPOLOGY_UNSATISFIABLE,
)
from proofplane.schedule.scoring import DEFAULT_SCORER, make_scorer
from proofplane.schedule.topology import TopologyIndex, fewest_domains, pick_domains
from proofplane.schedule.values import Request

EXCL = IsolationLevel.EXCLUSIVE_GPU
REQ = TopologyMode.REQUIRED
PREF = TopologyMode.PREFERRED


def tnode(
    name: str,
    rack: str | None,
    *,
    gpus: int = 4,
    nvl: str | None = None,
    certs: dict[str, str] | None = None,
    state: NodeState = NodeState.ADMITTED,
) -> Node:
    topology = {"nvlink_domain": nvl} if nvl else {}
    return Node(
        name,
        "r",
        "z",
        rack=rack,
        certifications=dict(certs or {}),
        state=state,
        topology=topology,
        gpus=tuple(Gpu(i, f"GPU-{name}-{i}", "H100-80GB", 81920) for i in range(gpus)),
    )


def gang(
    key: str,
    nodes: int,
    per: int = 4,
    *,
    level: str = "rack",
    mode: TopologyMode = REQ,
    tags: dict[str, str] | None = None,
    topology: bool = True,
) -> Job:
    topo = TopologyRequest(level, mode) if topology else None
    g = GpuRequest(nodes * per, nodes=nodes)
    return Job(
        key,
        Request(key, "t", dict(tags or {}), IsolationLevel.EXCLUSIVE_GPU, g, topology=topo),
    )


def racks(sizes: dict[str, int], **kw: object) -> list[Node]:
    return [
        tnode(f"{rack}-n{i}", rack, **kw)  # type: ignore[arg-type]
        for rack, n in sizes.items()
        for i in range(n)
    ]


# --- the pure domain choice -------------------------------------------------------------------


def test_fewest_domains_and_best_fit_for_the_last() -> None:
    assert fewest_domains([3, 5, 2], 5) == 1
    assert fewest_domains([3, 4, 2], 6) == 2
    assert fewest_domains([1, 1], 3) is None
    # 7 members: the largest (5) first, then the smallest that holds the last 2 (b: 2, not c: 4)
    assert pick_domains({"a": 5, "b": 2, "c": 4}, 7) == [("a", 5), ("b", 2)]
    assert pick_domains({"a": 1}, 2) is None


def test_index_counts_follow_reservations_and_states() -> None:
    idx = TopologyIndex()
    n = tnode("a", "r1", nvl="v1")
    idx.changed("a", n, 4)
    assert idx.bounds("rack", 4) == {"r1": 1} and idx.bounds("nvlink_domain", 1) == {"v1": 1}
    idx.changed("a", n, 2)  # two GPUs taken
    assert idx.bounds("rack", 4) == {} and idx.bounds("rack", 2) == {"r1": 1}
    assert idx.loose("block") == {"a"}
    idx.changed("a", None, 0)  # cordoned
    assert idx.bounds("rack", 1) == {} and not idx.loose("block")


def test_rack_falls_back_to_the_rack_field() -> None:
    n = tnode("a", "r7")
    assert domain_of(n, "rack") == "r7" and domain_of(n, "block") is None


# --- the engine --------------------------------------------------------------------------------


@pytest.mark.parametrize("scored", [False, True])
def test_required_gang_takes_the_smallest_rack_that_holds_it(scored: bool) -> None:
    scorer = make_scorer(DEFAULT_SCORER) if scored else None
    s = Scheduler(racks({"big": 6, "fit": 3, "small": 2}), scorer=scorer)
    out = s.schedule(gang("g", 3))
    assert out.placement is not None
    assert {domain_of(s.node(n), "rack") for n in out.placement.nodes} == {"fit"}  # type: ignore[arg-type]
    assert out.details["topology"]["domains"] == ["fit"]
    assert "within one rack" in out.message


def test_required_gang_waits_with_topology_unsatisfiable() -> None:
    s = Scheduler(racks({"a": 2, "b": 2}))
    out = s.schedule(gang("g", 3))
    assert out.placement is None and out.reason == TOPOLOGY_UNSATISFIABLE
    assert out.details["topology"]["most_in_one_domain"] == 2
    assert out.details["topology"]["fits_across"] == 2
    assert "requires one rack" in out.message
    assert TOPOLOGY_UNSATISFIABLE in REASONS and REASONS[TOPOLOGY_UNSATISFIABLE].kind == "pending"


def test_required_gang_without_capacity_anywhere_says_capacity() -> None:
    s = Scheduler(racks({"a": 2}))
    out = s.schedule(gang("g", 3))
    assert out.reason == INSUFFICIENT_CAPACITY


def test_preferred_gang_degrades_and_says_how_far() -> None:
    s = Scheduler(racks({"a": 3, "b": 2, "c": 2}))
    out = s.schedule(gang("g", 5, mode=PREF))
    assert out.placement is not None
    topo = out.details["topology"]
    assert topo["domains_used"] == 2 and topo["fewest_possible"] == 2 and topo["best_possible"]
    assert sorted(Counter(p.split("-")[0] for p in out.placement.nodes).values()) == [2, 3]
    assert "placed across 2 racks (the fewest possible)" in out.message


def test_preferred_uses_nodes_without_a_domain_last() -> None:
    nodes = [*racks({"a": 2}), tnode("loose", None)]
    s = Scheduler(nodes)
    out = s.schedule(gang("g", 3, mode=PREF))
    assert out.placement is not None and "loose" in out.placement.nodes
    assert "node:loose" in out.details["topology"]["domains"]
    # a required gang never uses a node that names no domain
    s2 = Scheduler([*racks({"a": 2}), tnode("l1", None), tnode("l2", None)])
    assert s2.schedule(gang("g", 2)).placement is not None
    assert s2.schedule(gang("h", 2)).reason == TOPOLOGY_UNSATISFIABLE


def test_compliance_comes_first() -> None:
    # rack "a" holds the whole gang but only one of its nodes is certified
    nodes = [
        *racks({"a": 3}),
        tnode("b-n0", "b", certs={"hipaa": "true"}),
        tnode("b-n1", "b", certs={"hipaa": "true"}),
    ]
    nodes[0] = tnode("a-n0", "a", certs={"hipaa": "true"})
    s = Scheduler(nodes)
    out = s.schedule(gang("g", 2, tags={"hipaa": "true"}))
    assert out.placement is not None and set(out.placement.nodes) == {"b-n0", "b-n1"}
    out = s.schedule(gang("h", 2, tags={"hipaa": "true"}))  # only a-n0 is left certified
    assert out.placement is None and out.reason == INSUFFICIENT_CAPACITY
    out = s.schedule(gang("i", 2, tags={"pci": "true"}))
    assert out.reason == NO_COMPLIANT_CAPACITY


def test_nvlink_domain_level_and_partial_nodes() -> None:
    nodes = [tnode(f"n{i}", f"r{i // 2}", nvl="v0" if i < 4 else "v1") for i in range(8)]
    s = Scheduler(nodes)
    # fill two GPUs on n0..n2: a 4-GPU member fits only on n3..n7
    for i in range(3):
        devices = tuple(PlacedDevice(g, f"GPU-n{i}-{g}") for g in (0, 1))
        s.hold(Held(f"bg{i}", f"bg{i}", "t", EXCL, 0, pool_of({}), Placement(f"n{i}", devices)))
    out = s.schedule(gang("g", 4, level="nvlink_domain"))
    assert out.placement is not None
    assert {domain_of(s.node(n), "nvlink_domain") for n in out.placement.nodes} == {"v1"}  # type: ignore[arg-type]
    # 2-GPU members fit the half-used nodes of v0 (best fit: fewest free GPUs first)
    out = s.schedule(gang("h", 3, per=2, level="nvlink_domain"))
    assert out.placement is not None and set(out.placement.nodes) == {"n0", "n1", "n2"}


def test_explain_shows_the_topology_outcome() -> None:
    s = Scheduler(racks({"a": 2, "b": 2}))
    j = gang("g", 3)
    s.schedule(j)
    out = explain_job(s, j)
    topo = out["topology"]
    assert topo["level"] == "rack" and topo["mode"] == "required"
    assert topo["satisfiable_now"] is False and topo["most_in_one_domain"] == 2
    j2 = gang("h", 2)
    placed = s.schedule(j2)
    assert placed.placement is not None
    out = explain_job(s, j2, placed.placement.nodes)
    assert out["topology"]["placed_domains"] == ["a"] or out["topology"]["placed_domains"] == ["b"]


def test_blind_gang_is_unchanged() -> None:
    s = Scheduler(racks({"a": 2, "b": 2}))
    out = s.schedule(gang("g", 3, topology=False))
    assert out.placement is not None and "topology" not in out.details


# --- property: compliance, no double allocation, required never spans -------------------------


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[list[Node], list[Job]]:
    n = draw(st.integers(4, 24))
    nodes = []
    for i in range(n):
        rack = draw(st.sampled_from(["r0", "r1", "r2", "r3", None]))
        certs = {"hipaa": "true"} if draw(st.booleans()) else {}
        state = draw(st.sampled_from([NodeState.ADMITTED] * 4 + [NodeState.CORDONED]))
        nodes.append(tnode(f"n{i}", rack, gpus=draw(st.integers(1, 4)), certs=certs, state=state))
    jobs = []
    for j in range(draw(st.integers(1, 12))):
        k = draw(st.integers(2, 5))
        per = draw(st.integers(1, 3))
        tags = {"hipaa": "true"} if draw(st.booleans()) else {}
        mode = draw(st.sampled_from([REQ, PREF]))
        blind = draw(st.integers(0, 4)) == 0
        jobs.append(gang(f"g{j}", k, per, mode=mode, tags=tags, topology=not blind))
    return nodes, jobs


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.booleans())
def test_topology_never_trades_compliance_nor_double_allocates(
    scenario: tuple[list[Node], list[Job]], scored: bool
) -> None:
    nodes, jobs = scenario
    by_name = {n.name: n for n in nodes}
    s = Scheduler(nodes, scorer=make_scorer(DEFAULT_SCORER) if scored else None)
    for j in jobs:
        out = s.schedule(j, preempt=False)
        if out.placement is None:
            assert out.reason is not None
            req = j.request
            if req.topology is not None and req.topology.mode is REQ:
                # complete: no rack had enough compliant nodes with the GPUs free
                held: Counter[str] = Counter(
                    part.node for h in s.held.values() for part in h.placement.parts
                    for _d in part.devices
                )  # fmt: skip
                able: Counter[str | None] = Counter(
                    domain_of(n, "rack")
                    for n in nodes
                    if n.state is NodeState.ADMITTED
                    and not missing_tags(req.tags, n.certifications)
                    and len(n.gpus) - held[n.name] >= req.gpus.per_node
                )
                able.pop(None, None)
                assert all(c < req.gpus.nodes for c in able.values()), (able, out.reason)
            continue
        req = j.request
        names = out.placement.nodes
        assert len(set(names)) == req.gpus.nodes  # distinct nodes, one member each
        for part in out.placement.parts:
            nd = by_name[part.node]
            assert nd.state is NodeState.ADMITTED
            assert not missing_tags(req.tags, nd.certifications)
            assert len(part.devices) == req.gpus.per_node
        if req.topology is not None and req.topology.mode is REQ:
            domains = {domain_of(by_name[n], "rack") for n in names}
            assert len(domains) == 1 and None not in domains
    # no GPU held twice
    seen: set[tuple[str, int]] = set()
    for h in s.held.values():
        for part in h.placement.parts:
            for d in part.devices:
                assert (part.node, d.gpu_index) not in seen
                seen.add((part.node, d.gpu_index))
