"""Property tests of defragmentation (issue 17 §3) on random fragmented MIG clusters: no
non-restartable running work moved, no GPU holding such work touched, the move budget kept,
every MIG layout valid, no compliance violation, no double allocation, and the scheduler left
as it was whenever the planner declines."""

from __future__ import annotations

from collections.abc import Hashable

from hypothesis import given, settings
from hypothesis import strategies as st

from defrag_cluster import (
    H100,
    HIPAA,
    check_plan,
    draw_layouts,
    fragmented,
    held,
    mig_job,
    mig_node,
    state_of,
)
from proofplane.hardware.skus import SKUS, layout_errors
from proofplane.model import MigInstance
from proofplane.schedule.defrag import Defragmenter, DefragPlan, apply_plan, plan_defrag
from proofplane.schedule.engine import Held, Scheduler

SMALL = fragmented(4)  # fragmented: many small slices


@st.composite
def clusters(draw: st.DrawFn) -> tuple[Scheduler, set[Hashable], dict[str, str], str, int]:
    n_nodes = draw(st.integers(1, 5))
    nodes = []
    work: list[Held] = []
    movable: set[Hashable] = set()
    for n in range(n_nodes):
        certified = draw(st.booleans())
        layouts = draw_layouts(draw, SMALL, 2)
        name = f"n{n}"
        nodes.append(mig_node(name, layouts, certs=HIPAA if certified else None))
        for g, layout in enumerate(layouts):
            for inst in layout:
                if not draw(st.integers(0, 4)):  # most instances held: a busy cluster
                    continue
                key = f"w{len(work)}"
                tags = HIPAA if certified and draw(st.booleans()) else None
                work.append(held(key, name, g, inst.start, inst.profile, tags=tags))
                if draw(st.integers(0, 3)):
                    movable.add(key)
    tags = HIPAA if draw(st.booleans()) else {}
    profile = draw(st.sampled_from(["3g.40gb", "4g.40gb", "7g.80gb", "2g.20gb"]))
    budget = draw(st.integers(0, 4))
    return Scheduler(nodes, work), movable, tags, profile, budget


def _untouchable(s: Scheduler, movable: set[Hashable]) -> dict[tuple[str, int], object]:
    """Per GPU holding immovable work: its layout and what every holder holds there."""
    out: dict[tuple[str, int], object] = {}
    for node in s.nodes():
        for gpu in node.gpus:
            on = sorted(
                (str(h.key), h.placement)
                for h in s.held.values()
                if any(
                    p.node == node.name and d.gpu_index == gpu.index
                    for p in h.placement.parts
                    for d in p.devices
                )
            )
            if any(s.held[k].key not in movable for k, _p in on):
                out[(node.name, gpu.index)] = (gpu.mig_instances, on)
    return out


@settings(max_examples=300, deadline=None)
@given(clusters())
def test_plans_keep_every_rule(
    case: tuple[Scheduler, set[Hashable], dict[str, str], str, int],
) -> None:
    s, movable, tags, profile, budget = case
    job = mig_job(profile=profile, tags=tags)
    if s.place(job.request)[0] is not None:
        return  # not waiting: nothing to defragment
    before = state_of(s)
    frozen = _untouchable(s, movable)
    original = {k: h for k, h in s.held.items()}
    out = plan_defrag(s, job, movable.__contains__, budget)
    assert state_of(s) == before
    if not isinstance(out, DefragPlan):
        return
    apply_plan(s, job, out)
    check_plan(s, job, out, movable, budget)
    # no immovable work moved, no GPU holding it touched
    for key, h in original.items():
        if key not in movable:
            assert s.held[key].placement == h.placement
    after = _untouchable(s, movable)
    for gpu, was in frozen.items():
        node = s.node(gpu[0])
        assert node is not None
        now = next(g for g in node.gpus if g.index == gpu[1]).mig_instances
        assert now == was[0]  # type: ignore[index]
        assert after.get(gpu, was) is not None
    assert out.placement.devices[0].mig_profile == profile
    assert MigInstance(profile, out.placement.devices[0].mig_start or 0) in next(
        g.mig_instances
        for g in (s.node(out.placement.node) or mig_node("x", [])).gpus
        if g.index == out.placement.devices[0].gpu_index
    )


@settings(max_examples=150, deadline=None)
@given(clusters(), st.lists(st.sampled_from(["3g.40gb", "4g.40gb", "7g.80gb"]), max_size=4))
def test_the_engine_keeps_the_budget_over_a_queue(
    case: tuple[Scheduler, set[Hashable], dict[str, str], str, int], more: list[str]
) -> None:
    s, movable, tags, profile, budget = case
    original = dict(s.held)
    d = Defragmenter(movable.__contains__, budget)
    total = 0
    for i, p in enumerate([profile, *more]):
        job = mig_job(f"q{i}", p, tags=tags)
        out = s.schedule(job, defrag=d, preempt=False)
        total += len(out.moves)
        for m in out.moves:
            assert m.key in movable and original[m.key].pool == job.pool
    assert total <= budget and d.budget == budget - total
    for key, h in original.items():  # immovable work stays where it was
        if key not in movable:
            assert s.held[key].placement == h.placement
    for node in s.nodes():
        for gpu in node.gpus:
            assert not gpu.mig_instances or not layout_errors(SKUS[H100], gpu.mig_instances)
