"""Incidents (issue 12, §9): open one on a node or a tenant, move it forward, close it with a
post-mortem, and keep the evidence captured when it was opened.

Opening an incident on a node quarantines the node (``lifecycle.change_node_state``: its work
is evicted and re-placed only where its tags hold, as for any quarantine) and captures an
**evidence bundle**, all in one transaction: an incident whose quarantine or capture fails is
not created. An incident on a tenant quarantines nothing; it records the incident and the
tenant's evidence.

The bundle is a ``proofplane-audit-bundle/v1`` file (``audit.bundle``), so ``proofplane audit
verify-bundle`` checks it offline unchanged: every audit entry about the subject, each with its
inclusion proof against a checkpoint signed in the same transaction (after the quarantine, so
the quarantine and the evictions are in it), that checkpoint and its verifier key. It also
carries, under ``incident``, what the verifier does not read: the subject's inventory, its
attestation evidence records (each one, as stored, is what ``proofplane attest replay`` reads),
the work it held when the incident was opened and the placement history taken from the
entries. The bundle's SHA-256 is stored with the incident and recorded in its
``incident.open`` event, so the stored bytes are themselves anchored in the log.

State: ``open → contained → resolved → closed``, forward only (a step may be skipped), closing
only with a post-mortem. Every step is an event on target ``incident/<id>``: ``incident.open``,
``incident.update``, ``incident.close``; those events are the incident's timeline.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import String, cast, or_, select

from proofplane.access import Actor, Permission, authorize
from proofplane.audit import bundle as bundle_mod
from proofplane.audit import note
from proofplane.audit.canonical import entry_bytes
from proofplane.errors import InvalidState, NotFound, ValidationFailed
from proofplane.keys import SIGN, KeyDisabled, KmsError
from proofplane.model import NodeState
from proofplane.service import keys as keys_svc
from proofplane.service.audit import AuditKeys
from proofplane.service.changes import control_mode
from proofplane.service.context import Store, Tx
from proofplane.service.events import event_from_row
from proofplane.service.lifecycle import change_node_state, workloads_on
from proofplane.service.pagination import Page, check_limit, decode_cursor, paginate
from proofplane.store import audit_log
from proofplane.store.repo import node_row
from proofplane.store.tables import (
    AuditCheckpointRow,
    EventRow,
    EvidenceRow,
    IncidentRow,
    KmsKeyVersionRow,
    NodeAttestationRow,
    NodeRow,
    PlacementRow,
    TenantRow,
    WorkloadRow,
)

SEVERITIES = ("low", "medium", "high", "critical")
STATES = ("open", "contained", "resolved", "closed")
SUBJECT_TYPES = ("node", "tenant")
DEFAULT_SEVERITY = "high"
MAX_TEXT = 16_384  # reason, note, post-mortem (characters)
MAX_OWNER = 128
#: the incident part of the bundle (next to the audit bundle's own fields)
EVIDENCE_FORMAT = "proofplane-incident-evidence/v1"
#: event actions that make a workload's placement history
PLACEMENT_ACTIONS = frozenset({"workload.place", "workload.evict", "workload.preempt"})


# --- the pure part: values in, values out -------------------------------------------------------


def check_severity(severity: str) -> str:
    if severity not in SEVERITIES:
        raise ValidationFailed(
            f"severity must be one of {', '.join(SEVERITIES)}",
            code="invalid_severity",
            details={"severity": severity, "allowed": list(SEVERITIES)},
        )
    return severity


def check_state(state: str) -> str:
    if state not in STATES:
        raise ValidationFailed(
            f"state must be one of {', '.join(STATES)}",
            code="invalid_state_name",
            details={"state": state, "allowed": list(STATES)},
        )
    return state


def check_text(value: str, what: str, *, required: bool = True, limit: int = MAX_TEXT) -> str:
    """``value`` stripped; 422 when it is empty (and required), too long, or holds control
    characters other than newlines and tabs."""
    text = value.strip()
    if required and not text:
        raise ValidationFailed(f"{what} must not be empty", code=f"{what}_required")
    if len(text) > limit:
        raise ValidationFailed(
            f"{what} is longer than {limit} characters", code="text_too_long",
            details={"field": what, "limit": limit},
        )  # fmt: skip
    if any(not c.isprintable() and c not in "\n\t" for c in text):
        raise ValidationFailed(
            f"{what} contains control characters", code="invalid_text", details={"field": what}
        )
    return text


def transition_refusal(current: str, target: str) -> str | None:
    """Why the move ``current → target`` is not allowed (None: it is). Only forward moves;
    a step may be skipped (a tenant incident can be resolved without being contained)."""
    if STATES.index(target) <= STATES.index(current):
        return f"an incident moves only forward ({' → '.join(STATES)}): not {current} → {target}"
    return None


def mentions(value: Any, name: str) -> bool:
    """Whether ``name`` is one of the strings in ``value`` (nested dicts and lists), or a
    ``<name>/gpu<i>`` (a node's GPU) or ``<name>/<workload>`` (a tenant's workload) reference."""
    if isinstance(value, str):
        return value == name or value.startswith(f"{name}/")
    if isinstance(value, dict):
        return any(mentions(v, name) for v in value.values())
    if isinstance(value, list | tuple):
        return any(mentions(v, name) for v in value)
    return False


# --- values -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TimelineEntry:
    seq: int
    ts: datetime
    actor: str
    action: str
    details: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"seq": self.seq, "ts": self.ts.isoformat(), "actor": self.actor,
                "action": self.action, "details": self.details}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Incident:
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
    bundle_sha256: str | None
    bundle_bytes: int
    timeline: tuple[TimelineEntry, ...] = field(default=())

    def to_json(self, *, timeline: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "subject_type": self.subject_type,
            "subject": self.subject,
            "severity": self.severity,
            "state": self.state,
            "owner": self.owner,
            "reason": self.reason,
            "opened_by": self.opened_by,
            "opened_at": self.opened_at.isoformat(),
            "updated_at": self.updated_at.isoformat(),
            "closed_at": self.closed_at.isoformat() if self.closed_at else None,
            "postmortem": self.postmortem,
            "bundle_sha256": self.bundle_sha256,
            "bundle_bytes": self.bundle_bytes,
        }
        if timeline:
            out["timeline"] = [t.to_json() for t in self.timeline]
        return out


def _incident(row: IncidentRow, timeline: Iterable[TimelineEntry] = ()) -> Incident:
    return Incident(
        id=row.id, subject_type=row.subject_type, subject=row.subject, severity=row.severity,
        state=row.state, owner=row.owner, reason=row.reason, opened_by=row.opened_by,
        opened_at=row.opened_at, updated_at=row.updated_at, closed_at=row.closed_at,
        postmortem=row.postmortem, bundle_sha256=row.bundle_sha256,
        bundle_bytes=len(row.bundle) if row.bundle is not None else 0, timeline=tuple(timeline),
    )  # fmt: skip


def _timeline(session: Any, incident_id: int) -> list[TimelineEntry]:
    rows = session.scalars(
        select(EventRow)
        .where(EventRow.target_type == "incident", EventRow.target_id == str(incident_id))
        .order_by(EventRow.seq)
    )
    return [TimelineEntry(r.seq, r.ts, r.actor, r.action, dict(r.details or {})) for r in rows]


def _row(session: Any, incident_id: int) -> IncidentRow:
    row = session.get(IncidentRow, incident_id) if 0 < incident_id < 2**63 else None
    if row is None:
        raise NotFound(f"incident {incident_id} not found", code="incident_not_found",
                       details={"incident": incident_id})  # fmt: skip
    return row


# --- use cases ----------------------------------------------------------------------------------


def open_incident(
    store: Store,
    actor: Actor,
    keys: AuditKeys,
    subject: str,
    *,
    reason: str,
    subject_type: str | None = None,
    severity: str = DEFAULT_SEVERITY,
    owner: str | None = None,
    now: datetime | None = None,
) -> Incident:
    """Open an incident on a node (quarantined now, its work moved compliantly) or a tenant
    (nothing quarantined), with its evidence bundle, in one transaction. ``subject_type``
    None: a node of that name, else a tenant of that name (``ambiguous_subject`` when both
    exist). A node that is already quarantined stays so; one that cannot be quarantined
    (decommissioned) refuses the incident (``invalid_transition``), and nothing is written."""
    authorize(actor, Permission.NODES_WRITE)
    check_severity(severity)
    reason = check_text(reason, "reason")
    owner = check_text(owner if owner is not None else actor.name, "owner", limit=MAX_OWNER)
    if subject_type is not None and subject_type not in SUBJECT_TYPES:
        raise ValidationFailed("subject_type must be node or tenant", code="invalid_subject_type",
                               details={"subject_type": subject_type})  # fmt: skip
    if not subject or len(subject) > 63:
        raise ValidationFailed("subject must be 1 to 63 characters", code="invalid_subject")
    kms = keys_svc.kms_for(store)
    with store.write(actor, now) as tx:
        s = tx.session
        node = s.scalar(select(NodeRow).where(NodeRow.name == subject))
        tenant = s.scalar(select(TenantRow).where(TenantRow.name == subject))
        if subject_type is None:
            if node is not None and tenant is not None:
                raise ValidationFailed(
                    f"{subject!r} is both a node and a tenant: say which (subject_type)",
                    code="ambiguous_subject", details={"subject": subject},
                )  # fmt: skip
            subject_type = "node" if node is not None else "tenant"
        if subject_type == "node" and node is None:
            raise NotFound(f"node {subject!r} not found", details={"node": subject})
        if subject_type == "tenant" and tenant is None:
            raise NotFound(f"tenant {subject!r} not found", details={"tenant": subject})
        row = IncidentRow(
            subject_type=subject_type, subject=subject, severity=severity, state="open",
            owner=owner, reason=reason, opened_by=actor.name, opened_at=tx.now,
            updated_at=tx.now, closed_at=None, postmortem=None, bundle=None, bundle_sha256=None,
        )  # fmt: skip
        s.add(row)
        s.flush()
        held: list[dict[str, Any]]
        quarantine: dict[str, Any] = {}
        if node is not None and subject_type == "node":
            nrow = node_row(s, subject)
            held = [_held(w) for w in workloads_on(tx, nrow)]
            before = nrow.state
            if NodeState(before) != NodeState.QUARANTINED:
                change_node_state(tx, nrow, NodeState.QUARANTINED, f"incident {row.id}: {reason}")
            quarantine = {"quarantined": True, "node_state_before": before,
                          "already_quarantined": before == NodeState.QUARANTINED.value}  # fmt: skip
        else:
            assert tenant is not None
            held = [_held(w) for w in _tenant_workloads(s, tenant)]
            quarantine = {"quarantined": False}
        raw, checkpoint_size = _capture(tx, kms, keys, row, held, control_mode(store))
        digest = hashlib.sha256(raw).hexdigest()
        row.bundle, row.bundle_sha256 = raw, digest
        tx.record(
            "incident.open",
            "incident",
            str(row.id),
            details={
                "subject_type": subject_type, "subject": subject, "severity": severity,
                "owner": owner, "reason": reason, **quarantine,
                "bundle_sha256": digest, "bundle_checkpoint_size": checkpoint_size,
            },
        )  # fmt: skip
        return _incident(row, _timeline(s, row.id))


def list_incidents(
    store: Store,
    actor: Actor,
    *,
    state: str | None = None,
    subject: str | None = None,
    limit: int = 100,
    cursor: str | None = None,
) -> Page[Incident]:
    """Incidents, newest first, optionally in one state or about one subject."""
    authorize(actor, Permission.AUDIT_READ)
    check_limit(limit)
    if state is not None:
        check_state(state)
    before = decode_cursor("incidents", cursor, int)
    query = select(IncidentRow).order_by(IncidentRow.id.desc())
    if before is not None:
        query = query.where(IncidentRow.id < before)
    if state is not None:
        query = query.where(IncidentRow.state == state)
    if subject is not None:
        query = query.where(IncidentRow.subject == subject)
    with store.read() as s:
        rows = list(s.scalars(query.limit(limit + 1)))
        items = [_incident(r) for r in rows]
    return paginate("incidents", items, limit, rows[limit - 1].id if len(rows) > limit else None)


def get_incident(store: Store, actor: Actor, incident_id: int) -> Incident:
    """One incident with its timeline (its events, oldest first)."""
    authorize(actor, Permission.AUDIT_READ)
    with store.read() as s:
        row = _row(s, incident_id)
        return _incident(row, _timeline(s, row.id))


def get_bundle(store: Store, actor: Actor, incident_id: int) -> tuple[bytes, str]:
    """The evidence bundle's bytes and SHA-256, exactly as captured."""
    authorize(actor, Permission.AUDIT_READ)
    with store.read() as s:
        row = _row(s, incident_id)
        if row.bundle is None or row.bundle_sha256 is None:
            raise NotFound(f"incident {incident_id} has no evidence bundle", code="no_bundle")
        return bytes(row.bundle), row.bundle_sha256


def update_incident(
    store: Store,
    actor: Actor,
    incident_id: int,
    *,
    state: str | None = None,
    severity: str | None = None,
    owner: str | None = None,
    note: str | None = None,
    now: datetime | None = None,
) -> Incident:
    """Move an incident forward (``contained``, ``resolved``), change its severity or owner,
    or add a note to its timeline; one ``incident.update`` event with what changed. Closing is
    ``close_incident`` (it needs the post-mortem)."""
    authorize(actor, Permission.NODES_WRITE)
    if state is None and severity is None and owner is None and note is None:
        raise ValidationFailed("nothing to update: give state, severity, owner or note",
                               code="empty_update")  # fmt: skip
    if state is not None:
        check_state(state)
    if severity is not None:
        check_severity(severity)
    if owner is not None:
        owner = check_text(owner, "owner", limit=MAX_OWNER)
    if note is not None:
        note = check_text(note, "note")
    with store.write(actor, now) as tx:
        row = _row(tx.session, incident_id)
        _not_closed(row)
        changes: dict[str, Any] = {}
        if state is not None:
            if state == "closed":
                raise InvalidState(
                    "closing an incident needs its post-mortem: POST /api/v1/incidents/"
                    f"{row.id}/close (proofplane incident close)", code="postmortem_required",
                    details={"incident": row.id},
                )  # fmt: skip
            refusal = transition_refusal(row.state, state)
            if refusal is not None:
                raise InvalidState(
                    refusal,
                    code="invalid_transition",
                    details={"incident": row.id, "from": row.state, "to": state},
                )
            changes["state"] = {"from": row.state, "to": state}
            row.state = state
        if severity is not None and severity != row.severity:
            changes["severity"] = {"from": row.severity, "to": severity}
            row.severity = severity
        if owner is not None and owner != row.owner:
            changes["owner"] = {"from": row.owner, "to": owner}
            row.owner = owner
        if note is not None:
            changes["note"] = note
        if changes:
            row.updated_at = tx.now
            tx.record("incident.update", "incident", str(row.id), details=changes)
        return _incident(row, _timeline(tx.session, row.id))


def close_incident(
    store: Store, actor: Actor, incident_id: int, *, postmortem: str, now: datetime | None = None
) -> Incident:
    """Close an incident with its post-mortem (from any earlier state); ``incident.close``."""
    authorize(actor, Permission.NODES_WRITE)
    postmortem = check_text(postmortem, "postmortem")
    with store.write(actor, now) as tx:
        row = _row(tx.session, incident_id)
        _not_closed(row)
        before = row.state
        row.state, row.postmortem = "closed", postmortem
        row.closed_at = row.updated_at = tx.now
        tx.record(
            "incident.close",
            "incident",
            str(row.id),
            details={"from": before, "to": "closed", "postmortem": postmortem,
                     "postmortem_sha256": hashlib.sha256(postmortem.encode()).hexdigest()},
        )  # fmt: skip
        return _incident(row, _timeline(tx.session, row.id))


def _not_closed(row: IncidentRow) -> None:
    if row.state == "closed":
        raise InvalidState(f"incident {row.id} is closed", code="invalid_transition",
                           details={"incident": row.id, "from": "closed"})  # fmt: skip


# --- the evidence bundle ------------------------------------------------------------------------


def _held(w: WorkloadRow) -> dict[str, Any]:
    p = w.placement
    return {
        "workload": w.name,
        "tenant": w.tenant.name,
        "status": w.status,
        "tags": dict(w.tags),
        "node": None if p is None else p.node.name,
        "devices": None if p is None else list(p.devices),
        "members": None if p is None or p.members is None else list(p.members),
        "placed_at": None if p is None else p.placed_at.isoformat(),
    }


def _tenant_workloads(session: Any, tenant: TenantRow) -> list[WorkloadRow]:
    return list(
        session.scalars(
            select(WorkloadRow)
            .join(WorkloadRow.placement)
            .where(WorkloadRow.tenant_id == tenant.id)
            .order_by(WorkloadRow.name)
        )
    )


def _inventory(session: Any, row: NodeRow) -> dict[str, Any]:
    ident = session.get(NodeAttestationRow, row.id)
    return {
        "name": row.name, "region": row.region, "zone": row.zone, "rack": row.rack,
        "labels": dict(row.labels), "state": row.state, "state_reason": row.state_reason,
        "certifications": [
            {"key": c.key, "value": c.value, "issued_by": c.issued_by,
             "issued_at": c.issued_at.isoformat()}
            for c in sorted(row.certifications, key=lambda c: c.key)
        ],
        "gpus": [
            {"index": g.index, "uuid": g.uuid, "model": g.model, "memory_mb": g.memory_mb,
             "mig_enabled": g.mig_enabled, "mig_instances": list(g.mig_instances or []),
             "vbios_version": g.vbios_version, "driver_version": g.driver_version}
            for g in sorted(row.gpus, key=lambda g: g.index)
        ],
        "tpm_identity": None if ident is None else {
            "ek_sha256": ident.ek_sha256, "ek_cert_sha256": ident.ek_cert_sha256,
            "ak_name": ident.ak_name,
            "bound_at": ident.bound_at.isoformat() if ident.bound_at else None,
            "last_passed_at": ident.last_passed_at.isoformat() if ident.last_passed_at else None,
            "quarantined_by_attestation": bool(ident.quarantined),
            "simulated": bool(ident.simulated),
        },
    }  # fmt: skip


def _attestation(session: Any, row: NodeRow) -> list[dict[str, Any]]:
    """Every evidence record of the node, oldest first; ``record`` is exactly what the
    verifier stored, the document ``proofplane attest replay`` reads."""
    rows = session.scalars(
        select(EvidenceRow).where(EvidenceRow.node_id == row.id).order_by(EvidenceRow.id)
    )
    return [
        {"evidence_id": e.id, "at": e.created_at.isoformat(), "ok": e.ok,
         "reasons": list(e.reasons), "evidence_hash": e.evidence_hash,
         "policy_id": e.policy_id, "policy_hash": e.policy_hash, "record": e.record}
        for e in rows
    ]  # fmt: skip


def _about(session: Any, subject_type: str, subject: str, size: int) -> list[EventRow]:
    """The events among the first ``size`` about the subject: its own (target
    ``<type>/<name>``), and any whose details name it (a workload placed on or evicted from the
    node, a tenant's workloads, earlier incidents)."""
    pattern = '%"' + subject.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
    rows = session.scalars(
        select(EventRow)
        .where(EventRow.seq <= size)
        .where(
            or_(
                (EventRow.target_type == subject_type) & (EventRow.target_id == subject),
                cast(EventRow.details, String).like(pattern, escape="\\"),
            )
        )
        .order_by(EventRow.seq)
    )
    out = []
    for r in rows:
        own = r.target_type == subject_type and r.target_id == subject
        if own or mentions(r.details, subject):
            out.append(r)
    return out


def _sign_checkpoint(
    tx: Tx, kms: keys_svc.Kms, keys: AuditKeys
) -> tuple[str, note.VerifierKey, int]:
    """Sign the log as it stands inside this transaction (its Merkle hashes written first) with
    the KMS key ``audit-checkpoint``, as ``service.audit.sign_checkpoint`` does, and keep the
    checkpoint: it commits with the incident, or neither does."""
    s = tx.session
    key = kms.ensure_key(tx, keys_svc.AUDIT_KEY, SIGN)
    tx.finish()  # the Merkle hashes of this transaction's events so far, so the tree is whole
    size = audit_log.tree_size(s)
    root = audit_log.root_at(s, size)
    text = note.Checkpoint(keys.origin, size, root).text()
    try:
        version, signature = kms.sign(s, keys_svc.AUDIT_KEY, text.encode())
    except KeyDisabled as exc:
        raise KmsError(f"the checkpoint key cannot sign: {exc}") from exc
    ver = s.get(KmsKeyVersionRow, (key.id, version))
    if ver is None or ver.public_key is None:
        raise KmsError(f"key {keys_svc.AUDIT_KEY!r} version {version} has no public key")
    verifier = note.verifier_for(keys.origin, bytes(ver.public_key))
    try:
        signed = note.signed_note(text, verifier, signature)
    except note.NoteError as exc:
        raise KmsError(f"the KMS signature does not verify: {exc}",
                       code="kms_bad_signature") from None  # fmt: skip
    s.add(AuditCheckpointRow(tree_size=size, root_hash=root, note=signed, created_at=tx.now))
    return signed, verifier, size


def _capture(
    tx: Tx,
    kms: keys_svc.Kms,
    keys: AuditKeys,
    incident: IncidentRow,
    held: list[dict[str, Any]],
    change_control: str = "off",
) -> tuple[bytes, int]:
    """The evidence bundle's bytes and the size of the checkpoint it is proved against;
    ``change_control``: the mode the server ran under (``enforce`` | ``off``), evidence of
    whether trust-bearing changes needed approvals then."""
    s = tx.session
    signed, verifier, size = _sign_checkpoint(tx, kms, keys)
    events = _about(s, incident.subject_type, incident.subject, size)
    items = []
    history = []
    for r in events:
        _, proof = audit_log.inclusion(s, r.seq - 1, size)
        items.append((r.seq - 1, entry_bytes(event_from_row(r)), proof))
        if r.action in PLACEMENT_ACTIONS or r.action == "node.state":
            history.append({"index": r.seq - 1, "ts": r.ts.isoformat(), "action": r.action,
                            "target": f"{r.target_type}/{r.target_id}",
                            "details": r.details})  # fmt: skip
    data = bundle_mod.make_bundle(
        checkpoint=signed,
        verifier_key=verifier.text(),
        items=items,
        created_at=tx.now,
        selection={
            "incident": incident.id,
            "subject_type": incident.subject_type,
            "subject": incident.subject,
        },  # fmt: skip
    )
    evidence: dict[str, Any] = {
        "format": EVIDENCE_FORMAT,
        "id": incident.id,
        "subject_type": incident.subject_type,
        "subject": incident.subject,
        "severity": incident.severity,
        "owner": incident.owner,
        "reason": incident.reason,
        "opened_by": incident.opened_by,
        "opened_at": incident.opened_at.isoformat(),
        "held_at_open": held,
        "placement_history": history,
        "change_control": change_control,
    }
    if incident.subject_type == "node":
        nrow = node_row(s, incident.subject)
        evidence["inventory"] = _inventory(s, nrow)
        evidence["attestation"] = _attestation(s, nrow)
        evidence["holding_now"] = [
            w.name for w in s.scalars(
                select(WorkloadRow).join(WorkloadRow.placement)
                .where(PlacementRow.nodes.any(NodeRow.id == nrow.id))
            )
        ]  # fmt: skip
    else:
        t = s.scalar(select(TenantRow).where(TenantRow.name == incident.subject))
        assert t is not None
        evidence["tenant"] = {"name": t.name, "description": t.description,
                              "profile": t.profile, "quota_gpus": t.quota_gpus,
                              "quota_mig_slices": t.quota_mig_slices}  # fmt: skip
        evidence["attestation"] = []
    data["incident"] = evidence
    raw = (json.dumps(data, indent=1, sort_keys=False, default=str) + "\n").encode("ascii")
    return raw, size
