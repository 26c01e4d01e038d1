"""Network segmentation (issue 14): tenants' segments, each node's desired network state in the
formats its agent and an operator use, the agents' reports, underlay facts, a tenant's network
policy, and the segmentation map as evidence.

Access: segments are tenant objects (``tenants:read``, scoped). A node's desired state names
every tenant on the node: its own agent, or ``audit:read``. Reports and underlay facts: the
node's agent, or ``nodes:write``. A tenant's policy: ``tenants:write``, governed
(``network.policy``)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request, Response
from pydantic import ConfigDict, Field, StrictBool

from proofplane.access import Actor
from proofplane.access import Permission as P
from proofplane.api.deps import agent_or, get_settings, get_store, requires
from proofplane.api.schemas import BodyIn, ErrorResponse, Page, json_response
from proofplane.service import changes as changes_svc
from proofplane.service import network as svc
from proofplane.service.context import Store

_ERRORS = {
    403: {"model": ErrorResponse, "description": "forbidden; cross_tenant_rule (a policy rule "
          "naming another tenant)"},
    404: {"model": ErrorResponse, "description": "no such node or tenant"},
    409: {"model": ErrorResponse, "description": "network_underlay_unknown, vtep_in_use, "
          "subnet_in_use, change_request_required"},
    422: {"model": ErrorResponse, "description": "invalid_underlay, invalid_guid, "
          "invalid_report, invalid_network_policy, unknown_tenant, invalid_cursor"},
}  # fmt: skip

router = APIRouter(prefix="/api/v1", responses=_ERRORS, tags=["network"])  # type: ignore[arg-type]
StoreDep = Annotated[Store, Depends(get_store)]
Limit = Annotated[int, Query(ge=1, le=500, description="page size")]
Cursor = Annotated[str | None, Query(description="the `next` value of the previous page")]
Resource = dict[str, Any]
_TEXT: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/plain": {}, "application/json": {}}}
}


class UnderlayIn(BodyIn):
    vtep: str = Field(max_length=45, description="the node's VTEP: its IPv4 address on the "
                      "underlay", examples=["10.250.0.1"])  # fmt: skip
    underlay_dev: str = Field("ul0", max_length=15, description="the underlay interface")
    hca_guids: list[Annotated[str, Field(max_length=40)]] = Field(
        [], max_length=svc.MAX_GUIDS, description="InfiniBand HCA port GUIDs"
    )


class SelfCheckIn(BodyIn):
    model_config = ConfigDict(extra="allow")
    ok: StrictBool = Field(description="every segment present, FDB as desired, ruleset loaded")


class ReportIn(BodyIn):
    applied_generation: int = Field(ge=0, le=svc.MAX_GENERATION)
    applied_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    ruleset_sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")
    self_check: SelfCheckIn


class PolicyIn(BodyIn):
    policy: dict[str, Any] | None = Field(
        description="subnet, allow, egress (see the README); null: the default policy",
        examples=[{"subnet": "10.10.0.0/24",
                   "allow": [{"proto": "tcp", "ports": 29500, "source": "tenant"}]}],
    )  # fmt: skip


# --- segments ------------------------------------------------------------------------------------


@router.get("/tenants/{name}/segments")
def tenant_segments(
    name: str, store: StoreDep, actor: Annotated[Actor, Depends(requires(P.TENANTS_READ))]
) -> Resource:
    """The tenant's segments (VXLAN VNI, InfiniBand PKey), the nodes that carry them, its
    workloads' endpoints (overlay IP and MAC), its effective policy and its hash, and its
    released segments still cooling down."""
    return svc.tenant_segments(store, actor, name)


@router.get("/network/segments")
def list_segments(
    store: StoreDep,
    actor: Annotated[Actor, Depends(requires(P.TENANTS_READ))],
    tenant: Annotated[str | None, Query(max_length=63)] = None,
    state: Literal["active", "released", "all"] = "active",
    limit: Limit = 100,
    cursor: Cursor = None,
) -> Page[Resource]:
    """Segments in allocation order, of the tenants the caller can see."""
    page = svc.list_segments(store, actor, state=state, tenant=tenant, limit=limit, cursor=cursor)
    return Page(items=page.items, next=page.next)


@router.put("/tenants/{name}/network-policy")
def set_network_policy(
    name: str,
    body: PolicyIn,
    store: StoreDep,
    actor: Annotated[Actor, Depends(requires(P.TENANTS_WRITE))],
    request: Request,
) -> Resource:
    """Set the tenant's network policy (null: the default: all traffic inside the tenant, none
    from or to anyone else). A governed change (``network.policy``)."""
    changes_svc.gate(get_settings(request).change_control, "network.policy",
                     {"tenant": name, "policy": body.policy})  # fmt: skip
    return svc.set_network_policy(store, actor, name, body.policy)


# --- nodes ---------------------------------------------------------------------------------------


@router.get("/nodes/{name}/network", responses=_TEXT)  # type: ignore[arg-type]
def node_network(
    name: str,
    store: StoreDep,
    actor: Annotated[Actor, Depends(agent_or(P.AUDIT_READ))],
    format: Annotated[Literal["json", "iproute2", "nftables", "partitions"], Query()] = "json",
) -> Response:
    """The node's desired network state: ``json`` (what its agent applies: segments, endpoints,
    FDB, policies, with ``generation`` and the expected ``ruleset_sha256``), or as text:
    ``iproute2`` (``ip -batch`` and ``bridge -batch`` lines), ``nftables`` (the ruleset),
    ``partitions`` (OpenSM ``partitions.conf`` for its segments)."""
    state = svc.node_network(store, actor, name)
    headers = {
        "ETag": f'"{state.desired.sha256}"',
        "X-Proofplane-Generation": str(state.generation),
    }
    if format == "json":
        response = json_response(state.to_json())
        response.headers.update(headers)
        return response
    return Response(state.render(format), media_type="text/plain; charset=utf-8", headers=headers)


@router.put("/nodes/{name}/network/underlay")
def set_underlay(
    name: str,
    body: UnderlayIn,
    store: StoreDep,
    actor: Annotated[Actor, Depends(agent_or(P.NODES_WRITE))],
) -> Resource:
    """Register or change the node's underlay facts (its agent, or ``nodes:write``)."""
    return svc.set_underlay(
        store, actor, name, vtep=body.vtep, underlay_dev=body.underlay_dev,
        hca_guids=body.hca_guids,
    )  # fmt: skip


@router.post("/nodes/{name}/network/report")
def report(
    name: str,
    body: ReportIn,
    store: StoreDep,
    actor: Annotated[Actor, Depends(agent_or(P.NODES_WRITE))],
) -> Resource:
    """The node's agent reports the desired state it applied (generation and SHA-256), the
    SHA-256 of the ruleset it loaded and its self-check. Answers the node's network status:
    ``network_drift`` and why (``drift``)."""
    return svc.report(store, actor, name, body.model_dump(mode="json"))


@router.get("/network/nodes")
def list_node_status(
    store: StoreDep,
    actor: Annotated[Actor, Depends(requires(P.AUDIT_READ))],
    drift: Annotated[bool, Query(description="only the nodes whose network drifted")] = False,
    limit: Limit = 100,
    cursor: Cursor = None,
) -> Page[Resource]:
    """Every node with underlay facts: desired and applied generations and hashes, its last
    report, ``network_drift`` (null: never reported) and why."""
    page = svc.list_node_status(store, actor, drift_only=drift, limit=limit, cursor=cursor)
    return Page(items=page.items, next=page.next)


@router.get("/network/export", response_model=None)
def export_map(
    store: StoreDep,
    actor: Annotated[Actor, Depends(requires(P.AUDIT_READ))],
    format: Annotated[Literal["json", "csv"], Query()] = "json",
) -> Resource | Response:
    """The segmentation map (evidence): per tenant its VNIs, PKeys with their members, the
    nodes, its policy's hash and the last isolation check of those nodes."""
    data = svc.segmentation_map(store, actor)
    if format == "csv":
        return Response(
            svc.segmentation_csv(data),
            media_type="text/csv; charset=utf-8",
            headers={"Content-Disposition": 'attachment; filename="segmentation-map.csv"'},
        )
    return data
