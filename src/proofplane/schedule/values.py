"""The values placement speaks in: what is asked, what is held, what was decided.

Shared by the snapshot (``schedule.snapshot``), the one-shot ``schedule.placer.place`` and the
scanning reference (``schedule.reference``), so all three answer in exactly the same terms.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from proofplane.model import GpuRequest, IsolationLevel, Placement

FULL_GPU_MILLI = 1000

# Filters whose rejections mean "this node may never host this workload" (as opposed to "not
# enough free capacity right now").
COMPLIANCE_FILTERS = frozenset({"node_not_admitted", "missing_certification"})


@dataclass(frozen=True, slots=True)
class Request:
    workload: str
    tenant: str
    tags: Mapping[str, str]
    isolation: IsolationLevel
    gpus: GpuRequest


@dataclass(frozen=True, slots=True)
class Allocation:
    """Capacity a workload holds now."""

    workload: str
    tenant: str
    isolation: IsolationLevel
    placement: Placement


@dataclass(frozen=True, slots=True)
class Decision:
    placement: Placement | None
    reason: str | None  # None when placed; else no_compliant_capacity | insufficient_capacity
    message: str
    rejections: dict[str, int] = field(default_factory=dict)
