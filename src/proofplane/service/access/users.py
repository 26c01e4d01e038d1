"""Users: create, change, unlock, read and list them. A tenant-admin manages only the users
of their own tenants, and grants only the roles a tenant-admin may grant."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select

from proofplane.access import Actor, Forbidden, Permission, Role, authorize, parse_roles
from proofplane.access import credentials as cred
from proofplane.access.roles import DELEGABLE_BY_TENANT_ADMIN, SCOPED_ROLES
from proofplane.errors import Conflict, NotFound, ValidationFailed
from proofplane.service.access.common import (
    User,
    check_password,
    check_username,
    end_sessions,
    new_user_row,
    revoke_credentials,
    user_from_row,
    user_row,
)
from proofplane.service.context import Store, Tx
from proofplane.service.pagination import (
    Page,
    check_limit,
    decode_text_cursor,
    paginate,
)
from proofplane.store.tables import TenantRow, UserRow


def _check_grant(tx: Tx, actor: Actor, roles: frozenset[Role], tenants: frozenset[str]) -> None:
    """May ``actor`` give these roles on these tenants? Tenant-admins hand out tenant roles on
    their own tenants only; nobody grants a tenant that does not exist."""
    if roles & SCOPED_ROLES and not tenants:
        raise ValidationFailed(
            "developer and tenant-admin need at least one tenant", code="tenant_required"
        )
    known = set(
        tx.session.scalars(
            select(TenantRow.name).where(
                TenantRow.name.in_(tenants), TenantRow.deleted_at.is_(None)
            )
        )
    )
    visible = actor.visible_tenants(Permission.USERS_WRITE)
    for t in sorted(tenants):
        if t not in known or (visible is not None and t not in visible):
            raise NotFound(f"tenant {t!r} not found", details={"tenant": t})
    if visible is not None and not roles <= DELEGABLE_BY_TENANT_ADMIN:
        raise Forbidden(
            "a tenant-admin may grant only developer and tenant-admin",
            details={"roles": sorted(r.value for r in roles - DELEGABLE_BY_TENANT_ADMIN)},
        )


def _can_see_user(actor: Actor, row: UserRow, permission: Permission) -> bool:
    visible = actor.visible_tenants(permission)
    if visible is None:
        return True
    # A tenant-admin sees (and manages) the users whose every tenant is one of theirs and
    # whose every role is one a tenant-admin may grant: never an operator or an auditor.
    return (
        bool(row.tenants)
        and set(row.tenants) <= visible
        and {r for r in row.roles} <= {r.value for r in DELEGABLE_BY_TENANT_ADMIN}
    )


def create_user(
    store: Store,
    actor: Actor,
    username: str,
    password: str | None,
    roles: list[str],
    tenants: list[str],
) -> User:
    authorize(actor, Permission.USERS_WRITE)
    check_username(username)
    if password is not None:
        check_password(password)
    role_set, tenant_set = parse_roles(roles), frozenset(tenants)
    with store.write(actor) as tx:
        _check_grant(tx, actor, role_set, tenant_set)
        if tx.session.scalar(select(UserRow.id).where(UserRow.username == username)):
            raise Conflict(f"user {username!r} already exists", details={"username": username})
        row = new_user_row(
            username,
            source="local",
            now=tx.now,
            password_hash=cred.hash_password(password) if password is not None else None,
            roles=sorted(r.value for r in role_set),
            tenants=sorted(tenant_set),
        )
        tx.session.add(row)
        tx.session.flush()
        tx.record(
            "user.create",
            "user",
            username,
            details={"roles": row.roles, "tenants": row.tenants, "source": "local"},
        )
        return user_from_row(row)


def update_user(
    store: Store,
    actor: Actor,
    username: str,
    *,
    roles: list[str] | None = None,
    tenants: list[str] | None = None,
    disabled: bool | None = None,
    password: str | None = None,
) -> User:
    """Change a user's roles, tenants, password or disabled flag.

    Disabling the user, changing their password or taking a role or tenant away revokes every
    credential they hold (API tokens and sessions), for good: enabling them again or giving
    the grant back revives none. A grant only added ends their sessions (the next login
    carries it); their API tokens keep the scope they were issued with."""
    authorize(actor, Permission.USERS_WRITE)
    if password is not None:
        check_password(password)
    with store.write(actor) as tx:
        row = user_row(tx.session, username)
        if not _can_see_user(actor, row, Permission.USERS_WRITE):
            raise NotFound(f"user {username!r} not found", details={"username": username})
        new_roles = parse_roles(roles) if roles is not None else parse_roles(row.roles)
        new_tenants = frozenset(tenants) if tenants is not None else frozenset(row.tenants)
        _check_grant(tx, actor, new_roles, new_tenants)
        changes: dict[str, Any] = {}
        if sorted(r.value for r in new_roles) != row.roles:
            changes["roles"] = {"before": row.roles, "after": sorted(r.value for r in new_roles)}
            row.roles = changes["roles"]["after"]
        if sorted(new_tenants) != row.tenants:
            changes["tenants"] = {"before": row.tenants, "after": sorted(new_tenants)}
            row.tenants = sorted(new_tenants)
        if disabled is not None and disabled != row.disabled:
            changes["disabled"] = {"before": row.disabled, "after": disabled}
            row.disabled = disabled
        if password is not None:
            row.password_hash = cred.hash_password(password)
            changes["password"] = "changed"  # never the password itself
        if changes:
            row.updated_at = tx.now
            why = _revocation_reason(changes)
            if why is not None:
                changes["credentials_revoked"] = revoke_credentials(tx, row, why)
            elif set(changes) & {"roles", "tenants"}:
                end_sessions(tx, row, "user changed")
            tx.record("user.update", "user", username, details=changes)
        return user_from_row(row)


def _revocation_reason(changes: dict[str, Any]) -> str | None:
    """Why a change revokes all of the user's credentials, or None when it does not."""
    if "disabled" in changes and changes["disabled"]["after"]:
        return "user disabled"
    if "password" in changes:
        return "password changed"
    for grant in ("roles", "tenants"):
        if grant in changes and set(changes[grant]["before"]) - set(changes[grant]["after"]):
            return f"{grant} removed"
    return None


def unlock_user(store: Store, actor: Actor, username: str) -> User:
    authorize(actor, Permission.USERS_WRITE)
    with store.write(actor) as tx:
        row = user_row(tx.session, username)
        if not _can_see_user(actor, row, Permission.USERS_WRITE):
            raise NotFound(f"user {username!r} not found", details={"username": username})
        if row.locked_until is None and row.failed_logins == 0:
            return user_from_row(row)
        row.locked_until = None
        row.failed_logins = 0
        row.updated_at = tx.now
        tx.record("account.unlock", "user", username, details={"by": actor.name})
        return user_from_row(row)


def get_user(store: Store, actor: Actor, username: str) -> User:
    authorize(actor, Permission.USERS_READ)
    with store.read() as session:
        row = user_row(session, username)
        if not _can_see_user(actor, row, Permission.USERS_READ):
            raise NotFound(f"user {username!r} not found", details={"username": username})
        return user_from_row(row)


def list_users(
    store: Store, actor: Actor, *, limit: int = 100, cursor: str | None = None
) -> Page[User]:
    authorize(actor, Permission.USERS_READ)
    check_limit(limit)
    after = decode_text_cursor("users", cursor)
    query = select(UserRow).order_by(UserRow.username)
    if after is not None:
        query = query.where(UserRow.username > after)
    items: list[User] = []
    last: str | None = None
    with store.read() as session:
        for row in session.scalars(query):
            if not _can_see_user(actor, row, Permission.USERS_READ):
                continue
            if len(items) == limit:
                return paginate("users", [*items, user_from_row(row)], limit, last)
            items.append(user_from_row(row))
            last = row.username
    return Page(items, None)
