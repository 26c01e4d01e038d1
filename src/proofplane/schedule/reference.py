"""The first placement engine, kept as the reference the snapshot is checked against.

It rebuilds usage from every allocation and scans every node on each call: O(nodes +
allocations) per decision, far too slow at scale, but short enough to read in one sitting and
trust. ``tests/test_snapshot.py`` replays random operations on a ``ClusterSnapshot`` and asks
this function the same question after each one; the answers must be identical (placement,
reason, message, rejection counts). ``bench/placement.py`` uses it for the before/after ratio.
Not part of the public API. Its reason codes and messages come from ``schedule.reasons``, as
the snapshot's do.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from proofplane.model import (
    Gpu,
    IsolationLevel,
    Node,
    NodeState,
    PlacedDevice,
    Placement,
    missing_tags,
)
from proofplane.schedule.reasons import (
    COMPLIANCE_FILTERS,
    GPU_MODEL_UNAVAILABLE,
    INSUFFICIENT_CAPACITY,
    INSUFFICIENT_CPU,
    INSUFFICIENT_GPU_CAPACITY,
    INSUFFICIENT_MEMORY,
    MISSING_CERTIFICATION,
    NO_COMPLIANT_CAPACITY,
    NODE_DEDICATED_TO_OTHER_TENANT,
    NODE_NOT_ADMITTED,
    NODE_SHARED_WITH_OTHER_TENANT,
    blocking,
    render,
)
from proofplane.schedule.values import (
    FULL_GPU_MILLI,
    Allocation,
    Decision,
    Request,
    allowed_models,
    gpu_conflict,
)


@dataclass(slots=True)
class _Usage:
    whole: set[int] = field(default_factory=set)
    mig: set[tuple[int, int]] = field(default_factory=set)
    shares: Counter[int] = field(default_factory=Counter)
    tenants: set[str] = field(default_factory=set)
    dedicated_to: str | None = None
    # GPU index → tenant holding a slice or share of it → whether all it holds there allows
    # co-residency
    holders: dict[int, dict[str, bool]] = field(default_factory=dict)
    cpu: int = 0  # milli-cores held
    mem: int = 0  # MiB held

    def idle(self, gpu: Gpu) -> bool:
        if gpu.index in self.whole or self.shares[gpu.index]:
            return False
        return not any(idx == gpu.index for idx, _ in self.mig)


def _usage(allocations: Iterable[Allocation]) -> dict[str, _Usage]:
    usage: dict[str, _Usage] = {}
    for alloc in allocations:
        u = usage.setdefault(alloc.placement.node, _Usage())
        u.tenants.add(alloc.tenant)
        u.cpu += alloc.cpu_milli
        u.mem += alloc.memory_mib
        if alloc.isolation is IsolationLevel.DEDICATED_NODE:
            u.dedicated_to = alloc.tenant
        for dev in alloc.placement.devices:
            if dev.mig_start is not None or dev.share_milli is not None:
                on_gpu = u.holders.setdefault(dev.gpu_index, {})
                on_gpu[alloc.tenant] = on_gpu.get(alloc.tenant, True) and alloc.co_residency
            if dev.mig_start is not None:
                u.mig.add((dev.gpu_index, dev.mig_start))
            elif dev.share_milli is not None:
                u.shares[dev.gpu_index] += dev.share_milli
            else:
                u.whole.add(dev.gpu_index)
    return usage


def _model_ok(gpu: Gpu, req: Request) -> bool:
    allowed = allowed_models(req.gpus.model)
    return allowed is None or gpu.model in allowed


def _open(gpu: Gpu, u: _Usage, req: Request) -> bool:
    return not gpu_conflict(req.tenant, req.co_residency, u.holders.get(gpu.index))


def _fit(node: Node, u: _Usage, req: Request) -> tuple[PlacedDevice, ...] | None:
    g = req.gpus
    if g.mig_profile is not None:
        free = [
            (gpu, inst)
            for gpu in node.gpus
            if gpu.mig_enabled and _model_ok(gpu, req) and _open(gpu, u, req)
            for inst in gpu.mig_instances
            if inst.profile == g.mig_profile and (gpu.index, inst.start) not in u.mig
        ]
        if len(free) < g.count:
            return None
        busy = Counter(idx for idx, _ in u.mig)
        free.sort(key=lambda gi: (-busy[gi[0].index], gi[0].index, gi[1].start))
        return tuple(
            PlacedDevice(gpu.index, gpu.uuid, mig_profile=inst.profile, mig_start=inst.start)
            for gpu, inst in free[: g.count]
        )
    plain = [
        gpu
        for gpu in node.gpus
        if not gpu.mig_enabled and _model_ok(gpu, req) and gpu.index not in u.whole
    ]
    if g.share_milli is not None:
        fits = [
            gpu
            for gpu in plain
            if u.shares[gpu.index] + g.share_milli <= FULL_GPU_MILLI and _open(gpu, u, req)
        ]
        if not fits:
            return None
        best = min(fits, key=lambda gpu: (FULL_GPU_MILLI - u.shares[gpu.index], gpu.index))
        return (PlacedDevice(best.index, best.uuid, share_milli=g.share_milli),)
    idle = [gpu for gpu in plain if not u.shares[gpu.index]]
    if len(idle) < g.count:
        return None
    return tuple(PlacedDevice(gpu.index, gpu.uuid) for gpu in idle[: g.count])


_Filter = Callable[[Node, _Usage, Request], str | None]


def _state(node: Node, _u: _Usage, _r: Request) -> str | None:
    return None if node.state is NodeState.ADMITTED else NODE_NOT_ADMITTED


def _certifications(node: Node, _u: _Usage, req: Request) -> str | None:
    return MISSING_CERTIFICATION if missing_tags(req.tags, node.certifications) else None


def _tenancy(_node: Node, u: _Usage, req: Request) -> str | None:
    if u.dedicated_to is not None and u.dedicated_to != req.tenant:
        return NODE_DEDICATED_TO_OTHER_TENANT
    if req.isolation is IsolationLevel.DEDICATED_NODE and u.tenants - {req.tenant}:
        return NODE_SHARED_WITH_OTHER_TENANT
    return None


def _gpu_model(node: Node, _u: _Usage, req: Request) -> str | None:
    if req.gpus.model is None or any(_model_ok(g, req) for g in node.gpus):
        return None
    return GPU_MODEL_UNAVAILABLE


def _cpu(node: Node, u: _Usage, req: Request) -> str | None:
    if node.cpu_milli is not None and req.cpu_milli > node.cpu_milli - u.cpu:
        return INSUFFICIENT_CPU
    return None


def _memory(node: Node, u: _Usage, req: Request) -> str | None:
    if node.memory_mib is not None and req.memory_mib > node.memory_mib - u.mem:
        return INSUFFICIENT_MEMORY
    return None


_FILTERS: tuple[_Filter, ...] = (_state, _certifications, _tenancy, _gpu_model, _cpu, _memory)


def reference_place(
    req: Request, nodes: Iterable[Node], allocations: Iterable[Allocation]
) -> Decision:
    """Choose a node and devices for ``req`` by scanning everything, or explain why none fits."""
    usage = _usage(allocations)
    rejections: Counter[str] = Counter()
    best: tuple[int, str, tuple[PlacedDevice, ...]] | None = None
    for node in nodes:
        u = usage.get(node.name) or _Usage()
        code = next((c for f in _FILTERS if (c := f(node, u, req)) is not None), None)
        devices = None if code else _fit(node, u, req)
        if code is None and devices is None:
            code = INSUFFICIENT_GPU_CAPACITY
        if code is not None:
            rejections[code] += 1
            continue
        assert devices is not None
        taken = {d.gpu_index for d in devices}
        idle_after = sum(1 for g in node.gpus if u.idle(g) and g.index not in taken)
        candidate = (idle_after, node.name, devices)
        if best is None or candidate[:2] < best[:2]:
            best = candidate
    if best is not None:
        return Decision(Placement(best[1], best[2]), None, f"placed on {best[1]}")
    total = sum(rejections.values())
    compliant = total - sum(n for c, n in rejections.items() if c in COMPLIANCE_FILTERS)
    if compliant == 0:
        return Decision(
            None,
            NO_COMPLIANT_CAPACITY,
            render(NO_COMPLIANT_CAPACITY, total=total, tags=dict(req.tags) or "this"),
            dict(rejections),
        )
    return Decision(
        None,
        INSUFFICIENT_CAPACITY,
        render(INSUFFICIENT_CAPACITY, compliant=compliant, blocking=blocking(rejections)),
        dict(rejections),
    )
