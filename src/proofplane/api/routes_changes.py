"""Change requests under /api/v1/changes (issue 12, §6 and §7): ask for a typed change, edit it,
approve, deny, apply, cancel; review an emergency change; the change register export.

Access: every route needs an authenticated caller. Reading (and the register) needs
``changes:read``. Asking for, editing, applying and cancelling a change: the service checks the
permission the type's direct call needs (``nodes:certify`` for a certification grant…), so
these routes admit any signed-in identity. Approving, denying and reviewing need
``changes:approve``; the service checks eligibility (403 ``not_an_approver``) and separation
of duties (403 ``separation_of_duties``).

The routes of one change (ask, read, edit, vote, apply, cancel) run on the event loop but for
their one service call, which runs in the thread pool (one hop, issue 12's benchmark), and
answer the resource as the service built it (``json_response``: no re-validation of our own
output; ``response_model`` still documents it)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Path, Query, Request, Response, status
from pydantic import Field, StrictBool
from starlette.concurrency import run_in_threadpool

from proofplane.access import Actor
from proofplane.access import Permission as P
from proofplane.api.deps import StoreDep, get_settings, requires, signed_in
from proofplane.api.schemas import BodyIn, ErrorResponse, Page, json_response
from proofplane.govern import changes as rules
from proofplane.service import change_register as register
from proofplane.service import changes as svc

_ERRORS = {
    403: {"model": ErrorResponse, "description": "not allowed: forbidden, not_an_approver, "
          "separation_of_duties"},
    404: {"model": ErrorResponse, "description": "no such change (or the node, tenant… its "
          "payload names, when applying)"},
    409: {"model": ErrorResponse, "description": "change_not_pending, change_not_approved, "
          "change_expired, already_voted, no_review_pending, change_request_required (a rule "
          "change under change control), or the direct call's own refusal when applying"},
    422: {"model": ErrorResponse, "description": "unknown_change_type, invalid_payload, "
          "invalid_reason, invalid_comment, invalid_state, invalid_window, invalid_rule, "
          "invalid_runbook, invalid_mig_layout"},
}  # fmt: skip

router = APIRouter(prefix="/api/v1/changes", responses=_ERRORS, tags=["changes"])  # type: ignore[arg-type]
SignedIn = Annotated[Actor, Depends(signed_in)]
Reader = Annotated[Actor, Depends(requires(P.CHANGES_READ))]
Approver = Annotated[Actor, Depends(requires(P.CHANGES_APPROVE))]
ChangeId = Annotated[int, Path(ge=1, le=2**63 - 1)]
Comment = Annotated[str, Field(max_length=svc.MAX_REASON)]
Resource = dict[str, Any]


class ChangeIn(BodyIn):
    type: str = Field(max_length=64, description=f"one of {', '.join(sorted(svc.TYPES))}")
    payload: dict[str, Any] = Field(description="the type's payload (what the direct call takes)")
    reason: str = Field("", max_length=svc.MAX_REASON)
    emergency: StrictBool = Field(
        False, description="admins only, with a reason: applied at once, reviewed afterwards"
    )


class ChangePatch(BodyIn):
    payload: dict[str, Any] = Field(description="replaces the payload: earlier approvals void")


class CommentIn(BodyIn):
    comment: Comment = ""


class RuleIn(BodyIn):
    approvals: int = Field(description="distinct approvers needed (1..10)")
    roles: list[str] = Field(
        max_length=8, description=f"who may approve: among {', '.join(rules.APPROVER_ROLES)}"
    )


async def _resource(call: Callable[..., Resource], *args: Any, **kwargs: Any) -> Response:
    """``call(*args, **kwargs)`` in the thread pool, its change resource as the answer."""
    return json_response(await run_in_threadpool(call, *args, **kwargs))


@router.post("", status_code=status.HTTP_201_CREATED, response_model=Resource)
async def create_change(
    body: ChangeIn, store: StoreDep, actor: SignedIn, request: Request
) -> Response:
    """Ask for a change: 201 with the change resource (state ``pending``; ``applied`` for an
    emergency change)."""
    review = timedelta(hours=get_settings(request).emergency_review_hours)
    change = await run_in_threadpool(
        svc.create_change, store, actor, body.type, body.payload, reason=body.reason,
        emergency=body.emergency, review_within=review,
    )  # fmt: skip
    return json_response(
        change, status.HTTP_201_CREATED, {"Location": f"/api/v1/changes/{change['id']}"}
    )


@router.get("")
def list_changes(
    store: StoreDep,
    actor: Reader,
    state: Annotated[str | None, Query(max_length=16, description=", ".join(rules.STATES))] = None,
    type: Annotated[str | None, Query(max_length=64)] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 100,
    cursor: Annotated[str | None, Query(max_length=512)] = None,
) -> Page[Resource]:
    """Change requests, newest first, optionally in one state or of one type."""
    page = register.list_page(
        store, actor, state=state, change_type=type, limit=limit, cursor=cursor
    )
    return Page(items=page.items, next=page.next)


@router.get("/export", response_model=None)
def export_register(
    store: StoreDep,
    actor: Reader,
    start: Annotated[
        datetime | None, Query(alias="from", description="ISO 8601; UTC if no zone")
    ] = None,
    end: Annotated[datetime | None, Query(alias="to", description="ISO 8601, exclusive")] = None,
    format: Annotated[Literal["json", "csv"], Query()] = "json",
) -> Resource | Response:
    """The change register (evidence for CM-3 / A.8.32): every change with an event in
    [from, to), its approvers with times, its separation-of-duties checks, who applied it
    and when, and the audit-log index of each of its events (prove one with ``proofplane
    audit prove --index INDEX``). ``format=csv``: one row per change."""
    data = register.export_register(store, actor, start=start, end=end)
    data["change_control"] = svc.control_mode(store)
    if format == "csv":
        return Response(
            register.register_csv(data),
            media_type="text/csv; charset=utf-8",
            headers={"Content-Disposition": 'attachment; filename="change-register.csv"'},
        )
    return data


@router.get("/rules")
def list_rules(store: StoreDep, actor: Reader) -> dict[str, list[Resource]]:
    """Every change type's approval rule: set by an admin (through a ``change.rules``
    change) or the default."""
    return {"items": svc.list_rules(store, actor)}


@router.put("/rules/{change_type}")
def set_rule(
    change_type: Annotated[str, Path(max_length=64)],
    body: RuleIn,
    store: StoreDep,
    actor: SignedIn,
    request: Request,
) -> Resource:
    """Set a change type's approval rule (admins). A rule change may loosen control, so it is
    itself governed: with change control on it answers 409 ``change_request_required`` with
    the ``change.rules`` request that would do it (two approvals by default)."""
    payload = {"type": change_type, "approvals": body.approvals, "roles": body.roles}
    svc.check_rule_change(actor, payload)
    svc.gate(get_settings(request).change_control, "change.rules", payload)
    return svc.set_rule(store, actor, change_type, body.approvals, body.roles)


@router.get("/{change_id}", response_model=Resource)
async def get_change(change_id: ChangeId, store: StoreDep, actor: Reader) -> Response:
    return await _resource(svc.get_change, store, actor, change_id)


@router.patch("/{change_id}", response_model=Resource)
async def edit_change(
    change_id: ChangeId, body: ChangePatch, store: StoreDep, actor: SignedIn
) -> Response:
    """Replace the payload of an open request: every earlier approval is void, and the
    editor may not approve it."""
    return await _resource(svc.edit_change, store, actor, change_id, body.payload)


def _comment(body: CommentIn | None) -> str:
    return body.comment if body is not None else ""


@router.post("/{change_id}/approve", response_model=Resource)
async def approve_change(
    change_id: ChangeId, store: StoreDep, actor: Approver, body: CommentIn | None = None
) -> Response:
    """Approve the payload as it stands (bound to its SHA-256)."""
    return await _resource(svc.vote, store, actor, change_id, rules.APPROVE, _comment(body))


@router.post("/{change_id}/deny", response_model=Resource)
async def deny_change(
    change_id: ChangeId, store: StoreDep, actor: Approver, body: CommentIn | None = None
) -> Response:
    """One denial denies the request."""
    return await _resource(svc.vote, store, actor, change_id, rules.DENY, _comment(body))


@router.post("/{change_id}/review", response_model=Resource)
async def review_change(
    change_id: ChangeId, store: StoreDep, actor: Approver, body: CommentIn | None = None
) -> Response:
    """The post-implementation review of an applied emergency change."""
    return await _resource(svc.vote, store, actor, change_id, rules.REVIEW, _comment(body))


@router.post("/{change_id}/apply", response_model=Resource)
async def apply_change(
    change_id: ChangeId, store: StoreDep, actor: SignedIn, body: CommentIn | None = None
) -> Response:
    """Apply an approved change (who may make the direct call may apply it), re-checked
    against the cluster now; a failure leaves it approved with the error recorded."""
    del body  # accepted for symmetry with the other actions; the events carry no comment
    return await _resource(svc.apply_change, store, actor, change_id)


@router.post("/{change_id}/cancel", response_model=Resource)
async def cancel_change(
    change_id: ChangeId, store: StoreDep, actor: SignedIn, body: CommentIn | None = None
) -> Response:
    """The requester (or an admin) withdraws an open request."""
    return await _resource(svc.cancel_change, store, actor, change_id, _comment(body))
