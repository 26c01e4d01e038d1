"""The per-node fit rules: one rule per filter, each answering with its reason code.

Run by the snapshot's search for one admitted, certified node at a time, after the
admission and certification filters (which the snapshot answers from its indexes, as sets):
``tenancy`` and ``gpu_model`` return the code of the rule a node breaks (``schedule.reasons``),
or None; ``fit`` returns the devices the node would give the request, or None when it lacks
the capacity (``insufficient_gpu_capacity``).
"""

from __future__ import annotations

from proofplane.model import Gpu, IsolationLevel, PlacedDevice
from proofplane.schedule.reasons import (
    GPU_MODEL_UNAVAILABLE,
    INSUFFICIENT_CPU,
    INSUFFICIENT_MEMORY,
    NODE_DEDICATED_TO_OTHER_TENANT,
    NODE_SHARED_WITH_OTHER_TENANT,
)
from proofplane.schedule.usage import NodeInfo, Usage, blocked_gpus
from proofplane.schedule.values import FULL_GPU_MILLI, Request, allowed_models

_DEDICATED = IsolationLevel.DEDICATED_NODE
_EMPTY_INTS: frozenset[int] = frozenset()


def tenancy(u: Usage, req: Request) -> str | None:
    """One rule: a dedicated node serves only its owner; a dedicated request shares with no one."""
    owner = u.dedicated_to
    if owner is not None and owner != req.tenant:
        return NODE_DEDICATED_TO_OTHER_TENANT
    if req.isolation is _DEDICATED and any(t != req.tenant for t in u.tenants):
        return NODE_SHARED_WITH_OTHER_TENANT
    return None


def gpu_model(info: NodeInfo, req: Request) -> str | None:
    """One rule: a pinned GPU model must exist on the node."""
    model = req.gpus.model
    if model is None or model in info.models:
        return None
    allowed = allowed_models(model)
    if allowed and not allowed.isdisjoint(info.models):
        return None
    return GPU_MODEL_UNAVAILABLE


def resources(info: NodeInfo, u: Usage, req: Request) -> str | None:
    """Two rules (issue 17): the node's free CPU, then its free memory, must hold the request's
    (a node that does not track a resource never refuses it)."""
    if req.cpu_milli > 0 and info.cpu is not None and info.cpu - u.cpu < req.cpu_milli:
        return INSUFFICIENT_CPU
    if req.memory_mib > 0 and info.mem is not None and info.mem - u.mem < req.memory_mib:
        return INSUFFICIENT_MEMORY
    return None


def fit(
    info: NodeInfo, u: Usage, req: Request, *, only: int | None = None
) -> tuple[PlacedDevice, ...] | None:
    """The devices this node would give the request, or None when it lacks the capacity.
    ``only``: a MIG slice or a share must go on the GPU of that index (a scorer's choice)."""
    g = req.gpus
    allowed = allowed_models(g.model)
    if g.mig_profile is not None:
        # Pack: prefer GPUs that already carry work, so whole GPUs stay free; then the lowest
        # GPU index and start.
        slots, busy = u.mig, u.busy
        blocked = blocked_gpus(u, req) or _EMPTY_INTS
        if g.count == 1:  # the common case: one pass, no sort
            pick = None
            pick_key = None
            for gpu, inst, slot in info.mig.get(g.mig_profile, ()):
                if slot in slots or (allowed is not None and gpu.model not in allowed):
                    continue
                if slot[0] in blocked or (only is not None and slot[0] != only):
                    continue
                k = (-busy.get(slot[0], 0), slot[0], slot[1])
                if pick_key is None or k < pick_key:
                    pick, pick_key = (gpu, inst), k
            if pick is None:
                return None
            gpu, inst = pick
            return (
                PlacedDevice(gpu.index, gpu.uuid, mig_profile=inst.profile, mig_start=inst.start),
            )
        free = [
            (gpu, inst)
            for gpu, inst, slot in info.mig.get(g.mig_profile, ())
            if (allowed is None or gpu.model in allowed)
            and slot not in slots
            and slot[0] not in blocked
        ]
        if len(free) < g.count:
            return None
        free.sort(key=lambda gi: (-busy.get(gi[0].index, 0), gi[0].index, gi[1].start))
        return tuple(
            PlacedDevice(gpu.index, gpu.uuid, mig_profile=inst.profile, mig_start=inst.start)
            for gpu, inst in free[: g.count]
        )
    whole, shares = u.whole, u.shares
    if g.share_milli is not None:  # the fullest GPU that still has room, then lowest index
        need = g.share_milli
        best: Gpu | None = None
        best_key = None
        closed = blocked_gpus(u, req) or _EMPTY_INTS
        for gpu in info.plain:
            i = gpu.index
            if i in whole or (allowed is not None and gpu.model not in allowed) or i in closed:
                continue
            if only is not None and i != only:
                continue
            held = shares.get(i, 0)
            if held + need > FULL_GPU_MILLI:
                continue
            rank = (FULL_GPU_MILLI - held, i)
            if best_key is None or rank < best_key:
                best, best_key = gpu, rank
        if best is None:
            return None
        return (PlacedDevice(best.index, best.uuid, share_milli=need),)
    plain = [
        gpu
        for gpu in info.plain
        if (allowed is None or gpu.model in allowed) and gpu.index not in whole
    ]
    idle = [gpu for gpu in plain if not shares.get(gpu.index)]
    if len(idle) < g.count:
        return None
    return tuple(PlacedDevice(gpu.index, gpu.uuid) for gpu in idle[: g.count])
