"""The defragmentation planner (``schedule.defrag``, issue 17 §3): fewest moves, only idle or
restartable work of the request's own pool, never to a node its tags do not allow, within the
budget, and the scheduler left as it was found."""

from __future__ import annotations

from defrag_cluster import (
    SEVEN_1G,
    TWO_3G,
    check_plan,
    held,
    mig_job,
    mig_node,
    state_of,
)
from proofplane.model import MigInstance
from proofplane.schedule.defrag import (
    DEFRAG_DETAIL,
    NO_DESTINATION,
    NON_RESTARTABLE_WORK,
    OTHER_POOL,
    OVER_BUDGET,
    Defragmenter,
    DefragPlan,
    DefragRefusal,
    apply_plan,
    plan_defrag,
)
from proofplane.schedule.engine import Scheduler


def fragmented() -> Scheduler:
    """Three nodes of one H100 in seven 1g slices each. A 4g (slots 0-3) needs one move on n1
    (slot 0), two on n2 (slots 0, 1), one on n3 (slot 0; slots 4-6 stay where they are)."""
    nodes = [mig_node("n1", [SEVEN_1G]), mig_node("n2", [SEVEN_1G]), mig_node("n3", [SEVEN_1G])]
    work = [
        held("a", "n1", 0, 0),
        held("b", "n2", 0, 0),
        held("c", "n2", 0, 1),
        held("d", "n3", 0, 4),
        held("e", "n3", 0, 5),
        held("f", "n3", 0, 6),
        held("g", "n3", 0, 0),
    ]
    return Scheduler(nodes, work)


def test_frees_the_region_with_the_fewest_moves() -> None:
    s = fragmented()
    job = mig_job()
    assert s.schedule(job).placement is None  # waits without defragmentation
    before = state_of(s)
    movable = set(s.held)
    plan = plan_defrag(s, job, movable.__contains__, budget=10)
    assert isinstance(plan, DefragPlan)
    assert state_of(s) == before  # the planner leaves the scheduler as it found it
    assert [m.key for m in plan.moves] == ["a"]  # one move, on n1 (n3 ties, later by name)
    assert plan.placement.node == "n1"
    assert plan.placement.devices[0].mig_profile == "4g.40gb"
    assert plan.repartition is not None and MigInstance("4g.40gb", 0) in plan.repartition.after
    out = apply_plan(s, job, plan)
    assert out.placement == plan.placement and out.moves == plan.moves
    assert "after defragmentation" in out.message
    check_plan(s, job, plan, movable, 10)


def test_the_engine_defragments_before_preempting() -> None:
    s = fragmented()
    job = mig_job()
    d = Defragmenter(set(s.held).__contains__, budget=3)
    out = s.schedule(job, defrag=d)
    assert out.placement is not None and [m.key for m in out.moves] == ["a"]
    assert d.budget == 2 and d.refusal is None
    moved = s.held["a"].placement
    assert moved.node != "n1" or (moved.devices[0].mig_start or 0) >= 4  # out of the region


def test_refuses_when_only_non_restartable_work_blocks() -> None:
    s = fragmented()
    job = mig_job()
    before = state_of(s)
    out = plan_defrag(s, job, lambda key: False, budget=10)
    assert isinstance(out, DefragRefusal) and out.code == NON_RESTARTABLE_WORK
    assert "not restartable" in out.message
    assert state_of(s) == before
    # an immovable workload on n1's GPU closes that GPU: n3's one move is the answer
    plan = plan_defrag(s, job, lambda key: key != "a", budget=10)
    assert isinstance(plan, DefragPlan)
    assert [m.key for m in plan.moves] == ["g"]
    # immovable work on n1 and n3: n2's two moves
    plan = plan_defrag(s, job, lambda key: key not in ("a", "d"), budget=10)
    assert isinstance(plan, DefragPlan)
    assert sorted(str(m.key) for m in plan.moves) == ["b", "c"]
    assert all(m.source.node == "n2" for m in plan.moves)


def test_never_touches_a_gpu_with_immovable_work_even_outside_the_region() -> None:
    # n1: the only movable work in the region, but an immovable 1g at slot 6 on the same GPU
    s = Scheduler(
        [mig_node("n1", [SEVEN_1G]), mig_node("n2", [SEVEN_1G])],
        [held("a", "n1", 0, 0), held("x", "n1", 0, 6), held("y", "n2", 0, 3)],
    )
    out = plan_defrag(s, mig_job(), lambda key: key != "x" and key != "y", budget=10)
    assert isinstance(out, DefragRefusal) and out.code == NON_RESTARTABLE_WORK


def test_respects_the_budget() -> None:
    s = fragmented()
    job = mig_job()
    out = plan_defrag(s, job, set(s.held).__contains__, budget=0)
    assert isinstance(out, DefragRefusal) and out.code == OVER_BUDGET
    assert "1 move(s)" in out.message
    plan = plan_defrag(s, job, lambda key: key not in ("a", "g"), budget=1)  # n2 needs 2
    assert isinstance(plan, DefragRefusal) and plan.code == OVER_BUDGET
    d = Defragmenter(set(s.held).__contains__, budget=0)
    assert s.schedule(job, defrag=d, preempt=False).placement is None
    assert d.refusal is not None and d.refusal.code == OVER_BUDGET


def test_never_crosses_pools_nor_violates_tags() -> None:
    hipaa = {"hipaa": "true"}
    # the only certified node holds general-pool work: never moved for a HIPAA request
    s = Scheduler(
        [mig_node("h1", [SEVEN_1G], certs=hipaa), mig_node("g1", [SEVEN_1G])],
        [held("gen", "h1", 0, 0)],
    )
    job = mig_job(tags=hipaa)
    out = plan_defrag(s, job, lambda key: True, budget=10)
    assert isinstance(out, DefragRefusal) and out.code == OTHER_POOL
    # HIPAA work may move only to another HIPAA node: none has room, so no plan
    s = Scheduler(
        [mig_node("h1", [SEVEN_1G], certs=hipaa), mig_node("g1", [SEVEN_1G])],
        [held(f"w{i}", "h1", 0, i, tags=hipaa) for i in range(4)]
        + [held(f"v{i}", "h1", 0, i, tags=hipaa) for i in range(4, 7)],
    )
    out = plan_defrag(s, job, lambda key: True, budget=10)
    assert isinstance(out, DefragRefusal) and out.code == NO_DESTINATION
    # with a second HIPAA node with free slices, the work moves there and nowhere else
    s = Scheduler(
        [
            mig_node("h1", [SEVEN_1G], certs=hipaa),
            mig_node("h2", [SEVEN_1G, TWO_3G], certs=hipaa),
            mig_node("g1", [SEVEN_1G]),
        ],
        [held("w0", "h1", 0, 0, tags=hipaa), held("h2a", "h2", 0, 0, tags=hipaa)]
        + [held(f"h2b{i}", "h2", 0, i, tags=hipaa) for i in range(1, 7)]
        + [held(f"h2c{i}", "h2", 1, 4 * i, "3g.40gb", tags=hipaa) for i in range(2)],
    )
    movable = {"w0"}
    plan = plan_defrag(s, job, movable.__contains__, budget=10)
    assert isinstance(plan, DefragPlan)
    assert [m.key for m in plan.moves] == ["w0"]
    # h1's only other room is its own GPU outside the region, on the new layout
    assert plan.moves[0].target.node == "h1"
    apply_plan(s, job, plan)
    check_plan(s, job, plan, movable, 10)


def test_an_occupied_instance_of_the_profile_is_freed_without_a_new_layout() -> None:
    layout = (MigInstance("4g.40gb", 0), MigInstance("3g.40gb", 4))
    s = Scheduler(
        [mig_node("n1", [layout]), mig_node("n2", [layout])],
        [held("big", "n1", 0, 0, "4g.40gb"), held("x", "n2", 0, 4, "3g.40gb")],
    )
    # n2's 4g is free but its GPU holds immovable work: the 4g request takes it directly
    job = mig_job()
    out = s.schedule(job)
    assert out.placement is not None and out.placement.node == "n2"
    # a second 4g: n1's holder could move only to a 4g, none is free: no destination
    job2 = mig_job("wait2")
    refusal = plan_defrag(s, job2, lambda key: key == "big", budget=10)
    assert isinstance(refusal, DefragRefusal) and refusal.code == NO_DESTINATION


def test_a_queue_of_alike_requests_costs_one_search() -> None:
    s = fragmented()
    asked: list[object] = []

    def never(key: object) -> bool:
        asked.append(key)
        return False

    d = Defragmenter(never, budget=5)
    assert s.schedule(mig_job("w1"), defrag=d, preempt=False).placement is None
    first = len(asked)
    assert first and d.refusal is not None and d.refusal.code == NON_RESTARTABLE_WORK
    assert s.schedule(mig_job("w2"), defrag=d, preempt=False).placement is None
    assert len(asked) == first and d.refusal.code == NON_RESTARTABLE_WORK
    # another shape is searched again
    s.schedule(mig_job("w3", "7g.80gb"), defrag=d, preempt=False)
    assert len(asked) > first


def test_a_mover_never_goes_to_a_node_that_has_not_applied_its_network() -> None:
    s = fragmented()
    job = mig_job()
    everywhere = frozenset({"n1", "n2", "n3"})
    plan = plan_defrag(
        s,
        job,
        set(s.held).__contains__,
        budget=10,
        unready=lambda h: everywhere if h.key == "a" else frozenset(),
    )
    assert isinstance(plan, DefragPlan)
    assert [m.key for m in plan.moves] == ["g"]  # "a" could go nowhere: n3's region instead
    plan = plan_defrag(
        s, job, set(s.held).__contains__, budget=10, unready=lambda h: frozenset({"n2", "n3"})
    )
    assert isinstance(plan, DefragPlan)
    assert all(m.target.node == "n1" for m in plan.moves)
    assert all(n.state.value == "admitted" for n in s.nodes())  # hidden nodes restored


def test_work_outside_the_region_stays_and_the_gpu_is_relaid_without_a_move() -> None:
    s = Scheduler(
        [mig_node("n1", [SEVEN_1G]), mig_node("n2", [SEVEN_1G])],
        [held("edge", "n1", 0, 6), held("x", "n2", 0, 0)],
    )
    job = mig_job()
    out = s.schedule(job, defrag=Defragmenter(lambda key: key == "edge", budget=0 + 1))
    assert out.placement is not None and out.placement.node == "n1" and out.moves == ()
    assert DEFRAG_DETAIL in out.details
    (change,) = out.repartitions
    assert MigInstance("1g.10gb", 6) in change.after and MigInstance("4g.40gb", 0) in change.after
    assert s.held["edge"].placement.devices[0].mig_start == 6  # it did not move
