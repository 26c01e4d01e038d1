"""The HTTP API under /api/v1. Each handler parses, calls one service function, renders."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Path, Query, Request, Response, status

from proofplane.access import Actor
from proofplane.access import Permission as P
from proofplane.api.deps import StoreDep, get_settings, requires
from proofplane.api.schemas import (
    CancelIn,
    CertificationIn,
    ErrorResponse,
    EventOut,
    ExplanationOut,
    NodeIn,
    NodeOut,
    NodePatch,
    NodeStateIn,
    Page,
    ProfileIn,
    QuotaIO,
    TenantIn,
    TenantOut,
    TenantPatch,
    WorkloadBatchIn,
    WorkloadBatchOut,
    WorkloadIn,
    WorkloadOut,
    event_json,
    json_page,
    json_response,
    node_json,
    workload_json,
)
from proofplane.errors import ValidationFailed
from proofplane.model import (
    ComplianceProfile,
    Gpu,
    MigInstance,
    Node,
    NodeState,
    Outcome,
    Quota,
    Tenant,
    WorkloadStatus,
    parse_tag_pairs,
)
from proofplane.service import changes as changes_svc
from proofplane.service import events as events_svc
from proofplane.service import nodes as nodes_svc
from proofplane.service import tenants as tenants_svc
from proofplane.service import workloads as workloads_svc

_ERRORS = {
    404: {"model": ErrorResponse, "description": "not found"},
    409: {"model": ErrorResponse, "description": "conflict or invalid state"},
    422: {"model": ErrorResponse, "description": "invalid input"},
}

router = APIRouter(prefix="/api/v1", responses=_ERRORS)  # type: ignore[arg-type]


Limit = Annotated[int, Query(ge=1, le=500, description="page size")]
Cursor = Annotated[str | None, Query(description="the `next` value of the previous page")]
TenantQuery = Annotated[
    str | None, Query(description="the workload's tenant, when several tenants use the name")
]


def _profile(p: ProfileIn) -> ComplianceProfile:
    return ComplianceProfile(
        dict(p.required_tags),
        p.min_isolation,
        dict(p.isolation_rules),
        p.co_residency,
        p.segment,
        p.network_policy,
    )


# --- tenants -----------------------------------------------------------------------------------


@router.get("/tenants", tags=["tenants"])
def list_tenants(
    store: StoreDep,
    actor: Annotated[Actor, Depends(requires(P.TENANTS_READ))],
    limit: Limit = 100,
    cursor: Cursor = None,
) -> Page[TenantOut]:
    page = tenants_svc.list_tenants(store, actor, limit=limit, cursor=cursor)
    return Page(items=[TenantOut.of(t) for t in page.items], next=page.next)


@router.post("/tenants", status_code=status.HTTP_201_CREATED, tags=["tenants"])
def create_tenant(
    body: TenantIn,
    store: StoreDep,
    actor: Annotated[Actor, Depends(requires(P.TENANTS_WRITE))],
    response: Response,
) -> TenantOut:
    t = tenants_svc.create_tenant(
        store,
        actor,
        Tenant(body.name, body.description, _profile(body.profile)),
        vni=body.vni,
        pkey=body.pkey,
    )
    response.headers["Location"] = f"/api/v1/tenants/{t.name}"
    return TenantOut.of(t)


@router.get("/tenants/{name}", tags=["tenants"])
def get_tenant(
    name: str, store: StoreDep, actor: Annotated[Actor, Depends(requires(P.TENANTS_READ))]
) -> TenantOut:
    return TenantOut.of(tenants_svc.get_tenant(store, actor, name))


@router.patch("/tenants/{name}", tags=["tenants"])
def update_tenant(
    name: str,
    body: TenantPatch,
    store: StoreDep,
    actor: Annotated[Actor, Depends(requires(P.TENANTS_WRITE))],
    request: Request,
) -> TenantOut:
    if body.profile is not None:  # a compliance profile is a governed change (issue 12)
        changes_svc.gate(
            get_settings(request).change_control,
            "tenant.profile",
            {"tenant": name, "profile": body.profile.model_dump(mode="json"),
             "description": body.description},
        )  # fmt: skip
    profile = _profile(body.profile) if body.profile is not None else None
    return TenantOut.of(
        tenants_svc.update_tenant(store, actor, name, description=body.description, profile=profile)
    )


@router.delete("/tenants/{name}", tags=["tenants"])
def delete_tenant(
    name: str,
    store: StoreDep,
    actor: Annotated[Actor, Depends(requires(P.TENANTS_WRITE))],
    request: Request,
) -> dict[str, Any]:
    """Delete a tenant with no unfinished work: its network segments are released into the
    cool-down; its name is never used again. A governed change (``tenant.delete``)."""
    changes_svc.gate(get_settings(request).change_control, "tenant.delete", {"tenant": name})
    return tenants_svc.delete_tenant(store, actor, name)


@router.put("/tenants/{name}/quota", tags=["tenants"])
def set_tenant_quota(
    name: str,
    body: QuotaIO,
    store: StoreDep,
    actor: Annotated[Actor, Depends(requires(P.QUOTAS_WRITE))],
    request: Request,
) -> TenantOut:
    """Set the tenant's quotas (null: no limit); raising one places waiting work at once."""
    payload = {"tenant": name, "gpus": body.gpus, "mig_slices": body.mig_slices}
    changes_svc.gate(get_settings(request).change_control, "quota.set", payload)
    return TenantOut.of(
        tenants_svc.set_quota(store, actor, name, Quota(body.gpus, body.mig_slices))
    )


# --- nodes -------------------------------------------------------------------------------------


@router.get("/nodes", tags=["nodes"], response_model=Page[NodeOut])
def list_nodes(
    store: StoreDep,
    actor: Annotated[Actor, Depends(requires(P.NODES_READ))],
    state: NodeState | None = None,
    region: str | None = None,
    zone: str | None = None,
    certification: Annotated[
        list[str] | None, Query(description="key=value; repeat to require several")
    ] = None,
    limit: Limit = 100,
    cursor: Cursor = None,
) -> Response:
    certs = parse_tag_pairs(certification, field="certification") if certification else None
    page = nodes_svc.list_nodes(
        store,
        actor,
        state=state,
        region=region,
        zone=zone,
        certification=certs,
        limit=limit,
        cursor=cursor,
    )
    return json_page([node_json(n) for n in page.items], page.next)


@router.post("/nodes", status_code=status.HTTP_201_CREATED, tags=["nodes"])
def register_node(
    body: NodeIn,
    store: StoreDep,
    actor: Annotated[Actor, Depends(requires(P.NODES_WRITE))],
    response: Response,
) -> NodeOut:
    node = Node(
        name=body.name,
        region=body.region,
        zone=body.zone,
        rack=body.rack,
        labels=dict(body.labels),
        gpus=tuple(
            Gpu(
                index=g.index,
                uuid=g.uuid,
                model=g.model,
                memory_mb=g.memory_mb,
                mig_enabled=g.mig_enabled,
                mig_instances=tuple(MigInstance(i.profile, i.start) for i in g.mig_instances),
                vbios_version=g.vbios_version,
                driver_version=g.driver_version,
            )
            for g in body.gpus
        ),
        cpu_milli=body.cpu_milli,
        memory_mib=body.memory_mib,
        topology=dict(body.topology),
    )
    n = nodes_svc.register_node(store, actor, node)
    response.headers["Location"] = f"/api/v1/nodes/{n.name}"
    return NodeOut.of(n)


@router.get("/nodes/{name}", tags=["nodes"], response_model=NodeOut)
def get_node(
    name: str, store: StoreDep, actor: Annotated[Actor, Depends(requires(P.NODES_READ))]
) -> Response:
    return json_response(node_json(nodes_svc.get_node(store, actor, name)))


@router.patch("/nodes/{name}", tags=["nodes"])
def update_node(
    name: str,
    body: NodePatch,
    store: StoreDep,
    actor: Annotated[Actor, Depends(requires(P.NODES_WRITE))],
) -> NodeOut:
    topology = dict(body.topology) if body.topology is not None else None
    return NodeOut.of(
        nodes_svc.update_node(
            store, actor, name, labels=body.labels, rack=body.rack, topology=topology
        )
    )


@router.post("/nodes/{name}/state", tags=["nodes"])
def set_node_state(
    name: str,
    body: NodeStateIn,
    store: StoreDep,
    actor: Annotated[Actor, Depends(requires(P.NODES_WRITE))],
    request: Request,
) -> NodeOut:
    control = get_settings(request).change_control
    if body.state == NodeState.DECOMMISSIONED:  # the lifecycle's last step: governed
        changes_svc.gate(control, "node.decommission",
                         {"node": name, "reason": body.reason or ""})  # fmt: skip
    elif body.state == NodeState.ADMITTED and control == "enforce":
        current = nodes_svc.get_node(store, actor, name)
        if current.state == NodeState.QUARANTINED:  # lifting a quarantine by hand: governed
            changes_svc.gate(control, "node.readmit", {"node": name, "reason": body.reason or ""})
    return NodeOut.of(nodes_svc.set_node_state(store, actor, name, body.state, body.reason))


@router.post("/nodes/{name}/certifications", tags=["nodes"])
def grant_certification(
    name: str,
    body: CertificationIn,
    store: StoreDep,
    actor: Annotated[Actor, Depends(requires(P.CERTIFY))],
    request: Request,
) -> NodeOut:
    changes_svc.gate(get_settings(request).change_control, "certification.grant",
                     {"node": name, "key": body.key, "value": body.value})  # fmt: skip
    return NodeOut.of(nodes_svc.grant_certification(store, actor, name, body.key, body.value))


@router.delete("/nodes/{name}/certifications/{key}", tags=["nodes"])
def revoke_certification(
    name: str,
    key: str,
    store: StoreDep,
    actor: Annotated[Actor, Depends(requires(P.CERTIFY))],
    request: Request,
) -> NodeOut:
    changes_svc.gate(get_settings(request).change_control, "certification.revoke",
                     {"node": name, "key": key})  # fmt: skip
    return NodeOut.of(nodes_svc.revoke_certification(store, actor, name, key))


# --- workloads ---------------------------------------------------------------------------------


@router.get("/workloads", tags=["workloads"], response_model=Page[WorkloadOut])
def list_workloads(
    store: StoreDep,
    actor: Annotated[Actor, Depends(requires(P.WORKLOADS_READ))],
    tenant: str | None = None,
    status: WorkloadStatus | None = None,
    node: str | None = None,
    limit: Limit = 100,
    cursor: Cursor = None,
) -> Response:
    page = workloads_svc.list_workloads(
        store, actor, tenant=tenant, status=status, node=node, limit=limit, cursor=cursor
    )
    return json_page([workload_json(w) for w in page.items], page.next)


def _workload_spec(body: WorkloadIn) -> workloads_svc.WorkloadSpec:
    return workloads_svc.WorkloadSpec(
        name=body.name,
        tenant=body.tenant,
        tags=dict(body.tags),
        isolation=body.isolation,
        gpus=body.gpus.to_domain(),
        priority=body.priority,
        command=tuple(body.command),
        cpu_milli=body.cpu_milli,
        memory_mib=body.memory_mib,
        restartable=body.restartable,
        topology=workloads_svc.topology_request(body.topology.level, body.topology.mode)
        if body.topology is not None
        else None,
    )


@router.post("/workloads", status_code=status.HTTP_201_CREATED, tags=["workloads"])
def submit_workload(
    body: WorkloadIn,
    store: StoreDep,
    actor: Annotated[Actor, Depends(requires(P.WORKLOADS_WRITE))],
    response: Response,
) -> WorkloadOut:
    w = workloads_svc.submit_workload(store, actor, _workload_spec(body))
    response.headers["Location"] = f"/api/v1/workloads/{w.name}"
    return WorkloadOut.of(w)


# A POST-only path: no per-workload route takes POST on /workloads/{name}, so a workload
# named "batch" stays reachable (GET /workloads/batch is that workload).
@router.post("/workloads/batch", status_code=status.HTTP_201_CREATED, tags=["workloads"])
def submit_workloads(
    body: WorkloadBatchIn,
    store: StoreDep,
    actor: Annotated[Actor, Depends(requires(P.WORKLOADS_WRITE))],
) -> WorkloadBatchOut:
    """Submit up to 1000 workloads in one transaction, all or nothing, placed in order. A
    refused item refuses the batch; the error names it (``items[i]: …``, ``details.index``)."""
    specs = []
    for i, item in enumerate(body.items):
        with workloads_svc.batch_item(i):  # a refused topology names its item too
            specs.append(_workload_spec(item))
    return WorkloadBatchOut(
        items=[WorkloadOut.of(w) for w in workloads_svc.submit_workloads(store, actor, specs)]
    )


@router.get("/workloads/{name}", tags=["workloads"], response_model=WorkloadOut)
def get_workload(
    name: str,
    store: StoreDep,
    actor: Annotated[Actor, Depends(requires(P.WORKLOADS_READ))],
    tenant: TenantQuery = None,
) -> Response:
    return json_response(
        workload_json(workloads_svc.get_workload(store, actor, name, tenant=tenant))
    )


@router.get("/workloads/{name}/explain", tags=["workloads"])
def explain_workload(
    name: str,
    store: StoreDep,
    actor: Annotated[Actor, Depends(requires(P.WORKLOADS_READ))],
    tenant: TenantQuery = None,
) -> ExplanationOut:
    """Why the workload is where it is (node, devices, its best-fit rank), or why it waits
    (reason code and how many nodes each filter rejected)."""
    return ExplanationOut.of(workloads_svc.explain_workload(store, actor, name, tenant=tenant))


@router.post("/workloads/{name}/cancel", tags=["workloads"])
def cancel_workload(
    name: str,
    store: StoreDep,
    actor: Annotated[Actor, Depends(requires(P.WORKLOADS_WRITE))],
    body: CancelIn | None = None,
    tenant: TenantQuery = None,
) -> WorkloadOut:
    reason = body.reason if body else None
    return WorkloadOut.of(workloads_svc.cancel_workload(store, actor, name, reason, tenant=tenant))


# --- events ------------------------------------------------------------------------------------


@router.get("/events", tags=["events"], response_model=Page[EventOut])
def list_events(
    store: StoreDep,
    actor: Annotated[Actor, Depends(requires(P.EVENTS_READ))],
    action: Annotated[str | None, Query(description="exact, or a prefix ending in *")] = None,
    target_type: str | None = None,
    target_id: str | None = None,
    actor_name: Annotated[str | None, Query(alias="actor")] = None,
    outcome: Outcome | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    order: Annotated[Literal["asc", "desc"], Query(description="desc: newest first")] = "asc",
    limit: Limit = 100,
    cursor: Cursor = None,
) -> Response:
    page = events_svc.list_events(
        store,
        actor,
        action=action,
        target_type=target_type,
        target_id=target_id,
        actor_name=actor_name,
        outcome=outcome,
        since=utc_time(since, "since"),
        until=utc_time(until, "until"),
        newest_first=order == "desc",
        limit=limit,
        cursor=cursor,
    )
    return json_page([event_json(e) for e in page.items], page.next)


@router.get("/events/{seq}", tags=["events"], response_model=EventOut)
def get_event(
    seq: Annotated[int, Path(ge=1, le=2**63 - 1)],
    store: StoreDep,
    actor: Annotated[Actor, Depends(requires(P.EVENTS_READ))],
) -> Response:
    return json_response(event_json(events_svc.get_event(store, actor, seq)))


def utc_time(ts: datetime | None, name: str) -> datetime | None:
    """The time in UTC (every stored time is UTC; a time without a zone is read as UTC). A
    time that has no UTC equivalent in the calendar (9999-12-31T23:59:59-14:00) is a 422."""
    if ts is None:
        return None
    if ts.tzinfo is None:
        return ts.replace(tzinfo=UTC)
    try:
        return ts.astimezone(UTC)
    except OverflowError:
        raise ValidationFailed(
            f"{name}: {ts.isoformat()} is outside the years 1 to 9999 in UTC",
            details=[
                {
                    "loc": ["query", name],
                    "msg": "outside the calendar in UTC",
                    "type": "datetime_range",
                }
            ],
        ) from None
