"""The domain model: plain values, no I/O. Everything else speaks in these types."""

from proofplane.model.event import Event, Outcome
from proofplane.model.node import (
    KEEPS_WORK,
    NODE_TRANSITIONS,
    TOPOLOGY_LEVELS,
    Gpu,
    MigInstance,
    Node,
    NodeState,
    can_transition,
    domain_of,
    validate_topology,
)
from proofplane.model.tags import missing_tags, parse_tag_pairs, validate_name, validate_tags
from proofplane.model.tenant import ComplianceProfile, IsolationLevel, Quota, Tenant
from proofplane.model.workload import (
    GpuRequest,
    PlacedDevice,
    Placement,
    TopologyMode,
    TopologyRequest,
    Workload,
    WorkloadStatus,
)

__all__ = [
    "KEEPS_WORK",
    "NODE_TRANSITIONS",
    "TOPOLOGY_LEVELS",
    "ComplianceProfile",
    "Event",
    "Gpu",
    "GpuRequest",
    "IsolationLevel",
    "MigInstance",
    "Node",
    "NodeState",
    "Outcome",
    "PlacedDevice",
    "Placement",
    "Quota",
    "Tenant",
    "TopologyMode",
    "TopologyRequest",
    "Workload",
    "WorkloadStatus",
    "can_transition",
    "domain_of",
    "missing_tags",
    "parse_tag_pairs",
    "validate_name",
    "validate_tags",
    "validate_topology",
]
