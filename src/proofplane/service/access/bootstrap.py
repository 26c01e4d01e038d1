"""The first administrator, and the credentials of node agents (not users: no role, no
tenant, only what an agent does for its own node)."""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import func, select

from proofplane.access import Actor, Permission, Role, authorize
from proofplane.errors import ValidationFailed
from proofplane.service.access.common import (
    MAX_TOKEN_TTL,
    IssuedToken,
    issue_credential,
    new_user_row,
)
from proofplane.service.context import Store
from proofplane.store.tables import UserRow


def bootstrap_admin(store: Store, token: str, now: datetime | None = None) -> bool:
    """``PROOFPLANE_ADMIN_TOKEN``: on a control plane with no users yet, create the ``admin``
    user and an admin API token with exactly this value (90 days), for automation and demos
    (like Vault's dev root token). Returns whether it did anything."""
    if len(token) < 16:
        raise ValidationFailed(
            "PROOFPLANE_ADMIN_TOKEN must be at least 16 characters", code="weak_token"
        )
    with store.write(Actor("system"), now) as tx:
        if tx.session.scalar(select(func.count()).select_from(UserRow)):
            return False
        row = new_user_row("admin", source="bootstrap", now=tx.now, roles=[Role.ADMIN.value])
        tx.session.add(row)
        tx.session.flush()
        tx.record(
            "user.create", "user", "admin", details={"roles": ["admin"], "source": "bootstrap"}
        )
        issued = issue_credential(
            tx,
            kind="api",
            name="bootstrap admin token",
            user=row,
            roles=[Role.ADMIN.value],
            tenants=[],
            ttl=MAX_TOKEN_TTL,
            token=token,
        )
        tx.record(
            "token.issue",
            "token",
            issued.id,
            details={
                "owner": "admin",
                "name": "bootstrap admin token",
                "roles": ["admin"],
                "source": "PROOFPLANE_ADMIN_TOKEN",
                "expires_at": issued.expires_at.isoformat(),
            },
        )
        return True


def issue_agent_credential(
    store: Store, actor: Actor, node: str, ttl_days: int = 90
) -> IssuedToken:
    """A credential for a node's agent, separate from user tokens: it carries no role and will
    grant only what agents do (report evidence), never user or tenant access."""
    from proofplane.store.repo import node_row

    authorize(actor, Permission.AGENT_CREDENTIALS)
    if not 1 <= ttl_days <= 90:
        raise ValidationFailed("ttl_days must be 1 to 90", code="invalid_expiry")
    with store.write(actor) as tx:
        node_row(tx.session, node)
        issued = issue_credential(
            tx,
            kind="agent",
            name=f"agent {node}",
            user=None,
            roles=[],
            tenants=[],
            ttl=timedelta(days=ttl_days),
            node_name=node,
        )
        tx.record(
            "token.issue",
            "token",
            issued.id,
            details={
                "owner": f"node:{node}",
                "kind": "agent",
                "expires_at": issued.expires_at.isoformat(),
            },
        )
        return issued
