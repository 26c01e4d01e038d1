"""Telemetry under /api/v1 (issue 15): the agents' samples in, readings and rollups out, GPU
health, tenants' idle policies.

``POST /nodes/{name}/telemetry`` takes a node's agent credential (its own node only; a node's
channel certificate on a mutual-TLS server) or ``nodes:write``. Its body is at most
PROOFPLANE_MAX_BODY_BYTES (1 MiB: 413 ``payload_too_large`` beyond) and 20,000 readings (422
``too_many_samples``). Readings and rollups are read with ``workloads:read``: a reader scoped
to tenants sees the readings its tenants' workloads held.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Body, Depends, Path, Query, Request
from fastapi.responses import Response

from proofplane.access import Actor
from proofplane.access import Permission as P
from proofplane.api.deps import agent_or, get_settings, get_store, requires
from proofplane.api.schemas import ErrorResponse, json_page, json_response
from proofplane.errors import ValidationFailed
from proofplane.service import gpu_health, idle
from proofplane.service import telemetry as svc
from proofplane.service.context import Store

router = APIRouter(
    prefix="/api/v1",
    tags=["telemetry"],
    responses={
        404: {"model": ErrorResponse},
        409: {"model": ErrorResponse},
        413: {"model": ErrorResponse},
        422: {"model": ErrorResponse},
    },  # type: ignore[dict-item]
)
StoreDep = Annotated[Store, Depends(get_store)]
NodeName = Annotated[str, Path(max_length=63)]
TenantName = Annotated[str, Path(max_length=63)]
Agent = Annotated[Actor, Depends(agent_or(P.NODES_WRITE))]
Reader = Annotated[Actor, Depends(requires(P.WORKLOADS_READ))]
Limit = Annotated[int, Query(ge=1, le=500, description="page size")]
Cursor = Annotated[str | None, Query(max_length=1024, description="the previous page's `next`")]


def _utc(ts: datetime | None, name: str) -> datetime | None:
    """A query time in UTC (a time without a zone is read as UTC)."""
    if ts is None:
        return None
    if ts.tzinfo is None:
        return ts.replace(tzinfo=UTC)
    try:
        return ts.astimezone(UTC)
    except OverflowError:
        raise ValidationFailed(
            f"{name}: {ts.isoformat()} is outside the years 1 to 9999 in UTC",
            code="validation_failed",
            details={name: ts.isoformat()},
        ) from None


@router.post("/nodes/{name}/telemetry")
def post_telemetry(
    name: NodeName,
    store: StoreDep,
    actor: Agent,
    request: Request,
    body: Annotated[Any, Body(description="{'simulated': bool, 'samples': [...]}")],
) -> Response:
    """Store a batch of the node's GPU and MIG-instance readings (DCGM field names). The
    answer counts what was accepted and stored, what was left out and why, and the GPUs a
    reading drained."""
    settings = get_settings(request)
    out = svc.ingest(store, actor, name, body, raw_hours=settings.telemetry_raw_hours)
    return json_response(out.as_dict())


@router.get("/telemetry")
def list_telemetry(
    store: StoreDep,
    actor: Reader,
    node: Annotated[str | None, Query(max_length=63)] = None,
    tenant: Annotated[str | None, Query(max_length=63)] = None,
    field: Annotated[str | None, Query(max_length=64, description="a DCGM field name")] = None,
    start: Annotated[datetime | None, Query(alias="from")] = None,
    end: Annotated[datetime | None, Query(alias="to")] = None,
    resolution: Annotated[Literal["raw", "hour"], Query()] = "raw",
    limit: Limit = 100,
    cursor: Cursor = None,
) -> Response:
    """Readings (``raw``, oldest first) or stored hourly rollups (``hour``) in [from, to),
    filtered by node, tenant and field. Every item says whether it is ``simulated``."""
    page = svc.list_telemetry(
        store, actor, node=node, tenant=tenant, field_name=field, start=_utc(start, "from"),
        end=_utc(end, "to"), resolution=resolution, limit=limit, cursor=cursor,
    )  # fmt: skip
    return json_page([_jsonable(i) for i in page.items], page.next)


@router.get("/telemetry/latest")
def latest_telemetry(
    store: StoreDep,
    actor: Reader,
    node: Annotated[str | None, Query(max_length=63)] = None,
) -> Response:
    """The newest reading of every device and field (of ``node``)."""
    return json_response({"items": [_jsonable(i) for i in svc.list_latest(store, actor, node)]})


@router.get("/gpu-health")
def drained_gpus(
    store: StoreDep,
    actor: Annotated[Actor, Depends(requires(P.NODES_READ))],
    node: Annotated[str | None, Query(max_length=63)] = None,
) -> dict[str, Any]:
    """The GPUs drained for their health (an XID, an ECC error, a thermal violation)."""
    return {"items": gpu_health.list_drained(store, actor, node)}


@router.post("/nodes/{name}/gpus/{gpu_uuid}/recover")
def recover_gpu(
    name: NodeName,
    gpu_uuid: Annotated[str, Path(max_length=64)],
    store: StoreDep,
    actor: Annotated[Actor, Depends(requires(P.NODES_WRITE))],
) -> dict[str, Any]:
    """Return a drained GPU to service (an operator's action, ``gpu.recover``)."""
    return gpu_health.recover(store, actor, name, gpu_uuid)


@router.get("/tenants/{name}/idle-policy")
def get_idle_policy(
    name: TenantName,
    store: StoreDep,
    actor: Annotated[Actor, Depends(requires(P.TENANTS_READ))],
) -> dict[str, Any]:
    """The tenant's idle policy (``default``: none set, notify with the defaults)."""
    return idle.get_idle_policy(store, actor, name)


@router.put("/tenants/{name}/idle-policy")
def put_idle_policy(
    name: TenantName,
    store: StoreDep,
    actor: Annotated[Actor, Depends(requires(P.TENANTS_WRITE))],
    body: Annotated[
        Any,
        Body(
            description="{'action': 'notify'|'reclaim', 'window_s', "
            "'threshold', 'preemptible_priority'}"
        ),
    ],  # fmt: skip
) -> dict[str, Any]:
    """Set the tenant's idle policy: ``notify`` (an event) or ``reclaim`` (evict idle
    preemptible workloads, reason ``idle_reclaimed``)."""
    return idle.set_idle_policy(store, actor, name, body)


def _jsonable(item: dict[str, Any]) -> dict[str, Any]:
    return {k: v.isoformat() if isinstance(v, datetime) else v for k, v in item.items()}
