"""API tokens: a user's own, scoped to a subset of what they hold, always expiring."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import select

from proofplane.access import Actor, Forbidden, Permission, parse_roles
from proofplane.errors import Conflict, NotFound, ValidationFailed
from proofplane.service.access.common import (
    MAX_TOKEN_TTL,
    MIN_TOKEN_TTL,
    IssuedToken,
    TokenInfo,
    issue_credential,
    token_from_row,
)
from proofplane.service.context import Store, Tx
from proofplane.store.tables import TokenRow, UserRow


def _owner_row(tx: Tx, actor: Actor) -> UserRow:
    row = tx.session.scalar(select(UserRow).where(UserRow.username == actor.name))
    if row is None or actor.enrollment_only:
        raise Forbidden("only a user can hold API tokens")
    return row


def issue_token(
    store: Store,
    actor: Actor,
    *,
    roles: list[str] | None,
    tenants: list[str] | None,
    expires_in: int,
    name: str = "",
) -> IssuedToken:
    """An API token for the caller, scoped to a subset of the caller's roles and tenants, with
    a mandatory expiry of at most 90 days."""
    ttl = timedelta(seconds=expires_in)
    if not MIN_TOKEN_TTL <= ttl <= MAX_TOKEN_TTL:
        raise ValidationFailed(
            f"expires_in must be {int(MIN_TOKEN_TTL.total_seconds())} to "
            f"{int(MAX_TOKEN_TTL.total_seconds())} seconds (90 days)",
            code="invalid_expiry",
            details={"expires_in": expires_in},
        )
    want_roles = parse_roles(roles) if roles is not None else actor.roles
    want_tenants = frozenset(tenants) if tenants is not None else actor.tenants
    if not want_roles <= actor.roles:
        raise Forbidden(
            "a token cannot carry roles its owner does not hold",
            details={"roles": sorted(r.value for r in want_roles - actor.roles)},
        )
    if not want_tenants <= actor.tenants:
        raise Forbidden(
            "a token cannot reach tenants its owner cannot",
            details={"tenants": sorted(want_tenants - actor.tenants)},
        )
    if len(name) > 255:
        raise ValidationFailed("name is at most 255 characters", code="validation_failed")
    with store.write(actor) as tx:
        owner = _owner_row(tx, actor)
        issued = issue_credential(
            tx,
            kind="api",
            name=name,
            user=owner,
            roles=[r.value for r in want_roles],
            tenants=sorted(want_tenants),
            ttl=ttl,
        )
        tx.record(
            "token.issue",
            "token",
            issued.id,
            details={
                "owner": owner.username,
                "name": name,
                "roles": sorted(r.value for r in want_roles),
                "tenants": sorted(want_tenants),
                "expires_at": issued.expires_at.isoformat(),
            },
        )
        return issued


def _token_for(tx: Tx, actor: Actor, token_id: str, permission: Permission) -> TokenRow:
    row = tx.session.get(TokenRow, token_id)
    mine = row is not None and row.user is not None and row.user.username == actor.name
    if row is None or not (mine or actor.holds_globally(permission)):
        raise NotFound(f"token {token_id!r} not found", details={"token": token_id})
    return row


def revoke_token(store: Store, actor: Actor, token_id: str) -> TokenInfo:
    with store.write(actor) as tx:
        row = _token_for(tx, actor, token_id, Permission.TOKENS_REVOKE_ALL)
        if row.revoked_at is None:
            row.revoked_at = tx.now
            tx.record(
                "token.revoke",
                "token",
                row.id,
                details={"owner": token_from_row(row).owner, "kind": row.kind},
            )
        return token_from_row(row)


def rotate_token(
    store: Store, actor: Actor, token_id: str, expires_in: int | None = None
) -> IssuedToken:
    """Replace an API token with a new secret of the same scope; the old one stops working."""
    with store.write(actor) as tx:
        old = _token_for(tx, actor, token_id, Permission.TOKENS_REVOKE_ALL)
        if old.kind != "api" or old.revoked_at is not None or old.expires_at <= tx.now:
            raise Conflict(
                "only a live API token can be rotated",
                code="invalid_state",
                details={"token": token_id},
            )
        ttl = timedelta(seconds=expires_in) if expires_in else old.expires_at - old.created_at
        if not MIN_TOKEN_TTL <= ttl <= MAX_TOKEN_TTL:
            raise ValidationFailed(
                "expires_in must be 60 seconds to 90 days", code="invalid_expiry"
            )
        old.revoked_at = tx.now
        issued = issue_credential(
            tx,
            kind="api",
            name=old.name,
            user=old.user,
            roles=old.roles,
            tenants=old.tenants,
            ttl=ttl,
        )
        tx.record(
            "token.rotate",
            "token",
            old.id,
            details={"replaced_by": issued.id, "expires_at": issued.expires_at.isoformat()},
        )
        return issued


def list_tokens(
    store: Store, actor: Actor, *, owner: str | None = None, include_inactive: bool = False
) -> list[TokenInfo]:
    """The caller's tokens; admins and auditors may list anyone's (``owner``) or all."""
    see_all = actor.holds_globally(Permission.TOKENS_READ_ALL)
    query = select(TokenRow).outerjoin(TokenRow.user).order_by(TokenRow.created_at, TokenRow.id)
    if owner is None and see_all:
        pass
    elif owner is None or owner == actor.name:
        query = query.where(UserRow.username == actor.name)
    elif see_all:
        query = query.where(UserRow.username == owner)
    else:
        raise NotFound(f"user {owner!r} not found", details={"username": owner})
    if not include_inactive:
        query = query.where(TokenRow.revoked_at.is_(None))
    with store.read() as session:
        return [token_from_row(r) for r in session.scalars(query)]
