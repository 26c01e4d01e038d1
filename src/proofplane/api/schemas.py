"""Request and response bodies of the HTTP API (and so of its OpenAPI document)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Generic, Literal, TypeVar

from fastapi import Response
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StringConstraints,
    model_validator,
)
from pydantic_core import to_json

from proofplane.model import (
    Event,
    GpuRequest,
    IsolationLevel,
    Node,
    NodeState,
    Outcome,
    PlacedDevice,
    Placement,
    Tenant,
    Workload,
    WorkloadStatus,
)
from proofplane.model.tags import MAX_NAME_CHARS, MAX_TAG_CHARS, MAX_TAGS, NAME_PATTERN
from proofplane.model.tenant import profile_to_json
from proofplane.model.workload import (
    MAX_BATCH,
    MAX_COMMAND_ARG_CHARS,
    MAX_COMMAND_ARGS,
    MAX_COMMAND_CHARS,
    MAX_SKU_CHARS,
    devices_json,
)

T = TypeVar("T")
Name = Annotated[
    str,
    Field(
        max_length=MAX_NAME_CHARS,
        pattern=NAME_PATTERN,
        description=f"DNS-label-like, at most {MAX_NAME_CHARS}",
    ),
]
# Bounds on every free-form field (issue 19, §3); the services check the same constants.
TagPart = Annotated[str, StringConstraints(max_length=MAX_TAG_CHARS)]
Tags = Annotated[
    dict[TagPart, TagPart],
    Field(max_length=MAX_TAGS, description=f"at most {MAX_TAGS} key=value pairs"),
]
Short = Annotated[str, StringConstraints(max_length=MAX_SKU_CHARS)]  # a model, a MIG profile


def _command_total(command: list[str]) -> list[str]:
    total = sum(len(arg) for arg in command)
    if total > MAX_COMMAND_CHARS:
        raise ValueError(
            f"the arguments have {total} characters together, at most {MAX_COMMAND_CHARS}"
        )
    return command


Command = Annotated[
    list[Annotated[str, StringConstraints(max_length=MAX_COMMAND_ARG_CHARS)]],
    Field(
        max_length=MAX_COMMAND_ARGS,
        description=f"at most {MAX_COMMAND_ARGS} arguments of at most {MAX_COMMAND_ARG_CHARS} "
        f"characters, {MAX_COMMAND_CHARS} together",
    ),
    AfterValidator(_command_total),
]


def _has_nul(value: Any) -> bool:
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(_has_nul(k) or _has_nul(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_nul(v) for v in value)
    return False


class BodyIn(BaseModel):
    """Request bodies: unknown fields are refused, and so is the NUL character, which no store
    keeps faithfully (PostgreSQL refuses it, SQLite truncates on it in places)."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _no_nul(cls, data: Any) -> Any:
        if _has_nul(data):
            raise ValueError("text must not contain the NUL character")
        return data


class Page(BaseModel, Generic[T]):
    items: list[T]
    next: str | None = Field(description="cursor for the next page, null on the last one")


def json_page(items: list[dict[str, Any]], next_cursor: str | None) -> Response:
    """A ``Page`` answer from items already in their response shape (``node_json`` …).

    The hot read routes render this way (issue 20): their values come from our own store, so
    FastAPI's re-validation of the response model is skipped, and pydantic-core's serializer
    writes the very bytes the model would (the route still declares ``response_model`` for
    the OpenAPI document; tests/api/test_list_fast.py compares the two)."""
    return json_response({"items": items, "next": next_cursor})


def json_response(
    content: Any, status_code: int = 200, headers: dict[str, str] | None = None
) -> Response:
    """``content`` (already in its response shape, from our own store) as JSON, unvalidated:
    the bytes FastAPI's serializer would write for it."""
    return Response(
        to_json(content), status_code=status_code, headers=headers, media_type="application/json"
    )


class ErrorBody(BaseModel):
    code: str
    message: str
    details: Any = None


class ErrorResponse(BaseModel):
    error: ErrorBody


# --- tenants -----------------------------------------------------------------------------------


class ProfileIn(BodyIn):
    required_tags: Tags = {}
    min_isolation: IsolationLevel = IsolationLevel.SHARED
    isolation_rules: dict[
        Annotated[str, StringConstraints(max_length=2 * MAX_TAG_CHARS + 1)], IsolationLevel
    ] = Field(
        {},
        max_length=MAX_TAGS,
        description='tag → minimum isolation, e.g. {"pci-dss=isolated": "dedicated-node"}',
    )
    co_residency: StrictBool = Field(
        True,
        description="false: the tenant's MIG slices and GPU shares never share a physical GPU "
        "with another tenant's",
    )
    segment: Literal["per-tenant", "per-workload"] = Field(
        "per-tenant",
        description="per-workload: each workload gets its own network segment (VNI + PKey)",
    )
    network_policy: dict[str, Any] | None = Field(
        None,
        description="subnet, allow, egress (see PUT /tenants/{name}/network-policy); null: the "
        "default, or on an update the tenant's current policy",
    )


class TenantIn(BodyIn):
    name: Name
    description: str = Field("", max_length=1000)
    profile: ProfileIn = ProfileIn()
    vni: int | None = Field(
        None,
        ge=-(2**31),
        le=2**31 - 1,
        description="a VXLAN VNI from the pool (default: the lowest free)",
    )
    pkey: int | None = Field(
        None,
        ge=-(2**31),
        le=2**31 - 1,
        description="an InfiniBand PKey from the pool (default: the lowest free)",
    )


class TenantPatch(BodyIn):
    description: str | None = Field(None, max_length=1000)
    profile: ProfileIn | None = None


class QuotaIO(BodyIn):
    """null: no limit. ``gpus`` counts whole GPUs (a shared fraction counts as its fraction);
    ``mig_slices`` counts MIG compute slices (a 3g.40gb instance is 3)."""

    gpus: int | None = Field(None, ge=-(2**31), le=2**31 - 1)
    mig_slices: int | None = Field(None, ge=-(2**31), le=2**31 - 1)


class TenantOut(BaseModel):
    name: str
    description: str
    profile: dict[str, Any]
    quota: QuotaIO
    created_at: datetime | None
    updated_at: datetime | None

    @classmethod
    def of(cls, t: Tenant) -> TenantOut:
        return cls(
            name=t.name,
            description=t.description,
            profile=profile_to_json(t.profile),
            quota=QuotaIO(gpus=t.quota.gpus, mig_slices=t.quota.mig_slices),
            created_at=t.created_at,
            updated_at=t.updated_at,
        )


# --- nodes -------------------------------------------------------------------------------------


class MigInstanceIO(BodyIn):
    profile: Short
    start: int = Field(ge=0, le=7)


class GpuIn(BodyIn):
    index: int = Field(ge=0, le=255)
    uuid: str = Field(min_length=1, max_length=64)
    model: Short
    memory_mb: int = Field(0, ge=0, le=16 * 1024 * 1024, description="0: the SKU's nominal memory")
    mig_enabled: bool = False
    mig_instances: list[MigInstanceIO] = Field([], max_length=64)
    vbios_version: str | None = Field(None, max_length=63)
    driver_version: str | None = Field(None, max_length=63)


# level → domain; the levels and names are checked by the service (machine-readable codes)
NodeTopology = Annotated[dict[Short, Short], Field(max_length=8)]


class TopologyIO(BodyIn):
    """A gang's topology request (issue 17 §4)."""

    level: Short = Field(description="block, rack, nvlink_domain or rail")
    mode: Short = Field(
        "required",
        description="required: all members in one domain or the gang waits "
        "(topology_unsatisfiable); preferred: the fewest domains possible now",
    )


class NodeIn(BodyIn):
    name: Name
    region: Name
    zone: Name
    rack: Name | None = None
    labels: Tags = {}
    gpus: list[GpuIn] = Field([], max_length=64)
    cpu_milli: int | None = Field(
        None, ge=0, le=2**31 - 1, description="allocatable CPU, milli-cores (absent: not tracked)"
    )
    memory_mib: int | None = Field(
        None, ge=0, le=2**31 - 1, description="allocatable memory, MiB (absent: not tracked)"
    )
    topology: NodeTopology = Field(
        {},
        description="topology level (block, rack, nvlink_domain, rail) → domain name, e.g. "
        '{"nvlink_domain": "nvl72-3"}; `rack` is the rack level unless this names one',
    )


class NodePatch(BodyIn):
    labels: Tags | None = None
    rack: Name | None = None
    topology: NodeTopology | None = Field(None, description="replaces the node's whole mapping")


class NodeStateIn(BodyIn):
    state: NodeState
    reason: str | None = Field(None, max_length=1000)


class CertificationIn(BodyIn):
    key: TagPart
    value: TagPart


class GpuOut(BaseModel):
    index: int
    uuid: str
    model: str
    memory_mb: int
    mig_enabled: bool
    mig_instances: list[MigInstanceIO]
    vbios_version: str | None
    driver_version: str | None


class NodeOut(BaseModel):
    name: str
    region: str
    zone: str
    rack: str | None
    labels: dict[str, str]
    certifications: dict[str, str]
    state: NodeState
    state_reason: str | None
    gpus: list[GpuOut]
    created_at: datetime | None
    updated_at: datetime | None
    network_drift: bool | None = Field(
        None,
        description="null: not under network management; true: its agent's last report "
        "differs from the desired network state (GET /api/v1/network/nodes says how)",
    )
    cpu_milli: int | None = None
    memory_mib: int | None = None
    topology: dict[str, str] = {}

    @classmethod
    def of(cls, n: Node) -> NodeOut:
        return cls(
            name=n.name,
            region=n.region,
            zone=n.zone,
            rack=n.rack,
            labels=n.labels,
            certifications=n.certifications,
            state=n.state,
            state_reason=n.state_reason,
            gpus=[
                GpuOut(
                    index=g.index,
                    uuid=g.uuid,
                    model=g.model,
                    memory_mb=g.memory_mb,
                    mig_enabled=g.mig_enabled,
                    mig_instances=[
                        MigInstanceIO(profile=i.profile, start=i.start) for i in g.mig_instances
                    ],
                    vbios_version=g.vbios_version,
                    driver_version=g.driver_version,
                )
                for g in n.gpus
            ],
            created_at=n.created_at,
            updated_at=n.updated_at,
            network_drift=n.network_drift,
            cpu_milli=n.cpu_milli,
            memory_mib=n.memory_mib,
            topology=n.topology,
        )


def node_json(n: Node) -> dict[str, Any]:
    """``NodeOut.of(n)`` as the JSON value it serializes to (same keys, same order)."""
    return {
        "name": n.name,
        "region": n.region,
        "zone": n.zone,
        "rack": n.rack,
        "labels": n.labels,
        "certifications": n.certifications,
        "state": n.state.value,
        "state_reason": n.state_reason,
        "gpus": [
            {
                "index": g.index,
                "uuid": g.uuid,
                "model": g.model,
                "memory_mb": g.memory_mb,
                "mig_enabled": g.mig_enabled,
                "mig_instances": [{"profile": i.profile, "start": i.start} for i in g.mig_instances]
                if g.mig_instances
                else [],
                "vbios_version": g.vbios_version,
                "driver_version": g.driver_version,
            }
            for g in n.gpus
        ],
        "created_at": n.created_at,
        "updated_at": n.updated_at,
        "network_drift": n.network_drift,
        "cpu_milli": n.cpu_milli,
        "memory_mib": n.memory_mib,
        "topology": n.topology,
    }


# --- workloads ---------------------------------------------------------------------------------


class GpuRequestIO(BodyIn):
    count: int = Field(
        1,
        ge=-(2**31),
        le=2**31 - 1,
        description="whole GPUs, or MIG instances when mig_profile is set",
    )
    model: Short | None = None
    mig_profile: Short | None = Field(None, examples=["3g.40gb"])
    share_milli: int | None = Field(
        None, ge=-(2**31), le=2**31 - 1, description="a fraction of one GPU, in thousandths"
    )
    nodes: int = Field(
        1,
        ge=-(2**31),
        le=2**31 - 1,
        description="> 1: a gang, `count` whole GPUs in total, count/nodes on each of that many "
        "distinct nodes, placed all together or not at all",
    )

    def to_domain(self) -> GpuRequest:
        return GpuRequest(
            count=self.count,
            model=self.model,
            mig_profile=self.mig_profile,
            share_milli=self.share_milli,
            nodes=self.nodes,
        )

    @classmethod
    def from_domain(cls, g: GpuRequest) -> GpuRequestIO:
        return cls(
            count=g.count,
            model=g.model,
            mig_profile=g.mig_profile,
            share_milli=g.share_milli,
            nodes=g.nodes,
        )


class WorkloadIn(BodyIn):
    name: Name
    tenant: Name
    tags: Tags = Field({}, examples=[{"hipaa": "true"}])
    isolation: IsolationLevel | None = Field(
        None, description="default: what the GPU request implies; raised to the tenant's floor"
    )
    gpus: GpuRequestIO = GpuRequestIO()
    priority: int = Field(0, ge=-1000, le=1000)
    command: Command = []
    cpu_milli: int = Field(
        0,
        ge=-(2**31),
        le=2**31 - 1,
        description="CPU in milli-cores besides the GPUs (0: none); with CPU or memory asked, "
        "gpus.count may be 0",
    )
    memory_mib: int = Field(0, ge=-(2**31), le=2**31 - 1, description="memory in MiB (0: none)")
    restartable: StrictBool = Field(
        False,
        description="it checkpoints itself and may be stopped and started again elsewhere: "
        "defragmentation may move it while it runs (false: only while no job has started)",
    )
    topology: TopologyIO | None = Field(
        None,
        description="a gang's packing request (gangs only: refused with topology_requires_gang "
        "on a one-node workload)",
    )


class WorkloadBatchIn(BodyIn):
    items: list[WorkloadIn] = Field(
        min_length=1,
        max_length=MAX_BATCH,
        description=f"up to {MAX_BATCH} workloads (the POST /workloads body each), submitted in "
        "one transaction, all or nothing, and placed in this order",
    )


class CancelIn(BodyIn):
    reason: str | None = Field(None, max_length=1000)


class DeviceOut(BaseModel):
    gpu_index: int
    gpu_uuid: str
    mig_profile: str | None
    mig_start: int | None
    share_milli: int | None

    @classmethod
    def from_domain(cls, d: PlacedDevice) -> DeviceOut:
        return cls(
            gpu_index=d.gpu_index,
            gpu_uuid=d.gpu_uuid,
            mig_profile=d.mig_profile,
            mig_start=d.mig_start,
            share_milli=d.share_milli,
        )


class PlacementPartOut(BaseModel):
    node: str
    devices: list[DeviceOut]


class PlacementOut(BaseModel):
    node: str = Field(description="the first (for most workloads the only) node")
    devices: list[DeviceOut]
    members: list[PlacementPartOut] = Field(
        description="every node and its devices (one entry unless the workload is a gang)"
    )

    @classmethod
    def of(cls, p: Placement) -> PlacementOut:
        return cls(
            node=p.node,
            devices=[DeviceOut.from_domain(d) for d in p.devices],
            members=[
                PlacementPartOut(node=m.node, devices=[DeviceOut.from_domain(d) for d in m.devices])
                for m in p.parts
            ],
        )


class WorkloadOut(BaseModel):
    name: str
    tenant: str
    tags: dict[str, str]
    isolation: IsolationLevel
    gpus: GpuRequestIO
    priority: int
    command: list[str]
    status: WorkloadStatus
    reason: str | None
    reason_details: dict[str, Any] | None
    placement: PlacementOut | None
    created_at: datetime | None
    updated_at: datetime | None
    co_residency: bool
    cpu_milli: int = 0
    memory_mib: int = 0
    restartable: bool = False
    topology: dict[str, str] | None = None

    @classmethod
    def of(cls, w: Workload) -> WorkloadOut:
        return cls(
            name=w.name,
            tenant=w.tenant,
            tags=w.tags,
            isolation=w.isolation,
            gpus=GpuRequestIO.from_domain(w.gpus),
            priority=w.priority,
            command=list(w.command),
            status=w.status,
            reason=w.reason,
            reason_details=w.reason_details,
            placement=PlacementOut.of(w.placement) if w.placement else None,
            created_at=w.created_at,
            updated_at=w.updated_at,
            co_residency=w.co_residency,
            cpu_milli=w.cpu_milli,
            memory_mib=w.memory_mib,
            restartable=w.restartable,
            topology=w.topology.to_json() if w.topology is not None else None,
        )


def workload_json(w: Workload) -> dict[str, Any]:
    """``WorkloadOut.of(w)`` as the JSON value it serializes to (same keys, same order)."""
    p = w.placement
    g = w.gpus
    return {
        "name": w.name,
        "tenant": w.tenant,
        "tags": w.tags,
        "isolation": w.isolation.value,
        "gpus": {
            "count": g.count,
            "model": g.model,
            "mig_profile": g.mig_profile,
            "share_milli": g.share_milli,
            "nodes": g.nodes,
        },
        "priority": w.priority,
        "command": list(w.command),
        "status": w.status.value,
        "reason": w.reason,
        "reason_details": w.reason_details,
        "placement": None
        if p is None
        else {
            "node": p.node,
            "devices": devices_json(p.devices),
            "members": [{"node": m.node, "devices": devices_json(m.devices)} for m in p.parts],
        },
        "created_at": w.created_at,
        "updated_at": w.updated_at,
        "co_residency": w.co_residency,
        "cpu_milli": w.cpu_milli,
        "memory_mib": w.memory_mib,
        "restartable": w.restartable,
        "topology": w.topology.to_json() if w.topology is not None else None,
    }


class WorkloadBatchOut(BaseModel):
    items: list[WorkloadOut]


class ExplanationOut(BaseModel):
    """Why a workload is where it is, or why it waits."""

    workload: str
    tenant: str
    status: WorkloadStatus
    reason: str | None
    message: str | None
    placement: PlacementOut | None
    summary: str = Field(description="one sentence for humans")
    analysis: dict[str, Any] | None = Field(
        description="filters (nodes rejected per reason code), candidates (best-fit ranks), "
        "quota, pool, priority, placed_on; null for finished workloads"
    )
    defrag: dict[str, Any] | None = Field(
        None,
        description="issue 17 §3: for a workload placed after defragmentation, the moves "
        '({"moves": [{workload, from, to}]}); for a moved one, {moved, for_workload, from}; '
        "for one waiting, why defragmentation could not help ({refused: code, message, "
        "counts}); null otherwise",
    )
    mig_layout: dict[str, Any] | None = Field(
        None,
        description="issue 17 §2: for a workload whose placement carved new MIG instances or "
        "re-laid an idle GPU, {auto_layout (PROOFPLANE_MIG_AUTO_LAYOUT now), changes: [{node, "
        "gpu_index, step (carve | repartition), carved, before, after, why, "
        "freed_by_defragmentation}], instances: [{node, gpu_index, profile, start}]}; for a "
        "waiting MIG request that carving or "
        "re-laying would place now but PROOFPLANE_MIG_AUTO_LAYOUT (idle or off) turns off, "
        "{auto_layout, disabled, would_place_on, would, message}; null otherwise",
    )

    @classmethod
    def of(cls, e: dict[str, Any]) -> ExplanationOut:
        p = e["placement"]
        return cls(**{**e, "placement": PlacementOut.of(p) if p is not None else None})


# --- events ------------------------------------------------------------------------------------


class EventOut(BaseModel):
    seq: int
    ts: datetime
    actor: str
    action: str
    target_type: str
    target_id: str
    outcome: Outcome
    details: dict[str, Any]

    @classmethod
    def of(cls, e: Event) -> EventOut:
        return cls(
            seq=e.seq,
            ts=e.ts,
            actor=e.actor,
            action=e.action,
            target_type=e.target_type,
            target_id=e.target_id,
            outcome=e.outcome,
            details=e.details,
        )


def event_json(e: Event) -> dict[str, Any]:
    """``EventOut.of(e)`` as the JSON value it serializes to (same keys, same order)."""
    return {
        "seq": e.seq,
        "ts": e.ts,
        "actor": e.actor,
        "action": e.action,
        "target_type": e.target_type,
        "target_id": e.target_id,
        "outcome": e.outcome.value,
        "details": e.details,
    }
