"""Single sign-on use cases: OpenID Connect authorization code flow with PKCE (S256).

``begin_oidc_login`` remembers ``state``, ``nonce`` and the PKCE verifier for ten minutes and
answers the provider URL to send the browser to; ``complete_oidc_login`` uses the ``state`` up,
exchanges the code, validates the ID token and opens a session for the user the provider
vouched for (``sessions.login_federated``). The protocol itself (discovery, token exchange,
ID-token validation, group mapping) is ``proofplane.access.oidc``.

The nonce and the PKCE verifier are stored only as KMS ciphertext bound to their row
(``oidc_logins/<state>/<column>``); a login whose verifier does not open (KMS down, tampered)
fails with that error and its row is not consumed.

Every failed completion is recorded as an ``auth.login`` event with outcome ``failure`` and
``details.method = "oidc"`` in its own committed transaction, so that the refusal cannot roll
the evidence back.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import timedelta

from sqlalchemy import delete, select

from proofplane.access import Actor, Unauthenticated
from proofplane.access import oidc as oidc_client
from proofplane.config import OidcSettings
from proofplane.errors import NotFound, ProofplaneError, ValidationFailed
from proofplane.model import Outcome
from proofplane.service.access.common import IssuedToken
from proofplane.service.access.sessions import client_details, login_federated
from proofplane.service.context import Store
from proofplane.service.keys import kms_for, open_secret, seal_secret, secret_aad
from proofplane.store.tables import OidcLoginRow

LOGIN_TTL = timedelta(minutes=10)  # how long an authorization request may stay in flight
ANONYMOUS = Actor("anonymous")
_ERROR_CODE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_UNSAFE_PATH = re.compile(r"[\\\x00-\x1f\x7f]")


class InvalidOidcState(ProofplaneError):
    code = "invalid_oidc_state"


class OidcProviderError(ProofplaneError):
    code = "oidc_error"


@dataclass(frozen=True, slots=True)
class OidcSession:
    """A completed single sign-on: the session opened, and where the user was going."""

    issued: IssuedToken
    return_to: str


@dataclass(frozen=True, slots=True)
class _Pending:
    nonce: str
    code_verifier: str
    return_to: str


def _configured(config: OidcSettings | None) -> OidcSettings:
    if config is None:
        raise NotFound(
            "single sign-on is not configured (set PROOFPLANE_OIDC_ISSUER)",
            code="oidc_not_configured",
        )
    return config


def check_return_to(value: str | None) -> str:
    """Only a path on this site: starts with one ``/``, no scheme, no host, no backslash or
    control character (browsers read ``/\\host`` and ``/\\t/host`` as ``//host``)."""
    if value is None or value == "":
        return "/"
    if not value.startswith("/") or value.startswith("//") or _UNSAFE_PATH.search(value):
        raise ValidationFailed(
            "return_to must be a path on this site, starting with a single /",
            code="invalid_return_to",
            details={"return_to": value},
        )
    return value


def _record_failure(
    store: Store, issuer: str, source: str | None, reason: str, **details: str
) -> None:
    """A failed SSO attempt, committed on its own (the caller raises afterwards)."""
    with store.write(ANONYMOUS) as tx:
        tx.record(
            "auth.login",
            "user",
            "<unknown>",
            outcome=Outcome.FAILURE,
            details={"method": "oidc", "reason": reason, "issuer": issuer, **details,
                     **client_details(source)},
        )  # fmt: skip


def _aad(state: str, column: str) -> bytes:
    return secret_aad(OidcLoginRow.__tablename__, state, column)


def _take_state(store: Store, state: str | None) -> _Pending | None:
    """The login in flight under ``state``, deleted as it is read (single use); None when
    there is none or it has expired."""
    if not state:
        return None
    with store.write(ANONYMOUS) as tx:
        row = tx.session.scalar(select(OidcLoginRow).where(OidcLoginRow.state == state))
        if row is None:
            return None
        pending = None
        if row.expires_at > tx.now:
            kms = kms_for(store)
            pending = _Pending(
                open_secret(kms, tx.session, row.nonce, _aad(state, "nonce")),
                open_secret(kms, tx.session, row.code_verifier, _aad(state, "code_verifier")),
                row.return_to or "/",
            )
        tx.session.delete(row)
    return pending


def begin_oidc_login(store: Store, config: OidcSettings | None, return_to: str | None) -> str:
    """Start single sign-on: remember ``state``, ``nonce`` and the PKCE verifier for
    ``LOGIN_TTL`` (dropping the expired ones), and answer the provider's authorization URL.
    NotFound ``oidc_not_configured`` without a provider; ValidationFailed for a ``return_to``
    that is not a path on this site."""
    config = _configured(config)
    target = check_return_to(return_to)
    metadata = oidc_client.discover(config.issuer)
    auth = oidc_client.new_authorization_request(metadata, config)
    with store.write(ANONYMOUS) as tx:
        tx.session.execute(delete(OidcLoginRow).where(OidcLoginRow.expires_at <= tx.now))
        kms = kms_for(store)
        tx.session.add(
            OidcLoginRow(
                state=auth.state,
                nonce=seal_secret(kms, tx, auth.nonce, _aad(auth.state, "nonce")),
                code_verifier=seal_secret(
                    kms, tx, auth.code_verifier, _aad(auth.state, "code_verifier")
                ),
                return_to=target,
                expires_at=tx.now + LOGIN_TTL,
            )
        )
    return auth.url


def complete_oidc_login(
    store: Store,
    config: OidcSettings | None,
    *,
    code: str | None,
    state: str | None,
    error: str | None = None,
    error_description: str | None = None,
    iss: str | None = None,
    session_ttl: timedelta,
    source: str | None = None,
) -> OidcSession:
    """Finish single sign-on from the provider's redirect: the ``state`` is used up, the code
    is exchanged (with the PKCE verifier), the ID token is validated, and the user is created
    or refreshed from their groups. A user whose groups map to no role signs in with no roles.

    Refusals, each recorded first: OidcProviderError (the provider sent ``error``),
    InvalidOidcState (unknown, used or expired ``state``), ``OidcFailed`` (the response or
    the ID token does not hold), and whatever ``login_federated`` refuses. ``source``: the
    client's address, in every event (``source_ip``)."""
    config = _configured(config)
    try:
        pending = _take_state(store, state)
    except ProofplaneError as exc:  # the verifier does not open (KMS down, tampered row)
        _record_failure(store, config.issuer, source, exc.code)
        raise
    if error is not None:
        code_word = error if _ERROR_CODE.fullmatch(error) else "<invalid>"
        _record_failure(store, config.issuer, source, "provider_error", error=code_word)
        description = (error_description or "")[:300]
        raise OidcProviderError(
            f"the identity provider refused the login: {error}"
            + (f": {description}" if description else ""),
            details={"error": error, "error_description": description or None},
        )
    if pending is None:
        _record_failure(store, config.issuer, source, "invalid_state")
        raise InvalidOidcState(
            "unknown, already used or expired login state: start the login again",
        )
    try:
        if iss is not None and not oidc_client.same_issuer(iss, config.issuer):
            # RFC 9207: the response names the issuer that produced it (mix-up defence).
            raise oidc_client.OidcFailed(
                "the authorization response comes from another issuer", reason="issuer_mismatch"
            )
        if not code:
            raise oidc_client.OidcFailed(
                "the callback carries no authorization code", reason="no_code"
            )
        identity = oidc_client.complete_login(
            config, code=code, code_verifier=pending.code_verifier, nonce=pending.nonce
        )
    except oidc_client.OidcFailed as exc:
        _record_failure(store, config.issuer, source, exc.reason, message=exc.message)
        raise
    except ProofplaneError as exc:  # the provider is unreachable, or the group map is wrong
        _record_failure(store, config.issuer, source, exc.code, message=exc.message)
        raise
    try:
        issued = login_federated(
            store,
            subject=identity.subject,
            username=identity.username,
            roles=list(identity.roles),
            tenants=list(identity.tenants),
            issuer=config.issuer,
            session_ttl=session_ttl,
            source=source,
        )
    except Unauthenticated:
        raise  # login_federated has recorded it (a disabled account)
    except ProofplaneError as exc:
        _record_failure(store, config.issuer, source, exc.code, username=identity.username)
        raise
    return OidcSession(issued, pending.return_to)
