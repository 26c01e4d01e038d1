"""Cluster files: a YAML description of a (simulated) cluster — tenants, nodes with GPUs by SKU,
certifications the operator grants, and workloads to submit.

Parsing is pure: text in, a ``ClusterSpec`` of domain values out, or ValidationFailed naming the
path of every problem. ``proofplane up`` loads the demo cluster shipped in ``proofplane/data``.

GPUs are given in groups: ``{model: H100-80GB, count: 8, mig: ["3g.40gb@0", "3g.40gb@4"],
mig_gpus: 2}`` makes eight H100s of which the first two are MIG-enabled with that layout.
UUIDs are derived from the node name and index, so a file always yields the same inventory.
"""

from __future__ import annotations

import ipaddress
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError

from proofplane.errors import ValidationFailed
from proofplane.model import (
    ComplianceProfile,
    Gpu,
    GpuRequest,
    IsolationLevel,
    MigInstance,
    Node,
    NodeState,
    Tenant,
    TopologyMode,
    TopologyRequest,
)

_UUID_NS = uuid.UUID("7f1c2a4e-5b6d-4e8f-9a0b-1c2d3e4f5a6b")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", str_strip_whitespace=True)


class _Profile(_Strict):
    required_tags: dict[str, str] = {}
    min_isolation: IsolationLevel = IsolationLevel.SHARED
    isolation_rules: dict[str, IsolationLevel] = {}
    co_residency: StrictBool = True
    segment: Literal["per-tenant", "per-workload"] = "per-tenant"
    network_policy: dict[str, Any] | None = None


class _Tenant(_Strict):
    name: str
    description: str = ""
    profile: _Profile = _Profile()
    vni: int | None = None  # a manual segment assignment (default: the pools' lowest free)
    pkey: int | None = None


class _Underlay(_Strict):
    vtep: str
    underlay_dev: str = "ul0"
    hca_guids: list[str] = []


class _Network(_Strict):
    # The demo: every node without its own `network` gets a VTEP from this range (in file
    # order), underlay device ul0 and one made-up HCA port GUID, marked simulated.
    simulated_underlay: str | None = None


class _GpuGroup(_Strict):
    model: str
    count: int = Field(1, ge=1, le=16)
    memory_mb: int = Field(0, ge=0)
    mig: list[str] = []  # layout as "profile@start"
    mig_gpus: int | None = Field(None, ge=0)  # how many of the group get MIG (default: all)
    vbios_version: str | None = None
    driver_version: str | None = None


class _Node(_Strict):
    name: str
    region: str
    zone: str
    rack: str | None = None
    labels: dict[str, str] = {}
    state: Literal["registered", "admitted", "cordoned"] = "admitted"
    certifications: dict[str, str] = {}
    gpus: list[_GpuGroup] = []
    network: _Underlay | None = None
    cpu_milli: int | None = Field(None, ge=0, le=2**31 - 1)  # issue 17; absent: not tracked
    memory_mib: int | None = Field(None, ge=0, le=2**31 - 1)
    # issue 17 §4: topology level → domain, e.g. {"nvlink_domain": "nvl72-1", "block": "b1"}
    topology: dict[str, str] = {}


class _Gpus(_Strict):
    count: int = 1
    model: str | None = None
    mig_profile: str | None = None
    share_milli: int | None = None
    nodes: int = Field(1, ge=1, le=4096)  # > 1: a gang (count GPUs over that many nodes)


class _Topology(_Strict):
    level: Literal["block", "rack", "nvlink_domain", "rail"]
    mode: Literal["required", "preferred"] = "required"


class _Workload(_Strict):
    name: str
    tenant: str
    tags: dict[str, str] = {}
    isolation: IsolationLevel | None = None
    gpus: _Gpus = _Gpus()
    priority: int = 0
    command: list[str] = []
    cpu_milli: int = Field(0, ge=0, le=2**31 - 1)  # issue 17
    memory_mib: int = Field(0, ge=0, le=2**31 - 1)
    restartable: StrictBool = False  # issue 17 §3: defragmentation may move it while it runs
    topology: _Topology | None = None  # issue 17 §4: a gang's packing request


class _Cluster(_Strict):
    cluster: str = "proofplane"
    network: _Network | None = None
    tenants: list[_Tenant] = []
    nodes: list[_Node] = []
    workloads: list[_Workload] = []


@dataclass(frozen=True, slots=True)
class Underlay:
    """A node's underlay facts (issue 14): checked by the service that stores them."""

    vtep: str
    underlay_dev: str = "ul0"
    hca_guids: tuple[str, ...] = ()
    simulated: bool = False


@dataclass(frozen=True, slots=True)
class NodeSpec:
    node: Node  # without certifications: those are granted after admission
    state: NodeState
    certifications: dict[str, str]
    underlay: Underlay | None = None


@dataclass(frozen=True, slots=True)
class WorkloadEntry:
    name: str
    tenant: str
    tags: dict[str, str]
    isolation: IsolationLevel | None
    gpus: GpuRequest
    priority: int
    command: tuple[str, ...]
    cpu_milli: int = 0
    memory_mib: int = 0
    restartable: bool = False
    topology: TopologyRequest | None = None


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    name: str
    tenants: tuple[Tenant, ...]
    nodes: tuple[NodeSpec, ...]
    workloads: tuple[WorkloadEntry, ...]
    # tenant → (vni, pkey) given in the file (None: the pools' lowest free)
    segments: dict[str, tuple[int | None, int | None]] = field(default_factory=dict)


def simulated_guid(node: str) -> str:
    """A made-up HCA port GUID for a simulated node (stable per name)."""
    return "0x" + uuid.uuid5(_UUID_NS, f"{node}/hca0").hex[:16]


def _underlays(c: _Cluster) -> list[Underlay | None]:
    """Each node's underlay: its own ``network``, else one from ``network.simulated_underlay``
    (the next free host address, in file order), else none."""
    given = {n.network.vtep for n in c.nodes if n.network is not None}
    pool: Any = iter(())
    cidr = c.network.simulated_underlay if c.network is not None else None
    if cidr is not None:
        try:
            pool = (str(h) for h in ipaddress.IPv4Network(cidr, strict=True).hosts())
        except ValueError as exc:
            raise ValidationFailed(
                f"network.simulated_underlay: {exc}", code="invalid_cluster_file"
            ) from None
    out: list[Underlay | None] = []
    for n in c.nodes:
        if n.network is not None:
            u = n.network
            out.append(Underlay(u.vtep, u.underlay_dev, tuple(u.hca_guids)))
            continue
        if cidr is None:
            out.append(None)
            continue
        vtep = next((h for h in pool if h not in given), None)
        if vtep is None:
            raise ValidationFailed(
                f"network.simulated_underlay {cidr} has fewer addresses than nodes",
                code="invalid_cluster_file",
            )
        out.append(Underlay(vtep, "ul0", (simulated_guid(n.name),), simulated=True))
    return out


def gpu_uuid(node: str, index: int) -> str:
    return f"GPU-{uuid.uuid5(_UUID_NS, f'{node}/{index}')}"


def _mig_layout(items: list[str], where: str) -> tuple[MigInstance, ...]:
    out = []
    for item in items:
        profile, sep, start = item.partition("@")
        if not sep or not start.isascii() or not start.isdecimal():
            raise ValidationFailed(
                f"{where}: MIG instance {item!r} must be written profile@start, e.g. 3g.40gb@4",
                code="invalid_cluster_file",
            )
        out.append(MigInstance(profile, int(start)))
    return tuple(out)


def _gpus(node: _Node) -> tuple[Gpu, ...]:
    gpus: list[Gpu] = []
    for gi, group in enumerate(node.gpus):
        layout = _mig_layout(group.mig, f"nodes.{node.name}.gpus[{gi}]")
        mig_gpus = group.count if group.mig_gpus is None else group.mig_gpus
        if mig_gpus > group.count:
            raise ValidationFailed(
                f"nodes.{node.name}.gpus[{gi}]: mig_gpus ({mig_gpus}) exceeds count "
                f"({group.count})",
                code="invalid_cluster_file",
            )
        if mig_gpus and not layout and group.mig_gpus:
            raise ValidationFailed(
                f"nodes.{node.name}.gpus[{gi}]: mig_gpus given without a mig layout",
                code="invalid_cluster_file",
            )
        for k in range(group.count):
            index = len(gpus)
            mig = bool(layout) and k < mig_gpus
            gpus.append(
                Gpu(
                    index=index,
                    uuid=gpu_uuid(node.name, index),
                    model=group.model,
                    memory_mb=group.memory_mb,
                    mig_enabled=mig,
                    mig_instances=layout if mig else (),
                    vbios_version=group.vbios_version,
                    driver_version=group.driver_version,
                )
            )
    return tuple(gpus)


def _loc(err: Any) -> str:
    return ".".join(str(p) for p in err["loc"]) or "(top level)"


def parse_cluster(text: str) -> ClusterSpec:
    """Parse a cluster file's text. Structure is checked here; names, tags, SKUs and MIG
    layouts are checked by the services that load it, with the same rules as the API."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ValidationFailed(
            f"cluster file is not valid YAML{where}", code="invalid_cluster_file"
        ) from exc
    if not isinstance(data, dict):
        raise ValidationFailed("cluster file must be a YAML mapping", code="invalid_cluster_file")
    try:
        c = _Cluster.model_validate(data)
    except ValidationError as exc:
        problems = [f"{_loc(e)}: {e['msg']}" for e in exc.errors()]
        raise ValidationFailed(
            "invalid cluster file", code="invalid_cluster_file", details=problems
        ) from exc
    return ClusterSpec(
        name=c.cluster,
        tenants=tuple(
            Tenant(
                t.name,
                t.description,
                ComplianceProfile(
                    dict(t.profile.required_tags),
                    t.profile.min_isolation,
                    dict(t.profile.isolation_rules),
                    t.profile.co_residency,
                    t.profile.segment,
                    t.profile.network_policy,
                ),
            )
            for t in c.tenants
        ),
        nodes=tuple(
            NodeSpec(
                Node(
                    n.name,
                    n.region,
                    n.zone,
                    n.rack,
                    dict(n.labels),
                    gpus=_gpus(n),
                    cpu_milli=n.cpu_milli,
                    memory_mib=n.memory_mib,
                    topology=dict(n.topology),
                ),
                NodeState(n.state),
                dict(n.certifications),
                underlay,
            )
            for n, underlay in zip(c.nodes, _underlays(c), strict=True)
        ),
        workloads=tuple(
            WorkloadEntry(
                w.name,
                w.tenant,
                dict(w.tags),
                w.isolation,
                GpuRequest(
                    w.gpus.count, w.gpus.model, w.gpus.mig_profile, w.gpus.share_milli, w.gpus.nodes
                ),
                w.priority,
                tuple(w.command),
                w.cpu_milli,
                w.memory_mib,
                w.restartable,
                TopologyRequest(w.topology.level, TopologyMode(w.topology.mode))
                if w.topology is not None
                else None,
            )
            for w in c.workloads
        ),
        segments={
            t.name: (t.vni, t.pkey) for t in c.tenants if t.vni is not None or t.pkey is not None
        },
    )
