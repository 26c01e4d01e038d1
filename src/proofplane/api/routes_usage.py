"""Metering and chargeback under /api/v1 (issue 15, §5–§6).

``GET /usage?tenant=&from=&to=&group_by=&format=``: GPU-hours, energy and cost per tenant from
the audit log, priced with the server's rate card (``PROOFPLANE_RATE_CARD``, else the shipped
one); ``format`` json (default), csv or focus (a FOCUS 1.x CSV dataset). Whoever reads workloads
may ask: tenant-admins and developers get their own tenants only (another tenant, or an unknown
one, is a 404). ``waste=true`` adds the allocated-but-idle view from telemetry.

``GET /usage/cost-compare?from=&to=``: cost per effective GPU-hour on this fleet against the
cloud alternative of the server's cost model (``PROOFPLANE_COST_MODEL``), with every input and
measured fact. Fleet-wide figures: the roles that read the whole event log (``events:read``).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Query, Response

from proofplane.access import Actor
from proofplane.access import Permission as P
from proofplane.api.deps import get_store, requires
from proofplane.api.schemas import ErrorResponse
from proofplane.errors import ValidationFailed
from proofplane.service import usage as svc
from proofplane.service.context import Store

router = APIRouter(
    prefix="/api/v1",
    tags=["usage"],
    responses={
        404: {"model": ErrorResponse},
        422: {"model": ErrorResponse},
    },  # type: ignore[dict-item]
)
StoreDep = Annotated[Store, Depends(get_store)]
From = Annotated[
    datetime,
    Query(alias="from", description="window start (ISO 8601; UTC when no zone is given)"),
]
To = Annotated[datetime, Query(description="window end, exclusive")]


def _utc(ts: datetime, name: str) -> datetime:
    """The time in UTC (no zone: UTC); one outside the calendar in UTC is a 422."""
    if ts.tzinfo is None:
        return ts.replace(tzinfo=UTC)
    try:
        return ts.astimezone(UTC)
    except OverflowError:
        raise ValidationFailed(
            f"{name}: {ts.isoformat()} is outside the years 1 to 9999 in UTC",
            code="invalid_period",
        ) from None


@router.get("/usage", response_class=Response)
def usage(
    store: StoreDep,
    actor: Annotated[Actor, Depends(requires(P.WORKLOADS_READ))],
    start: From,
    to: To,
    tenant: Annotated[str | None, Query(max_length=63)] = None,
    group_by: Literal["tenant", "pool", "sku", "workload"] = "sku",
    format: Literal["json", "csv", "focus"] = "json",
    waste: bool = False,
) -> Response:
    """The usage report for [from, to). Lines per ``group_by``: ``tenant``, ``pool`` (tenant
    and compliance pool), ``sku`` (and MIG profile; the default) or ``workload``. Costs are
    rounded ROUND_HALF_EVEN to the currency's minor unit per line; totals add the lines. The
    same window on the same log gives the same bytes."""
    report = svc.usage_report(
        store,
        actor,
        start=_utc(start, "from"),
        end=_utc(to, "to"),
        now=datetime.now(UTC),
        tenant=tenant,
        group_by=group_by,
        waste=waste,
    )
    return Response(svc.render(report, format), media_type=svc.MEDIA_TYPES[format])


@router.get("/usage/cost-compare", response_class=Response)
def cost_compare(
    store: StoreDep,
    actor: Annotated[Actor, Depends(requires(P.EVENTS_READ))],
    start: From,
    to: To,
) -> Response:
    """Cost per effective GPU-hour, bare metal against the cloud alternative, for [from, to):
    the measured facts per SKU (``skus[].measured``), the model's inputs (``cost_model``) and
    the formulas. A client may price the same facts with its own model
    (``proofplane cost compare --cost-model``)."""
    result = svc.cost_compare(
        store, actor, start=_utc(start, "from"), end=_utc(to, "to"), now=datetime.now(UTC)
    )
    return Response(svc.dumps(result), media_type="application/json")
