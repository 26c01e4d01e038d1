"""Identity and access use cases: users, logins with TOTP and lockout, tokens, MFA.

Failed logins are recorded, not rolled back: ``login`` commits the failure (counter, lock,
events) and only then reports it, because evidence of an attack must survive the refusal.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, select

from proofplane.access import (
    Actor,
    Forbidden,
    Permission,
    Role,
    Unauthenticated,
    authorize,
    parse_roles,
    totp,
)
from proofplane.access import credentials as cred
from proofplane.access.roles import DELEGABLE_BY_TENANT_ADMIN, MFA_REQUIRED, SCOPED_ROLES
from proofplane.errors import Conflict, NotFound, ProofplaneError, ValidationFailed
from proofplane.model import Outcome
from proofplane.service.context import Store, Tx
from proofplane.service.pagination import Page, check_limit, decode_cursor, paginate
from proofplane.store.tables import EventRow, TenantRow, TokenRow, UserRow

LOCK_AFTER = 10  # consecutive failures (PCI DSS 4.0 §8.3.4: at most 10)
LOCK_FOR = timedelta(minutes=30)  # (…for at least 30 minutes)
ALERT_AFTER = 5  # consecutive failures on one account raise an alert
SPRAY_WINDOW = timedelta(seconds=60)
SPRAY_ALERT = 20  # failed logins across all accounts within the window
MAX_TOKEN_TTL = timedelta(days=90)
MIN_TOKEN_TTL = timedelta(minutes=1)
ENROLLMENT_TTL = timedelta(minutes=15)
ISSUER = "proofplane"
_USERNAME = re.compile(r"[a-z0-9][a-z0-9._@-]{0,62}")


class AccountLocked(ProofplaneError):
    status = 423
    code = "account_locked"


@dataclass(frozen=True, slots=True)
class User:
    username: str
    roles: tuple[str, ...]
    tenants: tuple[str, ...]
    source: str
    mfa_enabled: bool
    disabled: bool
    locked_until: datetime | None
    failed_logins: int
    created_at: datetime
    updated_at: datetime


@dataclass(frozen=True, slots=True)
class IssuedToken:
    """A credential as shown once to its owner; only ``id`` is ever shown again."""

    token: str
    id: str
    kind: str
    expires_at: datetime
    mfa_enrollment_required: bool = False


@dataclass(frozen=True, slots=True)
class TokenInfo:
    id: str
    kind: str
    name: str
    owner: str
    roles: tuple[str, ...]
    tenants: tuple[str, ...]
    created_at: datetime
    expires_at: datetime
    revoked_at: datetime | None
    last_used_at: datetime | None


def user_from_row(row: UserRow) -> User:
    return User(
        username=row.username,
        roles=tuple(sorted(row.roles)),
        tenants=tuple(sorted(row.tenants)),
        source=row.source,
        mfa_enabled=row.totp_enabled,
        disabled=row.disabled,
        locked_until=row.locked_until,
        failed_logins=row.failed_logins,
        created_at=row.created_at,
        updated_at=row.updated_at,
    )


def token_from_row(row: TokenRow) -> TokenInfo:
    owner = row.user.username if row.user is not None else f"node:{row.node_name}"
    return TokenInfo(
        id=row.id,
        kind=row.kind,
        name=row.name,
        owner=owner,
        roles=tuple(sorted(row.roles)),
        tenants=tuple(sorted(row.tenants)),
        created_at=row.created_at,
        expires_at=row.expires_at,
        revoked_at=row.revoked_at,
        last_used_at=row.last_used_at,
    )


def _safe_username(name: str) -> str:
    """Usernames go into events; what is not a valid username (perhaps a password typed in the
    wrong box) is not recorded."""
    return name if isinstance(name, str) and _USERNAME.fullmatch(name) else "<invalid>"


def _check_username(name: str) -> str:
    if not _USERNAME.fullmatch(name or ""):
        raise ValidationFailed(
            "username: lowercase letters, digits and . _ @ -, at most 63",
            code="invalid_name",
            details={"username": name},
        )
    return name


def _check_password(password: str) -> str:
    if not cred.MIN_PASSWORD <= len(password) <= cred.MAX_PASSWORD:
        raise ValidationFailed(
            f"password must be {cred.MIN_PASSWORD} to {cred.MAX_PASSWORD} characters",
            code="weak_password",
        )
    return password


def _user_row(tx_session: Any, username: str) -> UserRow:
    row = tx_session.scalar(select(UserRow).where(UserRow.username == username))
    if row is None:
        raise NotFound(f"user {username!r} not found", details={"username": username})
    return row


def _check_grant(tx: Tx, actor: Actor, roles: frozenset[Role], tenants: frozenset[str]) -> None:
    """May ``actor`` give these roles on these tenants? Tenant-admins hand out tenant roles on
    their own tenants only; nobody grants a tenant that does not exist."""
    if roles & SCOPED_ROLES and not tenants:
        raise ValidationFailed(
            "developer and tenant-admin need at least one tenant", code="tenant_required"
        )
    known = set(tx.session.scalars(select(TenantRow.name).where(TenantRow.name.in_(tenants))))
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


# --- users -------------------------------------------------------------------------------------


def create_user(
    store: Store,
    actor: Actor,
    username: str,
    password: str | None,
    roles: list[str],
    tenants: list[str],
) -> User:
    authorize(actor, Permission.USERS_WRITE)
    _check_username(username)
    if password is not None:
        _check_password(password)
    role_set, tenant_set = parse_roles(roles), frozenset(tenants)
    with store.write(actor) as tx:
        _check_grant(tx, actor, role_set, tenant_set)
        if tx.session.scalar(select(UserRow.id).where(UserRow.username == username)):
            raise Conflict(f"user {username!r} already exists", details={"username": username})
        row = UserRow(
            username=username,
            source="local",
            external_subject=None,
            password_hash=cred.hash_password(password) if password is not None else None,
            roles=sorted(r.value for r in role_set),
            tenants=sorted(tenant_set),
            totp_secret=None,
            totp_enabled=False,
            totp_last_step=None,
            recovery_codes=[],
            failed_logins=0,
            locked_until=None,
            disabled=False,
            created_at=tx.now,
            updated_at=tx.now,
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
    """Change a user's roles, tenants, password or disabled flag. Disabling a user or
    changing their grants ends their sessions; their API tokens shrink with their roles."""
    authorize(actor, Permission.USERS_WRITE)
    if password is not None:
        _check_password(password)
    with store.write(actor) as tx:
        row = _user_row(tx.session, username)
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
            tx.record("user.update", "user", username, details=changes)
            if set(changes) & {"roles", "tenants", "disabled", "password"}:
                _end_sessions(tx, row, "user changed")
        return user_from_row(row)


def unlock_user(store: Store, actor: Actor, username: str) -> User:
    authorize(actor, Permission.USERS_WRITE)
    with store.write(actor) as tx:
        row = _user_row(tx.session, username)
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
        row = _user_row(session, username)
        if not _can_see_user(actor, row, Permission.USERS_READ):
            raise NotFound(f"user {username!r} not found", details={"username": username})
        return user_from_row(row)


def list_users(
    store: Store, actor: Actor, *, limit: int = 100, cursor: str | None = None
) -> Page[User]:
    authorize(actor, Permission.USERS_READ)
    check_limit(limit)
    after = decode_cursor("users", cursor, str)
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


# --- authentication ----------------------------------------------------------------------------


def _issue(
    tx: Tx,
    *,
    kind: str,
    name: str,
    user: UserRow | None,
    roles: list[str],
    tenants: list[str],
    ttl: timedelta,
    node_name: str | None = None,
    token: str | None = None,
) -> IssuedToken:
    token = token or cred.new_token("ppa" if kind == "agent" else "ppt")
    row = TokenRow(
        id=f"tok_{secrets.token_hex(8)}",
        token_hash=cred.token_hash(token),
        kind=kind,
        name=name,
        user_id=user.id if user is not None else None,
        node_name=node_name,
        roles=sorted(roles),
        tenants=sorted(tenants),
        created_at=tx.now,
        expires_at=tx.now + ttl,
        revoked_at=None,
        last_used_at=None,
    )
    tx.session.add(row)
    tx.session.flush()
    return IssuedToken(token, row.id, kind, row.expires_at)


def _end_sessions(tx: Tx, user: UserRow, why: str) -> None:
    rows = tx.session.scalars(
        select(TokenRow).where(
            TokenRow.user_id == user.id,
            TokenRow.kind.in_(("session", "enrollment")),
            TokenRow.revoked_at.is_(None),
        )
    )
    for row in rows:
        row.revoked_at = tx.now
        tx.record(
            "token.revoke",
            "token",
            row.id,
            details={"owner": user.username, "kind": row.kind, "reason": why},
        )


def _fail(tx: Tx, row: UserRow | None, username: str, reason: str) -> None:
    """Record a failed login; count it against the account; lock and alert at the limits."""
    tx.record(
        "auth.login",
        "user",
        _safe_username(username),
        outcome=Outcome.FAILURE,
        details={"method": "password", "reason": reason},
    )
    if row is not None:
        row.failed_logins += 1
        row.updated_at = tx.now
        if row.failed_logins == ALERT_AFTER:
            tx.record(
                "alert.auth_failure_burst",
                "user",
                row.username,
                outcome=Outcome.FAILURE,
                details={"consecutive_failures": row.failed_logins, "severity": "medium"},
            )
        if row.failed_logins >= LOCK_AFTER:
            row.locked_until = tx.now + LOCK_FOR
            tx.record(
                "account.lock",
                "user",
                row.username,
                details={
                    "consecutive_failures": row.failed_logins,
                    "locked_until": row.locked_until.isoformat(),
                },
            )
    since = tx.now - SPRAY_WINDOW
    recent = (
        tx.session.scalar(
            select(func.count())
            .select_from(EventRow)
            .where(
                EventRow.action == "auth.login",
                EventRow.outcome == Outcome.FAILURE.value,
                EventRow.ts >= since,
            )
        )
        or 0
    )
    already = tx.session.scalar(
        select(func.count())
        .select_from(EventRow)
        .where(EventRow.action == "alert.auth_failure_spray", EventRow.ts >= since)
    )
    if recent + 1 >= SPRAY_ALERT and not already:
        tx.record(
            "alert.auth_failure_spray",
            "cluster",
            "authentication",
            outcome=Outcome.FAILURE,
            details={"failed_logins": recent + 1, "window_seconds": 60, "severity": "high"},
        )


def login(
    store: Store,
    username: str,
    password: str,
    code: str | None,
    *,
    session_ttl: timedelta,
    now: datetime | None = None,
) -> IssuedToken:
    """Password (+ TOTP or a recovery code) → a short-lived session token.

    An identity whose roles require MFA and who has not enrolled gets an enrollment-only
    session instead: it can enroll a TOTP authenticator and nothing else.
    """
    error: ProofplaneError | None = None
    issued: IssuedToken | None = None
    with store.write(Actor(_safe_username(username)), now) as tx:
        row = tx.session.scalar(select(UserRow).where(UserRow.username == username))
        if row is not None and row.locked_until is not None and row.locked_until <= tx.now:
            row.locked_until, row.failed_logins = None, 0  # the lock has run out
        if row is not None and row.locked_until is not None:
            cred.verify_password(None, password)  # same cost as any attempt
            tx.record(
                "auth.login",
                "user",
                row.username,
                outcome=Outcome.DENIED,
                details={"method": "password", "reason": "account_locked"},
            )
            error = AccountLocked(
                "account is locked after repeated failures; try later or ask an admin",
                details={"locked_until": row.locked_until.isoformat()},
            )
        elif row is None or row.disabled or not cred.verify_password(row.password_hash, password):
            reason = "unknown_user" if row is None else "disabled" if row.disabled else "password"
            if row is None:
                cred.verify_password(None, password)
            _fail(tx, row, username, reason)
            error = Unauthenticated("invalid username or password", code="invalid_credentials")
        else:
            mfa_needed = row.totp_enabled or bool(set(row.roles) & {r.value for r in MFA_REQUIRED})
            if row.totp_enabled and not code:
                error = Unauthenticated("this account needs a TOTP code", code="mfa_required")
            elif row.totp_enabled:
                assert row.totp_secret is not None and code is not None
                step = totp.verify(row.totp_secret, code, tx.now.timestamp(), row.totp_last_step)
                rhash = cred.recovery_hash(code)
                if step is not None:
                    row.totp_last_step = step
                elif rhash in row.recovery_codes:
                    row.recovery_codes = [h for h in row.recovery_codes if h != rhash]
                    tx.record(
                        "mfa.recovery_code.use",
                        "user",
                        row.username,
                        details={"remaining": len(row.recovery_codes)},
                    )
                else:
                    replay = row.totp_last_step is not None and any(
                        totp.code_at_step(row.totp_secret, s) == code.strip()
                        for s in range(row.totp_last_step - 1, row.totp_last_step + 1)
                    )
                    _fail(tx, row, username, "totp_replayed" if replay else "totp")
                    error = Unauthenticated("invalid TOTP code", code="invalid_totp")
            if error is None:
                row.failed_logins = 0
                row.updated_at = tx.now
                if mfa_needed and not row.totp_enabled:
                    issued = _issue(
                        tx,
                        kind="enrollment",
                        name="mfa enrollment",
                        user=row,
                        roles=[],
                        tenants=[],
                        ttl=ENROLLMENT_TTL,
                    )
                    issued = IssuedToken(
                        issued.token,
                        issued.id,
                        issued.kind,
                        issued.expires_at,
                        mfa_enrollment_required=True,
                    )
                else:
                    if row.password_hash and cred.needs_rehash(row.password_hash):
                        row.password_hash = cred.hash_password(password)
                    issued = _issue(
                        tx,
                        kind="session",
                        name="login session",
                        user=row,
                        roles=row.roles,
                        tenants=row.tenants,
                        ttl=session_ttl,
                    )
                tx.record(
                    "auth.login",
                    "user",
                    row.username,
                    details={
                        "method": "password",
                        "mfa": row.totp_enabled,
                        "token_id": issued.id,
                        "session": issued.kind,
                    },
                )
    if error is not None:
        raise error
    assert issued is not None
    return issued


def login_federated(
    store: Store,
    *,
    subject: str,
    username: str,
    roles: list[str],
    tenants: list[str],
    issuer: str,
    session_ttl: timedelta,
) -> IssuedToken:
    """An identity the OIDC provider vouched for: create or refresh the user from its groups
    (the provider is the source of truth for roles), then open a session."""
    _check_username(username)
    role_set = parse_roles(roles)
    with store.write(Actor(username)) as tx:
        known = set(tx.session.scalars(select(TenantRow.name).where(TenantRow.name.in_(tenants))))
        tenants = sorted(t for t in tenants if t in known)
        if role_set & SCOPED_ROLES and not tenants:
            role_set = role_set - SCOPED_ROLES
        ext = f"{issuer}#{subject}"
        row = tx.session.scalar(select(UserRow).where(UserRow.external_subject == ext))
        if row is None:
            if tx.session.scalar(select(UserRow.id).where(UserRow.username == username)):
                raise Conflict(
                    f"user {username!r} exists locally; federated login cannot take it over",
                    details={"username": username},
                )
            row = UserRow(
                username=username,
                source="oidc",
                external_subject=ext,
                password_hash=None,
                roles=[],
                tenants=[],
                totp_secret=None,
                totp_enabled=False,
                totp_last_step=None,
                recovery_codes=[],
                failed_logins=0,
                locked_until=None,
                disabled=False,
                created_at=tx.now,
                updated_at=tx.now,
            )
            tx.session.add(row)
            tx.session.flush()
            tx.record("user.create", "user", username, details={"source": "oidc", "issuer": issuer})
        if row.disabled:
            tx.record(
                "auth.login",
                "user",
                username,
                outcome=Outcome.FAILURE,
                details={"method": "oidc", "reason": "disabled"},
            )
            error: ProofplaneError | None = Unauthenticated(
                "this account is disabled", code="invalid_credentials"
            )
        else:
            error = None
            new_roles = sorted(r.value for r in role_set)
            if new_roles != row.roles or tenants != row.tenants:
                tx.record(
                    "user.update",
                    "user",
                    username,
                    details={
                        "source": "oidc",
                        "roles": {"before": row.roles, "after": new_roles},
                        "tenants": {"before": row.tenants, "after": tenants},
                    },
                )
                row.roles, row.tenants, row.updated_at = new_roles, tenants, tx.now
            issued = _issue(
                tx,
                kind="session",
                name="oidc session",
                user=row,
                roles=row.roles,
                tenants=row.tenants,
                ttl=session_ttl,
            )
            tx.record(
                "auth.login",
                "user",
                username,
                details={"method": "oidc", "issuer": issuer, "token_id": issued.id},
            )
    if error is not None:
        raise error
    return issued


def authenticate(store: Store, token: str, now: datetime) -> Actor:
    """The actor a bearer token stands for, or Unauthenticated."""
    with store.read() as session:
        row = session.scalar(select(TokenRow).where(TokenRow.token_hash == cred.token_hash(token)))
        if row is None or row.revoked_at is not None:
            raise Unauthenticated("invalid or revoked token", code="invalid_token")
        if row.expires_at <= now:
            raise Unauthenticated("token expired", code="token_expired")
        if row.kind == "agent":
            return Actor(f"node:{row.node_name}", token_id=row.id)
        user = row.user
        if user is None or user.disabled:
            raise Unauthenticated("invalid or revoked token", code="invalid_token")
        # A token never carries more than its owner holds now.
        roles = parse_roles(set(row.roles) & set(user.roles))
        tenants = frozenset(set(row.tenants) & set(user.tenants))
        stale = row.last_used_at is None or now - row.last_used_at > timedelta(minutes=5)
        token_id = row.id
        actor = Actor(
            user.username,
            roles,
            tenants,
            token_id=token_id,
            enrollment_only=row.kind == "enrollment",
        )
    if stale:
        _touch(store, token_id, now)
    return actor


def _touch(store: Store, token_id: str, now: datetime) -> None:
    """Note when a token was last used (at most every five minutes: not an audit trail)."""
    with store.write(Actor("system"), now) as tx:
        row = tx.session.get(TokenRow, token_id)
        if row is not None:
            row.last_used_at = now


# --- MFA ---------------------------------------------------------------------------------------


def _self(tx: Tx, actor: Actor) -> UserRow:
    row = tx.session.scalar(select(UserRow).where(UserRow.username == actor.name))
    if row is None or actor.token_id is None:
        raise Forbidden("only a signed-in user can manage their own MFA")
    return row


def mfa_begin(store: Store, actor: Actor) -> tuple[str, str]:
    """Start (or restart) TOTP enrollment: a new secret and its otpauth:// URI. Not active
    until confirmed with a code from the authenticator."""
    with store.write(actor) as tx:
        row = _self(tx, actor)
        if row.source == "oidc":
            raise Forbidden("federated users authenticate (and do MFA) at their provider")
        if row.totp_enabled:
            raise Conflict("MFA is already enabled for this account", code="mfa_already_enabled")
        row.totp_secret = totp.new_secret()
        row.totp_last_step = None
        row.updated_at = tx.now
        tx.record("mfa.enroll", "user", row.username, details={"stage": "started"})
        return row.totp_secret, totp.provisioning_uri(row.totp_secret, row.username, ISSUER)


def mfa_confirm(store: Store, actor: Actor, code: str) -> list[str]:
    """Activate TOTP with a first valid code; returns recovery codes (shown once). Ends the
    enrollment session: the user logs in again with the second factor."""
    with store.write(actor) as tx:
        row = _self(tx, actor)
        if row.totp_enabled:
            raise Conflict("MFA is already enabled for this account", code="mfa_already_enabled")
        if row.totp_secret is None:
            raise Conflict("start enrollment first", code="mfa_not_started")
        step = totp.verify(row.totp_secret, code, tx.now.timestamp(), None)
        if step is None:
            raise ValidationFailed("invalid TOTP code", code="invalid_totp")
        codes = cred.new_recovery_codes()
        row.totp_enabled = True
        row.totp_last_step = step
        row.recovery_codes = [cred.recovery_hash(c) for c in codes]
        row.updated_at = tx.now
        tx.record(
            "mfa.enroll",
            "user",
            row.username,
            details={"stage": "confirmed", "recovery_codes": len(codes)},
        )
        _end_sessions(tx, row, "mfa enrolled")
        return codes


# --- tokens ------------------------------------------------------------------------------------


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
        issued = _issue(
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
        issued = _issue(
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


def logout(store: Store, actor: Actor) -> None:
    if actor.token_id is None:
        return
    with store.write(actor) as tx:
        row = tx.session.get(TokenRow, actor.token_id)
        if row is not None and row.kind in ("session", "enrollment") and row.revoked_at is None:
            row.revoked_at = tx.now
            tx.record("auth.logout", "user", actor.name, details={"token_id": row.id})


# --- bootstrap and node agents -----------------------------------------------------------------


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
        row = UserRow(
            username="admin",
            source="bootstrap",
            external_subject=None,
            password_hash=None,
            roles=[Role.ADMIN.value],
            tenants=[],
            totp_secret=None,
            totp_enabled=False,
            totp_last_step=None,
            recovery_codes=[],
            failed_logins=0,
            locked_until=None,
            disabled=False,
            created_at=tx.now,
            updated_at=tx.now,
        )
        tx.session.add(row)
        tx.session.flush()
        tx.record(
            "user.create", "user", "admin", details={"roles": ["admin"], "source": "bootstrap"}
        )
        issued = _issue(
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
        issued = _issue(
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
