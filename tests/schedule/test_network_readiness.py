"""``Scheduler.schedule(..., unready=...)`` (issue 14): a node that has not applied the job's
network segment takes no new work of it, counts under ``network_not_applied`` (after the
compliance filters), and is left exactly as it was; ``explain_job`` says the same."""

from __future__ import annotations

from proofplane.model import Gpu, GpuRequest, IsolationLevel, Node, NodeState
from proofplane.schedule.engine import Held, Job, Scheduler, pool_of
from proofplane.schedule.explain import explain_job
from proofplane.schedule.reasons import (
    INSUFFICIENT_CAPACITY,
    MISSING_CERTIFICATION,
    NETWORK_NOT_APPLIED,
    NO_COMPLIANT_CAPACITY,
    NODE_NOT_ADMITTED,
)
from proofplane.schedule.values import Request

H100 = "H100-80GB"


def node(name: str, gpus: int = 4, certs: dict[str, str] | None = None,
         state: NodeState = NodeState.ADMITTED) -> Node:  # fmt: skip
    return Node(
        name, "r", "z", certifications=dict(certs or {}), state=state,
        gpus=tuple(Gpu(i, f"GPU-{name}-{i}", H100, 81920) for i in range(gpus)),
    )  # fmt: skip


def job(key: str, count: int = 1, tags: dict[str, str] | None = None, nodes: int = 1,
        priority: int = 0, tenant: str = "t") -> Job:  # fmt: skip
    g = GpuRequest(count, nodes=nodes)
    req = Request(key, tenant, dict(tags or {}), IsolationLevel.EXCLUSIVE_GPU, g)
    return Job(key, req, priority)


def test_an_unready_node_takes_nothing_and_is_left_as_it_was() -> None:
    nodes = [node("a", 1), node("b", 4)]
    s = Scheduler(nodes)
    out = s.schedule(job("j"), unready=frozenset({"a"}))
    assert out.placement is not None and out.placement.node == "b"  # a would fit best
    assert [s.node(n.name) for n in nodes] == nodes  # restored
    again = s.schedule(job("k"))
    assert again.placement is not None and again.placement.node == "a"


def test_waiting_for_the_network_is_insufficient_capacity_not_no_compliant_capacity() -> None:
    s = Scheduler(
        [node("a", certs={"hipaa": "true"}), node("b"), node("c", state=NodeState.FAILED)]
    )
    out = s.schedule(job("j", tags={"hipaa": "true"}), unready=frozenset({"a", "b"}))
    assert out.placement is None and out.reason == INSUFFICIENT_CAPACITY
    # a passes the compliance filters, so it waits for its network; b is not certified anyway
    assert out.rejections == {NODE_NOT_ADMITTED: 1, MISSING_CERTIFICATION: 1,
                              NETWORK_NOT_APPLIED: 1}  # fmt: skip
    assert out.message.startswith("1 node(s) are admitted and certified")
    without = Scheduler([node("b")]).schedule(job("j", tags={"hipaa": "true"}))
    assert without.reason == NO_COMPLIANT_CAPACITY  # unchanged when no node waits


def test_the_note_names_the_waiting_nodes_when_capacity_also_lacks() -> None:
    s = Scheduler([node("a", 1), node("b", 1)])
    out = s.schedule(job("j", count=2), unready=frozenset({"a"}))
    assert out.reason == INSUFFICIENT_CAPACITY
    assert out.rejections == {NETWORK_NOT_APPLIED: 1, "insufficient_gpu_capacity": 1}
    assert "1 more node(s) wait for their agent to apply its network segment" in out.message


def test_preemption_never_takes_victims_on_an_unready_node() -> None:
    low = Held("low", "low", "t", IsolationLevel.EXCLUSIVE_GPU, 0, pool_of({}),
               Scheduler([node("a", 1)]).schedule(job("low")).placement)  # type: ignore[arg-type]  # fmt: skip
    s = Scheduler([node("a", 1)], [low])
    out = s.schedule(job("high", priority=10), unready=frozenset({"a"}))
    assert out.placement is None and out.preempted == ()
    assert "low" in s.held
    assert s.schedule(job("high", priority=10)).preempted == (low,)


def test_a_gang_skips_unready_nodes() -> None:
    s = Scheduler([node("a", 2), node("b", 2), node("c", 2)])
    out = s.schedule(job("g", count=4, nodes=2), unready=frozenset({"a"}))
    assert out.placement is not None and set(out.placement.nodes) == {"b", "c"}
    s = Scheduler([node("a", 2), node("b", 2)])
    out = s.schedule(job("g", count=4, nodes=2), unready=frozenset({"a"}))
    assert out.placement is None and out.rejections.get(NETWORK_NOT_APPLIED) == 1


def test_explain_counts_the_same_filter() -> None:
    s = Scheduler([node("a"), node("b"), node("c", certs={"x": "y"})])
    out = explain_job(s, job("j", tags={"x": "y"}), unready=frozenset({"a", "c"}))
    assert out["filters"] == {MISSING_CERTIFICATION: 2, NETWORK_NOT_APPLIED: 1}
    assert out["candidates_total"] == 0
    assert explain_job(s, job("j"), unready=frozenset({"a"}))["filters"] == {NETWORK_NOT_APPLIED: 1}
