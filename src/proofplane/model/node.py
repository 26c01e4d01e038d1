"""Nodes and their GPUs. Certifications are issued by the control plane, never self-declared."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum

from proofplane.errors import ValidationFailed
from proofplane.model.tags import validate_name


class NodeState(StrEnum):
    REGISTERED = "registered"
    ADMITTED = "admitted"
    CORDONED = "cordoned"
    QUARANTINED = "quarantined"
    FAILED = "failed"
    DECOMMISSIONED = "decommissioned"


# Which state changes an operator may ask for. Admission of a registered node will require a
# passing attestation (attestation issue); quarantine release will require a fresh one.
NODE_TRANSITIONS: dict[NodeState, frozenset[NodeState]] = {
    NodeState.REGISTERED: frozenset(
        {NodeState.ADMITTED, NodeState.QUARANTINED, NodeState.FAILED, NodeState.DECOMMISSIONED}
    ),
    NodeState.ADMITTED: frozenset(
        {NodeState.CORDONED, NodeState.QUARANTINED, NodeState.FAILED, NodeState.DECOMMISSIONED}
    ),
    NodeState.CORDONED: frozenset(
        {NodeState.ADMITTED, NodeState.QUARANTINED, NodeState.FAILED, NodeState.DECOMMISSIONED}
    ),
    NodeState.QUARANTINED: frozenset(
        {NodeState.ADMITTED, NodeState.FAILED, NodeState.DECOMMISSIONED}
    ),
    NodeState.FAILED: frozenset(
        {NodeState.ADMITTED, NodeState.QUARANTINED, NodeState.DECOMMISSIONED}
    ),
    NodeState.DECOMMISSIONED: frozenset(),
}

# States in which a node keeps the work already placed on it (cordon stops only new work).
KEEPS_WORK: frozenset[NodeState] = frozenset({NodeState.ADMITTED, NodeState.CORDONED})


def can_transition(current: NodeState, target: NodeState) -> bool:
    return target in NODE_TRANSITIONS[current]


@dataclass(frozen=True, slots=True)
class MigInstance:
    """A GPU instance carved out of a MIG-enabled GPU: its profile and its first memory slot."""

    profile: str
    start: int


@dataclass(frozen=True, slots=True)
class Gpu:
    index: int
    uuid: str
    model: str
    memory_mb: int
    mig_enabled: bool = False
    mig_instances: tuple[MigInstance, ...] = ()
    vbios_version: str | None = None
    driver_version: str | None = None


@dataclass(frozen=True, slots=True)
class Node:
    name: str
    region: str
    zone: str
    rack: str | None = None
    labels: dict[str, str] = field(default_factory=dict)
    certifications: dict[str, str] = field(default_factory=dict)
    state: NodeState = NodeState.REGISTERED
    state_reason: str | None = None
    gpus: tuple[Gpu, ...] = ()
    created_at: datetime | None = None
    updated_at: datetime | None = None
    # Issue 14: whether its network state differs from the desired one (its agent's last
    # report); None while it is not under network management. Set by the reads that serve it.
    network_drift: bool | None = None
    # Issue 17: allocatable CPU (milli-cores) and memory (MiB) for workloads; None: not tracked
    # (placement then never filters on that resource).
    cpu_milli: int | None = None
    memory_mib: int | None = None
    # Issue 17 §4: where the node sits at each topology level (``TOPOLOGY_LEVELS``): level →
    # domain name, e.g. {"rack": "r12", "nvlink_domain": "nvl72-3"}. ``rack`` above is the
    # rack level's value when this mapping does not name one (see ``domain_of``).
    topology: dict[str, str] = field(default_factory=dict)


#: The topology levels a node may carry and a gang may ask to be packed at, largest first:
#: ``block`` (a group of racks behind one spine, Slurm's topology/block), ``rack``,
#: ``nvlink_domain`` (a multi-node NVLink system such as a GB200 NVL72), ``rail`` (the nodes on
#: one rail of a rail-optimised fabric).
TOPOLOGY_LEVELS: tuple[str, ...] = ("block", "rack", "nvlink_domain", "rail")


def validate_topology(topology: Mapping[str, str]) -> dict[str, str]:
    """A node's topology checked: each level one of ``TOPOLOGY_LEVELS``, each domain a name;
    returned in level order."""
    for level, domain in topology.items():
        if level not in TOPOLOGY_LEVELS:
            raise ValidationFailed(
                f"topology level {level!r} is not one of {', '.join(TOPOLOGY_LEVELS)}",
                code="invalid_topology_level",
                details={"level": level, "known": list(TOPOLOGY_LEVELS)},
            )
        validate_name(domain, f"topology {level}")
    return {lv: topology[lv] for lv in TOPOLOGY_LEVELS if lv in topology}


def domain_of(node: Node, level: str) -> str | None:
    """The node's domain at topology ``level``: its ``topology`` entry, else its ``rack`` for the
    rack level; None when the node does not say (it then belongs to no domain at that level)."""
    found = node.topology.get(level)
    if found is None and level == "rack":
        return node.rack
    return found
