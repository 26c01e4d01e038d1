"""Per-tenant quotas: what a placement costs, what a tenant holds, and whether a request fits.

Pure arithmetic, no state: the engine keeps the per-tenant totals and asks ``quota_check``
before it searches for a node (kube-scheduler's PreFilter: a request over quota is rejected by
every node alike, so it is counted once per node under ``quota_exceeded``, whose entry in
``schedule.reasons`` also carries the message).

Units (as ``model.Quota`` documents them): GPUs are counted in thousandths, a whole GPU being
1000 and a shared fraction its ``share_milli``; MIG is counted in compute slices (``3g.40gb``
is 3), the unit NVIDIA's profiles are named in.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from proofplane.model import GpuRequest, PlacedDevice, Quota
from proofplane.schedule.values import FULL_GPU_MILLI


def mig_slices(profile: str) -> int:
    """Compute slices of a MIG profile, from its name (``"3g.40gb"`` → 3, ``"1g.10gb+me"`` → 1)."""
    head, sep, _ = profile.partition("g.")
    return int(head) if sep and head.isdigit() else 1


@dataclass(frozen=True, slots=True)
class Cost:
    """What a placement holds, in quota units."""

    gpu_milli: int = 0
    mig_slices: int = 0

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.gpu_milli + other.gpu_milli, self.mig_slices + other.mig_slices)

    def __sub__(self, other: Cost) -> Cost:
        return Cost(self.gpu_milli - other.gpu_milli, self.mig_slices - other.mig_slices)


def device_cost(devices: Iterable[PlacedDevice]) -> Cost:
    """The cost of devices actually held."""
    milli = slices = 0
    for d in devices:
        if d.mig_profile is not None:
            slices += mig_slices(d.mig_profile)
        elif d.share_milli is not None:
            milli += d.share_milli
        else:
            milli += FULL_GPU_MILLI
    return Cost(milli, slices)


def request_cost(g: GpuRequest) -> Cost:
    """The cost a request will have once placed (known before placement: it is its shape)."""
    if g.mig_profile is not None:
        return Cost(0, mig_slices(g.mig_profile) * g.count)
    if g.share_milli is not None:
        return Cost(g.share_milli, 0)
    return Cost(FULL_GPU_MILLI * g.count, 0)


def quota_check(quota: Quota, used: Cost, demand: Cost) -> dict[str, object] | None:
    """None when ``demand`` fits under ``quota`` on top of ``used``; else what it exceeds."""
    over: dict[str, object] = {}
    if quota.gpus is not None and demand.gpu_milli:
        limit = quota.gpus * FULL_GPU_MILLI
        if used.gpu_milli + demand.gpu_milli > limit:
            over["gpus"] = {
                "limit": quota.gpus,
                "used": used.gpu_milli / FULL_GPU_MILLI,
                "requested": demand.gpu_milli / FULL_GPU_MILLI,
            }
    if (
        quota.mig_slices is not None
        and demand.mig_slices
        and used.mig_slices + demand.mig_slices > quota.mig_slices
    ):
        over["mig_slices"] = {
            "limit": quota.mig_slices,
            "used": used.mig_slices,
            "requested": demand.mig_slices,
        }
    return over or None
