"""``GET /metrics``: the Prometheus exposition of the control plane's health and its fleet
(issue 15, §3; what it holds: ``service.metrics``); ``GET /api/v1/alerts`` (§8) and
``GET /api/v1/capacity`` (§10).

Access: the ``metrics:read`` permission, like every other route a role grants. It holds the
fleet of every tenant (names, what each holds), so it is global: ``admin``, ``operator``,
``auditor``, ``security-officer`` and the ``monitoring`` role, a Prometheus server's identity
that may do nothing else. A scrape configuration carries an API token of a ``monitoring`` user
(``authorization: {credentials_file: …}``); ``/metrics`` is never anonymous, not even on
loopback, as a reverse proxy in front of the server would make every client look local.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query
from fastapi.responses import Response

from proofplane.access import Actor
from proofplane.access import Permission as P
from proofplane.api.deps import get_store, requires
from proofplane.api.schemas import ErrorResponse
from proofplane.service import alerts as alerts_svc
from proofplane.service import capacity as capacity_svc
from proofplane.service import metrics as svc
from proofplane.service.context import Store

router = APIRouter(
    tags=["observability"],
    responses={401: {"model": ErrorResponse}, 403: {"model": ErrorResponse}},  # type: ignore[dict-item]
)
StoreDep = Annotated[Store, Depends(get_store)]
Scraper = Annotated[Actor, Depends(requires(P.METRICS_READ))]
EventReader = Annotated[Actor, Depends(requires(P.EVENTS_READ))]


@router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text format"}},
)
def metrics(store: StoreDep, actor: Scraper) -> Response:
    """The control plane's own health (decision and HTTP latency, pending work by reason,
    attestation verdicts, the audit log and its checkpoints, SIEM sinks, KMS operations) and
    the fleet (GPUs and MIG slices held per tenant and compliance pool, free capacity per
    pool, utilisation per tenant under DCGM field names), in the Prometheus text format."""
    body, content_type = svc.render(store, actor)
    return Response(body, media_type=content_type)


@router.get("/api/v1/alerts", responses={422: {"model": ErrorResponse}})
def list_alerts(
    store: StoreDep,
    actor: EventReader,
    status: Annotated[Literal["firing", "resolved", "all"], Query()] = "firing",
) -> dict[str, Any]:
    """The alerts the audit log describes, the newest episode of each (``status``: firing,
    resolved within their episode, or all): rule, severity, labels, summary, evidence, the
    runbook that answers it, when it started and ended, and the events. Alerts are events:
    who reads the event log (``events:read``) reads them."""
    return {"items": alerts_svc.list_alerts(store, actor, datetime.now(UTC), status=status)}


@router.get("/api/v1/capacity", responses={422: {"model": ErrorResponse}})
def capacity(
    store: StoreDep,
    actor: Scraper,
    forecast: bool = True,
    weeks: Annotated[int, Query(ge=1, le=capacity_svc.MAX_WEEKS)] = 4,
) -> dict[str, Any]:
    """Per compliance pool: its nodes and GPUs, headroom (free GPUs, free MIG slices), what is
    held, the N+1 check (can it lose its largest node and re-place everything on it, decided
    by the production placement core) and, with ``forecast``, the trend of its metered daily
    demand over ``weeks`` weeks. ``metrics:read``; the workloads a check could not re-place
    are named only to who reads every tenant's workloads."""
    return capacity_svc.capacity_report(
        store, actor, datetime.now(UTC), forecast=forecast, weeks=weeks
    )
