"""The values placement speaks in: what is asked, what is held, what was decided.

Shared by the snapshot (``schedule.snapshot``), the one-shot ``schedule.placer.place`` and the
scanning reference (``schedule.reference``), so all three answer in exactly the same terms.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache

from proofplane.model import GpuRequest, IsolationLevel, Placement, TopologyRequest

FULL_GPU_MILLI = 1000
MODEL_SEPARATOR = "|"  # a request's GPU model may list alternatives: "V100M16|V100M32"


@lru_cache(maxsize=1024)
def allowed_models(model: str | None) -> frozenset[str] | None:
    """The GPU models a request's ``model`` accepts (any of ``|``-separated alternatives, the
    trace's ``gpu_spec``); None when it accepts any."""
    if model is None:
        return None
    return frozenset(m for m in model.split(MODEL_SEPARATOR) if m)


@dataclass(frozen=True, slots=True)
class Request:
    """``co_residency`` False: this workload's MIG instance or GPU share goes only on a GPU
    no other tenant uses, and no other tenant joins that GPU while it holds it (see
    ``gpu_conflict``)."""

    workload: str
    tenant: str
    tags: Mapping[str, str]
    isolation: IsolationLevel
    gpus: GpuRequest
    co_residency: bool = True
    cpu_milli: int = 0  # issue 17: milli-cores and MiB besides the GPUs (0: none asked)
    memory_mib: int = 0
    topology: TopologyRequest | None = None  # issue 17 §4: gangs only (``schedule.topology``)


@dataclass(frozen=True, slots=True)
class Allocation:
    """Capacity a workload holds now."""

    workload: str
    tenant: str
    isolation: IsolationLevel
    placement: Placement
    co_residency: bool = True
    cpu_milli: int = 0  # what it holds on ``placement.node`` besides the GPUs
    memory_mib: int = 0


def gpu_conflict(tenant: str, co_residency: bool, holders: Mapping[str, bool] | None) -> bool:
    """The co-residency rule for one physical GPU (MIG instances and shares; whole GPUs are
    never shared). ``holders`` maps each tenant holding a slice or share of the GPU to whether
    all its holdings there allow co-residency. A request of ``tenant`` may join the GPU only if
    every other tenant on it allows co-residency and the request does too: its own tenant's
    holdings never block it."""
    if not holders:
        return False
    for other, allows in holders.items():
        if other != tenant and not (allows and co_residency):
            return True
    return False


@dataclass(frozen=True, slots=True)
class Decision:
    placement: Placement | None
    reason: str | None  # None when placed; else a ``pending`` code of ``schedule.reasons``
    message: str
    rejections: dict[str, int] = field(default_factory=dict)
    # a gang with a topology request: how it was (or could not be) packed (``schedule.topology``)
    topology: dict[str, object] | None = None
