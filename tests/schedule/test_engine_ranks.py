"""Placement order in the engine (issue 15): preemption takes the most recently placed first
among equals, so what a decision only tries (releasing victims to see whether a job would
fit, then holding them again) must not move them in that order. Otherwise a scheduler that
tried a preemption decides differently from one loaded fresh from the database, where the
order is the placements' time."""

from __future__ import annotations

from proofplane.model import Gpu, GpuRequest, Node, NodeState
from proofplane.schedule.engine import Job, Scheduler
from proofplane.schedule.values import Request


def node(name: str, gpus: int) -> Node:
    devices = tuple(Gpu(i, f"GPU-{name}-{i}", "H100-80GB", 81920) for i in range(gpus))
    return Node(name, "r", "z", state=NodeState.ADMITTED, gpus=devices)


def job(key: str, count: int, priority: int = 0, nodes: int = 1) -> Job:
    g = GpuRequest(count, nodes=nodes)
    return Job(key, Request(key, "t", {}, g.natural_isolation, g), priority)


def order(s: Scheduler) -> list[object]:
    return sorted(s.held, key=lambda k: s.rank(k) or 0)


def test_a_preemption_that_does_not_help_keeps_the_order() -> None:
    s = Scheduler([node("a", 2), node("b", 2)])
    for k in ("w1", "w2", "w3", "w4"):
        assert s.schedule(job(k, 1)).placement is not None
    before = order(s)
    # too big even with every victim gone: each trial releases and re-holds victims
    assert s.schedule(job("huge", 3, priority=5)).placement is None
    assert s.schedule(job("gang", 6, priority=5, nodes=2)).placement is None
    assert order(s) == before


def test_a_tried_scheduler_decides_like_a_fresh_one() -> None:
    s = Scheduler([node("a", 2), node("b", 2)])
    for k in ("w1", "w2", "w3", "w4"):
        s.schedule(job(k, 1))
    s.schedule(job("huge", 3, priority=5))  # a failed trial
    fresh = Scheduler(list(s.nodes()), [s.held[k] for k in order(s)], s.quotas)
    a, b = s.schedule(job("hi", 1, priority=9)), fresh.schedule(job("hi", 1, priority=9))
    # node a (the lower name) holds w1 then w2: the most recently placed goes
    assert [v.key for v in a.preempted] == [v.key for v in b.preempted] == ["w2"]


def test_hold_at_a_rank_puts_it_back() -> None:
    s = Scheduler([node("a", 4)])
    for k in ("w1", "w2", "w3"):
        s.schedule(job(k, 1))
    h, rank = s.held["w1"], s.rank("w1")
    s.release("w1")
    assert s.rank("w1") is None
    s.hold(h, rank=rank)
    assert order(s) == ["w1", "w2", "w3"]
