"""Unit tests of the pure scheduling engine: quota, gang, repartitioning, preemption, explain."""

from __future__ import annotations

from dataclasses import replace

import pytest

from proofplane.hardware.skus import get_sku, layout_errors
from proofplane.model import (
    Gpu,
    GpuRequest,
    IsolationLevel,
    MigInstance,
    Node,
    NodeState,
    PlacedDevice,
    Placement,
    Quota,
)
from proofplane.schedule.engine import Held, Job, Scheduler, pool_of
from proofplane.schedule.explain import explain_job
from proofplane.schedule.mig import layout_for, valid_layouts
from proofplane.schedule.quota import (
    Cost,
    device_cost,
    mig_slices,
    quota_check,
    request_cost,
)
from proofplane.schedule.values import Request

H100 = "H100-80GB"
EXCL = IsolationLevel.EXCLUSIVE_GPU
MIG = IsolationLevel.MIG


def node(
    name: str,
    gpus: int = 4,
    *,
    certs: dict[str, str] | None = None,
    mig: tuple[MigInstance, ...] | None = None,
    state: NodeState = NodeState.ADMITTED,
) -> Node:
    return Node(
        name,
        "r",
        "z",
        certifications=dict(certs or {}),
        state=state,
        gpus=tuple(
            Gpu(
                i,
                f"GPU-{name}-{i}",
                H100,
                81920,
                mig_enabled=mig is not None,
                mig_instances=mig or (),
            )
            for i in range(gpus)
        ),
    )


def job(
    key: str,
    tenant: str = "t",
    *,
    count: int = 1,
    tags: dict[str, str] | None = None,
    mig_profile: str | None = None,
    share: int | None = None,
    nodes: int = 1,
    priority: int = 0,
    isolation: IsolationLevel | None = None,
) -> Job:
    g = GpuRequest(count, None, mig_profile, share, nodes)
    iso = isolation or g.natural_isolation
    return Job(key, Request(key, tenant, dict(tags or {}), iso, g), priority)


def devices_of(p: Placement) -> list[tuple[str, PlacedDevice]]:
    return [(part.node, d) for part in p.parts for d in part.devices]


# --- quota -------------------------------------------------------------------------------------


def test_quota_units() -> None:
    assert mig_slices("3g.40gb") == 3 and mig_slices("1g.10gb+me") == 1
    assert mig_slices("7g.80gb") == 7
    assert request_cost(GpuRequest(2)) == Cost(2000, 0)
    assert request_cost(GpuRequest(1, share_milli=250)) == Cost(250, 0)
    assert request_cost(GpuRequest(2, mig_profile="2g.20gb")) == Cost(0, 4)
    devs = [
        PlacedDevice(0, "a"),
        PlacedDevice(1, "b", share_milli=500),
        PlacedDevice(2, "c", mig_profile="3g.40gb", mig_start=0),
    ]
    assert device_cost(devs) == Cost(1500, 3)


def test_quota_check_limits_each_unit() -> None:
    q = Quota(gpus=2, mig_slices=4)
    assert quota_check(q, Cost(1000, 0), Cost(1000, 0)) is None  # exactly at the limit
    over = quota_check(q, Cost(1500, 0), Cost(1000, 0))
    assert over is not None and set(over) == {"gpus"}
    assert quota_check(q, Cost(0, 3), Cost(0, 1)) is None
    assert set(quota_check(q, Cost(0, 3), Cost(0, 2)) or {}) == {"mig_slices"}
    # a MIG request is not charged against the GPU quota, nor the reverse
    assert quota_check(Quota(gpus=0), Cost(0, 0), Cost(0, 7)) is None
    assert quota_check(Quota(mig_slices=0), Cost(0, 0), Cost(8000, 0)) is None
    assert quota_check(Quota(), Cost(10**9, 10**9), Cost(1000, 7)) is None


def test_quota_exceeded_keeps_the_job_pending_and_counts_every_node() -> None:
    s = Scheduler([node("a"), node("b")], quotas={"t": Quota(gpus=2)})
    assert s.schedule(job("w1", count=2)).placement is not None
    out = s.schedule(job("w2"))
    assert out.placement is None and out.reason == "quota_exceeded"
    assert out.rejections == {"quota_exceeded": 2}
    assert out.details["quota"]["gpus"]["limit"] == 2
    # another tenant is not limited by t's quota
    assert s.schedule(job("w3", tenant="u")).placement is not None
    # releasing gives the headroom back
    s.release("w1")
    assert s.schedule(job("w2")).placement is not None


# --- gang --------------------------------------------------------------------------------------


def test_gang_spreads_over_distinct_nodes() -> None:
    s = Scheduler([node("a", 8), node("b", 8), node("c", 8)])
    out = s.schedule(job("g", count=8, nodes=2))
    p = out.placement
    assert p is not None and len(p.parts) == 2
    assert len(set(p.nodes)) == 2
    assert all(len(part.devices) == 4 for part in p.parts)
    # every member is reserved: the gang holds 8 GPUs
    assert s.used("t") == Cost(8000, 0)
    # released as a whole
    s.release("g")
    assert s.used("t") == Cost() and not s.snapshot.allocations


def test_gang_is_all_or_nothing() -> None:
    s = Scheduler([node("a", 4), node("b", 2)])
    out = s.schedule(job("g", count=8, nodes=2))
    assert out.placement is None and out.reason == "insufficient_capacity"
    assert "gang" in out.message
    assert out.rejections.get("gang_node_taken") == 1
    assert not s.snapshot.allocations  # nothing half-placed
    # the snapshot's nodes came back exactly as they were (none left cordoned)
    assert all(n.state is NodeState.ADMITTED for n in s.nodes())
    assert s.schedule(job("x", count=4)).placement is not None


def test_gang_respects_compliance() -> None:
    s = Scheduler([node("a", 4, certs={"hipaa": "true"}), node("b", 4), node("c", 4)])
    out = s.schedule(job("g", count=4, nodes=2, tags={"hipaa": "true"}))
    assert out.placement is None and out.reason == "insufficient_capacity"
    s.upsert_node(node("c", 4, certs={"hipaa": "true"}))
    out = s.schedule(job("g", count=4, nodes=2, tags={"hipaa": "true"}))
    assert out.placement is not None and set(out.placement.nodes) == {"a", "c"}


# --- MIG repartitioning ------------------------------------------------------------------------


def test_every_enumerated_layout_is_valid() -> None:
    for sku in ("A100-40GB", "H100-80GB", "B200-180GB"):
        layouts = valid_layouts(sku)
        assert layouts and len(set(layouts)) == len(layouts)
        assert all(not layout_errors(get_sku(sku), lay) for lay in layouts)


@pytest.mark.parametrize(
    ("profile", "wanted", "expected"),
    [
        ("1g.10gb", 1, {"4g.40gb", "2g.20gb", "1g.10gb"}),  # a 4g stays placeable
        ("3g.40gb", 1, {"4g.40gb", "3g.40gb"}),
        ("3g.40gb", 2, {"3g.40gb"}),
        ("7g.80gb", 1, {"7g.80gb"}),
    ],
)
def test_layout_keeps_large_profiles_placeable(profile: str, wanted: int, expected: set) -> None:
    layout = layout_for(H100, profile, wanted)
    assert layout is not None and not layout_errors(get_sku(H100), layout)
    assert {i.profile for i in layout} == expected
    assert sum(1 for i in layout if i.profile == profile) == min(
        wanted, 2 if "3g" in profile else 7
    )
    assert layout_for(H100, "9g.1gb", 1) is None


def test_repartitions_only_an_idle_gpu() -> None:
    two_3g = (MigInstance("3g.40gb", 0), MigInstance("3g.40gb", 4))
    s = Scheduler([node("a", 2, mig=two_3g)])
    assert s.schedule(job("busy", mig_profile="3g.40gb")).placement is not None
    busy_gpu = s.held["busy"].placement.devices[0].gpu_index
    out = s.schedule(job("small", mig_profile="1g.10gb"))
    assert out.placement is not None and len(out.repartitions) == 1
    change = out.repartitions[0]
    assert change.gpu_index != busy_gpu  # the GPU with work was not touched
    assert not layout_errors(get_sku(H100), change.after)
    gpu = next(g for g in s.node("a").gpus if g.index == change.gpu_index)
    assert gpu.mig_instances == change.after
    busy = next(g for g in s.node("a").gpus if g.index == busy_gpu)
    assert busy.mig_instances == two_3g
    # now every GPU holds work: a request nothing fits stays pending, nothing is repartitioned
    out = s.schedule(job("big", mig_profile="7g.80gb"))
    assert out.placement is None and not out.repartitions
    assert out.reason == "insufficient_capacity"


def test_repartition_never_on_uncertified_or_non_mig_gpu() -> None:
    s = Scheduler([node("plain", 2), node("mig", 1, mig=(MigInstance("7g.80gb", 0),))])
    out = s.schedule(job("m", mig_profile="1g.10gb", tags={"hipaa": "true"}))
    assert out.placement is None and out.reason == "no_compliant_capacity"
    out = s.schedule(job("m", mig_profile="1g.10gb"))
    assert out.placement is not None and out.placement.node == "mig"
    assert s.node("plain").gpus[0].mig_enabled is False


# --- preemption --------------------------------------------------------------------------------


def test_preempts_lower_priority_in_the_same_pool_only() -> None:
    tags = {"hipaa": "true"}
    s = Scheduler([node("a", 2, certs=tags)])
    assert s.schedule(job("low", count=2, tags=tags, priority=1)).placement is not None
    out = s.schedule(job("high", count=2, tags=tags, priority=5))
    assert out.placement is not None and [v.key for v in out.preempted] == ["low"]
    assert "low" not in s.held and "high" in s.held


def test_never_preempts_across_pools_or_equal_priority() -> None:
    s = Scheduler([node("a", 2, certs={"hipaa": "true"})])
    assert s.schedule(job("general", count=2, priority=0)).placement is not None
    # another pool (hipaa) may not evict general-pool work, whatever its priority
    out = s.schedule(job("h", count=2, tags={"hipaa": "true"}, priority=1000))
    assert out.placement is None and not out.preempted
    # same pool, equal priority: no
    out = s.schedule(job("eq", count=2, priority=0))
    assert out.placement is None and not out.preempted
    assert set(s.held) == {"general"}


def test_preemption_picks_the_fewest_victims() -> None:
    s = Scheduler([node("a", 2), node("b", 2)])
    for key, prio in (("a1", 1), ("a2", 1), ("b1", 2)):
        assert s.schedule(job(key, priority=prio)).placement is not None
    assert s.schedule(job("b-small", priority=2)).placement is not None
    # a 2-GPU job at priority 3: evicting b1+b-small (two) or a1+a2 (two): priority decides
    out = s.schedule(job("big", count=2, priority=3))
    assert out.placement is not None
    assert {v.key for v in out.preempted} == {"a1", "a2"}  # the lower-priority pair
    assert out.placement.node == "a"


def test_preemption_evicts_no_more_than_needed() -> None:
    s = Scheduler([node("a", 4)])
    for key in ("v1", "v2", "v3", "v4"):
        assert s.schedule(job(key, priority=0)).placement is not None
    out = s.schedule(job("p", count=2, priority=1))
    assert out.placement is not None and len(out.preempted) == 2
    assert len(s.held) == 3


def test_a_gang_preempts_across_nodes_within_its_pool() -> None:
    tags = {"hipaa": "true"}
    s = Scheduler([node(n, 2, certs=tags) for n in ("a", "b", "c")])
    for key in ("a1", "a2", "b1", "b2"):
        assert s.schedule(job(key, tags=tags, priority=1)).placement is not None
    assert s.schedule(job("keep", count=2, tags=tags, priority=9)).placement is not None
    out = s.schedule(job("gang", count=4, nodes=2, tags=tags, priority=5))
    assert out.placement is not None and len(set(out.placement.nodes)) == 2
    assert {v.key for v in out.preempted} == {"a1", "a2", "b1", "b2"}
    assert "keep" in s.held and "gang" in s.held
    assert "preempting" in out.message


def test_a_gang_evicts_nothing_when_it_still_would_not_fit() -> None:
    s = Scheduler([node("a", 2), node("b", 2)])
    assert s.schedule(job("low", count=2, priority=1)).placement is not None
    assert s.schedule(job("high", count=2, priority=9)).placement is not None
    # evicting "low" frees one node; the gang needs two: all or nothing, so nothing
    out = s.schedule(job("gang", count=4, nodes=2, priority=5))
    assert out.placement is None and not out.preempted
    assert out.reason == "insufficient_capacity"
    assert set(s.held) == {"low", "high"} and s.used("t") == Cost(4000, 0)


def test_a_gang_never_preempts_across_pools_or_equal_priority() -> None:
    hipaa = {"hipaa": "true"}
    s = Scheduler([node("a", 2, certs=hipaa), node("b", 2, certs=hipaa)])
    assert s.schedule(job("g1", count=2, priority=0)).placement is not None
    assert s.schedule(job("g2", count=2, priority=0)).placement is not None
    out = s.schedule(job("h", count=4, nodes=2, tags=hipaa, priority=1000))
    assert out.placement is None and not out.preempted
    out = s.schedule(job("eq", count=4, nodes=2, priority=0))
    assert out.placement is None and not out.preempted
    assert set(s.held) == {"g1", "g2"}


def test_a_gang_evicts_no_more_than_it_needs() -> None:
    s = Scheduler([node("a", 4), node("b", 4)])
    for i in range(8):
        assert s.schedule(job(f"v{i}", priority=0)).placement is not None
    out = s.schedule(job("gang", count=2, nodes=2, priority=1))
    assert out.placement is not None and len(out.preempted) == 2
    victims = {v.key for v in out.preempted}
    assert {v.placement.node for v in out.preempted} == {"a", "b"}  # one GPU freed per node
    assert len(s.held) == 7 and not victims & set(s.held)


def test_a_gang_victim_loses_every_member() -> None:
    s = Scheduler([node("a", 2), node("b", 2)])
    assert s.schedule(job("low-gang", count=4, nodes=2, priority=1)).placement is not None
    out = s.schedule(job("high", count=2, priority=5))
    assert out.placement is not None and [v.key for v in out.preempted] == ["low-gang"]
    # the other member's node is free too: nothing of the gang is left held
    assert s.used("t") == Cost(2000, 0)
    assert s.schedule(job("more", count=2, priority=0)).placement is not None


# --- explain -----------------------------------------------------------------------------------


def test_explain_counts_each_node_under_its_first_failing_filter() -> None:
    nodes = [
        node("down", state=NodeState.FAILED),
        node("plain"),
        node("full", certs={"hipaa": "true"}, gpus=1),
        node("ok", certs={"hipaa": "true"}, gpus=2),
    ]
    s = Scheduler(nodes)
    assert s.schedule(job("filler", tags={"hipaa": "true"}, count=1)).placement is not None
    j = job("w", count=2, tags={"hipaa": "true"})
    out = s.schedule(j)
    e = explain_job(s, j)
    assert e["filters"] == {
        "node_not_admitted": 1,
        "missing_certification": 1,
        "insufficient_gpu_capacity": 2 if out.placement is None else 1,
    }
    assert e["nodes_total"] == 4
    # the explanation changed nothing
    assert set(s.held) == ({"filler", "w"} if out.placement else {"filler"})


def test_explain_ranks_the_node_a_placed_job_holds() -> None:
    s = Scheduler([node("a", 2), node("b", 4)])
    j = job("w", count=2)
    assert s.schedule(j).placement.node == "a"  # best fit: no idle GPU left
    e = explain_job(s, j, ("a",))
    assert e["placed_on"] == [{"node": "a", "rank": 1, "idle_gpus_after": 0}]
    assert [c["node"] for c in e["candidates"]] == ["a", "b"]
    assert "w" in s.held  # its own capacity is held again afterwards


def test_explain_reports_quota() -> None:
    s = Scheduler([node("a")], quotas={"t": Quota(mig_slices=0)})
    j = job("m", mig_profile="1g.10gb")
    assert s.schedule(j).reason == "quota_exceeded"
    e = explain_job(s, j)
    assert e["quota"]["fits"] is False and e["filters"]["quota_exceeded"] == 1


def test_pool_is_the_exact_tag_set() -> None:
    assert pool_of({"hipaa": "true"}) == pool_of({"hipaa": "true"})
    assert pool_of({"hipaa": "true"}) != pool_of({"hipaa": "true", "gdpr-zone": "paris"})
    assert pool_of({}) != pool_of({"hipaa": "true"})


def test_hold_and_release_are_inverse() -> None:
    s = Scheduler([node("a", 4), node("b", 4)])
    p = Placement.of_parts(
        (Placement("a", (PlacedDevice(0, "GPU-a-0"),)), Placement("b", (PlacedDevice(1, "x"),)))
    )
    h = Held("k", "k", "t", EXCL, 0, pool_of({}), p)
    s.hold(h)
    assert s.used("t") == Cost(2000, 0) and s.busy_gpus("b") == {1}
    s.hold(replace(h, placement=Placement("a", (PlacedDevice(2, "GPU-a-2"),))))
    assert s.used("t") == Cost(1000, 0) and s.busy_gpus("b") == set()
    assert s.release("k") is not None and s.used("t") == Cost()
    assert s.release("k") is None
