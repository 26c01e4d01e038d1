"""Signing in and being signed in: password logins with TOTP and lockout, federated (OIDC)
logins, bearer-token authentication, logout.

Failed logins are recorded, not rolled back: ``login`` commits the failure (counter, lock,
events) and only then reports it, because evidence of an attack must survive the refusal.
An unknown username is answered exactly as an account is, lock included, and a source address
that keeps failing is made to wait (``lockout``).
"""

from __future__ import annotations

import ipaddress
import time
from datetime import datetime, timedelta

from sqlalchemy import func, select

from proofplane.access import Actor, Unauthenticated, parse_roles, totp
from proofplane.access import credentials as cred
from proofplane.access.roles import MFA_REQUIRED, SCOPED_ROLES
from proofplane.errors import Conflict, ProofplaneError
from proofplane.model import Outcome
from proofplane.service.access import last_used
from proofplane.service.access.common import (
    AccountLocked,
    IssuedToken,
    check_username,
    issue_credential,
    new_user_row,
    revoke_credentials,
    safe_username,
)
from proofplane.service.access.lockout import (
    LOCK_AFTER,
    LOCK_FOR,
    check_source,
    count_source_failure,
    count_unknown_name_failure,
    source_key,
    unknown_name_locked_until,
)
from proofplane.service.access.mfa import totp_seed
from proofplane.service.access.token_cache import Entry, cache_for
from proofplane.service.context import Store, Tx
from proofplane.service.runbooks import with_runbook
from proofplane.store.tables import EventRow, TenantRow, TokenRow, UserRow

ALERT_AFTER = 5  # consecutive failures on one account raise an alert
SPRAY_WINDOW = timedelta(seconds=60)
SPRAY_ALERT = 20  # failed logins across all accounts within the window
ENROLLMENT_TTL = timedelta(minutes=15)


def client_details(source: str | None) -> dict[str, str]:
    """The client's address as an auth event records it (``source_ip``: OCSF
    ``src_endpoint``, CEF ``src``/``c6a2``); nothing when the caller has none or what it has
    is no IP address (``unknown``, a test client's name): a SIEM reads ``source_ip`` as one."""
    if not source:
        return {}
    try:
        return {"source_ip": str(ipaddress.ip_address(source.strip()))}
    except ValueError:
        return {}


def _fail(tx: Tx, row: UserRow | None, username: str, reason: str, source: dict[str, str]) -> None:
    """Record a failed login; count it against the account; lock and alert at the limits."""
    tx.record(
        "auth.login",
        "user",
        safe_username(username),
        outcome=Outcome.FAILURE,
        details={"method": "password", "reason": reason, **source},
    )
    if row is None:
        count_unknown_name_failure(tx, username)
    else:
        row.failed_logins += 1
        row.updated_at = tx.now
        if row.failed_logins == ALERT_AFTER:
            tx.record(
                "alert.auth_failure_burst",
                "user",
                row.username,
                outcome=Outcome.FAILURE,
                details=with_runbook(
                    {"consecutive_failures": row.failed_logins, "severity": "medium"},
                    "alert.auth_failure_burst",
                    Outcome.FAILURE,
                    tx.session,
                ),
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
            details=with_runbook(
                {"failed_logins": recent + 1, "window_seconds": 60, "severity": "high"},
                "alert.auth_failure_spray",
                Outcome.FAILURE,
                tx.session,
            ),
        )


def _open_session(tx: Tx, row: UserRow, name: str, ttl: timedelta) -> IssuedToken:
    """A session token carrying the user's roles and tenants (the caller records the login)."""
    return issue_credential(
        tx,
        kind="session",
        name=name,
        user=row,
        roles=row.roles,
        tenants=row.tenants,
        ttl=ttl,
    )


def login(
    store: Store,
    username: str,
    password: str,
    code: str | None,
    *,
    session_ttl: timedelta,
    now: datetime | None = None,
    source: str | None = None,
) -> IssuedToken:
    """Password (+ TOTP or a recovery code) → a short-lived session token.

    An identity whose roles require MFA and who has not enrolled gets an enrollment-only
    session instead: it can enroll a TOTP authenticator and nothing else.

    ``source`` is the client's address: while it is being made to wait after repeated
    failures the attempt is refused (TooManyAttempts) before anything is checked. None (a
    caller inside the process): no address throttle.
    """
    error: ProofplaneError | None = None
    issued: IssuedToken | None = None
    key = source_key(source) if source is not None else None
    where = client_details(source)
    with store.write(Actor(safe_username(username)), now) as tx:
        if key is not None:
            check_source(tx, key)  # raises: nothing is written for a refused attempt
        row = tx.session.scalar(select(UserRow).where(UserRow.username == username))
        if row is not None and row.locked_until is not None and row.locked_until <= tx.now:
            row.locked_until, row.failed_logins = None, 0  # the lock has run out
        locked_until = (
            row.locked_until if row is not None else unknown_name_locked_until(tx, username)
        )
        if locked_until is not None:
            cred.verify_password(None, password)  # same cost as any attempt
            tx.record(
                "auth.login",
                "user",
                safe_username(username),
                outcome=Outcome.DENIED,
                details={
                    "method": "password",
                    "reason": "account_locked" if row is not None else "unknown_user_locked",
                    **where,
                },
            )
            # The same answer whether or not the account exists.
            error = AccountLocked(
                "account is locked after repeated failures; try later or ask an admin",
                details={"locked_until": locked_until.isoformat()},
            )
        elif row is None or row.disabled or not cred.verify_password(row.password_hash, password):
            reason = "unknown_user" if row is None else "disabled" if row.disabled else "password"
            if row is None:
                cred.verify_password(None, password)
            _fail(tx, row, username, reason, where)
            error = Unauthenticated("invalid username or password", code="invalid_credentials")
        else:
            mfa_needed = row.totp_enabled or bool(set(row.roles) & {r.value for r in MFA_REQUIRED})
            if row.totp_enabled and not code:
                error = Unauthenticated("this account needs a TOTP code", code="mfa_required")
            elif row.totp_enabled:
                assert row.totp_secret is not None and code is not None
                # Opened here, in this transaction, only for a login that brings a code. A
                # seed that does not open (KMS down, another row's or a tampered ciphertext)
                # fails the login with that error and rolls it back: nothing is written.
                seed = totp_seed(store, tx, row)
                step = totp.verify(seed, code, tx.now.timestamp(), row.totp_last_step)
                rhash = cred.recovery_hash(code)
                if step is not None:
                    row.totp_last_step = step
                elif rhash in row.recovery_codes:
                    row.recovery_codes = [h for h in row.recovery_codes if h != rhash]
                    tx.record(
                        "mfa.recovery_code.use",
                        "user",
                        row.username,
                        details={"remaining": len(row.recovery_codes), **where},
                    )
                else:
                    replay = row.totp_last_step is not None and any(
                        totp.code_at_step(seed, s) == code.strip()
                        for s in range(row.totp_last_step - 1, row.totp_last_step + 1)
                    )
                    _fail(tx, row, username, "totp_replayed" if replay else "totp", where)
                    error = Unauthenticated("invalid TOTP code", code="invalid_totp")
            if error is None:
                row.failed_logins = 0
                row.updated_at = tx.now
                if mfa_needed and not row.totp_enabled:
                    issued = issue_credential(
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
                    issued = _open_session(tx, row, "login session", session_ttl)
                tx.record(
                    "auth.login",
                    "user",
                    row.username,
                    details={
                        "method": "password",
                        "mfa": row.totp_enabled,
                        "token_id": issued.id,
                        "session": issued.kind,
                        **where,
                    },
                )
        if key is not None and error is not None and error.code != "mfa_required":
            count_source_failure(tx, key)
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
    source: str | None = None,
) -> IssuedToken:
    """An identity the OIDC provider vouched for: create or refresh the user from its groups
    (the provider is the source of truth for roles), then open a session. ``source``: the
    client's address (the browser that came back from the provider), for the events."""
    check_username(username)
    where = client_details(source)
    role_set = parse_roles(roles)
    with store.write(Actor(username)) as tx:
        known = set(
            tx.session.scalars(
                select(TenantRow.name).where(
                    TenantRow.name.in_(tenants), TenantRow.deleted_at.is_(None)
                )
            )
        )
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
            row = new_user_row(username, source="oidc", now=tx.now, external_subject=ext)
            tx.session.add(row)
            tx.session.flush()
            tx.record("user.create", "user", username, details={"source": "oidc", "issuer": issuer})
        if row.disabled:
            tx.record(
                "auth.login",
                "user",
                username,
                outcome=Outcome.FAILURE,
                details={"method": "oidc", "reason": "disabled", **where},
            )
            error: ProofplaneError | None = Unauthenticated(
                "this account is disabled", code="invalid_credentials"
            )
        else:
            error = None
            new_roles = sorted(r.value for r in role_set)
            if new_roles != row.roles or tenants != row.tenants:
                details: dict[str, object] = {
                    "source": "oidc",
                    "roles": {"before": row.roles, "after": new_roles},
                    "tenants": {"before": row.tenants, "after": tenants},
                }
                # A grant the provider took away revokes what was issued under it, for good
                # (as an admin's change does: users.update_user).
                if set(row.roles) - set(new_roles) or set(row.tenants) - set(tenants):
                    details["credentials_revoked"] = revoke_credentials(
                        tx, row, "grants removed at the identity provider"
                    )
                tx.record("user.update", "user", username, details=details)
                row.roles, row.tenants, row.updated_at = new_roles, tenants, tx.now
            issued = _open_session(tx, row, "oidc session", session_ttl)
            tx.record(
                "auth.login",
                "user",
                username,
                details={"method": "oidc", "issuer": issuer, "token_id": issued.id, **where},
            )
    if error is not None:
        raise error
    return issued


TOUCH_EVERY = timedelta(minutes=5)


def authenticate(store: Store, token: str, now: datetime) -> Actor:
    """The actor a bearer token stands for, or Unauthenticated.

    A successful check is kept in this process for a while (``token_cache``): a cached
    token costs no database read. A revocation, a disabled user or a changed role made in this
    process takes effect at once; one made elsewhere, on PostgreSQL, milliseconds after it
    commits (``token_push``), else within the cache's TTL (2 s by default,
    ``PROOFPLANE_TOKEN_CACHE_SECONDS``). Expiry is checked against ``now`` every time. The
    token's "last used" time is noted at most every five minutes and written in a batch
    (``last_used``), never in this request's own write transaction."""
    key = cred.token_hash(token)
    cache = cache_for(store)
    entry = cache.get(key)
    if entry is None:
        generation = cache.generation
        entry = _load(store, key, now)
        cache.put(key, entry, generation)
    if entry.expires_at <= now:
        raise Unauthenticated("token expired", code="token_expired")
    last = entry.last_used_at
    if (last is None or now - last > TOUCH_EVERY) and cache.claim_touch(entry):
        assert entry.actor.token_id is not None
        last_used.for_store(store).note(entry.actor.token_id, now, entry.used)
    return entry.actor


def cached_actor(store: Store, token: str, now: datetime) -> Actor | None:
    """``authenticate``'s answer when it needs no I/O at all (a token checked within the
    cache's TTL, not expired, its "last used" not due), else None: then call
    ``authenticate``, which reads, refuses or writes as it must. Safe on an event loop."""
    entry = cache_for(store).get(cred.token_hash(token))
    if entry is None or entry.expires_at <= now:
        return None
    last = entry.last_used_at
    if last is None or now - last > TOUCH_EVERY:
        return None
    return entry.actor


def token_is_known(store: Store, token: str, now: datetime) -> bool:
    """Whether ``token`` was checked and accepted within the cache's TTL and has not expired:
    no I/O, so the overload limiter may call it on the event loop to tell a client it can
    name by its token from a caller inventing a new token per request."""
    entry = cache_for(store).get(cred.token_hash(token))
    return entry is not None and entry.expires_at > now


def _load(store: Store, key: str, now: datetime) -> Entry:
    """Read the token (and its owner) by its indexed hash; refusals raise and are not kept."""
    began = time.monotonic()  # an entry is as old as its read's start (token_push.Push)
    with store.read() as session:
        row = session.scalar(select(TokenRow).where(TokenRow.token_hash == key))
        if row is None or row.revoked_at is not None:
            raise Unauthenticated("invalid or revoked token", code="invalid_token")
        if row.expires_at <= now:
            raise Unauthenticated("token expired", code="token_expired")
        if row.kind == "agent":
            actor = Actor(f"node:{row.node_name}", token_id=row.id)
            return Entry(actor, row.expires_at, row.last_used_at, None, began)
        user = row.user
        if user is None or user.disabled:
            raise Unauthenticated("invalid or revoked token", code="invalid_token")
        # A token never carries more than its owner holds now.
        actor = Actor(
            user.username,
            parse_roles(set(row.roles) & set(user.roles)),
            frozenset(set(row.tenants) & set(user.tenants)),
            token_id=row.id,
            enrollment_only=row.kind == "enrollment",
        )
        return Entry(actor, row.expires_at, row.last_used_at, user.id, began)


def logout(store: Store, actor: Actor, *, source: str | None = None) -> None:
    """End the caller's session (``source``: the client's address, for the event)."""
    if actor.token_id is None:
        return
    with store.write(actor) as tx:
        row = tx.session.get(TokenRow, actor.token_id)
        if row is not None and row.kind in ("session", "enrollment") and row.revoked_at is None:
            row.revoked_at = tx.now
            tx.record("auth.logout", "user", actor.name,
                      details={"token_id": row.id, **client_details(source)})  # fmt: skip
