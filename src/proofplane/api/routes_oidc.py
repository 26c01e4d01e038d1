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
the evidence back. The flow's state and its checks are the service's
(``service.access.begin_oidc_login`` and ``complete_oidc_login``); this module parses and
redirects.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import RedirectResponse

from proofplane.api.deps import (
    client_address,
    get_settings,
    get_store,
    public,
    set_session_cookies,
)
from proofplane.api.schemas import ErrorResponse
from proofplane.config import Settings
from proofplane.service import access as svc
from proofplane.service.context import Store

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
    url = svc.begin_oidc_login(store, settings.oidc, return_to)
    return RedirectResponse(url, status_code=302, headers={"Cache-Control": "no-store"})


@router.get(
    "/auth/oidc/callback",
    dependencies=[Depends(public)],
    status_code=303,
    response_class=RedirectResponse,
    responses={303: {"description": "signed in: to return_to, with the session cookies"}},
)
def oidc_callback(
    request: Request,
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
    done = svc.complete_oidc_login(
        store,
        settings.oidc,
        code=code,
        state=state,
        error=error,
        error_description=error_description,
        iss=iss,
        session_ttl=settings.session_ttl,
        source=client_address(request),
    )
    response = RedirectResponse(
        done.return_to, status_code=303, headers={"Cache-Control": "no-store"}
    )
    set_session_cookies(response, done.issued, settings)
    return response
