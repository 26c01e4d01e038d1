"""Single sign-on over HTTP: OpenID Connect authorization code flow with PKCE (S256).

``GET /api/v1/auth/oidc/login`` sends the browser to the provider; the provider sends it back
to ``GET /api/v1/auth/oidc/callback``, which opens a browser session (the same HttpOnly session
cookie and CSRF cookie as ``POST /auth/login`` with ``cookie: true``) and redirects to where the
user was going. Both routes are public; both answer 404 ``oidc_not_configured`` when the control
plane has no ``PROOFPLANE_OIDC_ISSUER``.

The provider is the source of truth for who a user is and which groups they are in;
``PROOFPLANE_OIDC_GROUP_MAP`` turns groups into roles and tenants. A user none of whose groups
is in the map still logs in, with no roles: every route that needs a permission then answers
403. That is deliberate: the login itself is evidence (it is recorded), and access is granted
by changing the group map or the user's groups at the provider, never by the login.

Every failed callback is recorded as an ``auth.login`` event with outcome ``failure`` and
``details.method = "oidc"`` in its own committed transaction, so that the refusal cannot roll
the evidence back.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Annotated

from fastapi import APIRouter, Depends, Query
from fastapi.responses import RedirectResponse
from sqlalchemy import delete, select

from proofplane.access import Actor, Unauthenticated, oidc
from proofplane.access.credentials import csrf_token
from proofplane.api.deps import CSRF_COOKIE, SESSION_COOKIE, get_settings, get_store, public
from proofplane.api.schemas import ErrorResponse
from proofplane.config import OidcSettings, Settings
from proofplane.errors import NotFound, ProofplaneError, ValidationFailed
from proofplane.model import Outcome
from proofplane.service import access as svc
from proofplane.service.context import Store
from proofplane.store.tables import OidcLoginRow

LOGIN_TTL = timedelta(minutes=10)  # how long an authorization request may stay in flight
ANONYMOUS = Actor("anonymous")
_ERROR_CODE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_UNSAFE_PATH = re.compile(r"[\\\x00-\x1f\x7f]")

router = APIRouter(
    prefix="/api/v1",
    tags=["auth"],
    responses={  # type: ignore[dict-item]
        400: {"model": ErrorResponse, "description": "bad or used state, or a provider error"},
        401: {"model": ErrorResponse, "description": "SSO failed (token or ID token)"},
        404: {"model": ErrorResponse, "description": "OIDC is not configured"},
        422: {"model": ErrorResponse, "description": "invalid input"},
        502: {"model": ErrorResponse, "description": "the OIDC provider is unavailable"},
    },
)
StoreDep = Annotated[Store, Depends(get_store)]
SettingsDep = Annotated[Settings, Depends(get_settings)]


class InvalidOidcState(ProofplaneError):
    status = 400
    code = "invalid_oidc_state"


class OidcProviderError(ProofplaneError):
    status = 400
    code = "oidc_error"


def _configured(settings: Settings) -> OidcSettings:
    if settings.oidc is None:
        raise NotFound(
            "single sign-on is not configured (set PROOFPLANE_OIDC_ISSUER)",
            code="oidc_not_configured",
        )
    return settings.oidc


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


def _record_failure(store: Store, issuer: str, reason: str, **details: str) -> None:
    """A failed SSO attempt, committed on its own (the caller raises afterwards)."""
    with store.write(ANONYMOUS) as tx:
        tx.record(
            "auth.login",
            "user",
            "<unknown>",
            outcome=Outcome.FAILURE,
            details={"method": "oidc", "reason": reason, "issuer": issuer, **details},
        )


@dataclass(frozen=True, slots=True)
class _Pending:
    nonce: str
    code_verifier: str
    return_to: str


def _take_state(store: Store, state: str | None) -> _Pending | None:
    """The login in flight under ``state``, deleted as it is read (single use); None when
    there is none or it has expired."""
    if not state:
        return None
    with store.write(ANONYMOUS) as tx:
        row = tx.session.scalar(select(OidcLoginRow).where(OidcLoginRow.state == state))
        if row is None:
            return None
        pending = _Pending(row.nonce, row.code_verifier, row.return_to or "/")
        fresh = row.expires_at > tx.now
        tx.session.delete(row)
    return pending if fresh else None


def _set_session_cookies(
    response: RedirectResponse, issued: svc.IssuedToken, settings: Settings
) -> None:
    """The cookies ``POST /auth/login`` with ``cookie: true`` sets, with the same attributes."""
    csrf = csrf_token(issued.token)
    max_age = int((issued.expires_at - datetime.now(issued.expires_at.tzinfo)).total_seconds())
    response.set_cookie(
        SESSION_COOKIE,
        issued.token,
        max_age=max_age,
        httponly=True,
        secure=settings.cookie_secure,
        samesite="strict",
        path="/",
    )
    response.set_cookie(
        CSRF_COOKIE,
        csrf,
        max_age=max_age,
        httponly=False,
        secure=settings.cookie_secure,
        samesite="strict",
        path="/",
    )


@router.get(
    "/auth/oidc/login",
    dependencies=[Depends(public)],
    status_code=302,
    response_class=RedirectResponse,
    responses={302: {"description": "to the provider's authorization endpoint"}},
)
def oidc_login(
    store: StoreDep,
    settings: SettingsDep,
    return_to: Annotated[
        str | None, Query(max_length=255, description="a path on this site; default /")
    ] = None,
) -> RedirectResponse:
    """Start single sign-on: remember ``state``, ``nonce`` and the PKCE verifier for ten
    minutes, and redirect the browser to the provider."""
    config = _configured(settings)
    target = check_return_to(return_to)
    metadata = oidc.discover(config.issuer)
    auth = oidc.new_authorization_request(metadata, config)
    with store.write(ANONYMOUS) as tx:
        tx.session.execute(delete(OidcLoginRow).where(OidcLoginRow.expires_at <= tx.now))
        tx.session.add(
            OidcLoginRow(
                state=auth.state,
                nonce=auth.nonce,
                code_verifier=auth.code_verifier,
                return_to=target,
                expires_at=tx.now + LOGIN_TTL,
            )
        )
    return RedirectResponse(auth.url, status_code=302, headers={"Cache-Control": "no-store"})


@router.get(
    "/auth/oidc/callback",
    dependencies=[Depends(public)],
    status_code=303,
    response_class=RedirectResponse,
    responses={303: {"description": "signed in: to return_to, with the session cookies"}},
)
def oidc_callback(
    store: StoreDep,
    settings: SettingsDep,
    code: Annotated[str | None, Query(max_length=2048)] = None,
    state: Annotated[str | None, Query(max_length=255)] = None,
    error: Annotated[str | None, Query(max_length=255)] = None,
    error_description: Annotated[str | None, Query(max_length=1024)] = None,
    iss: Annotated[str | None, Query(max_length=2048)] = None,
) -> RedirectResponse:
    """Finish single sign-on: the ``state`` is used up, the code is exchanged (with the PKCE
    verifier), the ID token is validated, and the user is created or refreshed from their
    groups. A user whose groups map to no role signs in with no roles (403 on every route
    that needs a permission)."""
    config = _configured(settings)
    pending = _take_state(store, state)
    if error is not None:
        code_word = error if _ERROR_CODE.fullmatch(error) else "<invalid>"
        _record_failure(store, config.issuer, "provider_error", error=code_word)
        description = (error_description or "")[:300]
        raise OidcProviderError(
            f"the identity provider refused the login: {error}"
            + (f": {description}" if description else ""),
            details={"error": error, "error_description": description or None},
        )
    if pending is None:
        _record_failure(store, config.issuer, "invalid_state")
        raise InvalidOidcState(
            "unknown, already used or expired login state: start the login again",
        )
    try:
        if iss is not None and not oidc.same_issuer(iss, config.issuer):
            # RFC 9207: the response names the issuer that produced it (mix-up defence).
            raise oidc.OidcFailed(
                "the authorization response comes from another issuer", reason="issuer_mismatch"
            )
        if not code:
            raise oidc.OidcFailed("the callback carries no authorization code", reason="no_code")
        identity = oidc.complete_login(
            config, code=code, code_verifier=pending.code_verifier, nonce=pending.nonce
        )
    except oidc.OidcFailed as exc:
        _record_failure(store, config.issuer, exc.reason, message=exc.message)
        raise
    except ProofplaneError as exc:  # the provider is unreachable, or the group map is wrong
        _record_failure(store, config.issuer, exc.code, message=exc.message)
        raise
    try:
        issued = svc.login_federated(
            store,
            subject=identity.subject,
            username=identity.username,
            roles=list(identity.roles),
            tenants=list(identity.tenants),
            issuer=config.issuer,
            session_ttl=settings.session_ttl,
        )
    except Unauthenticated:
        raise  # login_federated has recorded it (a disabled account)
    except ProofplaneError as exc:
        _record_failure(store, config.issuer, exc.code, username=identity.username)
        raise
    response = RedirectResponse(
        pending.return_to, status_code=303, headers={"Cache-Control": "no-store"}
    )
    _set_session_cookies(response, issued, settings)
    return response
