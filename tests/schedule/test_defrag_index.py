"""The defragmentation planner's region index (``schedule.defrag.RegionIndex``): kept between
calls, it must answer exactly what a fresh scan answers (the same plan, or the same refusal
with the same counts), whatever changed in between: work placed, moved, released or held
again, eligibility changed, nodes cordoned, re-certified or relaid out."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from defrag_cluster import (
    HIPAA,
    LAYOUTS,
    PROFILES,
    draw_layouts,
    fragmented,
    held,
    mig_job,
    mig_node,
)
from proofplane.model import NodeState
from proofplane.schedule.defrag import (
    Defragmenter,
    DefragPlan,
    RegionIndex,
    apply_plan,
    plan_defrag,
)
from proofplane.schedule.engine import Held, Scheduler

SMALL = fragmented(4)


@st.composite
def clusters(draw: st.DrawFn) -> tuple[Scheduler, set[Hashable]]:
    nodes = []
    work: list[Held] = []
    movable: set[Hashable] = set()
    for n in range(draw(st.integers(1, 4))):
        certified = draw(st.booleans())
        layouts = draw_layouts(draw, SMALL, 3)
        name = f"n{n}"
        nodes.append(mig_node(name, layouts, certs=HIPAA if certified else None))
        for g, layout in enumerate(layouts):
            for inst in layout:
                if not draw(st.integers(0, 3)):
                    continue
                key = f"w{len(work)}"
                tags = HIPAA if certified and draw(st.booleans()) else None
                work.append(held(key, name, g, inst.start, inst.profile, tags=tags))
                if draw(st.integers(0, 3)):
                    movable.add(key)
    return Scheduler(nodes, work), movable


OPS = st.lists(
    st.tuples(
        st.sampled_from(["plan", "plan", "plan", "release", "movable", "again", "node"]),
        st.integers(0, 1_000),
        st.booleans(),
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=200, deadline=None)
@given(clusters(), OPS)
def test_the_index_answers_what_a_fresh_scan_answers(
    case: tuple[Scheduler, set[Hashable]], ops: list[tuple[str, int, bool]]
) -> None:
    s, movable = case
    index = RegionIndex()
    for step, (op, n, flag) in enumerate(ops):
        keys = sorted(s.held, key=str)
        nodes = sorted(s.nodes(), key=lambda x: x.name)
        if op == "plan":
            job = mig_job(f"j{step}", PROFILES[n % len(PROFILES)], tags=HIPAA if flag else None)
            budget = n % 4
            kept = plan_defrag(s, job, movable.__contains__, budget, index=index)
            fresh = plan_defrag(s, job, movable.__contains__, budget)
            assert kept == fresh
            if isinstance(kept, DefragPlan) and n % 2:
                apply_plan(s, job, kept)  # moves work and relays a GPU out
        elif op == "release" and keys:
            s.release(keys[n % len(keys)])
        elif op == "movable" and keys:
            movable.symmetric_difference_update({keys[n % len(keys)]})
        elif op == "again" and keys:  # held again: equal content, another object
            h = s.held[keys[n % len(keys)]]
            s.hold(replace(h, priority=h.priority + int(flag)), rank=s.rank(h.key))
        elif op == "node":
            node = nodes[n % len(nodes)]
            if flag:
                state = (
                    NodeState.CORDONED if node.state is NodeState.ADMITTED else NodeState.ADMITTED
                )
                s.upsert_node(replace(node, state=state))
            else:
                certs = {} if node.certifications else dict(HIPAA)
                s.upsert_node(replace(node, certifications=certs))


def test_a_defragmenter_reuses_its_index_and_stays_exact() -> None:
    """A queue of requests on one scheduler: the engine's defragmenter (with its index) places
    and refuses exactly as fresh planners do, call after call."""
    layouts = [LAYOUTS[0], SMALL[0], SMALL[-1]]
    nodes = [mig_node(f"n{i}", layouts) for i in range(3)]
    work = [
        held(f"w{i}-{g}-{inst.start}", f"n{i}", g, inst.start, inst.profile)
        for i in range(3)
        for g, layout in enumerate(layouts)
        for inst in layout
        if (i + g + inst.start) % 3
    ]
    a, b = Scheduler(nodes, work), Scheduler(nodes, work)
    movable = {h.key for i, h in enumerate(work) if i % 5}
    da = Defragmenter(movable.__contains__, budget=6)
    for i, p in enumerate(PROFILES * 2):
        job = mig_job(f"q{i}", p)
        da.refusal = None  # set only when the engine reaches the defragmentation step
        out_a = a.schedule(job, defrag=da, preempt=False)
        db = Defragmenter(movable.__contains__, budget=da.budget + len(out_a.moves))
        out_b = b.schedule(job, defrag=db, preempt=False)  # a fresh planner each time
        assert out_a.placement == out_b.placement and out_a.moves == out_b.moves
        assert da.refusal == db.refusal


def test_the_snapshot_version_moves_with_every_change_of_a_node() -> None:
    s = Scheduler([mig_node("n0", [SMALL[0]]), mig_node("n1", [SMALL[0]])], [])
    snap = s.snapshot
    seen = {snap.version("n0")}
    other = snap.version("n1")
    inst = SMALL[0][0]
    s.hold(held("w", "n0", 0, inst.start, inst.profile))
    seen.add(snap.version("n0"))
    s.release("w")
    seen.add(snap.version("n0"))
    node = s.node("n0")
    assert node is not None
    s.upsert_node(replace(node, state=NodeState.CORDONED))
    seen.add(snap.version("n0"))
    assert len(seen) == 4 and snap.version("n1") == other
    assert snap.version("absent") == 0
