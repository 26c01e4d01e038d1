"""Node decommissioning (issue 12, part 10): the last step of a node's lifecycle.

:func:`decommission` does it all in the caller's transaction (the ``node.decommission``
change applies it together with the request's state): the node moves to ``decommissioned``
through ``change_node_state`` (its work is evicted and re-placed only where its tags hold, its
agent channel certificates are revoked), its certifications and its agent credentials are
revoked (each with its event), and the endorsement key it enrolled with is **retired**: the
same TPM cannot enroll again, under any node name, until an approved change lifts it
(:func:`reenroll`, the ``node.reenroll`` change). One ``node.decommission`` event sums it up.

Afterwards the node's agent reports the sanitisation it performed (MIG instances destroyed, GPU
memory cleared): :func:`report_sanitisation`. Its credentials are revoked by then, so the
report comes either with a short-lived agent credential issued for this step (``proofplane
nodes agent-credential NODE --ttl-days 1``; a complete report revokes it again) or from an
operator holding ``nodes:write`` who relays the agent's report. On the demo's simulated nodes
the report is marked ``simulated``, as their evidence is.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select

from proofplane.access import Actor, Permission, authorize
from proofplane.errors import Conflict, InvalidState, NotFound, ValidationFailed
from proofplane.model import NodeState, Outcome
from proofplane.service.attestation import agent_node
from proofplane.service.context import Store, Tx
from proofplane.service.lifecycle import change_node_state, workloads_on
from proofplane.store.repo import WORKLOAD_LOAD, node_row
from proofplane.store.tables import (
    AgentCertRow,
    EventRow,
    NodeAttestationRow,
    NodeRow,
    RetiredEkRow,
    TokenRow,
    WorkloadRow,
)

MAX_REASON = 500
MAX_METHOD = 200
SANITISE_ACTION = "node.sanitise"
REPORT_FIELDS = {"mig_instances_destroyed": bool, "gpu_memory_cleared": bool, "method": str}


def _reason(reason: Any) -> str:
    if not isinstance(reason, str) or not reason.strip():
        raise ValidationFailed("a decommission needs a reason", code="reason_required")
    if len(reason) > MAX_REASON:
        raise ValidationFailed(f"the reason is at most {MAX_REASON} characters",
                               code="reason_too_long")  # fmt: skip
    return reason.strip()


def decommission_node(
    store: Store, actor: Actor, name: str, reason: str, *, change_id: int | None = None
) -> dict[str, Any]:
    """Decommission ``name`` in one transaction (see :func:`decommission`)."""
    authorize(actor, Permission.NODES_WRITE)
    authorize(actor, Permission.CERTIFY)  # it revokes the node's certifications
    why = _reason(reason)
    with store.write(actor) as tx:
        return decommission(tx, name, why, change_id=change_id)


def decommission(tx: Tx, name: str, reason: str, *, change_id: int | None = None) -> dict[str, Any]:
    """Decommission the node inside ``tx``; a summary of what was revoked and evicted.
    ``not_found`` (404) for an unknown node, ``already_decommissioned`` (409) for a node that
    already is; either way nothing is written."""
    reason = _reason(reason)
    row = node_row(tx.session, name)
    if NodeState(row.state) is NodeState.DECOMMISSIONED:
        raise Conflict(f"node {name!r} is already decommissioned",
                       code="already_decommissioned", details={"node": name})  # fmt: skip
    held = [wl.id for wl in workloads_on(tx, row)]
    live_certs = _count_live_certificates(tx, name)

    change_node_state(tx, row, NodeState.DECOMMISSIONED, reason)

    certifications = _revoke_certifications(tx, row, reason, change_id)
    credentials = _revoke_agent_credentials(tx, name, f"node decommissioned: {reason}")
    ident = tx.session.get(NodeAttestationRow, row.id)
    retired = _retire_ek(tx, name, ident, reason, change_id) if ident is not None else None

    moved = _where_now(tx, held)
    summary: dict[str, Any] = {
        "node": name,
        "state": row.state,
        "reason": reason,
        "change_id": change_id,
        "evicted": len(held),
        "replaced": sum(1 for w in moved if w["status"] in ("placed", "running")),
        "pending": sum(1 for w in moved if w["status"] == "pending"),
        "certifications_revoked": certifications,
        "agent_credentials_revoked": credentials,
        "agent_certificates_revoked": live_certs,
        "ek_retired": retired,
    }
    if ident is not None and ident.simulated:
        summary["simulated"] = True
    event = tx.record("node.decommission", "node", name, details=summary)
    return {**summary, "workloads": moved, "event_seq": event.seq}


def _count_live_certificates(tx: Tx, name: str) -> int:
    return len(
        list(
            tx.session.scalars(
                select(AgentCertRow.serial).where(
                    AgentCertRow.node_name == name,
                    AgentCertRow.revoked_at.is_(None),
                    AgentCertRow.not_after > tx.now,
                )
            )
        )
    )


def _revoke_certifications(tx: Tx, row: NodeRow, reason: str, change_id: int | None) -> list[str]:
    """Every certification of the node withdrawn, each with its ``node.certification.revoke``
    (the node holds no work any more, so nothing else moves)."""
    revoked = []
    for cert in sorted(row.certifications, key=lambda c: c.key):
        row.certifications.remove(cert)
        revoked.append(cert.key)
        tx.record(
            "node.certification.revoke",
            "node",
            row.name,
            details={"key": cert.key, "value": cert.value,
                     "reason": f"node decommissioned: {reason}", "change_id": change_id},
        )  # fmt: skip
    if revoked:
        row.updated_at = tx.now
        tx.session.flush()
    return revoked


def _revoke_agent_credentials(tx: Tx, name: str, why: str) -> int:
    """Revoke the node's live agent credentials, each with its ``token.revoke``."""
    rows = tx.session.scalars(
        select(TokenRow)
        .where(
            TokenRow.kind == "agent",
            TokenRow.node_name == name,
            TokenRow.revoked_at.is_(None),
            TokenRow.expires_at > tx.now,
        )
        .order_by(TokenRow.created_at, TokenRow.id)
    )
    n = 0
    for token in rows:
        token.revoked_at = tx.now
        n += 1
        tx.record("token.revoke", "token", token.id,
                  details={"owner": f"node:{name}", "kind": "agent", "reason": why})  # fmt: skip
    return n


def _retire_ek(
    tx: Tx, name: str, ident: NodeAttestationRow, reason: str, change_id: int | None
) -> str | None:
    ek = ident.ek_sha256
    if not ek:
        return None
    row = tx.session.get(RetiredEkRow, ek)
    if row is None:
        row = RetiredEkRow(ek_sha256=ek)
        tx.session.add(row)
    row.node_name, row.retired_at, row.change_id, row.reason = name, tx.now, change_id, reason
    tx.session.flush()
    return ek


def _where_now(tx: Tx, ids: list[int]) -> list[dict[str, Any]]:
    """Where each evicted workload went: re-placed (on which nodes) or pending (why)."""
    if not ids:
        return []
    tx.session.flush()
    rows = tx.session.scalars(
        select(WorkloadRow)
        .where(WorkloadRow.id.in_(ids))
        .options(*WORKLOAD_LOAD)
        .order_by(WorkloadRow.name)
        .execution_options(populate_existing=True)
    )
    out = []
    for wl in rows:
        nodes = sorted(n.name for n in wl.placement.nodes) if wl.placement is not None else []
        out.append({"name": wl.name, "tenant": wl.tenant.name, "status": wl.status,
                    "nodes": nodes, "reason": wl.reason})  # fmt: skip
    return out


# --- a retired EK coming back ----------------------------------------------------------------


def unretire_ek(
    tx: Tx, ek_sha256: str, *, change_id: int | None = None, reason: str | None = None
) -> dict[str, Any]:
    """Let a retired endorsement key enroll again (inside the ``node.reenroll`` change's
    transaction, :func:`reenroll`): the retirement is lifted and the decommissioned node's
    identity releases the EK (its enroll and bind events and its evidence stay), so the TPM
    can enroll as a new node. ``ek_not_retired`` (404) when the key is not retired."""
    row = tx.session.get(RetiredEkRow, ek_sha256)
    if row is None:
        raise NotFound("this endorsement key is not retired", code="ek_not_retired",
                       details={"ek_sha256": ek_sha256})  # fmt: skip
    released = tx.session.scalar(
        select(NodeAttestationRow)
        .join(NodeRow, NodeRow.id == NodeAttestationRow.node_id)
        .where(
            NodeAttestationRow.ek_sha256 == ek_sha256,
            NodeRow.state == NodeState.DECOMMISSIONED.value,
        )
    )
    if released is not None:
        tx.session.delete(released)
    tx.session.delete(row)
    tx.session.flush()
    details = {"ek_sha256": ek_sha256, "node": row.node_name, "retired_at":
               row.retired_at.isoformat(), "change_id": change_id, "reason": reason,
               "identity_released": released is not None}  # fmt: skip
    tx.record("node.attest.ek_unretire", "node", row.node_name, details=details)
    return details


def reenroll(
    store: Store,
    actor: Actor,
    *,
    node: str | None = None,
    ek_sha256: str | None = None,
    reason: str,
    change_id: int | None = None,
) -> dict[str, Any]:
    """Let a retired endorsement key enroll again, in one transaction: the ``node.reenroll``
    change's apply (a retired TPM comes back only through an approved change). Name the
    key by its SHA-256, or by the decommissioned node that last held it. ``ek_not_retired``
    (404) when nothing is retired under that name."""
    authorize(actor, Permission.NODES_WRITE)
    why = _reason(reason)
    if (node is None) == (ek_sha256 is None):
        raise ValidationFailed("name the retired endorsement key: node or ek_sha256 (one)",
                               code="invalid_payload")  # fmt: skip
    with store.write(actor) as tx:
        ek = ek_sha256
        if ek is None:
            ek = tx.session.scalar(
                select(RetiredEkRow.ek_sha256)
                .where(RetiredEkRow.node_name == node)
                .order_by(RetiredEkRow.retired_at.desc())
                .limit(1)
            )
            if ek is None:
                raise NotFound(f"node {node!r} left no retired endorsement key",
                               code="ek_not_retired", details={"node": node})  # fmt: skip
        return unretire_ek(tx, ek, change_id=change_id, reason=why)


# --- sanitisation ----------------------------------------------------------------------------


def _check_report(report: Any) -> dict[str, Any]:
    if not isinstance(report, dict):
        raise ValidationFailed("the sanitisation report is a JSON object",
                               code="invalid_sanitisation_report")  # fmt: skip
    unknown = sorted(str(k)[:40] for k in report if k not in REPORT_FIELDS)
    missing = sorted(k for k in REPORT_FIELDS if k not in report)
    if unknown or missing:
        raise ValidationFailed(
            "the sanitisation report has exactly mig_instances_destroyed, gpu_memory_cleared "
            "and method",
            code="invalid_sanitisation_report",
            details={"unknown": unknown[:10], "missing": missing},
        )
    for key, kind in REPORT_FIELDS.items():
        if type(report[key]) is not kind:
            raise ValidationFailed(f"{key} is a {kind.__name__}",
                                   code="invalid_sanitisation_report",
                                   details={"field": key})  # fmt: skip
    method = report["method"].strip()
    if not method or len(method) > MAX_METHOD or not method.isprintable():
        raise ValidationFailed(f"method is one line of text (at most {MAX_METHOD} characters)",
                               code="invalid_sanitisation_report",
                               details={"field": "method"})  # fmt: skip
    return {"mig_instances_destroyed": report["mig_instances_destroyed"],
            "gpu_memory_cleared": report["gpu_memory_cleared"], "method": method}  # fmt: skip


def report_sanitisation(store: Store, actor: Actor, name: str, report: Any) -> dict[str, Any]:
    """Record the sanitisation a decommissioned node's agent performed (``node.sanitise``,
    outcome failure unless both steps were done). The node's own agent, or an identity with
    ``nodes:write``. ``node_not_decommissioned`` (409) before the decommission,
    ``already_sanitised`` (409) after a complete report. A complete report revokes the agent
    credentials issued for the step."""
    own = agent_node(actor)
    if own is not None:
        if own != name:
            raise NotFound(f"node {name!r} not found", details={"node": name})
    else:
        authorize(actor, Permission.NODES_WRITE)
    checked = _check_report(report)
    with store.write(actor) as tx:
        row = node_row(tx.session, name)
        if NodeState(row.state) is not NodeState.DECOMMISSIONED:
            raise InvalidState(
                f"node {name!r} is {row.state}: sanitisation is reported after decommissioning",
                code="node_not_decommissioned",
                details={"node": name, "state": row.state},
            )
        done = tx.session.scalar(
            select(EventRow.seq).where(
                EventRow.action == SANITISE_ACTION,
                EventRow.target_type == "node",
                EventRow.target_id == name,
                EventRow.outcome == Outcome.SUCCESS.value,
            )
        )
        if done is not None:
            raise Conflict(f"node {name!r} was already sanitised (event {done})",
                           code="already_sanitised",
                           details={"node": name, "event_seq": done})  # fmt: skip
        ident = tx.session.get(NodeAttestationRow, row.id)
        complete = checked["mig_instances_destroyed"] and checked["gpu_memory_cleared"]
        details: dict[str, Any] = {
            **checked,
            "complete": complete,
            "reported_by": "agent" if own is not None else "operator",
        }
        if ident is not None and ident.simulated:
            details["simulated"] = True
        event = tx.record(SANITISE_ACTION, "node", name, details=details,
                          outcome=Outcome.SUCCESS if complete else Outcome.FAILURE)  # fmt: skip
        revoked = 0
        if complete:
            revoked = _revoke_agent_credentials(tx, name, "node sanitised after decommissioning")
        return {"node": name, **details, "agent_credentials_revoked": revoked,
                "event_seq": event.seq}  # fmt: skip
