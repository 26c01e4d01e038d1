"""Test helpers for defragmentation (``schedule.defrag``): MIG nodes with given layouts, work
held on their instances, and the checks every plan must pass."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from collections.abc import Set as AbstractSet

from hypothesis import strategies as st

from proofplane.hardware.skus import SKUS, layout_errors
from proofplane.model import (
    Gpu,
    GpuRequest,
    IsolationLevel,
    MigInstance,
    Node,
    NodeState,
    PlacedDevice,
    Placement,
    missing_tags,
)
from proofplane.schedule.defrag import DefragPlan
from proofplane.schedule.engine import Held, Job, Scheduler, pool_of
from proofplane.schedule.mig import valid_layouts
from proofplane.schedule.values import Request

H100 = "H100-80GB"
#: every valid H100 layout without media extensions, and the fragmented ones (many instances)
LAYOUTS = [
    layout for layout in valid_layouts(H100) if not any(i.profile.endswith("+me") for i in layout)
]
HIPAA = {"hipaa": "true"}
PROFILES = ["1g.10gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"]


def fragmented(at_least: int) -> list[tuple[MigInstance, ...]]:
    """The valid layouts with ``at_least`` instances or more."""
    return [layout for layout in LAYOUTS if len(layout) >= at_least]


def draw_layouts(
    draw: st.DrawFn, small: list[tuple[MigInstance, ...]], gpus: int
) -> list[tuple[MigInstance, ...]]:
    """One node's GPU layouts for a hypothesis strategy: 1 to ``gpus`` GPUs, each a layout from
    ``small`` or any valid one."""
    return [
        draw(st.sampled_from(small) | st.sampled_from(LAYOUTS))
        for _ in range(draw(st.integers(1, gpus)))
    ]


SEVEN_1G = tuple(MigInstance("1g.10gb", s) for s in range(7))
TWO_3G = (MigInstance("3g.40gb", 0), MigInstance("3g.40gb", 4))


def mig_node(
    name: str,
    layouts: Iterable[tuple[MigInstance, ...]],
    *,
    certs: Mapping[str, str] | None = None,
) -> Node:
    return Node(
        name,
        "r",
        "z",
        certifications=dict(certs or {}),
        state=NodeState.ADMITTED,
        gpus=tuple(
            Gpu(i, f"GPU-{name}-{i}", H100, 81920, mig_enabled=True, mig_instances=layout)
            for i, layout in enumerate(layouts)
        ),
    )


def held(
    key: str,
    node: str,
    gpu: int,
    start: int,
    profile: str = "1g.10gb",
    *,
    tenant: str = "t",
    tags: Mapping[str, str] | None = None,
) -> Held:
    dev = PlacedDevice(gpu, f"GPU-{node}-{gpu}", mig_profile=profile, mig_start=start)
    return Held(
        key, key, tenant, IsolationLevel.MIG, 0, pool_of(dict(tags or {})), Placement(node, (dev,))
    )


def mig_job(
    key: str = "wait",
    profile: str = "4g.40gb",
    *,
    tenant: str = "t",
    tags: Mapping[str, str] | None = None,
) -> Job:
    return Job(
        key,
        Request(
            key,
            tenant,
            dict(tags or {}),
            IsolationLevel.MIG,
            GpuRequest(count=1, mig_profile=profile),
        ),
    )


def state_of(s: Scheduler) -> tuple[object, ...]:
    """Everything a plan must leave as it was: nodes, held work and its ranks."""
    return (
        sorted((n.name, n) for n in s.nodes()),
        sorted((str(k), h, s.rank(k)) for k, h in s.held.items()),
        sorted((str(k), a) for k, a in s.snapshot.allocations.items()),
    )


def check_plan(
    s: Scheduler, job: Job, plan: DefragPlan, movable: AbstractSet[Hashable], budget: int
) -> None:
    """The invariants of a plan, checked on ``s`` after ``apply_plan``: budget, only movable
    same-pool work moved, untouched GPUs with immovable work, valid layouts, compliance, no
    double allocation, the waiting job placed."""
    assert len(plan.moves) <= budget
    for m in plan.moves:
        assert m.key in movable
        h = s.held[m.key]
        assert h.pool == job.pool
        node = s.node(m.target.node)
        assert node is not None and not missing_tags(dict(h.pool), node.certifications)
    taken: set[tuple[str, int, int]] = set()
    for h in s.held.values():
        for part in h.placement.parts:
            node = s.node(part.node)
            assert node is not None
            if h.key == job.key or h.key in {m.key for m in plan.moves}:
                assert not missing_tags(dict(h.pool), node.certifications)
            for d in part.devices:
                gpu = next(g for g in node.gpus if g.index == d.gpu_index)
                assert MigInstance(d.mig_profile or "", d.mig_start or 0) in gpu.mig_instances
                slot = (part.node, d.gpu_index, d.mig_start or 0)
                assert slot not in taken, f"double allocation of {slot}"
                taken.add(slot)
    for node in s.nodes():
        for gpu in node.gpus:
            if gpu.mig_enabled and gpu.mig_instances:
                assert not layout_errors(SKUS[gpu.model], gpu.mig_instances)
    assert job.key in s.held
