"""API tokens: a user's own, scoped to a subset of what they hold, always expiring.

A token minted with an API token (not a session) expires no later than that token, and is
revoked with it (its ``parent_id`` names it); a session is the user in person and may mint up
to ``MAX_TOKEN_TTL``. Only a token's owner may rotate it (a rotated token acts as its owner);
an admin may revoke anyone's.
"""

from __future__ import annotations

import math
from datetime import datetime, timedelta

from sqlalchemy import select

from proofplane.access import Actor, Forbidden, Permission, parse_roles
from proofplane.errors import Conflict, NotFound, ValidationFailed
from proofplane.service.access.common import (
    MAX_TOKEN_TTL,
    MIN_TOKEN_TTL,
    IssuedToken,
    TokenInfo,
    issue_credential,
    revoke_minted,
    token_from_row,
)
from proofplane.service.context import Store, Tx
from proofplane.store.tables import TokenRow, UserRow


def _owner_row(tx: Tx, actor: Actor) -> UserRow:
    row = tx.session.scalar(select(UserRow).where(UserRow.username == actor.name))
    if row is None or actor.enrollment_only:
        raise Forbidden("only a user can hold API tokens")
    return row


def _minting_token(tx: Tx, actor: Actor) -> TokenRow | None:
    """The API token the caller acts with, if it is one (a session, or no stored credential:
    None)."""
    if actor.token_id is None:
        return None
    row = tx.session.get(TokenRow, actor.token_id)
    return row if row is not None and row.kind == "api" else None


def _check_within(tx: Tx, expires_at: datetime, bounds: list[TokenRow], asked: int) -> None:
    """A token minted with API tokens expires no later than any of them."""
    for bound in bounds:
        if expires_at > bound.expires_at:
            left = math.floor((bound.expires_at - tx.now).total_seconds())
            raise ValidationFailed(
                "a token minted with an API token cannot outlive it: "
                f"expires_in may be at most {max(left, 0)} seconds"
                + ("" if left >= MIN_TOKEN_TTL.total_seconds() else " (too little to mint one)"),
                code="expiry_beyond_parent",
                details={
                    "expires_in": asked,
                    "max_expires_in": max(left, 0),
                    "parent": bound.id,
                    "parent_expires_at": bound.expires_at.isoformat(),
                },
            )


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
    a mandatory expiry of at most 90 days, and no later than the caller's own token's when the
    caller acts with an API token."""
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
        minted_with = tx.session.get(TokenRow, actor.token_id) if actor.token_id else None
        if minted_with is not None and minted_with.kind == "api":
            _check_within(tx, tx.now + ttl, [minted_with], expires_in)
        # a session is recorded too (the trail), but bounds nothing
        parent_id = minted_with.id if minted_with is not None else None
        issued = issue_credential(
            tx,
            kind="api",
            name=name,
            user=owner,
            roles=[r.value for r in want_roles],
            tenants=sorted(want_tenants),
            ttl=ttl,
            parent_id=parent_id,
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
                "parent": parent_id,
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
    """Revoke a token (one's own; anyone's with ``tokens:revoke-all``), and every API token
    minted with it."""
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
        revoke_minted(tx, row, "parent revoked")
        return token_from_row(row)


def rotate_token(
    store: Store, actor: Actor, token_id: str, expires_in: int | None = None
) -> IssuedToken:
    """Replace one's own API token with a new secret of the same scope; the old one stops
    working, and so do the tokens it minted.

    Only the owner rotates: the new secret acts as its owner, so an admin rotating another
    user's token would receive a credential that impersonates them (an admin revokes instead:
    403; whoever may not revoke it either does not see it: 404). The new token takes the old
    one's place under the token that minted it, so it expires no later than that one, nor
    (when the caller acts with an API token) later than the caller's token; without
    ``expires_in`` it lives as long as the old one did, within those bounds."""
    with store.write(actor) as tx:
        old = _token_for(tx, actor, token_id, Permission.TOKENS_REVOKE_ALL)
        if old.user is None or old.user.username != actor.name:
            raise Forbidden(
                "only a token's owner may rotate it (the new token would act as its owner); "
                "revoke it instead",
                details={"token": token_id},
            )
        if old.kind != "api" or old.revoked_at is not None or old.expires_at <= tx.now:
            raise Conflict(
                "only a live API token can be rotated",
                code="invalid_state",
                details={"token": token_id},
            )
        bounds = [
            b
            for b in (
                tx.session.get(TokenRow, old.parent_id) if old.parent_id else None,
                _minting_token(tx, actor),
            )
            if b is not None and b.kind == "api"
        ]
        if expires_in:
            ttl = timedelta(seconds=expires_in)
            if not MIN_TOKEN_TTL <= ttl <= MAX_TOKEN_TTL:
                raise ValidationFailed(
                    "expires_in must be 60 seconds to 90 days", code="invalid_expiry"
                )
        else:  # the old one's lifetime, within the bounds
            ttl = min([old.expires_at - old.created_at, *(b.expires_at - tx.now for b in bounds)])
            ttl = max(MIN_TOKEN_TTL, timedelta(seconds=math.floor(ttl.total_seconds())))
        _check_within(tx, tx.now + ttl, bounds, int(ttl.total_seconds()))
        old.revoked_at = tx.now
        revoke_minted(tx, old, "parent rotated")
        issued = issue_credential(
            tx,
            kind="api",
            name=old.name,
            user=old.user,
            roles=old.roles,
            tenants=old.tenants,
            ttl=ttl,
            parent_id=old.parent_id,
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
