"""The change register (issue 12, §7): change requests page by page, and the register an
auditor takes away as evidence for NIST 800-53 CM-3 / ISO 27001 A.8.32.

Per change the register says who asked, who approved and when, whether separation of duties
held (computed here from the stored votes and the audit log's own ``change.apply`` event, as
booleans), who applied it and when, the emergency flag and its review, and the audit-log
index of each of the change's events (``target_type == "change"``), so every line can be
proved with an inclusion proof against a signed checkpoint:
``proofplane audit prove --index INDEX`` (an event's index is its ``seq`` - 1).
"""

from __future__ import annotations

import csv
import io
from collections import defaultdict
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select

from proofplane.access import Actor, Permission, authorize
from proofplane.errors import ValidationFailed
from proofplane.govern import changes as rules
from proofplane.service import changes as changes_svc
from proofplane.service.context import Store
from proofplane.service.pagination import Page, check_limit, decode_cursor, paginate
from proofplane.store.tables import ChangeRequestRow, ChangeVoteRow, EventRow

REGISTER_FORMAT = "proofplane change register v1"
VERIFY_HINT = (
    "each event's audit-log index proves with: proofplane audit prove --index INDEX "
    "(INDEX = seq - 1), against the newest signed checkpoint"
)
FORMATS = ("json", "csv")
CSV_COLUMNS = (
    "id",
    "type",
    "state",
    "requested_by",
    "requested_at",
    "last_edited_by",
    "payload_sha256",
    "required_approvals",
    "approvers",  # name@time;name@time: approvals of the payload as it stands
    "voided_approvals",  # approvals of an earlier payload (an edit voided them)
    "denials",
    "sod_requester_not_approver",
    "sod_editor_not_approver",
    "sod_approvals_on_applied_payload",
    "sod_passed",
    "applied_by",
    "applied_at",
    "emergency",
    "review_state",
    "reviewers",
    "event_seqs",
    "audit_indexes",
)
_CHUNK = 500  # ids per IN (…) query


# --- the list ----------------------------------------------------------------------------------


def list_page(
    store: Store,
    actor: Actor,
    *,
    state: str | None = None,
    change_type: str | None = None,
    limit: int = 100,
    cursor: str | None = None,
) -> Page[dict[str, Any]]:
    """Change requests, newest first (the resource JSON of ``service.changes.view``)."""
    authorize(actor, Permission.CHANGES_READ)
    check_limit(limit)
    if state is not None and state not in rules.STATES:
        raise ValidationFailed(f"state is one of {', '.join(rules.STATES)}", code="invalid_state",
                               details={"states": list(rules.STATES)})  # fmt: skip
    if change_type is not None and change_type not in changes_svc.TYPES:
        known = sorted(changes_svc.TYPES)
        raise ValidationFailed(f"unknown change type {change_type!r}; one of {', '.join(known)}",
                               code="unknown_change_type", details={"types": known})  # fmt: skip
    before = decode_cursor("changes", cursor, int)
    query = select(ChangeRequestRow).order_by(ChangeRequestRow.id.desc())
    if before is not None:
        query = query.where(ChangeRequestRow.id < before)
    if state is not None:
        query = query.where(ChangeRequestRow.state == state)
    if change_type is not None:
        query = query.where(ChangeRequestRow.type == change_type)
    with store.read() as session:
        rows = list(session.scalars(query.limit(limit + 1)))
        votes = _votes_of(session, [r.id for r in rows])
        items = [changes_svc.view(r, votes.get(r.id, [])) for r in rows]
    return paginate("changes", items, limit, rows[limit - 1].id if len(rows) > limit else None)


def _votes_of(session: Any, ids: list[int]) -> dict[int, list[ChangeVoteRow]]:
    out: dict[int, list[ChangeVoteRow]] = defaultdict(list)
    for start in range(0, len(ids), _CHUNK):
        chunk = ids[start : start + _CHUNK]
        query = select(ChangeVoteRow).where(ChangeVoteRow.change_id.in_(chunk))
        for v in session.scalars(query.order_by(ChangeVoteRow.id)):
            out[v.change_id].append(v)
    return out


def _events_of(session: Any, ids: list[int]) -> dict[int, list[EventRow]]:
    out: dict[int, list[EventRow]] = defaultdict(list)
    for start in range(0, len(ids), _CHUNK):
        chunk = [str(i) for i in ids[start : start + _CHUNK]]
        query = select(EventRow).where(
            EventRow.target_type == "change", EventRow.target_id.in_(chunk)
        )
        for e in session.scalars(query.order_by(EventRow.seq)):
            out[int(e.target_id)].append(e)
    return out


# --- the register ------------------------------------------------------------------------------


def _utc(value: datetime | None, name: str = "time") -> datetime | None:
    """The time in UTC (no zone: UTC); one with no UTC equivalent in the calendar
    (9999-12-31T23:59:59-14:00) is a 422, not an overflow."""
    if value is None:
        return None
    if value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    try:
        return value.astimezone(UTC)
    except OverflowError:
        raise ValidationFailed(f"{name}: {value.isoformat()} is outside the years 1 to 9999 in UTC",
                               code="invalid_time", details={"field": name}) from None  # fmt: skip


def export_register(
    store: Store,
    actor: Actor,
    *,
    start: datetime | None = None,
    end: datetime | None = None,
    now: datetime | None = None,
) -> dict[str, Any]:
    """Every change with an event of its own in ``[start, end)`` (all of them without
    bounds), oldest first, each with its whole history. Times without a zone are UTC."""
    authorize(actor, Permission.CHANGES_READ)
    start, end = _utc(start, "from"), _utc(end, "to")
    if start is not None and end is not None and start >= end:
        window = {"from": start.isoformat(), "to": end.isoformat()}
        raise ValidationFailed("'from' must be before 'to'", code="invalid_window", details=window)
    query = select(EventRow.target_id).where(EventRow.target_type == "change").distinct()
    if start is not None:
        query = query.where(EventRow.ts >= start)
    if end is not None:
        query = query.where(EventRow.ts < end)
    items: list[dict[str, Any]] = []
    with store.read() as session:
        ids = sorted({int(t) for t in session.scalars(query) if t.isdigit()})
        votes = _votes_of(session, ids)
        events = _events_of(session, ids)
        for start_i in range(0, len(ids), _CHUNK):
            chunk = ids[start_i : start_i + _CHUNK]
            rows = session.scalars(
                select(ChangeRequestRow).where(ChangeRequestRow.id.in_(chunk)).order_by(
                    ChangeRequestRow.id)
            )  # fmt: skip
            for row in rows:
                rule = changes_svc.rule_for(session, row.type)
                items.append(register_entry(row, votes.get(row.id, []),
                                            events.get(row.id, []), rule))  # fmt: skip
    return {
        "format": REGISTER_FORMAT,
        "from": start.isoformat() if start else None,
        "to": end.isoformat() if end else None,
        "generated_at": (now or datetime.now(UTC)).isoformat(),
        "verify": VERIFY_HINT,
        "count": len(items),
        "items": items,
    }


def register_entry(
    row: ChangeRequestRow, votes: list[ChangeVoteRow], events: list[EventRow], rule: rules.Rule
) -> dict[str, Any]:
    """One change's line of the register, its separation-of-duties checks computed."""

    def vote_json(v: ChangeVoteRow) -> dict[str, Any]:
        return {"by": v.by, "at": v.at.isoformat(), "payload_sha256": v.payload_sha256,
                "current": v.payload_sha256 == row.payload_sha256}  # fmt: skip

    approvals = [v for v in votes if v.decision == rules.APPROVE]
    reviews = [v for v in votes if v.decision == rules.REVIEW]
    current = [v for v in approvals + reviews if v.payload_sha256 == row.payload_sha256]
    sod = {
        "requester_not_approver": all(v.by != row.requested_by for v in approvals + reviews),
        "editor_not_approver": all(v.by != row.last_edited_by for v in current),
        "approvals_on_applied_payload": _approvals_on_applied(row, approvals, events, rule),
    }
    return {
        "id": row.id,
        "type": row.type,
        "state": row.state,
        "requested_by": row.requested_by,
        "requested_at": row.requested_at.isoformat(),
        "last_edited_by": row.last_edited_by,
        "reason": row.reason,
        "payload_sha256": row.payload_sha256,
        "required_approvals": rule.approvals,
        "approvals": [vote_json(v) for v in approvals],
        "denials": [vote_json(v) for v in votes if v.decision == rules.DENY],
        "reviews": [vote_json(v) for v in reviews],
        "sod": sod,
        "sod_passed": all(value is not False for value in sod.values()),
        "applied_by": row.applied_by,
        "applied_at": row.applied_at.isoformat() if row.applied_at else None,
        "emergency": row.emergency,
        "review_state": row.review_state,
        "error": row.error,
        "events": [
            {
                "seq": e.seq,
                "index": e.seq - 1,
                "action": e.action,
                "actor": e.actor,
                "at": e.ts.isoformat(),
                "outcome": e.outcome,
            }
            for e in events
        ],  # fmt: skip
    }


def _approvals_on_applied(
    row: ChangeRequestRow, approvals: list[ChangeVoteRow], events: list[EventRow], rule: rules.Rule
) -> bool | None:
    """An applied (non-emergency) change: the audit log's ``change.apply`` event names the
    payload hash applied and the approvers counted; each of them approved exactly that hash,
    none is the requester or last editor, and there are enough. None where nothing was
    applied through approvals (not applied, or an emergency change: see its review)."""
    if row.state != rules.APPLIED or row.emergency:
        return None
    applied = [e for e in events if e.action == "change.apply" and e.outcome == "success"]
    if not applied:
        return False
    details = applied[-1].details or {}
    applied_hash = details.get("payload_sha256")
    names = details.get("approvals") or []
    if applied_hash != row.payload_sha256 or not isinstance(names, list):
        return False
    if not all(isinstance(n, str) for n in names) or len(set(names)) != len(names):
        return False
    on_hash = {v.by for v in approvals if v.payload_sha256 == applied_hash}
    counted = set(names) & (on_hash - {row.requested_by, row.last_edited_by})
    return set(names) == counted and len(counted) >= rule.approvals


# --- CSV ---------------------------------------------------------------------------------------


def _flag(value: bool | None) -> str:
    return "" if value is None else ("true" if value else "false")


def _who(votes: list[dict[str, Any]]) -> str:
    return ";".join(f"{v['by']}@{v['at']}" for v in votes)


def csv_row(item: dict[str, Any]) -> dict[str, str]:
    return {
        "id": str(item["id"]),
        "type": item["type"],
        "state": item["state"],
        "requested_by": item["requested_by"],
        "requested_at": item["requested_at"],
        "last_edited_by": item["last_edited_by"],
        "payload_sha256": item["payload_sha256"],
        "required_approvals": str(item["required_approvals"]),
        "approvers": _who([v for v in item["approvals"] if v["current"]]),
        "voided_approvals": _who([v for v in item["approvals"] if not v["current"]]),
        "denials": _who(item["denials"]),
        "sod_requester_not_approver": _flag(item["sod"]["requester_not_approver"]),
        "sod_editor_not_approver": _flag(item["sod"]["editor_not_approver"]),
        "sod_approvals_on_applied_payload": _flag(item["sod"]["approvals_on_applied_payload"]),
        "sod_passed": _flag(item["sod_passed"]),
        "applied_by": item["applied_by"] or "",
        "applied_at": item["applied_at"] or "",
        "emergency": _flag(item["emergency"]),
        "review_state": item["review_state"] or "",
        "reviewers": _who(item["reviews"]),
        "event_seqs": ";".join(str(e["seq"]) for e in item["events"]),
        "audit_indexes": ";".join(str(e["index"]) for e in item["events"]),
    }


def register_csv(register: dict[str, Any]) -> str:
    """The register as CSV: one row per change (the columns of ``CSV_COLUMNS``)."""
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=CSV_COLUMNS, lineterminator="\n")
    writer.writeheader()
    for item in register["items"]:
        writer.writerow(csv_row(item))
    return out.getvalue()
