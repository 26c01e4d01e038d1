"""What the access use cases share: the values they return, usernames and passwords, and the
one place a credential row is written."""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select

from proofplane.access import credentials as cred
from proofplane.errors import NotFound, ProofplaneError, ValidationFailed
from proofplane.service.context import Tx
from proofplane.store.tables import TokenRow, UserRow

MAX_TOKEN_TTL = timedelta(days=90)
MIN_TOKEN_TTL = timedelta(minutes=1)
USERNAME_PATTERN = r"^[a-z0-9][a-z0-9._@-]{0,62}$"
_USERNAME = re.compile(USERNAME_PATTERN)


class AccountLocked(ProofplaneError):
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
    parent_id: str | None = None


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
        parent_id=row.parent_id,
    )


def safe_username(name: str) -> str:
    """Usernames go into events; what is not a valid username (perhaps a password typed in the
    wrong box) is not recorded."""
    return name if isinstance(name, str) and _USERNAME.fullmatch(name) else "<invalid>"


def check_username(name: str) -> str:
    if not _USERNAME.fullmatch(name or ""):
        raise ValidationFailed(
            "username: lowercase letters, digits and . _ @ -, at most 63",
            code="invalid_name",
            details={"username": name},
        )
    return name


def check_password(password: str) -> str:
    if not cred.MIN_PASSWORD <= len(password) <= cred.MAX_PASSWORD:
        raise ValidationFailed(
            f"password must be {cred.MIN_PASSWORD} to {cred.MAX_PASSWORD} characters",
            code="weak_password",
        )
    return password


def user_row(tx_session: Any, username: str) -> UserRow:
    """The user's row, or NotFound."""
    row = tx_session.scalar(select(UserRow).where(UserRow.username == username))
    if row is None:
        raise NotFound(f"user {username!r} not found", details={"username": username})
    return row


def new_user_row(
    username: str,
    *,
    source: str,
    now: datetime,
    external_subject: str | None = None,
    password_hash: str | None = None,
    roles: list[str] | None = None,
    tenants: list[str] | None = None,
) -> UserRow:
    """A new user's row: no MFA yet, no failures, not locked, not disabled."""
    return UserRow(
        username=username,
        source=source,
        external_subject=external_subject,
        password_hash=password_hash,
        roles=roles if roles is not None else [],
        tenants=tenants if tenants is not None else [],
        totp_secret=None,
        totp_enabled=False,
        totp_last_step=None,
        recovery_codes=[],
        failed_logins=0,
        locked_until=None,
        disabled=False,
        created_at=now,
        updated_at=now,
    )


def issue_credential(
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
    parent_id: str | None = None,
) -> IssuedToken:
    """Write a credential row (session, enrollment, API or agent token); the secret itself is
    returned once and only its hash is stored. ``parent_id``: the credential it was minted
    with. The caller records the event."""
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
        parent_id=parent_id,
    )
    tx.session.add(row)
    tx.session.flush()
    return IssuedToken(token, row.id, kind, row.expires_at)


def end_sessions(tx: Tx, user: UserRow, why: str) -> None:
    """Revoke the user's browser and enrollment sessions (not their API tokens)."""
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


def revoke_credentials(tx: Tx, user: UserRow, why: str) -> int:
    """Revoke every live credential of the user (API tokens, sessions, enrollment sessions),
    each with its event; returns how many. For good: a revoked row never works again, so
    re-enabling the user or granting the role back brings none of them back."""
    rows = tx.session.scalars(
        select(TokenRow)
        .where(
            TokenRow.user_id == user.id,
            TokenRow.revoked_at.is_(None),
            TokenRow.expires_at > tx.now,
        )
        .order_by(TokenRow.created_at, TokenRow.id)
    )
    n = 0
    for row in rows:
        row.revoked_at = tx.now
        n += 1
        tx.record(
            "token.revoke",
            "token",
            row.id,
            details={"owner": user.username, "kind": row.kind, "reason": why},
        )
    return n


def revoke_minted(tx: Tx, parent: TokenRow, why: str) -> None:
    """Revoke the live API tokens minted with the API token ``parent``, and theirs in turn (as
    Vault revokes a token's children): what a token minted does not outlive it. Tokens minted
    in a session are the user's own and outlive the session."""
    if parent.kind != "api":
        return
    frontier = [parent.id]
    while frontier:
        children = list(
            tx.session.scalars(
                select(TokenRow)
                .where(TokenRow.parent_id.in_(frontier), TokenRow.kind == "api")
                .order_by(TokenRow.created_at, TokenRow.id)
            )
        )
        frontier = [c.id for c in children]
        for row in children:
            if row.revoked_at is None:
                row.revoked_at = tx.now
                tx.record(
                    "token.revoke",
                    "token",
                    row.id,
                    details={
                        "owner": token_from_row(row).owner,
                        "kind": row.kind,
                        "reason": why,
                        "parent": row.parent_id,
                    },
                )
