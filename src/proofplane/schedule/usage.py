"""Per-node accounting for placement: what a node offers and what its allocations hold.

``NodeInfo`` is what placement needs from a node, precomputed once when the node is upserted
(its GPUs by kind, its MIG instances by profile, the capacity class keys of each GPU).
``Usage`` is what the allocations on one node hold, kept by reference count so that a release
is the exact inverse of its reserve. Both are read by the fit rules (``schedule.fit``) and the
capacity signatures (``schedule.buckets``); the ``ClusterSnapshot`` (``schedule.snapshot``)
owns them and keeps them current.

Capacity classes: ``(CLASS_WHOLE, model)`` (idle plain GPUs), ``(CLASS_SHARE, model)`` (room
on one plain GPU for a share) and ``(CLASS_MIG, profile, model)`` (free instances of a MIG
profile), ``model`` None meaning any.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import TypeVar

from proofplane.model import Gpu, IsolationLevel, MigInstance, Node, NodeState
from proofplane.schedule.values import Allocation, Request

ClassKey = tuple[str | None, ...]
Slot = tuple[int, int]  # (GPU index, MIG start)

CLASS_WHOLE, CLASS_SHARE, CLASS_MIG = "w", "s", "m"
_DEDICATED = IsolationLevel.DEDICATED_NODE

_K = TypeVar("_K", bound=Hashable)


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """What placement needs from a node, precomputed once per upsert."""

    node: Node
    admitted: bool
    indexes: tuple[int, ...]
    plain: tuple[Gpu, ...]  # GPUs without MIG, in node order
    # profile → (GPU, instance, its (index, start) slot), in node order
    mig: dict[str, tuple[tuple[Gpu, MigInstance, Slot], ...]]
    models: frozenset[str]
    # (index, whole-GPU class keys, share class keys) per plain GPU
    plain_keys: tuple[tuple[int, tuple[ClassKey, ...], tuple[ClassKey, ...]], ...]
    # per MIG GPU: (index, per profile on it: (MIG class keys, its (index, start) slots))
    mig_gpus: tuple[tuple[int, tuple[tuple[tuple[ClassKey, ...], tuple[Slot, ...]], ...]], ...]
    cpu: int | None = None  # allocatable milli-cores; None: not tracked
    mem: int | None = None  # allocatable MiB; None: not tracked


def node_info(node: Node, intern: dict[ClassKey, ClassKey]) -> NodeInfo:
    """``intern`` shares equal key tuples between nodes (thousands of nodes, a few keys)."""

    def keys(*ks: ClassKey) -> tuple[ClassKey, ...]:
        return tuple(intern.setdefault(k, k) for k in ks)

    mig: dict[str, list[tuple[Gpu, MigInstance, Slot]]] = {}
    mig_gpus = []
    plain: list[Gpu] = []
    plain_keys: list[tuple[int, tuple[ClassKey, ...], tuple[ClassKey, ...]]] = []
    for gpu in node.gpus:
        if gpu.mig_enabled:
            by_profile: dict[str, list[Slot]] = {}
            for inst in gpu.mig_instances:
                slot = (gpu.index, inst.start)
                mig.setdefault(inst.profile, []).append((gpu, inst, slot))
                by_profile.setdefault(inst.profile, []).append(slot)
            mig_gpus.append(
                (
                    gpu.index,
                    tuple(
                        (keys((CLASS_MIG, p, None), (CLASS_MIG, p, gpu.model)), tuple(slots))
                        for p, slots in by_profile.items()
                    ),
                )
            )
        else:
            plain.append(gpu)
            plain_keys.append(
                (
                    gpu.index,
                    keys((CLASS_WHOLE, None), (CLASS_WHOLE, gpu.model)),
                    keys((CLASS_SHARE, None), (CLASS_SHARE, gpu.model)),
                )
            )
    return NodeInfo(
        node=node,
        admitted=node.state is NodeState.ADMITTED,
        indexes=tuple(g.index for g in node.gpus),
        plain=tuple(plain),
        mig={p: tuple(v) for p, v in mig.items()},
        models=frozenset(g.model for g in node.gpus),
        plain_keys=tuple(plain_keys),
        mig_gpus=tuple(mig_gpus),
        cpu=node.cpu_milli,
        mem=node.memory_mib,
    )


class Usage:
    """What the allocations on one node hold, by reference count (release undoes reserve)."""

    __slots__ = (
        "busy", "cpu", "dedicated", "gpu_private", "gpu_tenants", "keys", "mem", "mig", "shares",
        "tenants", "whole",
    )  # fmt: skip

    def __init__(self) -> None:
        self.whole: dict[int, int] = {}  # GPU index → holders
        self.mig: dict[tuple[int, int], int] = {}  # (GPU index, start) → holders
        self.busy: dict[int, int] = {}  # GPU index → MIG instances in use on it
        self.shares: dict[int, int] = {}  # GPU index → milli held
        self.tenants: dict[str, int] = {}  # tenant → allocations
        self.dedicated: dict[Hashable, str] = {}  # key → tenant, for dedicated-node holders
        self.keys: dict[Hashable, None] = {}  # allocations here, in reservation order
        # GPU index → tenant → holders of a MIG instance or share on it (co-residency rule);
        # gpu_private: the same for holders that do not allow co-residency
        self.gpu_tenants: dict[int, dict[str, int]] = {}
        self.gpu_private: dict[int, dict[str, int]] = {}
        self.cpu = 0  # milli-cores held (issue 17)
        self.mem = 0  # MiB held

    def add(self, key: Hashable, alloc: Allocation) -> None:
        self.keys[key] = None
        self.cpu += alloc.cpu_milli
        self.mem += alloc.memory_mib
        tenant = alloc.tenant
        self.tenants[tenant] = self.tenants.get(tenant, 0) + 1
        if alloc.isolation is _DEDICATED:
            self.dedicated[key] = tenant
        for dev in alloc.placement.devices:
            idx = dev.gpu_index
            if dev.mig_start is not None or dev.share_milli is not None:
                _count_holder(self.gpu_tenants, idx, tenant, 1)
                if not alloc.co_residency:
                    _count_holder(self.gpu_private, idx, tenant, 1)
            if dev.mig_start is not None:
                slot = (idx, dev.mig_start)
                n = self.mig.get(slot, 0)
                self.mig[slot] = n + 1
                if n == 0:
                    self.busy[idx] = self.busy.get(idx, 0) + 1
            elif dev.share_milli is not None:
                self.shares[idx] = self.shares.get(idx, 0) + dev.share_milli
            else:
                self.whole[idx] = self.whole.get(idx, 0) + 1

    def remove(self, key: Hashable, alloc: Allocation) -> None:
        del self.keys[key]
        self.cpu -= alloc.cpu_milli
        self.mem -= alloc.memory_mib
        decrement(self.tenants, alloc.tenant, 1)
        self.dedicated.pop(key, None)
        for dev in alloc.placement.devices:
            idx = dev.gpu_index
            if dev.mig_start is not None or dev.share_milli is not None:
                _count_holder(self.gpu_tenants, idx, alloc.tenant, -1)
                if not alloc.co_residency:
                    _count_holder(self.gpu_private, idx, alloc.tenant, -1)
            if dev.mig_start is not None:
                if decrement(self.mig, (idx, dev.mig_start), 1) == 0:
                    decrement(self.busy, idx, 1)
            elif dev.share_milli is not None:
                decrement(self.shares, idx, dev.share_milli)
            else:
                decrement(self.whole, idx, 1)

    def idle(self, index: int) -> bool:
        return index not in self.whole and index not in self.busy and not self.shares.get(index)

    @property
    def dedicated_to(self) -> str | None:
        """The owner of the most recent dedicated-node reservation here, if any."""
        return next(reversed(self.dedicated.values())) if self.dedicated else None


NO_USAGE = Usage()  # stands in for a node nothing is reserved on; never mutated


def _count_holder(index: dict[int, dict[str, int]], gpu: int, tenant: str, by: int) -> None:
    per = index.get(gpu)
    if per is None:
        index[gpu] = {tenant: by}
        return
    left = per.get(tenant, 0) + by
    if left:
        per[tenant] = left
    else:
        del per[tenant]
        if not per:
            del index[gpu]


def blocked_gpus(u: Usage, req: Request) -> set[int] | None:
    """GPUs of the node the co-residency rule closes to ``req`` (``values.gpu_conflict``):
    with co-residency, those holding a slice or share of another tenant that refuses it;
    without, those holding any other tenant's. None when there are none (the common case)."""
    src = u.gpu_tenants if not req.co_residency else u.gpu_private
    if not src:
        return None
    tenant = req.tenant
    out = {i for i, ts in src.items() if any(t != tenant for t in ts)}
    return out or None


def decrement(counts: dict[_K, int], key: _K, by: int) -> int:
    left = counts.get(key, 0) - by  # shares: a 0-milli holder may find its GPU at 0 already
    if left:
        counts[key] = left
    else:
        counts.pop(key, None)
    return left
