"""Change control (issue 12): every trust-changing action as a typed, approved, recorded change.

``TYPES`` is the registry: per type, the payload's schema (pydantic), who may ask (the
permission the direct call needs), the tenant it is scoped to, and ``apply``: the very service
function the direct call runs, executed inside the change's own transaction
(``Store.joined``), so applying does exactly what the direct call did, atomically with the
request's state and events. A later issue adds its type with one ``register`` call.

The rules (who may approve, separation of duties, the payload hash) are the pure core's:
``proofplane.govern.changes``. Applying re-checks the payload against the cluster as it is
now; a failed apply leaves the request ``approved`` with the error recorded. Requests expire
(``PROOFPLANE_CHANGE_TTL_SECONDS``, default 7 days). An admin's emergency change applies at
once and then needs the same approvals as a review within ``PROOFPLANE_EMERGENCY_REVIEW_HOURS``
(default 24 h); an overdue one raises ``alert.change_review_overdue`` every hour
(``workers.change_reviews``).

Any apply function receives ``change_id`` (the request it applies; None for a direct call) so
the events it writes link to the change. A type's ``check`` runs when the request is created
or edited: a payload that could never apply (a runbook that does not parse) is refused then,
never left pending to fail later. The approval rules are data (``change_rules``), changed
only through a ``change.rules`` change (it may loosen control).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass, fields
from datetime import datetime, timedelta
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from sqlalchemy import bindparam, insert, select, update

from proofplane.access import Actor, Permission, Role, authorize
from proofplane.access.authz import Forbidden
from proofplane.errors import Conflict, InvalidState, NotFound, ProofplaneError, ValidationFailed
from proofplane.govern import changes as rules
from proofplane.model import NodeState, Quota
from proofplane.model.tenant import profile_from_json
from proofplane.service.context import Store, Tx
from proofplane.store.tables import ChangeRequestRow, ChangeRuleRow, ChangeVoteRow

DEFAULT_TTL = timedelta(days=7)
EMERGENCY_REVIEW = timedelta(hours=24)  # PROOFPLANE_EMERGENCY_REVIEW_HOURS's default
MAX_REASON = 2000


# --- the registry ------------------------------------------------------------------------------


class Payload(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class CertificationGrant(Payload):
    node: str = Field(min_length=1, max_length=63)
    key: str = Field(min_length=1, max_length=63)
    value: str = Field(min_length=1, max_length=63)


class CertificationRevoke(Payload):
    node: str = Field(min_length=1, max_length=63)
    key: str = Field(min_length=1, max_length=63)


class TenantProfile(Payload):
    tenant: str = Field(min_length=1, max_length=63)
    profile: dict[str, Any]
    description: str | None = Field(None, max_length=1000)


class AttestationPolicy(Payload):
    node_class: str = Field("default", min_length=1, max_length=63)
    policy: dict[str, Any]
    enforce: bool = True


class NodeDecommission(Payload):
    node: str = Field(min_length=1, max_length=63)
    reason: str = Field(min_length=1, max_length=MAX_REASON)


class NodeReadmit(Payload):
    node: str = Field(min_length=1, max_length=63)
    reason: str = Field(min_length=1, max_length=MAX_REASON)


class QuotaSet(Payload):
    tenant: str = Field(min_length=1, max_length=63)
    gpus: int | None = Field(None, ge=0, le=1_000_000)
    mig_slices: int | None = Field(None, ge=0, le=1_000_000)


class RunbookPublish(Payload):
    text: str = Field(min_length=1, max_length=200_000)


class ChangeRules(Payload):
    """An approval rule for ``type``: ``approvals`` distinct people holding one of ``roles``."""

    type: str = Field(min_length=1, max_length=64)
    approvals: int = Field(ge=1, le=rules.MAX_APPROVALS)
    roles: list[str] = Field(min_length=1, max_length=len(rules.APPROVER_ROLES))


class MigLayout(Payload):
    node: str = Field(min_length=1, max_length=63)
    gpu: int = Field(ge=0, le=255)
    layout: list[str] = Field(
        max_length=7, description="profile@start, e.g. 3g.40gb@4; []: MIG off"
    )


class KeyDestroy(Payload):
    key: str = Field(min_length=1, max_length=63)
    version: int = Field(ge=1, le=1_000_000)


class NodeReenroll(Payload):
    node: str | None = Field(None, min_length=1, max_length=63)
    ek_sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")
    reason: str = Field(min_length=1, max_length=MAX_REASON)


class NetworkPolicy(Payload):
    tenant: str = Field(min_length=1, max_length=63)
    policy: dict[str, Any] | None = Field(description="subnet, allow, egress; null: the default")


class TenantDelete(Payload):
    tenant: str = Field(min_length=1, max_length=63)


# apply(store, actor, payload, *, change_id): the direct call's function; change_id links its
# events to the request (None for a direct call)
Apply = Callable[..., Any]


@dataclass(frozen=True)
class ChangeType:
    name: str
    payload: type[Payload]
    permission: Permission  # what the direct call needs: who may ask for (and apply) it
    apply: Apply
    scope: Callable[[Any], str | None] = lambda _p: None  # the tenant it concerns
    summary: Callable[[Any], str] = lambda p: ""
    # at create and edit: raise (422) for a payload that could never apply
    check: Callable[[Store, Any], None] = lambda _s, _p: None
    admin_only: bool = False  # beyond the permission: only an admin asks for (and applies) it


TYPES: dict[str, ChangeType] = {}


def register(change_type: ChangeType) -> None:
    TYPES[change_type.name] = change_type


def _grant(
    store: Store, actor: Actor, p: CertificationGrant, *, change_id: int | None = None
) -> Any:
    from proofplane.service.nodes import certify

    return certify(store, actor, p.node, p.key, p.value)


def _revoke(
    store: Store, actor: Actor, p: CertificationRevoke, *, change_id: int | None = None
) -> Any:
    from proofplane.service.nodes import revoke_certification

    return revoke_certification(store, actor, p.node, p.key)


def _profile(store: Store, actor: Actor, p: TenantProfile, *, change_id: int | None = None) -> Any:
    from proofplane.service.tenants import update_tenant

    try:
        profile = profile_from_json(p.profile)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValidationFailed(f"invalid profile: {exc}", code="invalid_payload") from None
    return update_tenant(store, actor, p.tenant, description=p.description, profile=profile)


def _policy(
    store: Store, actor: Actor, p: AttestationPolicy, *, change_id: int | None = None
) -> Any:
    from proofplane.service.attestation import set_policy

    return set_policy(store, actor, {**p.policy, "node_class": p.node_class}, enforce=p.enforce)


def _decommission(
    store: Store, actor: Actor, p: NodeDecommission, *, change_id: int | None = None
) -> Any:
    from proofplane.service.decommission import decommission_node

    return decommission_node(store, actor, p.node, p.reason, change_id=change_id)


def _readmit(store: Store, actor: Actor, p: NodeReadmit, *, change_id: int | None = None) -> Any:
    from proofplane.service.nodes import set_node_state

    return set_node_state(store, actor, p.node, NodeState.ADMITTED, p.reason)


def _quota(store: Store, actor: Actor, p: QuotaSet, *, change_id: int | None = None) -> Any:
    from proofplane.service.tenants import set_quota

    return set_quota(store, actor, p.tenant, Quota(p.gpus, p.mig_slices))


def _runbook(store: Store, actor: Actor, p: RunbookPublish, *, change_id: int | None = None) -> Any:
    from proofplane.service import runbooks

    with store.write(actor) as tx:
        return runbooks.publish_runbook(tx, p.text, change_id=change_id)


def _check_runbook(store: Store, p: RunbookPublish) -> None:
    """The text parses (422 ``invalid_runbook``) and its version is newer than the stored ones
    (409 ``runbook_version_not_newer``), checked again when it is applied."""
    from proofplane.service import runbooks

    summary = runbooks.check_runbook(p.text)
    with store.read() as session:
        newest = max(runbooks.versions(session).get(summary["id"], {}), default=0)
    if summary["version"] <= newest:
        raise Conflict(
            f"runbook {summary['id']!r} is already at version {newest}: publish version "
            f"{newest + 1}",
            code="runbook_version_not_newer",
            details={"id": summary["id"], "version": summary["version"], "current": newest},
        )


def _rules(store: Store, actor: Actor, p: ChangeRules, *, change_id: int | None = None) -> Any:
    return set_rule(store, actor, p.type, p.approvals, p.roles, change_id=change_id)


def _check_rules(store: Store | None, p: ChangeRules) -> None:
    _change_type(p.type)
    rules.check_rule(p.approvals, p.roles)


def _mig_layout(store: Store, actor: Actor, p: MigLayout, *, change_id: int | None = None) -> Any:
    from proofplane.service.mig_layout import set_mig_layout

    return set_mig_layout(store, actor, p.node, p.gpu, p.layout, change_id=change_id)


def _check_mig_layout(store: Store, p: MigLayout) -> None:
    from proofplane.service.mig_layout import check_mig_layout

    check_mig_layout(store, p.node, p.gpu, p.layout)


def _key_destroy(store: Store, actor: Actor, p: KeyDestroy, *, change_id: int | None = None) -> Any:
    from proofplane.service.key_inventory import destroy_version

    return destroy_version(store, actor, p.key, p.version, change_id=change_id).to_json()


def _check_key_destroy(store: Store, p: KeyDestroy) -> None:
    from proofplane.access import SYSTEM
    from proofplane.service.key_inventory import check_destroy

    check_destroy(store, SYSTEM, p.key, p.version)


def _reenroll(store: Store, actor: Actor, p: NodeReenroll, *, change_id: int | None = None) -> Any:
    from proofplane.service.decommission import reenroll

    return reenroll(store, actor, node=p.node, ek_sha256=p.ek_sha256, reason=p.reason,
                    change_id=change_id)  # fmt: skip


def _check_reenroll(store: Store, p: NodeReenroll) -> None:
    if (p.node is None) == (p.ek_sha256 is None):
        raise ValidationFailed("name the retired endorsement key: node or ek_sha256 (one)",
                               code="invalid_payload")  # fmt: skip


def _network_policy(
    store: Store, actor: Actor, p: NetworkPolicy, *, change_id: int | None = None
) -> Any:
    from proofplane.service.network import set_network_policy

    return set_network_policy(store, actor, p.tenant, p.policy, change_id=change_id)


def _check_network_policy(store: Store, p: NetworkPolicy) -> None:
    from proofplane.service.network import check_policy_change

    check_policy_change(store, p.tenant, p.policy)


def _tenant_delete(
    store: Store, actor: Actor, p: TenantDelete, *, change_id: int | None = None
) -> Any:
    from proofplane.service.tenants import delete_tenant

    return delete_tenant(store, actor, p.tenant, change_id=change_id)


for _t in (
    ChangeType("certification.grant", CertificationGrant, Permission.CERTIFY, _grant,
               summary=lambda p: f"certify node {p.node} {p.key}={p.value}"),
    ChangeType("certification.revoke", CertificationRevoke, Permission.CERTIFY, _revoke,
               summary=lambda p: f"revoke {p.key} from node {p.node}"),
    ChangeType("tenant.profile", TenantProfile, Permission.TENANTS_WRITE, _profile,
               scope=lambda p: p.tenant, summary=lambda p: f"set tenant {p.tenant}'s profile"),
    ChangeType("attestation.policy", AttestationPolicy, Permission.ATTEST_POLICY_WRITE, _policy,
               summary=lambda p: f"set the {p.node_class} attestation policy"),
    ChangeType("node.decommission", NodeDecommission, Permission.NODES_WRITE, _decommission,
               summary=lambda p: f"decommission node {p.node}"),
    ChangeType("node.readmit", NodeReadmit, Permission.NODES_WRITE, _readmit,
               summary=lambda p: f"readmit node {p.node}"),
    ChangeType("quota.set", QuotaSet, Permission.QUOTAS_WRITE, _quota,
               scope=lambda p: p.tenant, summary=lambda p: f"set tenant {p.tenant}'s quota"),
    ChangeType("runbook.publish", RunbookPublish, Permission.NODES_WRITE, _runbook,
               summary=lambda p: "publish a runbook version", check=_check_runbook),
    ChangeType("change.rules", ChangeRules, Permission.USERS_WRITE, _rules, check=_check_rules,
               admin_only=True,
               summary=lambda p: f"{p.type} needs {p.approvals} of {', '.join(p.roles)}"),
    ChangeType("mig.layout", MigLayout, Permission.NODES_WRITE, _mig_layout,
               check=_check_mig_layout,
               summary=lambda p: f"set GPU {p.gpu} of node {p.node} to [{', '.join(p.layout)}]"),
    ChangeType("key.destroy", KeyDestroy, Permission.KEYS_WRITE, _key_destroy,
               check=_check_key_destroy,
               summary=lambda p: f"destroy version {p.version} of key {p.key}"),
    ChangeType("node.reenroll", NodeReenroll, Permission.NODES_WRITE, _reenroll,
               check=_check_reenroll,
               summary=lambda p: f"let the retired EK of {p.node or p.ek_sha256} enroll again"),
    ChangeType("network.policy", NetworkPolicy, Permission.TENANTS_WRITE, _network_policy,
               scope=lambda p: p.tenant, check=_check_network_policy,
               summary=lambda p: f"set tenant {p.tenant}'s network policy"),
    ChangeType("tenant.delete", TenantDelete, Permission.TENANTS_WRITE, _tenant_delete,
               scope=lambda p: p.tenant,
               summary=lambda p: f"delete tenant {p.tenant} (its segments cool down)"),
):  # fmt: skip
    register(_t)


# --- settings ----------------------------------------------------------------------------------


def ttl_from_env() -> timedelta:
    raw = os.environ.get("PROOFPLANE_CHANGE_TTL_SECONDS", "").strip()
    if not raw:
        return DEFAULT_TTL
    if not raw.isdigit() or not 60 <= int(raw) <= 90 * 86400:
        raise ValidationFailed("PROOFPLANE_CHANGE_TTL_SECONDS must be 60..7776000",
                               code="invalid_setting")  # fmt: skip
    return timedelta(seconds=int(raw))


def control_from_env() -> str:
    """``PROOFPLANE_CHANGE_CONTROL``: ``enforce`` (governed actions only through approved
    changes) or ``off``."""
    raw = os.environ.get("PROOFPLANE_CHANGE_CONTROL", "enforce").strip().lower() or "enforce"
    if raw not in ("enforce", "off"):
        raise ValidationFailed("PROOFPLANE_CHANGE_CONTROL must be enforce or off",
                               code="invalid_setting")  # fmt: skip
    return raw


# --- views -------------------------------------------------------------------------------------


# The change operations read and write their request and votes with prebuilt Core statements
# on the transaction's connection, not ORM objects: every step of a change holds the one write
# slot (SQLite's writer, PostgreSQL's advisory lock) for its whole transaction, and the ORM's
# identity map and unit-of-work flush were most of that time (issue 12's benchmark: about 60 %
# of a vote's time under the lock, the statements themselves under a tenth).
_CHANGES = ChangeRequestRow.__table__
_VOTE_TABLE = ChangeVoteRow.__table__


@dataclass(slots=True)
class ChangeRecord:
    """A change request as one Core statement reads it (the columns of ``change_requests``);
    ``_save`` writes its mutable fields back."""

    id: int
    type: str
    state: str
    payload: dict[str, Any]
    payload_sha256: str
    reason: str
    emergency: bool
    tenant: str | None
    requested_by: str
    requested_at: datetime
    last_edited_by: str
    updated_at: datetime
    expires_at: datetime
    applied_at: datetime | None
    applied_by: str | None
    error: str | None
    review_state: str | None
    review_due_at: datetime | None
    review_alerted_at: datetime | None


@dataclass(frozen=True, slots=True)
class VoteRecord:
    """A vote as stored (``change_votes``' columns but its id)."""

    decision: str
    by: str
    roles: list[str]
    at: datetime
    comment: str
    payload_sha256: str


_RECORD_FIELDS = frozenset(f.name for f in fields(ChangeRecord))
_VOTE_FIELDS = tuple(f.name for f in fields(VoteRecord))
_CHANGE_BY_ID = select(_CHANGES).where(_CHANGES.c.id == bindparam("change_id"))
_VOTES = (
    select(*(_VOTE_TABLE.c[name] for name in _VOTE_FIELDS))
    .where(_VOTE_TABLE.c.change_id == bindparam("change"))
    .order_by(_VOTE_TABLE.c.id)
)
_INSERT_CHANGE = insert(_CHANGES)
_INSERT_VOTE = insert(_VOTE_TABLE)
# what a step changes on a request: the same SET list every time (one cached statement each)
_STATE_FIELDS = ("state", "updated_at", "applied_at", "applied_by", "error", "review_state",
                 "review_due_at")  # fmt: skip
_PAYLOAD_FIELDS = ("payload", "payload_sha256", "tenant", "last_edited_by")
_SAVE = update(_CHANGES).where(_CHANGES.c.id == bindparam("change_id"))


def _find(session: Any, change_id: int) -> ChangeRecord | None:
    row = session.connection().execute(_CHANGE_BY_ID, {"change_id": change_id}).first()
    return None if row is None else ChangeRecord(**row._mapping)


def _load(session: Any, change_id: int) -> ChangeRecord:
    rec = _find(session, change_id)
    if rec is None:
        raise NotFound(f"change {change_id} not found", details={"change": change_id})
    return rec


def _save(tx: Tx, rec: ChangeRecord, *, payload: bool = False) -> None:
    """Write the request's state fields back (and, ``payload``, its payload and who edited it)."""
    names = _STATE_FIELDS + _PAYLOAD_FIELDS if payload else _STATE_FIELDS
    params: dict[str, Any] = {name: getattr(rec, name) for name in names}
    params["change_id"] = rec.id
    tx.session.connection().execute(_SAVE, params)


def _votes(session: Any, change_id: int) -> list[VoteRecord]:
    rows = session.connection().execute(_VOTES, {"change": change_id})
    return [VoteRecord(*r) for r in rows]


def _cast(tx: Tx, rec: ChangeRecord, vote: VoteRecord) -> None:
    values = {name: getattr(vote, name) for name in _VOTE_FIELDS}
    tx.session.connection().execute(_INSERT_VOTE, {**values, "change_id": rec.id})


def _pure(row: ChangeRecord, votes: list[VoteRecord]) -> rules.Change:
    return rules.Change(
        state=row.state, requested_by=row.requested_by, last_edited_by=row.last_edited_by,
        payload_sha256=row.payload_sha256, tenant=row.tenant, expires_at=row.expires_at,
        votes=tuple(rules.Vote(v.decision, v.by, v.payload_sha256) for v in votes),
        emergency=row.emergency, review_state=row.review_state,
    )  # fmt: skip


def view(
    row: ChangeRecord | ChangeRequestRow, votes: list[VoteRecord] | list[ChangeVoteRow]
) -> dict[str, Any]:
    """The change resource (the register's export passes the ORM rows it pages through)."""

    def entries(decision: str) -> list[dict[str, Any]]:
        return [{"by": v.by, "at": v.at.isoformat(), "comment": v.comment,
                 "payload_sha256": v.payload_sha256,
                 "current": v.payload_sha256 == row.payload_sha256}
                for v in votes if v.decision == decision]  # fmt: skip

    return {
        "id": row.id,
        "type": row.type,
        "state": row.state,
        "payload": row.payload,
        "payload_sha256": row.payload_sha256,
        "reason": row.reason,
        "emergency": row.emergency,
        "tenant": row.tenant,
        "requested_by": row.requested_by,
        "requested_at": row.requested_at.isoformat(),
        "last_edited_by": row.last_edited_by,
        "approvals": entries(rules.APPROVE),
        "denials": entries(rules.DENY),
        "reviews": entries(rules.REVIEW),
        "expires_at": row.expires_at.isoformat(),
        "applied_at": row.applied_at.isoformat() if row.applied_at else None,
        "applied_by": row.applied_by,
        "error": row.error,
        "review_state": row.review_state,
        "review_due_at": row.review_due_at.isoformat() if row.review_due_at else None,
    }


def _authorize(actor: Actor, ct: ChangeType, scope: str | None) -> None:
    if ct.admin_only and Role.ADMIN not in actor.roles:
        raise Forbidden(f"only an admin asks for (or applies) a {ct.name} change",
                        code="forbidden", details={"type": ct.name})  # fmt: skip
    if scope is not None:
        authorize(actor, ct.permission, tenant=scope)
    else:
        authorize(actor, ct.permission)


def _change_type(name: str) -> ChangeType:
    ct = TYPES.get(name)
    if ct is None:
        known = sorted(TYPES)
        raise ValidationFailed(
            f"unknown change type {name!r}; one of {', '.join(known)}",
            code="unknown_change_type",
            details={"types": known},
        )
    return ct


def _parse(ct: ChangeType, payload: Any) -> Payload:
    if not isinstance(payload, dict):
        raise ValidationFailed("the payload must be an object", code="invalid_payload")
    try:
        return ct.payload.model_validate(payload)
    except ValidationError as exc:
        problems = [f"{'.'.join(str(x) for x in e['loc'])}: {e['msg']}" for e in exc.errors()]
        raise ValidationFailed(f"the {ct.name} payload is invalid: {'; '.join(problems)}",
                               code="invalid_payload", details=problems) from None  # fmt: skip


def _digest(body: dict[str, Any]) -> str:
    """The payload's hash; a value JSON cannot hold exactly (an integer beyond 2**53, a lone
    surrogate) is an invalid payload, not a 500."""
    try:
        return rules.payload_sha256(body)
    except (ValueError, TypeError) as exc:
        raise ValidationFailed(f"the payload cannot be hashed canonically: {exc}",
                               code="invalid_payload") from None  # fmt: skip


def rule_for(session: Any, change_type: str) -> rules.Rule:
    """The type's stored rule, else its default (a Core read: most types have none stored,
    and the ORM would build nothing but still compile and run its own query each time)."""
    row = session.connection().execute(_RULE, {"type": change_type}).first()
    if row is not None:
        return rules.Rule(row.approvals, tuple(row.roles))
    return rules.DEFAULT_RULES.get(change_type, rules.ONE)


_RULE_TABLE = ChangeRuleRow.__table__
_RULE = select(_RULE_TABLE.c.approvals, _RULE_TABLE.c.roles).where(
    _RULE_TABLE.c.type == bindparam("type")
)


def list_rules(store: Store, actor: Actor) -> list[dict[str, Any]]:
    """Every change type's approval rule: the stored one (``source: "set"``, who set it and
    when) or the code's default."""
    _can_read(actor)
    with store.read() as session:
        stored = {r.type: r for r in session.scalars(select(ChangeRuleRow))}
    out = []
    for name in sorted(TYPES):
        row = stored.get(name)
        default = rules.DEFAULT_RULES.get(name, rules.ONE)
        entry: dict[str, Any] = {
            "type": name,
            "approvals": row.approvals if row else default.approvals,
            "roles": list(row.roles) if row else list(default.roles),
            "source": "set" if row else "default",
            "default": {"approvals": default.approvals, "roles": list(default.roles)},
        }
        if row is not None:
            entry["updated_by"], entry["updated_at"] = row.updated_by, row.updated_at.isoformat()
        out.append(entry)
    return out


def set_rule(
    store: Store,
    actor: Actor,
    change_type: str,
    approvals: Any,
    roles: Any,
    *,
    change_id: int | None = None,
) -> dict[str, Any]:
    """Set ``change_type``'s approval rule (an admin; the ``change.rules`` change's apply): at
    least one approval, roles among ``admin``, ``security-officer``, ``tenant-admin``. The
    ``change.rule.set`` event carries the rule before and after."""
    if Role.ADMIN not in actor.roles:
        raise Forbidden("only an admin sets approval rules", code="forbidden")
    _change_type(change_type)
    if not isinstance(roles, list | tuple):
        raise rules.InvalidRule("roles is a list", details={"roles": list(rules.APPROVER_ROLES)})
    rule = rules.check_rule(approvals, list(roles))
    with store.write(actor) as tx:
        before = rule_for(tx.session, change_type)
        row = tx.session.get(ChangeRuleRow, change_type)
        if row is None:
            row = ChangeRuleRow(type=change_type)
            tx.session.add(row)
        row.approvals, row.roles = rule.approvals, list(rule.roles)
        row.updated_by, row.updated_at = actor.name, tx.now
        tx.record("change.rule.set", "change_rule", change_type, details={
            "type": change_type, "approvals": rule.approvals, "roles": list(rule.roles),
            "before": {"approvals": before.approvals, "roles": list(before.roles)},
            "change_id": change_id,
            "loosened": rule.approvals < before.approvals
            or bool(set(rule.roles) - set(before.roles))})  # fmt: skip
        return {"type": change_type, "approvals": rule.approvals, "roles": list(rule.roles),
                "source": "set", "updated_by": actor.name,
                "updated_at": tx.now.isoformat()}  # fmt: skip


def check_rule_change(actor: Actor, payload: dict[str, Any]) -> None:
    """Everything a rule change is refused for, before it is gated or done: an admin, a known
    type, a rule that can be enforced (the ``change.rules`` payload)."""
    ct = _change_type("change.rules")
    parsed = _parse(ct, payload)
    _authorize(actor, ct, None)
    assert isinstance(parsed, ChangeRules)
    _check_rules(None, parsed)


# --- the change-control mode a server runs under (for the evidence it exports) ---------------

_MODES: weakref.WeakKeyDictionary[Store, str] = weakref.WeakKeyDictionary()


def set_control_mode(store: Store, mode: str) -> None:
    """What the server serving ``store`` enforces (``create_app`` tells it); recorded in the
    change register export and incident bundles."""
    _MODES[store] = mode


def control_mode(store: Store) -> str:
    """``enforce`` or ``off``: the serving app's mode; ``off`` for a store no app serves (a
    service call is not gated)."""
    return _MODES.get(store, "off")


def _can_read(actor: Actor) -> None:
    if not actor.holds(Permission.CHANGES_READ):
        authorize(actor, Permission.CHANGES_READ)


def _expire(tx: Tx, row: ChangeRecord) -> bool:
    """Mark an open request past its expiry ``expired`` (written at once); True if it was."""
    if row.state in rules.OPEN and tx.now >= row.expires_at:
        row.state, row.updated_at = rules.EXPIRED, tx.now
        _save(tx, row)
        tx.record("change.expire", "change", str(row.id), details={"type": row.type})
        return True
    return False


# --- the operations ----------------------------------------------------------------------------


def create_change(
    store: Store,
    actor: Actor,
    change_type: str,
    payload: Any,
    *,
    reason: str = "",
    emergency: bool = False,
    ttl: timedelta | None = None,
    review_within: timedelta | None = None,
    now: datetime | None = None,
) -> dict[str, Any]:
    """Ask for a change (who may make the direct call may ask). ``emergency`` (admins only,
    with a reason): applied at once, reviewed afterwards, within ``review_within``
    (``Settings.emergency_review_hours``; default 24 h)."""
    ct = _change_type(change_type)
    parsed = _parse(ct, payload)
    scope = ct.scope(parsed)
    _authorize(actor, ct, scope)
    ct.check(store, parsed)
    if not isinstance(reason, str) or len(reason) > MAX_REASON:
        raise ValidationFailed(f"reason is text of at most {MAX_REASON} characters",
                               code="invalid_reason")  # fmt: skip
    if emergency:
        if Role.ADMIN not in actor.roles:
            raise Forbidden("only an admin may apply an emergency change", code="forbidden")
        if not reason.strip():
            raise ValidationFailed("an emergency change needs a reason", code="invalid_reason")
    body = parsed.model_dump(mode="json")
    digest = _digest(body)
    summary = ct.summary(parsed)
    with store.write(actor, now) as tx:
        row = ChangeRecord(
            id=0, type=ct.name, state=rules.PENDING, payload=body,
            payload_sha256=digest, reason=reason, emergency=emergency,
            tenant=scope, requested_by=actor.name, requested_at=tx.now,
            last_edited_by=actor.name, updated_at=tx.now,
            expires_at=tx.now + (ttl or ttl_from_env()), applied_at=None, applied_by=None,
            error=None, review_state=None, review_due_at=None, review_alerted_at=None,
        )  # fmt: skip
        values = {name: getattr(row, name) for name in _RECORD_FIELDS if name != "id"}
        inserted = tx.session.connection().execute(_INSERT_CHANGE, values)
        row.id = inserted.inserted_primary_key[0]
        tx.record("change.create", "change", str(row.id), details={
            "type": ct.name, "payload_sha256": row.payload_sha256, "emergency": emergency,
            "reason": reason, "summary": summary})  # fmt: skip
        if emergency:
            with store.joined(tx):
                ct.apply(store, actor, parsed, change_id=row.id)
            row.state, row.applied_at, row.applied_by = rules.APPLIED, tx.now, actor.name
            row.review_state = rules.PENDING
            row.review_due_at = tx.now + (review_within or EMERGENCY_REVIEW)
            _save(tx, row)
            tx.record("change.apply", "change", str(row.id), details={
                "type": ct.name, "payload_sha256": row.payload_sha256, "emergency": True,
                "approvals": []})  # fmt: skip
        return view(row, [])


def get_change(store: Store, actor: Actor, change_id: int) -> dict[str, Any]:
    _can_read(actor)
    with store.read() as session:
        return view(_load(session, change_id), _votes(session, change_id))


def list_changes(
    store: Store, actor: Actor, *, state: str | None = None, change_type: str | None = None,
    limit: int = 100,
) -> list[dict[str, Any]]:  # fmt: skip
    _can_read(actor)
    if state is not None and state not in rules.STATES:
        raise ValidationFailed(f"state is one of {', '.join(rules.STATES)}", code="invalid_state")
    with store.read() as session:
        query = select(_CHANGES).order_by(_CHANGES.c.id.desc()).limit(limit)
        if state is not None:
            query = query.where(_CHANGES.c.state == state)
        if change_type is not None:
            query = query.where(_CHANGES.c.type == change_type)
        found = [ChangeRecord(**r._mapping) for r in session.connection().execute(query)]
        return [view(r, _votes(session, r.id)) for r in found]


def edit_change(
    store: Store, actor: Actor, change_id: int, payload: Any, *, now: datetime | None = None
) -> dict[str, Any]:
    """Replace the payload of an open request (its requester, or whoever may ask for it):
    every earlier approval is void, and the editor may not approve it."""
    with store.write(actor, now) as tx:
        row = _load(tx.session, change_id)
        ct = _change_type(row.type)
        parsed = _parse(ct, payload)
        scope = ct.scope(parsed)
        if actor.name != row.requested_by:
            _authorize(actor, ct, scope)
        if _expire(tx, row) or row.state not in rules.OPEN:
            raise InvalidState(f"the change is {row.state}: it cannot be edited",
                               code="change_not_pending", details={"state": row.state})  # fmt: skip
        ct.check(store, parsed)
        body = parsed.model_dump(mode="json")
        before = row.payload_sha256
        row.payload, row.payload_sha256 = body, _digest(body)
        row.tenant, row.last_edited_by, row.updated_at = scope, actor.name, tx.now
        row.state = rules.PENDING  # approvals of the old payload no longer count
        _save(tx, row, payload=True)
        details = {"type": row.type, "payload_sha256": row.payload_sha256, "previous": before}
        tx.record("change.edit", "change", str(row.id), details=details)
        return view(row, _votes(tx.session, row.id))


def vote(
    store: Store,
    actor: Actor,
    change_id: int,
    decision: str,
    comment: str = "",
    *,
    now: datetime | None = None,
) -> dict[str, Any]:
    """Approve, deny, or (an applied emergency change) review it. Separation of duties is
    checked here: 403 ``separation_of_duties``."""
    if decision not in (rules.APPROVE, rules.DENY, rules.REVIEW):
        raise ValidationFailed("decision is approve, deny or review", code="invalid_decision")
    if not isinstance(comment, str) or len(comment) > MAX_REASON:
        raise ValidationFailed(f"a comment is at most {MAX_REASON} characters",
                               code="invalid_comment")  # fmt: skip
    roles = sorted(r.value for r in actor.roles)
    tenants = sorted(actor.tenants)
    with store.write(actor, now) as tx:
        row = _load(tx.session, change_id)
        if _expire(tx, row):
            return view(row, _votes(tx.session, row.id))  # committed: it expired
        rule = rule_for(tx.session, row.type)
        votes = _votes(tx.session, row.id)
        rules.check_vote(_pure(row, votes), rule, by=actor.name, roles=roles, tenants=tenants,
                         decision=decision, now=tx.now)  # fmt: skip
        cast = VoteRecord(decision=decision, by=actor.name, roles=roles, at=tx.now,
                          comment=comment, payload_sha256=row.payload_sha256)  # fmt: skip
        _cast(tx, row, cast)
        votes.append(cast)
        pure = _pure(row, votes)
        if decision == rules.REVIEW:
            if rules.review_done(pure, rule):
                row.review_state = "done"
        else:
            row.state = rules.state_after_votes(pure, rule)
        row.updated_at = tx.now
        _save(tx, row)
        tx.record(f"change.{decision}", "change", str(row.id), details={
            "type": row.type, "payload_sha256": row.payload_sha256, "comment": comment,
            "state": row.state, "review_state": row.review_state})  # fmt: skip
        return view(row, votes)


def apply_change(
    store: Store, actor: Actor, change_id: int, *, now: datetime | None = None
) -> dict[str, Any]:
    """Apply an approved change: the direct call's own function, re-checked against the
    cluster now, in one transaction with the request's state and events. A failure leaves
    the request approved, with the error recorded (and raises it)."""
    checked = False  # who may apply it is checked: a refusal after this is the apply's
    try:
        with store.write(actor, now) as tx:
            # One transaction: who may, the request's state, its approvals and the change
            # itself all read and written under the writer lock, the payload parsed once.
            row = _load(tx.session, change_id)
            ct = _change_type(row.type)
            parsed = _parse(ct, row.payload)
            _authorize(actor, ct, ct.scope(parsed))
            checked = True
            if _expire(tx, row):
                expired = True
            else:
                expired = False
                if row.state != rules.APPROVED:
                    raise InvalidState(f"the change is {row.state}, not approved",
                                       code="change_not_approved",
                                       details={"state": row.state})  # fmt: skip
                votes = _votes(tx.session, row.id)
                rule = rule_for(tx.session, row.type)
                pure = _pure(row, votes)
                if rules.state_after_votes(pure, rule) != rules.APPROVED:  # defence in depth
                    raise InvalidState("the change lacks its approvals",
                                       code="change_not_approved")  # fmt: skip
                with store.joined(tx):
                    ct.apply(store, actor, parsed, change_id=row.id)
                row.state, row.applied_at, row.applied_by = rules.APPLIED, tx.now, actor.name
                row.error, row.updated_at = None, tx.now
                _save(tx, row)
                tx.record("change.apply", "change", str(row.id), details={
                    "type": row.type, "payload_sha256": row.payload_sha256,
                    "approvals": rules.approvals(pure)})  # fmt: skip
                return view(row, votes)
    except ProofplaneError as exc:
        # the request's own refusals (not found, not allowed, not approved) are not the apply
        # failing; anything the direct call refused (a conflict, a KMS error, a vanished
        # node…) is recorded on the request, which stays approved
        if checked and exc.code not in _NOT_APPLY_FAILURES:
            _record_failure(store, actor, change_id, exc)
        raise
    assert expired
    raise InvalidState("the change expired before it was applied", code="change_expired")


_NOT_APPLY_FAILURES = frozenset({"change_not_approved", "unavailable"})


def _record_failure(store: Store, actor: Actor, change_id: int, exc: ProofplaneError) -> None:
    message = exc.message
    with store.write(actor) as tx:
        row = _find(tx.session, change_id)
        if row is None or row.state != rules.APPROVED:
            return  # nothing to record it on (a request that is not approved did not apply)
        row.error, row.updated_at = f"{exc.code}: {message}"[:2000], tx.now
        _save(tx, row)
        tx.record("change.apply", "change", str(row.id), outcome=_failure(),
                  details={"type": row.type, "code": exc.code,
                           "error": message[:500]})  # fmt: skip


def _failure() -> Any:
    from proofplane.model import Outcome

    return Outcome.FAILURE


def cancel_change(
    store: Store, actor: Actor, change_id: int, comment: str = "", *, now: datetime | None = None
) -> dict[str, Any]:
    """The requester (or an admin) withdraws an open request."""
    with store.write(actor, now) as tx:
        row = _load(tx.session, change_id)
        if actor.name != row.requested_by and Role.ADMIN not in actor.roles:
            raise Forbidden("only the requester or an admin cancels a change", code="forbidden")
        if _expire(tx, row) or row.state not in rules.OPEN:
            raise InvalidState(f"the change is {row.state}: it cannot be cancelled",
                               code="change_not_pending", details={"state": row.state})  # fmt: skip
        row.state, row.updated_at = rules.CANCELLED, tx.now
        _save(tx, row)
        tx.record("change.cancel", "change", str(row.id),
                  details={"type": row.type, "comment": comment})  # fmt: skip
        return view(row, _votes(tx.session, row.id))


def overdue_reviews(store: Store, now: datetime) -> list[int]:
    """Emergency changes whose review is overdue: an ``alert.change_review_overdue`` event for
    each, at most once an hour while it stays overdue. Returns their ids."""
    from proofplane.access import SYSTEM
    from proofplane.service.runbooks import with_runbook

    def due(session: Any, at: datetime) -> list[ChangeRequestRow]:
        rows = session.scalars(
            select(ChangeRequestRow)
            .where(
                ChangeRequestRow.review_state == rules.PENDING,
                ChangeRequestRow.review_due_at <= at,
            )
            .order_by(ChangeRequestRow.id)
        )
        return [
            r for r in rows
            if r.review_alerted_at is None or at - r.review_alerted_at >= REALERT
        ]  # fmt: skip

    at = now
    with store.read() as session:  # most passes find nothing: no write transaction then
        if not due(session, at):
            return []
    out: list[int] = []
    with store.write(SYSTEM, now) as tx:
        for row in due(tx.session, tx.now):
            row.review_alerted_at = tx.now
            details = {
                "type": row.type,
                "change_id": row.id,
                "applied_by": row.applied_by,
                "due": row.review_due_at.isoformat() if row.review_due_at else None,
                "overdue_s": int((tx.now - row.review_due_at).total_seconds())
                if row.review_due_at else None,
                "severity": "high",
                "next_step": f"proofplane changes review {row.id} (by someone other than "
                "its requester)",
            }  # fmt: skip
            tx.record("alert.change_review_overdue", "change", str(row.id),
                      details=with_runbook(details, "alert.change_review_overdue", "success",
                                           tx.session))  # fmt: skip
            out.append(row.id)
    return out


REALERT = timedelta(hours=1)


class ChangeRequestRequired(Conflict):
    """409: with change control on, a governed action goes through an approved change; the
    details carry the request that would do it (``POST /api/v1/changes``)."""

    code = "change_request_required"


def gate(control: str, change_type: str, payload: dict[str, Any]) -> None:
    """Refuse a direct governed call when change control is ``enforce`` (nothing is written),
    naming the change request that would do it."""
    if control != "enforce":
        return
    ct = _change_type(change_type)
    body = {"type": change_type, "payload": payload, "reason": "", "emergency": False}
    raise ChangeRequestRequired(
        f"{ct.name} is a governed change: create a change request (POST /api/v1/changes) "
        "and have it approved; change control is on (PROOFPLANE_CHANGE_CONTROL=enforce)",
        details={"change": body},
    )
