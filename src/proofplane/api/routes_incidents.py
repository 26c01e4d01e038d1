"""Incidents under /api/v1/incidents (issue 12, §9): open one on a node (quarantined, its work
moved compliantly) or a tenant, with its evidence bundle; list, show with the timeline, move
forward, close with a post-mortem, and download the bundle (``proofplane audit verify-bundle``
checks it offline). Reading needs ``audit:read``; opening, updating, closing ``nodes:write``."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Path, Query, Request, Response, status
from pydantic import BaseModel, Field

from proofplane.access import Actor
from proofplane.access import Permission as P
from proofplane.api.deps import get_store, requires
from proofplane.api.schemas import BodyIn, ErrorResponse
from proofplane.service import incidents as svc
from proofplane.service.audit import AuditKeys
from proofplane.service.context import Store

_ERRORS = {
    404: {"model": ErrorResponse, "description": "no such incident, node or tenant"},
    409: {"model": ErrorResponse, "description": "a move the incident's state does not allow "
          "(invalid_transition, postmortem_required), or a node that cannot be quarantined"},
    422: {"model": ErrorResponse, "description": "a bad severity, state, subject or text"},
}  # fmt: skip

router = APIRouter(prefix="/api/v1/incidents", responses=_ERRORS, tags=["incidents"])  # type: ignore[arg-type]
StoreDep = Annotated[Store, Depends(get_store)]
IncidentId = Annotated[int, Path(ge=1, le=2**63 - 1)]
Severity = Literal["low", "medium", "high", "critical"]
Text = Annotated[str, Field(min_length=1, max_length=svc.MAX_TEXT)]
Owner = Annotated[str, Field(min_length=1, max_length=svc.MAX_OWNER)]


def _keys(request: Request) -> AuditKeys:
    return request.app.state.audit_keys  # type: ignore[no-any-return]


KeysDep = Annotated[AuditKeys, Depends(_keys)]


class IncidentIn(BodyIn):
    subject: Annotated[str, Field(min_length=1, max_length=63)] = Field(
        description="a node (quarantined) or a tenant (nothing quarantined)"
    )
    subject_type: Literal["node", "tenant"] | None = Field(
        None, description="null: the node of that name, else the tenant"
    )
    reason: Text
    severity: Severity = "high"
    owner: Owner | None = Field(None, description="null: whoever opens it")


class IncidentPatch(BodyIn):
    state: Literal["open", "contained", "resolved", "closed"] | None = Field(
        None,
        description="forward only (else 409 invalid_transition); closing is POST /close "
        "with the post-mortem (409 postmortem_required here)",
    )
    severity: Severity | None = None
    owner: Owner | None = None
    note: Text | None = Field(None, description="a line on the timeline")


class CloseIn(BodyIn):
    postmortem: Text


class TimelineOut(BaseModel):
    seq: int = Field(description="the event's sequence number (audit-log index + 1)")
    ts: datetime
    actor: str
    action: str
    details: dict[str, Any]


class IncidentOut(BaseModel):
    id: int
    subject_type: str
    subject: str
    severity: str
    state: str
    owner: str
    reason: str
    opened_by: str
    opened_at: datetime
    updated_at: datetime
    closed_at: datetime | None
    postmortem: str | None
    bundle_sha256: str | None = Field(description="SHA-256 of the evidence bundle's bytes")
    bundle_bytes: int
    timeline: list[TimelineOut] | None = Field(
        None, description="the incident's events, oldest first (not in lists)"
    )

    @classmethod
    def of(cls, inc: svc.Incident, *, timeline: bool = True) -> IncidentOut:
        return cls(**inc.to_json(timeline=timeline))


class IncidentsOut(BaseModel):
    items: list[IncidentOut]
    next: str | None


@router.post("", status_code=status.HTTP_201_CREATED)
def open_incident(
    body: IncidentIn,
    store: StoreDep,
    keys: KeysDep,
    actor: Annotated[Actor, Depends(requires(P.NODES_WRITE))],
    response: Response,
) -> IncidentOut:
    """Open an incident: a node is quarantined (its work moves compliantly) and the evidence
    bundle captured, in one transaction; on a tenant, only the incident and its evidence."""
    inc = svc.open_incident(
        store, actor, keys, body.subject, reason=body.reason, subject_type=body.subject_type,
        severity=body.severity, owner=body.owner,
    )  # fmt: skip
    response.headers["Location"] = f"/api/v1/incidents/{inc.id}"
    return IncidentOut.of(inc)


@router.get("")
def list_incidents(
    store: StoreDep,
    actor: Annotated[Actor, Depends(requires(P.AUDIT_READ))],
    state: Annotated[Literal["open", "contained", "resolved", "closed"] | None, Query()] = None,
    subject: Annotated[str | None, Query(max_length=63)] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 100,
    cursor: Annotated[str | None, Query(max_length=512)] = None,
) -> IncidentsOut:
    """Incidents, newest first."""
    page = svc.list_incidents(
        store, actor, state=state, subject=subject, limit=limit, cursor=cursor
    )
    return IncidentsOut(
        items=[IncidentOut.of(i, timeline=False) for i in page.items], next=page.next
    )


@router.get("/{incident_id}")
def get_incident(
    incident_id: IncidentId,
    store: StoreDep,
    actor: Annotated[Actor, Depends(requires(P.AUDIT_READ))],
) -> IncidentOut:
    """One incident with its timeline."""
    return IncidentOut.of(svc.get_incident(store, actor, incident_id))


@router.patch("/{incident_id}")
def update_incident(
    incident_id: IncidentId,
    body: IncidentPatch,
    store: StoreDep,
    actor: Annotated[Actor, Depends(requires(P.NODES_WRITE))],
) -> IncidentOut:
    """Move forward (contained, resolved), change severity or owner, add a note."""
    inc = svc.update_incident(
        store, actor, incident_id, state=body.state, severity=body.severity, owner=body.owner,
        note=body.note,
    )  # fmt: skip
    return IncidentOut.of(inc)


@router.post("/{incident_id}/close")
def close_incident(
    incident_id: IncidentId,
    body: CloseIn,
    store: StoreDep,
    actor: Annotated[Actor, Depends(requires(P.NODES_WRITE))],
) -> IncidentOut:
    """Close with the post-mortem."""
    return IncidentOut.of(svc.close_incident(store, actor, incident_id, postmortem=body.postmortem))


@router.get(
    "/{incident_id}/bundle",
    response_class=Response,
    responses={
        200: {
            "content": {"application/json": {}},
            "description": "a proofplane-audit-bundle/v1 file, byte for byte as "
            "captured (its SHA-256 in X-Content-SHA256)",
        }
    },  # fmt: skip
)
def get_bundle(
    incident_id: IncidentId,
    store: StoreDep,
    actor: Annotated[Actor, Depends(requires(P.AUDIT_READ))],
) -> Response:
    """The evidence bundle: check it with ``proofplane audit verify-bundle``."""
    raw, digest = svc.get_bundle(store, actor, incident_id)
    return Response(
        raw,
        media_type="application/json",
        headers={
            "X-Content-SHA256": digest,
            "Content-Disposition": f'attachment; filename="incident-{incident_id}-bundle.json"',
        },
    )
