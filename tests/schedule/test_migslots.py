"""MIG carving in the placement core (``schedule.migslots``, ``Scheduler(carver=...)``): the
layout state graph, the slot-choice plugins, and carving through the engine."""

from __future__ import annotations

from dataclasses import replace

from proofplane.hardware.skus import get_sku, layout_errors
from proofplane.model import Gpu, GpuRequest, IsolationLevel, MigInstance, Node, NodeState
from proofplane.schedule.engine import Job, Scheduler
from proofplane.schedule.migslots import (
    CarveIndex,
    FirstSlotBestFit,
    LeastFragmenting,
    geometry,
    gpu_states,
    max_fill,
    plan_carve,
    potentials,
)
from proofplane.schedule.scoring import make_scorer
from proofplane.schedule.values import Request

SKU = "H100-80GB"


def _state(*instances: tuple[str, int]) -> int:
    s = geometry(SKU).state_of(MigInstance(p, st) for p, st in instances)
    assert s is not None
    return s


def _idx(name: str) -> int:
    i = geometry(SKU).index(name)
    assert i is not None
    return i


def test_geometry_states_are_exactly_the_valid_layouts_without_me() -> None:
    geo = geometry(SKU)
    sku = get_sku(SKU)
    assert geo.layouts[0] == ()
    assert len(set(geo.layouts)) == len(geo.layouts)
    for lay in geo.layouts:
        assert layout_errors(sku, lay) == []
        assert all(not i.profile.endswith("+me") for i in lay)
    for s, row in enumerate(geo.moves):
        for p, moves in enumerate(row):
            for start, nxt in moves:
                added = set(geo.layouts[nxt]) - set(geo.layouts[s])
                assert added == {MigInstance(geo.profiles[p].name, start)}


def test_max_fill_and_stranded_compute() -> None:
    geo = geometry(SKU)
    fill = max_fill(geo)
    assert fill[0] == 7
    s = _state(("3g.40gb", 0), ("3g.40gb", 4))
    assert geo.free[s] == 1 and fill[s] == 0  # one slice, no memory left for it


def test_first_slot_and_least_fragmenting() -> None:
    geo = geometry(SKU)
    first = FirstSlotBestFit().move(geo, 0, _idx("1g.10gb"))
    assert first is not None and first[1] == 0
    lf = LeastFragmenting({"4g.40gb": 0.5, "3g.40gb": 0.5})
    best = lf.move(geo, 0, _idx("1g.10gb"))
    assert best is not None and best[1] >= 4  # keeps 4g@0 placeable
    assert geo.fit[best[2]][_idx("4g.40gb")] == 1
    three = lf.move(geo, 0, _idx("3g.40gb"))
    assert three is not None and three[1] == 4
    full = _state(("7g.80gb", 0))
    assert FirstSlotBestFit().move(geo, full, _idx("1g.10gb")) is None
    assert lf.move(geo, full, _idx("1g.10gb")) is None
    assert len(potentials(geo, [1.0] * len(geo.profiles))) == len(geo.layouts)


def _node(name: str, gpus: int = 1, cpu: int = 64_000) -> Node:
    return Node(
        name=name,
        region="r",
        zone="z",
        state=NodeState.ADMITTED,
        gpus=tuple(Gpu(i, f"{name}/{i}", SKU, 81_559, mig_enabled=True) for i in range(gpus)),
        cpu_milli=cpu,
        memory_mib=1 << 20,
    )


def _mig(name: str, profile: str, cpu: int = 0) -> Request:
    return Request(
        name, "t", {}, IsolationLevel.MIG, GpuRequest(count=1, mig_profile=profile), cpu_milli=cpu
    )


def test_carving_adds_instances_beside_running_ones_and_never_touches_them() -> None:
    sched = Scheduler([_node("a")], scorer=make_scorer("proofplane"), carver=LeastFragmenting())
    first = sched.schedule(Job(1, _mig("w1", "3g.40gb")), preempt=False, repartition=False)
    assert first.placement is not None and first.repartitions[0].carved
    second = sched.schedule(Job(2, _mig("w2", "4g.40gb")), preempt=False, repartition=False)
    assert second.placement is not None
    (change,) = second.repartitions
    assert change.carved and set(change.before) <= set(change.after)
    node = sched.node("a")
    assert node is not None
    assert layout_errors(get_sku(SKU), node.gpus[0].mig_instances) == []
    # full now: nothing fits
    third = sched.schedule(Job(3, _mig("w3", "1g.10gb")), preempt=False, repartition=False)
    assert third.placement is None
    # the server's default (no carver) never carves: a GPU holding work gets nothing new
    plain = Scheduler([_node("b")], scorer=make_scorer("proofplane"))
    assert plain.schedule(Job(1, _mig("w", "3g.40gb"))).placement is not None  # repartitioned
    plain.schedule(Job(2, _mig("x", "1g.10gb")), preempt=False)
    assert not any(r.carved for r in plain.schedule(Job(3, _mig("y", "2g.20gb"))).repartitions)


def test_reclaim_destroys_only_idle_instances() -> None:
    sched = Scheduler(
        [_node("a")], scorer=make_scorer("proofplane"), carver=FirstSlotBestFit(), reclaim=True
    )
    a = sched.schedule(Job(1, _mig("w1", "3g.40gb")), preempt=False, repartition=False)
    b = sched.schedule(Job(2, _mig("w2", "3g.40gb")), preempt=False, repartition=False)
    assert a.placement is not None and b.placement is not None
    sched.release(1)  # its 3g stays as an idle instance
    c = sched.schedule(Job(3, _mig("w3", "2g.20gb")), preempt=False, repartition=False)
    assert c.placement is not None
    (change,) = c.repartitions
    assert not change.carved  # the idle 3g was destroyed to make room
    kept = b.placement.devices[0]
    assert MigInstance("3g.40gb", kept.mig_start or 0) in change.after  # the running one stays


def test_carving_respects_cpu_and_falls_through_to_the_next_node() -> None:
    sched = Scheduler(
        [_node("a", cpu=1000), _node("b", cpu=8000)],
        scorer=make_scorer("first-slot-best-fit"),
        carver=FirstSlotBestFit(),
    )
    out = sched.schedule(Job(1, _mig("w", "1g.10gb", cpu=4000)), preempt=False, repartition=False)
    assert out.placement is not None and out.placement.node == "b"
    node_a = sched.node("a")
    assert node_a is not None and node_a.gpus[0].mig_instances == ()  # restored


def test_carving_asks_the_node_filters_before_changing_a_node() -> None:
    """``ClusterSnapshot.may_take`` (tenancy, model, CPU, memory) is a necessary condition of a
    fit, so carving skips a node it refuses without re-laying and restoring it; and the
    placements are those of carving every candidate."""
    nodes = [_node("a", gpus=2, cpu=3000), _node("b", cpu=2000), _node("c", gpus=2, cpu=9000)]
    sched = Scheduler(nodes, scorer=make_scorer("proofplane"), carver=LeastFragmenting())
    snap = sched.snapshot
    profiles = ["1g.10gb", "2g.20gb", "3g.40gb", "1g.20gb", "4g.40gb", "7g.80gb"]
    placed = []
    for i in range(24):
        req = _mig(f"w{i}", profiles[i % len(profiles)], cpu=500 * (1 + i % 4))
        for n in ("a", "b", "c"):
            if not snap.may_take(n, req):
                assert snap.member_fit(n, req) is None
        out = sched.schedule(Job(i, req), preempt=False, repartition=False)
        placed.append(out.placement)
        if out.placement is not None:
            node = sched.node(out.placement.node)
            assert node is not None and node.cpu_milli is not None
    assert any(p is None for p in placed) and sum(p is not None for p in placed) >= 6
    cpu_used = {n: 0 for n in ("a", "b", "c")}
    for i, p in enumerate(placed):
        if p is not None:
            cpu_used[p.node] += 500 * (1 + i % 4)
    assert cpu_used["a"] <= 3000 and cpu_used["b"] <= 2000 and cpu_used["c"] <= 9000
    assert not snap.may_take("missing", _mig("x", "1g.10gb"))
    short = _mig("big", "1g.10gb", cpu=10_000)  # no node has that much CPU
    assert not any(snap.may_take(n, short) for n in ("a", "b", "c"))
    assert sched.schedule(Job(99, short), preempt=False, repartition=False).placement is None


def test_idle_mig_nodes_follow_every_change() -> None:
    """``ClusterSnapshot.idle_mig_nodes`` (repartitioning's candidates) is exactly the admitted
    nodes with a MIG GPU nothing holds, after placements, releases and node changes."""
    nodes = [_node("a", gpus=2), _node("b"), _node("c", gpus=3)]
    sched = Scheduler(nodes, scorer=make_scorer("proofplane"), carver=LeastFragmenting())

    def expected() -> set[str]:
        return {
            n.name
            for n in sched.nodes()
            if n.state is NodeState.ADMITTED
            and any(g.mig_enabled and g.index not in sched.busy_gpus(n.name) for g in n.gpus)
        }

    assert set(sched.snapshot.idle_mig_nodes()) == expected() == {"a", "b", "c"}
    profiles = ["7g.80gb", "3g.40gb", "1g.10gb", "4g.40gb", "2g.20gb"]
    for i in range(12):
        sched.schedule(Job(i, _mig(f"w{i}", profiles[i % 5])), preempt=False)
        assert set(sched.snapshot.idle_mig_nodes()) == expected()
    assert set(sched.snapshot.idle_mig_nodes()) != {"a", "b", "c"}  # some GPU got busy
    for i in range(0, 12, 2):
        sched.release(i)
        assert set(sched.snapshot.idle_mig_nodes()) == expected()
    b = sched.node("b")
    assert b is not None
    sched.upsert_node(replace(b, state=NodeState.CORDONED))
    assert "b" not in sched.snapshot.idle_mig_nodes()
    assert set(sched.snapshot.idle_mig_nodes()) == expected()
    sched.remove_node("c")
    assert "c" not in sched.snapshot.idle_mig_nodes()


def test_candidates_of_every_shape_come_in_plan_order() -> None:
    """The indexed candidates (a heap per profile, count and models) are the nodes' plans
    sorted by (plan key, name), as a full scan orders them, also after nodes change."""
    index = CarveIndex(LeastFragmenting())
    nodes = {n.name: n for n in (_node("a", gpus=2), _node("b"), _node("c", gpus=3))}
    for n in nodes.values():
        index.track(n)

    def scan(profile: str, count: int, model: frozenset[str] | None) -> list[str]:
        rows = []
        for name in nodes:
            plan = plan_carve(index.carver, gpu_states(nodes[name]), profile, count, model)
            if plan is not None:
                rows.append((plan.key, name))
        return [name for _key, name in sorted(rows)]

    shapes = [("1g.10gb", 1, None), ("7g.80gb", 2, None), ("3g.40gb", 2, frozenset({SKU})),
              ("2g.20gb", 3, None), ("7g.80gb", 1, frozenset({"A100-80GB"}))]  # fmt: skip
    for step in range(4):
        for profile, count, model in shapes:
            got = [name for name, _plan in index.candidates(profile, count, model)]
            assert got == scan(profile, count, model), (step, profile, count)
        # carve the first candidate for a 2 x 3g request, as the engine would
        for name, plan in index.candidates("3g.40gb", 2, None):
            after = dict(plan.layouts)
            node = nodes[name]
            nodes[name] = replace(
                node,
                gpus=tuple(
                    replace(g, mig_instances=after[g.index]) if g.index in after else g
                    for g in node.gpus
                ),
            )
            index.track(nodes[name])
            break
    assert scan("7g.80gb", 2, frozenset({"A100-80GB"})) == []
