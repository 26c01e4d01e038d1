"""meter.capacity (issue 15, §10): holdings and free capacity per compliance pool, the N+1
check on the production placement core (and that it leaves the scheduler as it found it), and
the demand forecast."""

from __future__ import annotations

import random
from collections.abc import Hashable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proofplane.meter.capacity import (
    GENERAL,
    fleet,
    forecast,
    jobs_needed,
    largest_node,
    n_plus_one,
    pool_capacity,
    pool_label,
    pools_of,
)
from proofplane.model import (
    Gpu,
    GpuRequest,
    IsolationLevel,
    MigInstance,
    Node,
    NodeState,
)
from proofplane.schedule.engine import Job, Scheduler, pool_of
from proofplane.schedule.values import Request

H100 = "H100-80GB"
HIPAA = {"hipaa": "true"}


def node(
    name: str,
    gpus: int = 4,
    *,
    certs: dict[str, str] | None = None,
    mig: tuple[MigInstance, ...] | None = None,
    mig_gpus: int | None = None,
    state: NodeState = NodeState.ADMITTED,
) -> Node:
    return Node(
        name, "r", "z", certifications=dict(certs or {}), state=state,
        gpus=tuple(
            Gpu(i, f"GPU-{name}-{i}", H100, 81920,
                mig_enabled=mig is not None and (mig_gpus is None or i < mig_gpus),
                mig_instances=(mig or ()) if mig is not None and (mig_gpus is None or i < mig_gpus)
                else ())
            for i in range(gpus)
        ),
    )  # fmt: skip


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
) -> Job:
    g = GpuRequest(count, None, mig_profile, share, nodes)
    return Job(key, Request(key, tenant, dict(tags or {}), g.natural_isolation, g), priority)


def place_all(s: Scheduler, jobs: list[Job]) -> dict[Hashable, Job]:
    for j in jobs:
        assert s.schedule(j).placement is not None, j
    return {j.key: j for j in jobs}


THREE_G = (MigInstance("3g.40gb", 0), MigInstance("3g.40gb", 4))


def test_fleet_counts_whole_gpus_shares_mig_slices_and_gangs() -> None:
    s = Scheduler(
        [
            node("a", 4, certs=HIPAA),
            node("b", 4, mig=THREE_G, mig_gpus=2),
            node("c", 2),
            node("down", 8, state=NodeState.CORDONED),
        ]
    )
    place_all(
        s,
        [
            job("w1", "acme", count=2, tags=HIPAA),
            job("m1", "acme", mig_profile="3g.40gb"),
            job("s1", "beta", share=250),
            job("s2", "beta", share=500),
            job("g1", "beta", count=2, nodes=2),
        ],
    )
    f = fleet(s.nodes(), s.held.values())
    assert {
        k: (h.workloads, h.gpus, h.share_milli, h.mig_slices) for k, h in f.holdings.items()
    } == {
        ("acme", "hipaa=true"): (1, 2, 0, 0),
        ("acme", GENERAL): (1, 0, 0, 3),
        ("beta", GENERAL): (3, 2, 750, 0),
    }
    assert set(f.nodes) == {"a", "b", "c"}  # cordoned: no capacity
    used: dict[str, set[int]] = {}
    for h in s.held.values():
        for part in h.placement.parts:
            used.setdefault(part.node, set()).update(d.gpu_index for d in part.devices)
    for name, c in f.nodes.items():
        assert c.gpus_busy == len(used.get(name, ())), name
    # w1 (2), the MIG GPU, one GPU for both shares (they fit on one), the gang (1 + 1)
    assert sum(c.gpus_busy for c in f.nodes.values()) == 2 + 1 + 1 + 2
    b = f.nodes["b"]
    assert (b.mig_slices, b.mig_slices_free) == (12, 9)
    pools = pools_of(s.held.values(), extra=[{"pci-dss": "isolated"}])
    assert [pool_label(p) for p in pools] == [GENERAL, "hipaa=true", "pci-dss=isolated"]
    caps = pool_capacity(f.nodes, pools)
    assert (caps[GENERAL].nodes, caps[GENERAL].gpus, caps[GENERAL].gpus_idle) == (3, 10, 4)
    hipaa = caps["hipaa=true"]
    assert (hipaa.nodes, hipaa.gpus, hipaa.gpus_idle) == (1, 4, 4 - len(used.get("a", ())))
    assert (hipaa.mig_slices, hipaa.largest_node) == (0, "a")
    assert caps["pci-dss=isolated"].nodes == 0 and caps["pci-dss=isolated"].largest_node is None
    # largest: the most GPUs (a and b have 4), then the most in use, then the name
    big = max(("a", "b"), key=lambda n: (f.nodes[n].gpus_busy, n == "a"))
    assert caps[GENERAL].largest_node == big


def test_largest_node_breaks_ties_by_use_then_name() -> None:
    s = Scheduler([node("b", 4), node("a", 4), node("c", 2)])
    assert largest_node(s, frozenset()).name == "a"  # type: ignore[union-attr]
    place_all(s, [job("w", count=1)])  # lands on a (best fit, then name)
    s.schedule(job("x", count=1))
    held_on = {h.placement.node for h in s.held.values()}
    big = largest_node(s, frozenset())
    assert big is not None and big.gpus == 4 and big.name in held_on | {"a"}


def test_a_pool_that_survives_losing_its_largest_node() -> None:
    s = Scheduler([node("n1", 4), node("n2", 4), node("n3", 4)])
    jobs = place_all(s, [job("a", count=2), job("b", count=1), job("c", count=2)])
    r = n_plus_one(s, frozenset(), jobs)
    assert r.ok and r.lost_node is not None and r.lost_gpus == 4
    assert set(r.displaced) == set(r.replaced) and r.displaced and not r.unplaced


def test_a_pool_that_cannot_reports_what_would_wait_and_why() -> None:
    s = Scheduler([node("h1", 4, certs=HIPAA), node("h2", 2, certs=HIPAA), node("g1", 8)])
    jobs = place_all(s, [job("big", "clinic", count=4, tags=HIPAA), job("x", "clinic", tags=HIPAA)])
    r = n_plus_one(s, pool_of(HIPAA), jobs)
    assert not r.ok and r.lost_node == "h1"
    assert [u.workload for u in r.unplaced] == ["clinic/big"]
    assert r.unplaced[0].reason == "insufficient_capacity"
    # the general pool's largest node is g1 (8 GPUs), which holds nothing: trivially fine
    general = n_plus_one(s, frozenset(), jobs)
    assert general.ok and general.lost_node == "g1" and general.displaced == ()
    # a hipaa workload never goes to an uncertified node to make the numbers work
    assert all("g1" not in h.placement.nodes for h in s.held.values() if h.pool)


def test_preemption_and_repartitioning_count_as_the_scheduler_decides() -> None:
    s = Scheduler([node("n1", 2), node("n2", 2), node("m1", 1, mig=())])
    jobs = place_all(
        s,
        [
            job("hi", "t", count=2, priority=10),
            job("lo", "t", count=2, priority=0),
            job("mig", "t", mig_profile="1g.10gb"),
        ],
    )
    r = n_plus_one(s, frozenset(), jobs)
    # n1 and n2 tie on GPUs and use: n1 (the name) goes; "hi" preempts "lo", which then finds
    # no place: the pool cannot lose n1 without "lo" waiting
    assert (r.lost_node, r.displaced, r.replaced, r.victims) == ("n1", ("t/hi",), ("t/hi",),
                                                                 ("t/lo",))  # fmt: skip
    assert not r.ok and [(u.workload, u.reason) for u in r.unplaced] == [
        ("t/lo", "insufficient_capacity")
    ]
    # a MIG workload on a lost node is re-placed by repartitioning an idle MIG GPU elsewhere
    s2 = Scheduler([node("a", 2, mig=(MigInstance("1g.10gb", 0),)), node("b", 1, mig=())])
    jobs2 = place_all(s2, [job("m", "t", mig_profile="1g.10gb")])
    r2 = n_plus_one(s2, frozenset(), jobs2)
    assert (r2.lost_node, r2.ok, r2.repartitions) == ("a", True, 1)


def test_an_unknown_request_counts_as_unplaced() -> None:
    s = Scheduler([node("n1", 4), node("n2", 4)])
    place_all(s, [job("a", count=1)])
    r = n_plus_one(s, frozenset(), {})
    assert not r.ok and r.unplaced[0].reason is None


def test_no_node_serves_the_pool() -> None:
    s = Scheduler([node("n1", 4)])
    r = n_plus_one(s, pool_of({"pci-dss": "isolated"}), {})
    assert r.ok and r.lost_node is None and r.note


# --- the scheduler is left as it was -----------------------------------------------------------


def _state(s: Scheduler) -> tuple[object, ...]:
    return (
        {k: (h, s.rank(k)) for k, h in s.held.items()},
        {n.name: n for n in s.nodes()},
        dict(s.snapshot.allocations),
        {t: s.used(t) for t in {h.tenant for h in s.held.values()} | {"t0", "t1", "t2"}},
    )


def _random_cluster(rng: random.Random) -> tuple[Scheduler, dict[Hashable, Job]]:
    profiles = ("1g.10gb", "2g.20gb", "3g.40gb")
    nodes = []
    for i in range(rng.randint(2, 7)):
        certs = rng.choice([{}, HIPAA, {"hipaa": "true", "soc2": "type2"}, {"soc2": "type2"}])
        mig = tuple(MigInstance("1g.10gb", k) for k in range(7)) if rng.random() < 0.3 else None
        nodes.append(node(f"n{i}", rng.choice([1, 2, 4, 8]), certs=certs, mig=mig,
                          mig_gpus=rng.randint(0, 2) if mig else None))  # fmt: skip
    s = Scheduler(nodes)
    jobs: dict[Hashable, Job] = {}
    for k in range(rng.randint(1, 25)):
        tags = rng.choice([{}, {}, HIPAA, {"soc2": "type2"}])
        shape = rng.random()
        j = job(
            f"w{k}",
            f"t{rng.randint(0, 2)}",
            count=rng.choice([1, 1, 2, 4]) if shape < 0.6 else 1,
            tags=tags,
            mig_profile=rng.choice(profiles) if 0.6 <= shape < 0.8 else None,
            share=rng.choice([250, 500]) if shape >= 0.8 else None,
            priority=rng.randint(0, 3),
        )
        jobs[j.key] = j
        s.schedule(j)
    return s, jobs


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10_000))
def test_the_check_leaves_the_scheduler_as_it_was(seed: int) -> None:
    rng = random.Random(seed)
    s, jobs = _random_cluster(rng)
    before = _state(s)
    pools = pools_of(s.held.values(), extra=[HIPAA, {"soc2": "type2"}])
    needed = jobs_needed(s, pools)
    assert needed <= set(jobs)
    for pool in pools:
        n_plus_one(s, pool, jobs)
        assert _state(s) == before
    # and decides afterwards exactly as a scheduler built fresh from the same state
    fresh = Scheduler(
        list(s.nodes()), sorted(s.held.values(), key=lambda h: s.rank(h.key) or 0), s.quotas
    )
    for k in range(6):
        j = job(f"after{k}", "t1", count=rng.choice([1, 2]), priority=rng.randint(0, 4))
        a, b = s.schedule(j), fresh.schedule(j)
        assert (a.placement, a.reason, [v.key for v in a.preempted]) == (
            b.placement, b.reason, [v.key for v in b.preempted],
        )  # fmt: skip


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000))
def test_the_check_predicts_a_real_failover(seed: int) -> None:
    """Failing the node for real, on a copy, and re-offering its work the way the service
    does gives the same placed and unplaced workloads."""
    rng = random.Random(seed)
    s, jobs = _random_cluster(rng)
    for pool in pools_of(s.held.values()):
        r = n_plus_one(s, pool, jobs)
        if r.lost_node is None:
            continue
        copy = Scheduler(
            list(s.nodes()), sorted(s.held.values(), key=lambda h: s.rank(h.key) or 0), s.quotas
        )
        lost = copy.node(r.lost_node)
        assert lost is not None
        from dataclasses import replace

        copy.upsert_node(replace(lost, state=NodeState.FAILED))
        queue = [h for h in copy.held.values() if r.lost_node in h.placement.nodes]
        for h in queue:
            copy.release(h.key)
        queue.sort(key=lambda h: -h.priority)
        unplaced = []
        while queue:
            h = queue.pop(0)
            out = copy.schedule(jobs[h.key])
            if out.placement is None:
                unplaced.append(f"{h.tenant}/{h.name}")
            queue.extend(out.preempted)
            queue.sort(key=lambda v: -v.priority)
        assert sorted(u.workload for u in r.unplaced) == sorted(unplaced)


# --- forecast ------------------------------------------------------------------------------------


def test_forecast_of_a_rising_line() -> None:
    f = forecast([10, 12, 14, 16, 18], capacity=40, horizon_days=7)
    assert f.slope_per_week == pytest.approx(14)
    assert f.projected == pytest.approx(18 + 14)
    assert f.days_to_capacity == pytest.approx(11)


def test_forecast_flat_falling_empty_and_full() -> None:
    assert forecast([5, 5, 5], capacity=10).days_to_capacity is None
    assert forecast([9, 7, 5], capacity=10).days_to_capacity is None
    assert forecast([9, 7, 5], capacity=10).projected == 0.0  # never below zero
    empty = forecast([], capacity=10)
    assert (empty.days, empty.days_to_capacity) == (0, None)
    one = forecast([3], capacity=10)
    assert (one.slope_per_week, one.projected) == (0.0, 3.0)
    assert forecast([10, 12], capacity=11).days_to_capacity == 0.0
    assert set(forecast([1, 2], 3).to_json()) >= {"days_to_capacity", "slope_per_week"}


def test_labels() -> None:
    assert pool_label({}) == GENERAL
    assert pool_label({"b": "2", "a": "1"}) == "a=1,b=2"
    assert pool_label(pool_of({"hipaa": "true"})) == "hipaa=true"
    assert IsolationLevel.MIG  # the module's own vocabulary is the scheduler's
