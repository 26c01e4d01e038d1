"""Tenants and the compliance profile that sets the minimum for every workload they submit."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any


class IsolationLevel(StrEnum):
    """How far a workload is kept from other tenants, weakest first."""

    SHARED = "shared"  # a time-sliced fraction of a GPU
    MIG = "mig"  # a hardware-partitioned MIG slice
    EXCLUSIVE_GPU = "exclusive-gpu"  # whole GPUs, never shared
    DEDICATED_NODE = "dedicated-node"  # no other tenant on the node

    @property
    def rank(self) -> int:
        return _RANK[self]

    def at_least(self, other: IsolationLevel) -> IsolationLevel:
        """The stricter of the two levels."""
        return self if self.rank >= other.rank else other


_RANK = {
    IsolationLevel.SHARED: 0,
    IsolationLevel.MIG: 1,
    IsolationLevel.EXCLUSIVE_GPU: 2,
    IsolationLevel.DEDICATED_NODE: 3,
}


@dataclass(frozen=True, slots=True)
class ComplianceProfile:
    """What a tenant's workloads must always carry and the isolation they must at least get.

    ``required_tags`` are added to every workload of the tenant (a HIPAA tenant cannot submit a
    workload that forgets ``hipaa=true``). ``min_isolation`` is the floor for every workload;
    ``isolation_rules`` raise the floor per tag (``{"pci-dss=isolated": "dedicated-node"}``).
    ``co_residency`` False: the tenant's MIG instances and GPU shares go only on physical GPUs
    no other tenant uses, and no other tenant's join them (other tenants' slices may share a
    GPU only when both tenants' profiles allow it). Resolved into each workload at submit.
    """

    required_tags: dict[str, str] = field(default_factory=dict)
    min_isolation: IsolationLevel = IsolationLevel.SHARED
    isolation_rules: dict[str, IsolationLevel] = field(default_factory=dict)
    co_residency: bool = True
    # Network segmentation (issue 14): ``per-tenant`` (one VXLAN VNI + IB PKey for all its
    # workloads) or ``per-workload`` (each workload its own); ``network_policy``: the allow-list
    # inside the tenant's segments and its egress (canonical JSON of
    # ``proofplane.network.policy``; None: the default policy).
    segment: str = "per-tenant"
    network_policy: dict[str, Any] | None = None

    def minimum_for(self, tags: dict[str, str]) -> IsolationLevel:
        """The isolation floor for a workload carrying ``tags``."""
        floor = self.min_isolation
        for pair, level in self.isolation_rules.items():
            key, _, value = pair.partition("=")
            if tags.get(key) == value:
                floor = floor.at_least(level)
        return floor


PER_TENANT, PER_WORKLOAD = "per-tenant", "per-workload"
SEGMENT_MODES = (PER_TENANT, PER_WORKLOAD)


def profile_to_json(profile: ComplianceProfile) -> dict[str, Any]:
    """The profile as JSON: how it is stored, recorded in events and served."""
    return {
        "required_tags": dict(profile.required_tags),
        "min_isolation": profile.min_isolation.value,
        "isolation_rules": {k: v.value for k, v in profile.isolation_rules.items()},
        "co_residency": profile.co_residency,
        "segment": profile.segment,
        "network_policy": profile.network_policy,
    }


def profile_from_json(data: dict[str, Any]) -> ComplianceProfile:
    segment = data.get("segment") or PER_TENANT
    if segment not in SEGMENT_MODES:
        raise ValueError(f"segment must be one of {', '.join(SEGMENT_MODES)}, not {segment!r}")
    policy = data.get("network_policy")
    if policy is not None and not isinstance(policy, dict):
        raise ValueError("network_policy must be an object or null")
    return ComplianceProfile(
        required_tags=dict(data.get("required_tags", {})),
        min_isolation=IsolationLevel(data.get("min_isolation", "shared")),
        isolation_rules={k: IsolationLevel(v) for k, v in data.get("isolation_rules", {}).items()},
        co_residency=bool(data.get("co_residency", True)),
        segment=segment,
        network_policy=policy,
    )


@dataclass(frozen=True, slots=True)
class Quota:
    """The most a tenant may hold at once; None means no limit.

    ``gpus`` counts whole GPUs, a shared fraction counting as its fraction (two 500-milli
    shares are one GPU). ``mig_slices`` counts MIG compute slices (a ``3g.40gb`` instance is 3
    of a GPU's 7). Work placed before a quota was lowered keeps its capacity; new placements
    must fit under the quota.
    """

    gpus: int | None = None
    mig_slices: int | None = None


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    description: str = ""
    profile: ComplianceProfile = field(default_factory=ComplianceProfile)
    quota: Quota = field(default_factory=Quota)
    created_at: datetime | None = None
    updated_at: datetime | None = None
