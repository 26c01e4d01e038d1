"""The defragmentation planner's shortcuts (``schedule.defrag``): the trials it skips
(``_Doomed``: a request placed nowhere now can only go to the region's node, which cannot
take it) and ``movable=None`` (every held workload may move) must answer exactly what
running every trial with a ``movable`` callable answers, on clusters tight in instances, CPU
and memory, with several tenants and pools, work of two instances, and changes between
calls."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import replace
from unittest import mock

from hypothesis import given, settings
from hypothesis import strategies as st

from defrag_cluster import (
    HIPAA,
    PROFILES,
    draw_layouts,
    fragmented,
    held,
    mig_job,
    mig_node,
)
from proofplane.model import NodeState, PlacedDevice, Placement
from proofplane.schedule import defrag
from proofplane.schedule.defrag import DefragPlan, RegionIndex, apply_plan, plan_defrag
from proofplane.schedule.engine import Held, Scheduler
from proofplane.schedule.scoring import DEFAULT_SCORER, make_scorer

SMALL = fragmented(3)


@st.composite
def clusters(draw: st.DrawFn) -> tuple[Scheduler, set[Hashable]]:
    nodes = []
    work: list[Held] = []
    movable: set[Hashable] = set()
    for n in range(draw(st.integers(1, 4))):
        certified = draw(st.booleans())
        layouts = draw_layouts(draw, SMALL, 3)
        name = f"n{n}"
        node = mig_node(name, layouts, certs=HIPAA if certified else None)
        cpu = draw(st.sampled_from([None, 0, 2_000, 4_000, 8_000]))
        mem = draw(st.sampled_from([None, 4_096, 16_384]))
        nodes.append(replace(node, cpu_milli=cpu, memory_mib=mem))
        taken: set[tuple[int, int]] = set()
        for g, layout in enumerate(layouts):
            for inst in layout:
                if (g, inst.start) in taken or not draw(st.integers(0, 3)):
                    continue
                key = f"w{len(work)}"
                tags = HIPAA if certified and draw(st.booleans()) else None
                h = held(key, name, g, inst.start, inst.profile, tags=tags)
                h = replace(
                    h,
                    tenant=draw(st.sampled_from(["t", "t", "u"])),
                    co_residency=draw(st.integers(0, 5)) > 0,
                    cpu_milli=draw(st.sampled_from([0, 500, 1_000, 3_000])),
                    memory_mib=draw(st.sampled_from([0, 1_024, 8_192])),
                )
                taken.add((g, inst.start))
                # sometimes a second instance of the same profile on another GPU
                for g2, other in enumerate(layouts):
                    twin = next(
                        (
                            i
                            for i in other
                            if i.profile == inst.profile and (g2, i.start) not in taken
                        ),
                        None,
                    )
                    if g2 != g and twin is not None and not draw(st.integers(0, 4)):
                        dev = PlacedDevice(g2, f"GPU-{name}-{g2}", inst.profile, twin.start)
                        h = replace(h, placement=Placement(name, (*h.placement.devices, dev)))
                        taken.add((g2, twin.start))
                        break
                work.append(h)
                if draw(st.integers(0, 3)):
                    movable.add(key)
    scorer = make_scorer(DEFAULT_SCORER) if draw(st.booleans()) else None  # the server's search
    return Scheduler(nodes, work, scorer=scorer), movable


def _checked_fails(self: defrag._Doomed, region: defrag._Region) -> bool:
    """``_Doomed.fails``, with every trial it skips run anyway: it must have failed."""
    doomed = _FAILS(self, region)
    if doomed:
        layout = None
        if region.relayout:
            gpu = next(x for x in region.node.gpus if x.index == region.gpu_index)
            profile = self.job.request.gpus.mig_profile
            assert profile is not None
            layout = defrag._new_layout(
                defrag.SKUS[gpu.model],
                tuple(sorted(gpu.mig_instances, key=lambda i: i.start)),
                set(region.stay),
                defrag.MigInstance(profile, region.start),
            )
        assert defrag._trial(self.scheduler, self.job, region, layout, 0) is None
    return doomed


_FAILS = defrag._Doomed.fails

OPS = st.lists(
    st.tuples(
        st.sampled_from(["plan", "plan", "plan", "release", "movable", "node"]),
        st.integers(0, 1_000),
        st.booleans(),
    ),
    min_size=1,
    max_size=10,
)


@settings(max_examples=300, deadline=None)
@given(clusters(), OPS, st.booleans())
def test_skipped_trials_and_all_movable_answer_what_every_trial_answers(
    case: tuple[Scheduler, set[Hashable]], ops: list[tuple[str, int, bool]], everything: bool
) -> None:
    s, movable = case
    if everything:  # every workload may move: the replay's movable=None
        movable = set(s.held)
    index = RegionIndex()
    with mock.patch.object(defrag._Doomed, "fails", _checked_fails):
        for step, (op, n, flag) in enumerate(ops):
            keys = sorted(s.held, key=str)
            nodes = sorted(s.nodes(), key=lambda x: x.name)
            if op == "plan":
                job = mig_job(f"j{step}", PROFILES[n % len(PROFILES)], tags=HIPAA if flag else None)
                job = replace(
                    job,
                    request=replace(
                        job.request, cpu_milli=(n % 3) * 1_000, memory_mib=(n % 5) * 2_048
                    ),
                )
                budget = 1 + n % 4
                ask = None if everything else movable.__contains__
                kept = plan_defrag(s, job, ask, budget, index=index)
                every = plan_defrag(s, job, movable.__contains__, budget, prune=False)
                assert kept == every
                assert plan_defrag(s, job, ask, budget) == every
                if isinstance(kept, DefragPlan) and n % 2:
                    apply_plan(s, job, kept)
                    if everything:
                        movable = set(s.held)
            elif op == "release" and keys:
                s.release(keys[n % len(keys)])
            elif op == "movable" and keys and not everything:
                movable.symmetric_difference_update({keys[n % len(keys)]})
            elif op == "node":
                node = nodes[n % len(nodes)]
                if flag:
                    state = (
                        NodeState.CORDONED
                        if node.state is NodeState.ADMITTED
                        else NodeState.ADMITTED
                    )
                    s.upsert_node(replace(node, state=state))
                else:
                    certs = {} if node.certifications else dict(HIPAA)
                    s.upsert_node(replace(node, certifications=certs))


def test_a_trial_is_skipped_when_the_work_fits_nowhere_else() -> None:
    """One 1g instance holds GPU 0's 4g region; no other 1g instance is free: the one
    region's trial is skipped, and the refusal is the one running it gives."""
    a = mig_node("a", [defrag_layout("1g.10gb", 7)])
    s = Scheduler([a], [held(f"w{i}", "a", 0, i) for i in range(7)])
    job = mig_job("j", "4g.40gb")
    runs: list[object] = []
    real = defrag._trial

    def spy(*args: object, **kw: object) -> object:
        runs.append(args)
        return real(*args, **kw)  # type: ignore[arg-type]

    with mock.patch.object(defrag, "_trial", spy):
        skipped = plan_defrag(s, job, None, 10)
    assert runs == []
    assert skipped == plan_defrag(s, job, lambda _k: True, 10, prune=False)


def defrag_layout(profile: str, n: int) -> tuple[defrag.MigInstance, ...]:
    return tuple(defrag.MigInstance(profile, i) for i in range(n))
