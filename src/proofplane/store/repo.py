"""Rows ↔ domain values, and the lookups every service needs (raising NotFound by name)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, selectinload

from proofplane.errors import Conflict, NotFound
from proofplane.model import (
    Gpu,
    GpuRequest,
    IsolationLevel,
    MigInstance,
    Node,
    NodeState,
    PlacedDevice,
    Placement,
    Quota,
    Tenant,
    Workload,
    WorkloadStatus,
)
from proofplane.model.tenant import profile_from_json
from proofplane.store.tables import NodeRow, PlacementRow, TenantRow, WorkloadRow

NODE_LOAD = (selectinload(NodeRow.gpus), selectinload(NodeRow.certifications))
WORKLOAD_LOAD = (
    selectinload(WorkloadRow.tenant),
    selectinload(WorkloadRow.placement).selectinload(PlacementRow.node),
)


def tenant_from_row(row: TenantRow) -> Tenant:
    return Tenant(
        name=row.name,
        description=row.description,
        profile=profile_from_json(row.profile),
        quota=Quota(row.quota_gpus, row.quota_mig_slices),
        created_at=row.created_at,
        updated_at=row.updated_at,
    )


def node_from_row(row: NodeRow) -> Node:
    return Node(
        name=row.name,
        region=row.region,
        zone=row.zone,
        rack=row.rack,
        labels=dict(row.labels),
        certifications={c.key: c.value for c in row.certifications},
        state=NodeState(row.state),
        state_reason=row.state_reason,
        gpus=tuple(
            Gpu(
                index=g.index,
                uuid=g.uuid,
                model=g.model,
                memory_mb=g.memory_mb,
                mig_enabled=g.mig_enabled,
                mig_instances=tuple(MigInstance(i["profile"], i["start"]) for i in g.mig_instances),
                vbios_version=g.vbios_version,
                driver_version=g.driver_version,
            )
            for g in row.gpus
        ),
        created_at=row.created_at,
        updated_at=row.updated_at,
    )


def devices_to_json(devices: tuple[PlacedDevice, ...]) -> list[dict[str, Any]]:
    return [
        {
            "gpu_index": d.gpu_index,
            "gpu_uuid": d.gpu_uuid,
            "mig_profile": d.mig_profile,
            "mig_start": d.mig_start,
            "share_milli": d.share_milli,
        }
        for d in devices
    ]


def devices_from_json(data: list[dict[str, Any]]) -> tuple[PlacedDevice, ...]:
    return tuple(
        PlacedDevice(
            gpu_index=d["gpu_index"],
            gpu_uuid=d["gpu_uuid"],
            mig_profile=d.get("mig_profile"),
            mig_start=d.get("mig_start"),
            share_milli=d.get("share_milli"),
        )
        for d in data
    )


def members_to_json(placement: Placement) -> list[dict[str, Any]] | None:
    """A gang's members as stored (None for a plain placement)."""
    if not placement.members:
        return None
    return [{"node": p.node, "devices": devices_to_json(p.devices)} for p in placement.members]


def placement_from_row(row: PlacementRow) -> Placement:
    members = tuple(
        Placement(m["node"], devices_from_json(m["devices"])) for m in row.members or ()
    )
    return Placement(row.node.name, devices_from_json(row.devices), members)


def workload_from_row(row: WorkloadRow) -> Workload:
    return Workload(
        name=row.name,
        tenant=row.tenant.name,
        tags=dict(row.tags),
        isolation=IsolationLevel(row.isolation),
        gpus=GpuRequest.from_row(row),
        priority=row.priority,
        command=tuple(row.command),
        status=WorkloadStatus(row.status),
        reason=row.reason,
        reason_details=row.reason_details,
        placement=placement_from_row(row.placement) if row.placement else None,
        created_at=row.created_at,
        updated_at=row.updated_at,
        co_residency=row.co_residency,
    )


def tenant_row(session: Session, name: str) -> TenantRow:
    row = session.scalar(select(TenantRow).where(TenantRow.name == name))
    if row is None:
        raise NotFound(f"tenant {name!r} not found", details={"tenant": name})
    return row


def node_row(session: Session, name: str) -> NodeRow:
    row = session.scalar(select(NodeRow).where(NodeRow.name == name).options(*NODE_LOAD))
    if row is None:
        raise NotFound(f"node {name!r} not found", details={"node": name})
    return row


def workload_row(
    session: Session,
    name: str,
    *,
    tenant: str | None = None,
    visible: frozenset[str] | None = None,
) -> WorkloadRow:
    """The workload called ``name`` among those the caller can see (``visible`` tenants; None:
    all), in ``tenant`` when given. Names are unique per tenant, so a name shared by several
    visible tenants needs ``tenant`` (409 ``ambiguous_name``)."""
    query = select(WorkloadRow).where(WorkloadRow.name == name).options(*WORKLOAD_LOAD)
    if tenant is not None:
        query = query.where(WorkloadRow.tenant.has(TenantRow.name == tenant))
    if visible is not None:
        query = query.where(WorkloadRow.tenant.has(TenantRow.name.in_(visible)))
    rows = list(session.scalars(query))
    if not rows:
        raise NotFound(f"workload {name!r} not found", details={"workload": name})
    if len(rows) > 1:
        raise Conflict(
            f"several tenants have a workload {name!r}: say which with tenant=",
            code="ambiguous_name",
            details={"workload": name, "tenants": sorted(r.tenant.name for r in rows)},
        )
    return rows[0]
