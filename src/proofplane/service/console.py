"""What the web console's pages show: one read per page, scoped by the signed-in actor.

Each function checks authorization (``access.authorize``: the same rule as the API), reads
what its page needs in one transaction, bounded by a page size so a 5,000-node cluster
answers as fast as a 24-node demo, and returns plain values the console renders. Another
tenant's work is never named: on a node a developer sees the MIG slices other tenants hold as
"another tenant", with no workload or tenant name.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, func, or_, select

from proofplane.access import Actor, Permission, authorize
from proofplane.errors import NotFound, ValidationFailed
from proofplane.hardware.nvml import sku_for
from proofplane.hardware.skus import ALIASES, COMPUTE_SLICES, MEMORY_SLICES, SKUS, Sku
from proofplane.meter.fields import GPU_UTIL
from proofplane.model import Node, NodeState, Workload, WorkloadStatus
from proofplane.service import attestation as attestation_svc
from proofplane.service import events as events_svc
from proofplane.service import tenants as tenants_svc
from proofplane.service import workloads as workloads_svc
from proofplane.service.access import list_users
from proofplane.service.context import Store
from proofplane.service.pagination import check_limit, decode_text_cursor, encode_cursor
from proofplane.store.repo import (
    load_node,
    load_nodes,
    load_workloads,
    node_select,
    workload_on_node,
    workload_select,
)
from proofplane.store.tables import (
    TELEMETRY_COLUMNS,
    CertificationRow,
    EvidenceRow,
    GpuRow,
    NodeAttestationRow,
    NodeRow,
    TenantRow,
    WorkloadRow,
    telemetry_device_latest,
)

ATTESTATION_STATES = ("passed", "failed", "stale", "simulated", "none")
# Accessible fills (WCAG AA with black text), one per tenant by a hash of its name.
PALETTE = (
    "#8dd3c7", "#fdb462", "#bebada", "#fb8072", "#80b1d3", "#b3de69",
    "#fccde5", "#ffed6f", "#ccebc5", "#bc80bd", "#d9d9d9", "#e5c494",
)  # fmt: skip
OTHER_TENANT = "another tenant"
ACTIVE = (WorkloadStatus.PLACED.value, WorkloadStatus.RUNNING.value)


def tenant_colour(tenant: str) -> str:
    """The fill a tenant has on every page (stable: a hash of its name)."""
    return PALETTE[hashlib.sha256(tenant.encode()).digest()[0] % len(PALETTE)]


# --- the cluster ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NodeLine:
    node: Node
    attestation: str  # passed | failed | stale | simulated | none
    attestation_reason: str | None
    gpus_in_use: int
    utilisation: float | None = None  # mean DCGM GPU utilisation (%), newest readings


@dataclass
class ClusterView:
    by_region: dict[str, dict[str, int]]  # region -> state -> nodes
    attestation: dict[str, int]
    gpus_total: int
    gpus_whole_in_use: int
    mig_instances_in_use: int
    workloads_active: int
    workloads_pending: int
    nodes: list[NodeLine]
    next: str | None
    regions: list[str] = field(default_factory=list)
    utilisation: float | None = None  # fleet mean GPU utilisation (%), newest readings

    @property
    def total_nodes(self) -> int:
        return sum(sum(states.values()) for states in self.by_region.values())

    @property
    def states(self) -> list[str]:
        return sorted({st for states in self.by_region.values() for st in states})


def _attestation_condition(state: str, stale_before: datetime) -> Any:
    a = NodeAttestationRow
    if state == "none":
        return a.node_id.is_(None)
    if state == "failed":
        return a.quarantined.is_(True)
    if state == "stale":
        return and_(
            a.quarantined.is_(False),
            or_(a.last_passed_at.is_(None), a.last_passed_at < stale_before),
        )
    fresh = and_(a.quarantined.is_(False), a.last_passed_at >= stale_before)
    return and_(fresh, a.simulated.is_(state == "simulated"))


def attestation_of(row: tuple[bool, datetime | None, bool] | None, stale_before: datetime) -> str:
    """A node's attestation at a glance from (quarantined, last passed, simulated)."""
    if row is None:
        return "none"
    quarantined, last_passed, simulated = row
    if quarantined:
        return "failed"
    if last_passed is None or last_passed < stale_before:
        return "stale"
    return "simulated" if simulated else "passed"


def cluster_view(
    store: Store,
    actor: Actor,
    *,
    now: datetime,
    grace: timedelta,
    region: str | None = None,
    state: NodeState | None = None,
    certification: dict[str, str] | None = None,
    attestation: str | None = None,
    limit: int = 50,
    cursor: str | None = None,
) -> ClusterView:
    """The cluster page: nodes per region and state, attestation at a glance, GPUs in use,
    and one page of nodes with the filters applied."""
    authorize(actor, Permission.NODES_READ)
    check_limit(limit)
    if attestation is not None and attestation not in ATTESTATION_STATES:
        raise ValidationFailed(
            f"unknown attestation state {attestation!r}",
            code="invalid_filter",
            details={"known": list(ATTESTATION_STATES)},
        )
    stale_before = now - grace
    after = decode_text_cursor("console-nodes", cursor)
    a = NodeAttestationRow
    with store.read() as s:
        by_region: dict[str, dict[str, int]] = {}
        for reg, st, n in s.execute(
            select(NodeRow.region, NodeRow.state, func.count()).group_by(
                NodeRow.region, NodeRow.state
            )
        ):
            by_region.setdefault(reg, {})[st] = n
        counts = dict.fromkeys(ATTESTATION_STATES, 0)
        total_nodes = sum(sum(v.values()) for v in by_region.values())
        for q, last, sim in s.execute(select(a.quarantined, a.last_passed_at, a.simulated)):
            counts[attestation_of((q, last, sim), stale_before)] += 1
        counts["none"] = total_nodes - sum(counts[k] for k in ATTESTATION_STATES if k != "none")
        counts["simulated_total"] = (
            s.scalar(select(func.count()).select_from(a).where(a.simulated.is_(True))) or 0
        )
        gpus_total = s.scalar(select(func.count()).select_from(GpuRow)) or 0
        whole = s.scalar(
            select(func.coalesce(func.sum(WorkloadRow.gpu_count), 0)).where(
                WorkloadRow.status.in_(ACTIVE),
                WorkloadRow.mig_profile.is_(None),
                WorkloadRow.share_milli.is_(None),
            )
        )
        mig = s.scalar(
            select(func.count()).where(
                WorkloadRow.status.in_(ACTIVE), WorkloadRow.mig_profile.is_not(None)
            )
        )
        status_counts = dict(
            s.execute(select(WorkloadRow.status, func.count()).group_by(WorkloadRow.status)).all()
        )
        query = node_select().order_by(NodeRow.name)
        if after is not None:
            query = query.where(NodeRow.name > after)
        if region:
            query = query.where(NodeRow.region == region)
        if state is not None:
            query = query.where(NodeRow.state == state.value)
        for key, value in (certification or {}).items():
            query = query.where(
                NodeRow.certifications.any(
                    (CertificationRow.key == key) & (CertificationRow.value == value)
                )
            )
        if attestation is not None:
            query = query.outerjoin(a, a.node_id == NodeRow.id).where(
                _attestation_condition(attestation, stale_before)
            )
        nodes = load_nodes(s, query.limit(limit + 1))
        more = len(nodes) > limit
        nodes = nodes[:limit]
        names = [n.name for n in nodes]
        ids = dict(s.execute(select(NodeRow.name, NodeRow.id).where(NodeRow.name.in_(names))).all())
        att = {
            nid: (q, last, sim)
            for nid, q, last, sim in s.execute(
                select(a.node_id, a.quarantined, a.last_passed_at, a.simulated).where(
                    a.node_id.in_(ids.values())
                )
            )
        }
        reasons = _latest_failures(s, list(ids.values()))
        in_use = _gpus_in_use(s, names)
        # utilisation says what other tenants' work is doing: only for those who see all
        fleet_util, node_util = (
            _utilisation(s, names)
            if actor.visible_tenants(Permission.WORKLOADS_READ) is None
            else (None, {})
        )
    lines = [
        NodeLine(
            n,
            attestation_of(att.get(ids[n.name]), stale_before),
            reasons.get(ids[n.name]),
            in_use.get(n.name, 0),
            node_util.get(n.name),
        )
        for n in nodes
    ]
    return ClusterView(
        by_region=by_region,
        attestation=counts,
        gpus_total=gpus_total,
        gpus_whole_in_use=int(whole or 0),
        mig_instances_in_use=int(mig or 0),
        workloads_active=sum(status_counts.get(k, 0) for k in ACTIVE),
        workloads_pending=status_counts.get(WorkloadStatus.PENDING.value, 0),
        nodes=lines,
        next=encode_cursor("console-nodes", nodes[-1].name) if more else None,
        regions=sorted(by_region),
        utilisation=fleet_util,
    )


def _utilisation(session: Any, names: list[str]) -> tuple[float | None, dict[str, float]]:
    """The fleet's and each of ``names``' mean GPU utilisation (DCGM_FI_DEV_GPU_UTIL, %) over
    their newest readings."""
    L = telemetry_device_latest
    util = L.c[TELEMETRY_COLUMNS[GPU_UTIL]]
    whole = util.is_not(None) & L.c.gi_id.is_(None)
    fleet = session.scalar(select(func.avg(util)).where(whole))
    per_node = dict(
        session.execute(
            select(L.c.node, func.avg(util)).where(whole, L.c.node.in_(names)).group_by(L.c.node)
        ).all()
    )
    return (None if fleet is None else float(fleet)), {k: float(v) for k, v in per_node.items()}


def _latest_failures(session: Any, node_ids: list[int]) -> dict[int, str]:
    """Per node, the reasons of its latest attestation attempt when it failed."""
    if not node_ids:
        return {}
    latest = (
        select(func.max(EvidenceRow.id))
        .where(EvidenceRow.node_id.in_(node_ids))
        .group_by(EvidenceRow.node_id)
    )
    out: dict[int, str] = {}
    for nid, ok, reasons in session.execute(
        select(EvidenceRow.node_id, EvidenceRow.ok, EvidenceRow.reasons).where(
            EvidenceRow.id.in_(latest)
        )
    ):
        if not ok:
            out[nid] = ", ".join(reasons) or "failed"
    return out


def _gpus_in_use(session: Any, names: list[str]) -> dict[str, int]:
    """Distinct GPUs holding work, per node of ``names``."""
    held: dict[str, set[int]] = {}
    for name in names:
        held[name] = set()
    if not names:
        return {}
    query = workload_select().where(WorkloadRow.status.in_(ACTIVE))
    query = query.where(or_(*(workload_on_node(n) for n in names)))
    for wl in load_workloads(session, query):
        if wl.placement is None:
            continue
        for part in wl.placement.parts:
            if part.node in held:
                held[part.node].update(d.gpu_index for d in part.devices)
    return {n: len(g) for n, g in held.items()}


# --- a node --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Slot:
    """One MIG instance (or a whole GPU / a share) drawn on a GPU: memory slots
    ``[start, start + width)`` of 8, its profile and who holds it (None: free)."""

    start: int
    width: int
    label: str
    compute: int
    holder: str | None  # the workload, or OTHER_TENANT
    tenant: str | None  # the tenant, or OTHER_TENANT
    colour: str


@dataclass(frozen=True, slots=True)
class GpuPicture:
    index: int
    model: str
    mig_enabled: bool
    vbios: str | None
    driver: str | None
    slots: list[Slot]
    free_slots: list[int]  # memory slots no instance covers


@dataclass
class NodeView:
    node: Node
    attestation: dict[str, Any]
    attestation_state: str
    history: list[dict[str, Any]] | None  # None: the actor may not read attestation records
    gpus: list[GpuPicture]
    legend: dict[str, str]  # tenant (or OTHER_TENANT) -> colour
    events: list[Any] | None  # None: the actor may not read events


FREE = "#ffffff"
HIDDEN = "#9e9e9e"


def _sku(model: str, memory_mb: int) -> Sku | None:
    return SKUS.get(model) or SKUS.get(ALIASES.get(model, "")) or sku_for(model, memory_mb)


def _holders(
    node: str, workloads: list[Workload], visible: frozenset[str] | None
) -> dict[tuple[int, int | None], list[tuple[str, str, int | None]]]:
    """(gpu index, mig start or None) -> [(workload, tenant, share)], names hidden outside
    ``visible``."""
    out: dict[tuple[int, int | None], list[tuple[str, str, int | None]]] = {}
    for wl in workloads:
        if wl.placement is None:
            continue
        seen = visible is None or wl.tenant in visible
        name, tenant = (wl.name, wl.tenant) if seen else (OTHER_TENANT, OTHER_TENANT)
        for part in wl.placement.parts:
            if part.node != node:
                continue
            for d in part.devices:
                out.setdefault((d.gpu_index, d.mig_start), []).append((name, tenant, d.share_milli))
    return out


def mig_picture(
    node: Node, workloads: list[Workload], visible: frozenset[str] | None
) -> tuple[list[GpuPicture], dict[str, str]]:
    """Every GPU of ``node`` as slots on the 8 memory slots, with holders and colours; and
    the legend (tenant -> colour) of the tenants shown."""
    holders = _holders(node.name, workloads, visible)
    legend: dict[str, str] = {}
    pictures = []
    for gpu in node.gpus:
        sku = _sku(gpu.model, gpu.memory_mb)
        slots: list[Slot] = []
        if gpu.mig_enabled and gpu.mig_instances:
            for inst in sorted(gpu.mig_instances, key=lambda i: i.start):
                prof = sku.profile(inst.profile) if sku else None
                width = prof.mem_slices if prof else 1
                compute = prof.compute_slices if prof else 1
                slots.append(_slot(inst.start, width, inst.profile, compute,
                                   holders.get((gpu.index, inst.start), []), legend))  # fmt: skip
        else:
            held = holders.get((gpu.index, None), [])
            shared = any(share for _, _, share in held)
            label = "MIG on, no instances" if gpu.mig_enabled else "whole GPU"
            if shared:
                label = "shared: " + ", ".join(f"{(share or 0) / 10:g}%" for _, _, share in held)
            slots.append(_slot(0, MEMORY_SLICES, label, COMPUTE_SLICES, held, legend))
        covered = {k for sl in slots for k in range(sl.start, sl.start + sl.width)}
        pictures.append(
            GpuPicture(
                gpu.index,
                gpu.model,
                gpu.mig_enabled,
                gpu.vbios_version,
                gpu.driver_version,
                slots,
                [k for k in range(MEMORY_SLICES) if k not in covered],
            )  # fmt: skip
        )
    return pictures, legend


def _slot(
    start: int,
    width: int,
    label: str,
    compute: int,
    held: list[tuple[str, str, int | None]],
    legend: dict[str, str],
) -> Slot:
    if not held:
        return Slot(start, width, label, compute, None, None, FREE)
    tenants = sorted({tenant for _, tenant, _ in held})
    for tenant in tenants:
        legend[tenant] = HIDDEN if tenant == OTHER_TENANT else tenant_colour(tenant)
    workload = ", ".join(name for name, _, _ in held)
    tenant = ", ".join(tenants)
    return Slot(start, width, label, compute, workload, tenant, legend[tenants[0]])


def node_view(
    store: Store, actor: Actor, name: str, *, now: datetime, grace: timedelta
) -> NodeView:
    """The node page: its MIG layouts with holders, attestation (history for those who may
    read attestation records), inventory, and its newest events (for those who may read
    events)."""
    authorize(actor, Permission.NODES_READ)
    visible = actor.visible_tenants(Permission.WORKLOADS_READ)
    with store.read() as s:
        node = load_node(s, name)
        workloads = load_workloads(
            s, workload_select().where(workload_on_node(name), WorkloadRow.status.in_(ACTIVE))
        )
    status = attestation_svc.attestation_status(store, actor, name)
    history = None
    if actor.holds(Permission.AUDIT_READ):
        history = attestation_svc.list_evidence(store, actor, name, limit=20, records=False)
    events = None
    if actor.holds(Permission.EVENTS_READ):
        events = events_svc.list_events(
            store, actor, target_type="node", target_id=name, newest_first=True, limit=20
        ).items
    gpus, legend = mig_picture(node, workloads, visible)
    last = status.get("last_passed_at")
    row = (
        None
        if not status["enrolled"]
        else (
            status["quarantined_by_attestation"],
            datetime.fromisoformat(last) if last else None,
            status["simulated"],
        )
    )
    return NodeView(node, status, attestation_of(row, now - grace), history, gpus, legend, events)


def evidence_record(store: Store, actor: Actor, name: str, evidence_id: int) -> dict[str, Any]:
    """One attestation attempt's replayable record (``proofplane attest replay`` reads it)."""
    authorize(actor, Permission.AUDIT_READ)
    with store.read() as s:
        record = s.scalar(
            select(EvidenceRow.record)
            .join(NodeRow, NodeRow.id == EvidenceRow.node_id)
            .where(EvidenceRow.id == evidence_id, NodeRow.name == name)
        )
    if record is None:
        raise NotFound(f"no attestation record {evidence_id} for node {name!r}", code="not_found")
    return dict(record)


# --- tenants -------------------------------------------------------------------------------


@dataclass
class TenantView:
    tenant: Any
    gpus_in_use: float
    mig_slices_in_use: int
    workloads: dict[str, int]
    users: list[Any] | None  # None: the actor may not read users
    colour: str


def tenant_view(store: Store, actor: Actor, name: str) -> TenantView:
    """A tenant's profile, quota and usage, and (for those who may read users) its users."""
    tenant = tenants_svc.get_tenant(store, actor, name)
    with store.read() as s:
        tid = s.scalar(select(TenantRow.id).where(TenantRow.name == name))
        rows = s.execute(
            select(
                WorkloadRow.status,
                WorkloadRow.gpu_count,
                WorkloadRow.mig_profile,
                WorkloadRow.share_milli,
            ).where(WorkloadRow.tenant_id == tid)
        ).all()
    gpus = 0.0
    slices = 0
    counts: dict[str, int] = {}
    for st, count, mig, share in rows:
        counts[st] = counts.get(st, 0) + 1
        if st not in ACTIVE:
            continue
        if mig:
            slices += int(mig.split("g.", 1)[0]) if mig[0].isdigit() else 1
        elif share:
            gpus += share / 1000
        else:
            gpus += count
    users = None
    if actor.holds(Permission.USERS_READ):
        users = [u for u in list_users(store, actor, limit=500).items if name in u.tenants]
    return TenantView(tenant, gpus, slices, counts, users, tenant_colour(name))


def workload_view(
    store: Store, actor: Actor, name: str, tenant: str | None = None, *, live: bool = False
) -> tuple[Workload, dict[str, Any] | None]:
    """A workload, and (``live``) its explanation against the cluster as it stands now (why
    here / why waiting: every node judged again, which costs a cluster snapshot); without
    ``live`` the page shows the decision as it was recorded (its reason and rejection counts)."""
    wl = workloads_svc.get_workload(store, actor, name, tenant=tenant)
    if not live:
        return wl, None
    return wl, workloads_svc.explain_workload(store, actor, name, tenant=wl.tenant)
