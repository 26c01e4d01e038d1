"""The demo's governance seed (issue 12): a second admin and a security officer with API
tokens, and one pending change (a certification grant the first admin asked for), so the
tour can show a change approved by two other people and applied, and a refused
self-approval."""

from __future__ import annotations

from dataclasses import dataclass

from proofplane.access import SYSTEM, Actor, Role
from proofplane.service import access
from proofplane.service import changes as changes_svc
from proofplane.service.context import Store

DEMO_TOKEN_DAYS = 90
PENDING_GRANT = {"node": "fra-h100-04", "key": "hipaa", "value": "true"}


@dataclass(frozen=True)
class GovernanceSeed:
    second_admin_token: str
    security_officer_token: str
    change_id: int


def _token(store: Store, name: str, role: Role) -> str:
    access.create_user(store, SYSTEM, name, None, [role.value], [])
    actor = Actor(name, frozenset({role}))
    issued = access.issue_token(
        store, actor, roles=None, tenants=None, expires_in=DEMO_TOKEN_DAYS * 86400,
        name="demo token",
    )  # fmt: skip
    return issued.token


def seed_governance(store: Store, requester: str = "admin") -> GovernanceSeed:
    """``admin2`` (admin) and ``security`` (security-officer) with tokens, and a pending
    ``certification.grant`` requested by ``requester``."""
    second = _token(store, "admin2", Role.ADMIN)
    officer = _token(store, "security", Role.SECURITY_OFFICER)
    change = changes_svc.create_change(
        store, Actor(requester, frozenset({Role.ADMIN})), "certification.grant", PENDING_GRANT,
        reason="fra-h100-04 passed the HIPAA facility audit",
    )  # fmt: skip
    return GovernanceSeed(second, officer, int(change["id"]))
