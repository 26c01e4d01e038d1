"""Change requests: their lifecycle, approval rules and separation of duties. Pure.

A change request names a type (``certification.grant``…), a payload and who asked. It moves
``pending → approved → applied``, or ends ``denied``, ``expired`` or ``cancelled``. It is
approved when ``rule.approvals`` distinct eligible people approved the payload as it stands
now (each approval is bound to the SHA-256 of the canonical payload: an edit voids every
earlier one, GitHub's stale-review rule); any single denial denies it (Teleport's
``deny: 1``). The server enforces separation of duties: the requester never approves their own
request, and whoever last edited the payload cannot approve it. An eligible approver holds one
of the rule's roles; a ``tenant-admin`` counts only for a change scoped to one of its tenants;
an ``auditor`` never approves. An emergency change is applied at once by an admin and then
needs the same approvals as a post-implementation review.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from proofplane.audit.canonical import canonical_json
from proofplane.errors import Conflict, InvalidState, ProofplaneError, ValidationFailed

PENDING, APPROVED, APPLIED = "pending", "approved", "applied"
DENIED, EXPIRED, CANCELLED = "denied", "expired", "cancelled"
STATES = (PENDING, APPROVED, APPLIED, DENIED, EXPIRED, CANCELLED)
OPEN = frozenset({PENDING, APPROVED})
APPROVE, DENY, REVIEW = "approve", "deny", "review"

ADMIN, SECURITY_OFFICER, TENANT_ADMIN = "admin", "security-officer", "tenant-admin"
APPROVER_ROLES = (ADMIN, SECURITY_OFFICER, TENANT_ADMIN)


class SeparationOfDuties(ProofplaneError):
    """403 (``api.errors``): the same person may not both ask for (or shape) a change and
    approve it."""

    code = "separation_of_duties"


class NotAnApprover(ProofplaneError):
    """403: the voter holds none of the rule's roles (or a tenant-admin, another tenant's)."""

    code = "not_an_approver"


@dataclass(frozen=True, slots=True)
class Rule:
    """N approvals from distinct identities holding one of ``roles``."""

    approvals: int
    roles: tuple[str, ...] = APPROVER_ROLES


TWO = Rule(2)
ONE = Rule(1)
DEFAULT_RULES: dict[str, Rule] = {
    "certification.grant": TWO,
    "certification.revoke": ONE,
    "tenant.profile": TWO,
    "attestation.policy": TWO,
    "node.decommission": TWO,
    "node.readmit": ONE,
    "mig.layout": ONE,
    "quota.set": ONE,
    "runbook.publish": ONE,
    # a rule change may loosen control: two people agree to it
    "change.rules": TWO,
    # dual control over destroying key material (issue 13)
    "key.destroy": TWO,
    # a retired endorsement key (a decommissioned board or TPM) coming back
    "node.reenroll": TWO,
    # issue 14: what passes inside a tenant's segments (never between tenants); deleting a
    # tenant releases its segments
    "network.policy": ONE,
    "tenant.delete": TWO,
}
MAX_APPROVALS = 10


class InvalidRule(ValidationFailed):
    """422: an approval rule that cannot be enforced (no approvals, an unknown or
    non-approving role)."""

    code = "invalid_rule"


def check_rule(approvals: object, roles: Sequence[object]) -> Rule:
    """The rule ``approvals`` people holding one of ``roles`` describe, or ``InvalidRule``:
    at least one approval (at most ``MAX_APPROVALS``), at least one role, each role one that
    may approve (``APPROVER_ROLES``: never an auditor, never an operator)."""
    if isinstance(approvals, bool) or not isinstance(approvals, int):
        raise InvalidRule("approvals is a whole number", details={"approvals": approvals})
    if not 1 <= approvals <= MAX_APPROVALS:
        raise InvalidRule(f"approvals must be 1..{MAX_APPROVALS}: a change nobody approves is "
                          "not controlled", details={"approvals": approvals})  # fmt: skip
    if not roles:
        raise InvalidRule("name at least one role whose holders may approve",
                          details={"roles": list(APPROVER_ROLES)})  # fmt: skip
    bad = [r for r in roles if r not in APPROVER_ROLES]
    if bad:
        raise InvalidRule(
            f"only {', '.join(APPROVER_ROLES)} may approve changes; not {', '.join(map(str, bad))}",
            details={"refused": [str(r) for r in bad], "roles": list(APPROVER_ROLES)},
        )
    ordered = tuple(r for r in APPROVER_ROLES if r in roles)
    return Rule(approvals, ordered)


@dataclass(frozen=True, slots=True)
class Vote:
    decision: str  # approve | deny | review
    by: str
    payload_sha256: str


@dataclass(frozen=True, slots=True)
class Change:
    """What the rules look at: the request's state, who asked and last edited, its scope and
    its votes."""

    state: str
    requested_by: str
    last_edited_by: str
    payload_sha256: str
    tenant: str | None
    expires_at: datetime
    votes: tuple[Vote, ...] = ()
    emergency: bool = False
    review_state: str | None = None


def payload_sha256(payload: Mapping[str, Any]) -> str:
    """The SHA-256 (hex) of the payload's RFC 8785 canonical JSON: what approvals bind to."""
    return hashlib.sha256(canonical_json(dict(payload))).hexdigest()


def is_expired(change: Change, now: datetime) -> bool:
    return change.state in OPEN and now >= change.expires_at


def eligible(rule: Rule, roles: Sequence[str], tenants: Sequence[str], scope: str | None) -> bool:
    """Whether someone with ``roles`` (scoped to ``tenants``) may approve a change of scope
    ``scope`` under ``rule``."""
    for role in roles:
        if role not in rule.roles:
            continue
        if role == TENANT_ADMIN:
            if scope is not None and scope in tenants:
                return True
            continue
        return True
    return False


def check_vote(
    change: Change,
    rule: Rule,
    *,
    by: str,
    roles: Sequence[str],
    tenants: Sequence[str],
    decision: str,
    now: datetime,
) -> None:
    """Raise when ``by`` may not cast ``decision`` on ``change`` now (see the module's rules)."""
    if decision == REVIEW:
        if change.state != APPLIED or not change.emergency or change.review_state != PENDING:
            raise InvalidState("only an applied emergency change awaiting review is reviewed",
                               code="no_review_pending")  # fmt: skip
    elif change.state not in OPEN or is_expired(change, now):
        state = EXPIRED if is_expired(change, now) else change.state
        raise InvalidState(f"the change is {state}: nothing to approve or deny",
                           code="change_not_pending", details={"state": state})  # fmt: skip
    if by == change.requested_by and decision != DENY:
        raise SeparationOfDuties("the requester never approves their own request")
    if by == change.last_edited_by and decision != DENY:
        raise SeparationOfDuties("whoever last edited the payload cannot approve it")
    if not eligible(rule, roles, tenants, change.tenant):
        raise NotAnApprover(
            "approving this change needs one of the roles "
            f"{', '.join(rule.roles)} (a tenant-admin only for its own tenants)",
            details={"roles": list(rule.roles)},
        )
    voted = {(v.by, v.decision) for v in change.votes if v.payload_sha256 == change.payload_sha256}
    if (by, decision) in voted or (decision == APPROVE and (by, REVIEW) in voted):
        raise Conflict("you already voted on this version of the payload", code="already_voted")


def approvals(change: Change, decision: str = APPROVE) -> list[str]:
    """The distinct people whose ``decision`` counts: on the current payload, and neither the
    requester nor the last editor (checked when they voted; re-checked here)."""
    out: list[str] = []
    for v in change.votes:
        if v.decision != decision or v.payload_sha256 != change.payload_sha256:
            continue
        if v.by in (change.requested_by, change.last_edited_by) or v.by in out:
            continue
        out.append(v.by)
    return out


def state_after_votes(change: Change, rule: Rule) -> str:
    """The state the votes put a pending/approved change in."""
    if any(v.decision == DENY for v in change.votes):
        return DENIED
    if len(approvals(change)) >= rule.approvals:
        return APPROVED
    return PENDING


def review_done(change: Change, rule: Rule) -> bool:
    return len(approvals(change, REVIEW)) >= rule.approvals
