"""Rows ↔ domain values, and the lookups every service needs (raising NotFound by name)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import Any, TypeVar

from sqlalchemy import Select, Text, bindparam, cast, select
from sqlalchemy.orm import Session, joinedload, selectinload

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
    TopologyRequest,
    Workload,
    WorkloadStatus,
)
from proofplane.model.tenant import profile_from_json
from proofplane.model.workload import devices_json
from proofplane.store.tables import (
    CertificationRow,
    GpuHealthRow,
    GpuRow,
    NodeNetworkRow,
    NodeRow,
    PlacementRow,
    TenantRow,
    WorkloadRow,
    placement_nodes,
)

_T = TypeVar("_T")

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
        cpu_milli=row.cpu_milli,
        memory_mib=row.memory_mib,
        topology=dict(row.topology or {}),
    )


def drained_gpus(session: Session, nodes: Iterable[str] | None = None) -> frozenset[str]:
    """The UUIDs of the GPUs drained for their health (issue 15), of ``nodes`` or all."""
    query = select(GpuHealthRow.gpu_uuid)
    if nodes is not None:
        query = query.where(GpuHealthRow.node.in_(list(nodes)))
    return frozenset(session.scalars(query))


def schedulable(node: Node, drained: frozenset[str]) -> Node:
    """The node as placement sees it: without its drained GPUs (no new work goes to them;
    what already holds them keeps them until evicted)."""
    if not drained or not any(g.uuid in drained for g in node.gpus):
        return node
    return replace(node, gpus=tuple(g for g in node.gpus if g.uuid not in drained))


# --- reading nodes without ORM objects (issue 20: the API's hot reads) ------------------------
# A node list is three indexed queries whatever its length (nodes, then their GPUs and their
# certifications by node id), straight from result rows into domain values: no identity map,
# no per-row instrumentation, no lazy loads.

_N = NodeRow.__table__.c
_G = GpuRow.__table__.c
_C = CertificationRow.__table__.c
_NN = NodeNetworkRow.__table__.c
# the last column: the node's network drift (issue 14), from an outer join on node_network
NODE_COLUMNS = (
    _N.id, _N.name, _N.region, _N.zone, _N.rack, _N.labels, _N.state, _N.state_reason,
    _N.created_at, _N.updated_at, _NN.drift, _N.cpu_milli, _N.memory_mib, _N.topology,
)  # fmt: skip
_NODES_FROM = NodeRow.__table__.outerjoin(NodeNetworkRow.__table__, _NN.node_id == _N.id)
# mig_instances as its JSON text: most GPUs have none ("[]"), which then costs no decoding
_GPU_COLUMNS = (
    _G.node_id, _G.index, _G.uuid, _G.model, _G.memory_mb, _G.mig_enabled,
    cast(_G.mig_instances, Text), _G.vbios_version, _G.driver_version,
)  # fmt: skip


# Built once (statement construction costs more than SQLite answering them); run on the
# session's connection, not through the ORM's execute.
_GPUS_OF = (
    select(*_GPU_COLUMNS)
    .where(_G.node_id.in_(bindparam("ids", expanding=True)))
    .order_by(_G.node_id, _G.index)
)
_CERTS_OF = (
    select(_C.node_id, _C.key, _C.value)
    .where(_C.node_id.in_(bindparam("ids", expanding=True)))
    .order_by(_C.node_id, _C.key)
)
_NODE_NAMED = select(*NODE_COLUMNS).select_from(_NODES_FROM).where(_N.name == bindparam("name"))


def node_select() -> Select[Any]:
    """``SELECT`` of a node's own columns (what ``load_nodes`` takes): add filters, order and
    limit; filters on ``NodeRow`` attributes work as they do on the ORM query."""
    return select(*NODE_COLUMNS).select_from(_NODES_FROM)


def load_nodes(
    session: Session, query: Select[Any], params: dict[str, Any] | None = None
) -> list[Node]:
    """The nodes ``query`` (a ``node_select()``) selects, in its order, with their GPUs (by
    index) and certifications: three queries in all."""
    conn = session.connection()
    rows = conn.execute(query, params).all()
    if not rows:
        return []
    ids = [r[0] for r in rows]
    gpus: dict[int, list[Gpu]] = {i: [] for i in ids}
    certs: dict[int, dict[str, str]] = {i: {} for i in ids}
    for node_id, index, uuid, model, memory, mig, instances, vbios, driver in conn.execute(
        _GPUS_OF, {"ids": ids}
    ).all():
        gpus[node_id].append(
            Gpu(
                index=index,
                uuid=uuid,
                model=model,
                memory_mb=memory,
                mig_enabled=mig,
                mig_instances=_mig_instances(instances),
                vbios_version=vbios,
                driver_version=driver,
            )
        )
    for node_id, key, value in conn.execute(_CERTS_OF, {"ids": ids}):
        certs[node_id][key] = value
    return [_node(r, gpus[r[0]], certs[r[0]]) for r in rows]


def _mig_instances(text: str | None) -> tuple[MigInstance, ...]:
    if not text or text == "[]":
        return ()
    return tuple(MigInstance(i["profile"], i["start"]) for i in json.loads(text))


def _node(row: Sequence[Any], gpus: list[Gpu], certs: dict[str, str]) -> Node:
    (_id, name, region, zone, rack, labels, state, reason, created, updated, drift, cpu, mem,
     topology) = row  # fmt: skip
    return Node(
        name=name,
        region=region,
        zone=zone,
        rack=rack,
        labels=dict(labels),
        certifications=certs,
        state=NodeState(state),
        state_reason=reason,
        gpus=tuple(gpus),
        created_at=created,
        updated_at=updated,
        network_drift=drift,
        cpu_milli=cpu,
        memory_mib=mem,
        topology=dict(topology or {}),
    )


def load_node(session: Session, name: str) -> Node:
    """One node by name (``load_nodes``), or NotFound."""
    found = load_nodes(session, _NODE_NAMED, {"name": name})
    if not found:
        raise NotFound(f"node {name!r} not found", details={"node": name})
    return found[0]


def devices_to_json(devices: tuple[PlacedDevice, ...]) -> list[dict[str, Any]]:
    """A placement's devices as its row stores them (``model.workload.devices_json``)."""
    return devices_json(devices)


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
    return placement_of(row.node.name, row.devices, row.members)


def placement_of(
    node: str, devices: list[dict[str, Any]], members: list[dict[str, Any]] | None
) -> Placement:
    """A placement from its stored columns: its (first) node, devices and gang members."""
    parts = tuple(Placement(m["node"], devices_from_json(m["devices"])) for m in members or ())
    return Placement(node, devices_from_json(devices), parts)


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
        cpu_milli=row.cpu_milli,
        memory_mib=row.memory_mib,
        restartable=row.restartable,
        topology=TopologyRequest.from_json(row.topology),
    )


# --- reading workloads without ORM objects (issue 20) -------------------------------------------
# One query: the workload, its tenant's name, its placement and the placement's first node.

_W = WorkloadRow.__table__.c
_T = TenantRow.__table__.c
_P = PlacementRow.__table__.c
_PN = placement_nodes.c
_HELD_ON = NodeRow.__table__.alias("held_on")
_WORKLOAD_FROM = (
    WorkloadRow.__table__.join(TenantRow.__table__, _T.id == _W.tenant_id)
    .outerjoin(PlacementRow.__table__, _P.workload_id == _W.id)
    .outerjoin(NodeRow.__table__, _N.id == _P.node_id)
)


class WorkloadColumns:
    """What a ``workload_select()`` is filtered and ordered on."""

    name = _W.name
    tenant = _T.name  # the tenant's name
    status = _W.status


def workload_select() -> Select[Any]:
    """``SELECT`` of what ``load_workloads`` reads: filter it on ``WorkloadColumns`` or
    ``workload_on_node``; order and limit it."""
    return select(
        _W.name, _T.name, _W.tags, _W.isolation, _W.gpu_count, _W.gpu_model, _W.mig_profile,
        _W.share_milli, _W.gpu_nodes, _W.priority, _W.command, _W.status, _W.reason,
        _W.reason_details, _W.created_at, _W.updated_at, _W.co_residency,
        _W.cpu_milli, _W.memory_mib, _W.restartable, _W.topology, _N.name, _P.devices,
        _P.members,
    ).select_from(_WORKLOAD_FROM)  # fmt: skip


def workload_on_node(node: str) -> Any:
    """The condition "holds capacity on ``node``" (a gang member's node included)."""
    return _P.id.in_(
        select(_PN.placement_id)
        .join(_HELD_ON, _HELD_ON.c.id == _PN.node_id)
        .where(_HELD_ON.c.name == node)
    )


def load_workloads(
    session: Session, query: Select[Any], params: dict[str, Any] | None = None
) -> list[Workload]:
    """The workloads ``query`` (a ``workload_select()``, its bound ``params``) selects, in its
    order."""
    return [_workload(values) for values in session.connection().execute(query, params)]


def workload_target_select() -> Select[Any]:
    """``workload_select()`` with the workload's row id and its placement's id after its
    columns (None for a workload that holds no placement): what ``load_workload_targets``
    reads, for a write that changes the rows it finds without loading them as ORM objects."""
    return workload_select().add_columns(_W.id, _P.id)


def load_workload_targets(
    session: Session, query: Select[Any], params: dict[str, Any] | None = None
) -> list[tuple[int, int | None, Workload]]:
    """Each workload a ``workload_target_select()`` (its bound ``params``) selects, with its
    row id and its placement's id, in its order."""
    return [
        (*values[-2:], _workload(values[:-2]))
        for values in session.connection().execute(query, params)
    ]


def _workload(values: Sequence[Any]) -> Workload:
    (
        name, tenant, tags, isolation, count, model, mig_profile, share, nodes, priority,
        command, status, reason, details, created, updated, co_residency,
        cpu_milli, memory_mib, restartable, topology, node, devices, members,
    ) = values  # fmt: skip
    placement = None if node is None else placement_of(node, devices, members)
    return Workload(
        name=name,
        tenant=tenant,
        tags=dict(tags),
        isolation=IsolationLevel(isolation),
        gpus=GpuRequest(
            count=count,
            model=model,
            mig_profile=mig_profile,
            share_milli=share,
            nodes=nodes,
        ),
        priority=priority,
        command=tuple(command),
        status=WorkloadStatus(status),
        reason=reason,
        reason_details=details,
        placement=placement,
        created_at=created,
        updated_at=updated,
        co_residency=co_residency,
        cpu_milli=cpu_milli,
        memory_mib=memory_mib,
        restartable=restartable,
        topology=TopologyRequest.from_json(topology),
    )


_TENANT_BY_NAME = select(TenantRow).where(
    TenantRow.name == bindparam("name"), TenantRow.deleted_at.is_(None)
)  # built once, as _NODE_BY_NAME below


def tenant_row(session: Session, name: str) -> TenantRow:
    row = session.scalar(_TENANT_BY_NAME, {"name": name})
    if row is None:  # a deleted tenant is gone for every use case
        raise NotFound(f"tenant {name!r} not found", details={"tenant": name})
    return row


# Built once (its cache key too): building the statement cost more than running it.
_NODE_BY_NAME = select(NodeRow).where(NodeRow.name == bindparam("name")).options(*NODE_LOAD)


def node_row(session: Session, name: str) -> NodeRow:
    """The node called ``name`` with its certifications and GPUs loaded."""
    row = session.scalar(_NODE_BY_NAME, {"name": name})
    if row is None:
        raise NotFound(f"node {name!r} not found", details={"node": name})
    return row


# One workload (rarely a few): its tenant, placement and placement's node joined into its own
# query (scalar relationships: no row repeats), where WORKLOAD_LOAD's "SELECT … IN" loads,
# made for many rows, cost three statements more.
_WORKLOAD_ONE = (
    joinedload(WorkloadRow.tenant),
    joinedload(WorkloadRow.placement).joinedload(PlacementRow.node),
)


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
    query = select(WorkloadRow).where(WorkloadRow.name == name).options(*_WORKLOAD_ONE)
    if tenant is not None:
        query = query.where(WorkloadRow.tenant.has(TenantRow.name == tenant))
    if visible is not None:
        query = query.where(WorkloadRow.tenant.has(TenantRow.name.in_(visible)))
    return only_named(list(session.scalars(query)), name, lambda r: r.tenant.name)


def only_named(found: Sequence[_T], name: str, tenant_of: Callable[[_T], str]) -> _T:
    """The one workload called ``name`` in ``found`` (what a lookup by name among the
    caller's tenants gave): 404 when none, 409 ``ambiguous_name`` when several tenants have
    one (``tenant_of``: the tenant of each)."""
    if not found:
        raise NotFound(f"workload {name!r} not found", details={"workload": name})
    if len(found) > 1:
        raise Conflict(
            f"several tenants have a workload {name!r}: say which with tenant=",
            code="ambiguous_name",
            details={"workload": name, "tenants": sorted(tenant_of(w) for w in found)},
        )
    return found[0]
