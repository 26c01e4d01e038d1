"""Dependencies every route shares: the store, the settings, and access control.

Every route declares exactly one access rule, through one of ``requires(permission)``,
``agent_or(permission)`` (also a node's agent credential, for its own node),
``signed_in`` (any identity, for self-service), ``enrolling`` (also an MFA-enrollment session)
or ``public``. The route-matrix test walks the application's routes and fails on a route that
declares none.

A sync dependency costs a hop through the thread pool and back (issue 20), so these rules and
``StoreDep`` run on the event loop: they do no I/O, except ``current_actor`` when the caller
is not already known (``caller``), which then runs in the thread pool.
"""

from __future__ import annotations

import hmac
import ssl
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import Depends, Request, Response
from starlette.concurrency import run_in_threadpool

from proofplane.access import Actor, Forbidden, Permission, Unauthenticated, authorize
from proofplane.access.credentials import CSRF_COOKIE, CSRF_HEADER, SESSION_COOKIE, csrf_token
from proofplane.api.tls_scope import CLIENT_CA
from proofplane.config import Settings
from proofplane.service import pki
from proofplane.service.access import IssuedToken, authenticate, cached_actor
from proofplane.service.context import Store

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def set_session_cookies(response: Response, issued: IssuedToken, settings: Settings) -> str:
    """Open a browser session on ``response``: the HttpOnly session cookie and the CSRF cookie
    (readable by the page, which echoes it in ``x-csrf-token``), both strict same-site and
    living as long as the session. Returns the CSRF token."""
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
    return csrf


def clear_session_cookies(response: Response) -> None:
    response.delete_cookie(SESSION_COOKIE, path="/")
    response.delete_cookie(CSRF_COOKIE, path="/")


def get_store(request: Request) -> Store:
    return request.app.state.store  # type: ignore[no-any-return]


def get_settings(request: Request) -> Settings:
    return request.app.state.settings  # type: ignore[no-any-return]


async def app_store(request: Request) -> Store:
    """``get_store`` as a dependency, on the event loop (``StoreDep``)."""
    return get_store(request)


StoreDep = Annotated[Store, Depends(app_store)]


def client_address(request: Request) -> str:
    """The caller's address, for the login throttle. Behind a reverse proxy this is the
    proxy's unless uvicorn trusts it to say who the client is (``--forwarded-allow-ips``,
    ``FORWARDED_ALLOW_IPS``; 127.0.0.1 by default): then it is the ``X-Forwarded-For``
    client."""
    return request.client.host if request.client is not None else "unknown"


def current_actor(request: Request) -> Actor:
    """Who is calling: a bearer token, or a browser session cookie (with its CSRF token on
    every state-changing request)."""
    store = get_store(request)
    now = datetime.now(UTC)
    header = request.headers.get("authorization")
    if header is not None:
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthenticated("use Authorization: Bearer <token>", code="invalid_token")
        actor = authenticate(store, token.strip(), now)
        if mutual_tls(request) and route_path(request) not in BEARER_AGENT_ROUTES:
            # A node that holds an accepted certificate uses it: its bearer agent credential
            # only enrolls and asks for a certificate (issue 13).
            pki.refuse_bearer_when_certified(store, actor, now)
        return actor
    cookie = request.cookies.get(SESSION_COOKIE)
    if cookie:
        actor = authenticate(store, cookie, now)
        if request.method not in SAFE_METHODS:
            sent = request.headers.get(CSRF_HEADER, "")
            if not hmac.compare_digest(sent.encode(), csrf_token(cookie).encode()):
                raise Forbidden(f"missing or wrong {CSRF_HEADER} header", code="csrf_failed")
        return actor
    cert = client_certificate(request)
    if cert is not None:
        # A node agent's channel certificate (issue 13): the TLS layer checked the chain
        # against --tls-client-ca; the service checks it is ours, valid, not revoked, and
        # that its node is still in service.
        return pki.actor_for_certificate(store, cert, now)
    raise Unauthenticated("authentication required: send Authorization: Bearer <token>")


async def caller(request: Request) -> Actor:
    """``current_actor``, answered on the event loop when that needs no I/O: a bearer token
    this process checked within the token cache's TTL (``cached_actor``: not expired, its
    "last used" not due) on a connection without client certificates. Anything else (a token
    not seen yet, a session cookie and its CSRF check, a client certificate, a mutual-TLS
    connection) goes through ``current_actor`` in the thread pool."""
    header = request.headers.get("authorization")
    if header is not None and not mutual_tls(request):
        scheme, _, token = header.partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            actor = cached_actor(get_store(request), token.strip(), datetime.now(UTC))
            if actor is not None:
                return actor
    return await run_in_threadpool(current_actor, request)


# The routes where a node agent's bearer credential stays good on a mutual-TLS server even
# while its node holds a certificate: first enrollment (and a new AK), and asking for a
# certificate (an agent whose certificate is gone gets a new one this way).
BEARER_AGENT_ROUTES = frozenset(
    {
        "/api/v1/nodes/{name}/attestation/enroll",
        "/api/v1/nodes/{name}/attestation/activate",
        "/api/v1/nodes/{name}/agent-certificate",
    }
)


def route_path(request: Request) -> str | None:
    """The matched route's path template (``/api/v1/nodes/{name}/…``), or None."""
    return getattr(request.scope.get("route"), "path", None)


def mutual_tls(request: Request) -> bool:
    """Whether this connection's server verifies client certificates (``--tls-client-ca``):
    set by ``api.tls_scope.ClientCertProtocol`` on every request of such a connection."""
    tls = (request.scope.get("extensions") or {}).get("tls") or {}
    return bool(tls.get(CLIENT_CA))


def client_certificate(request: Request) -> bytes | None:
    """The DER of the client certificate the TLS connection presented (the ASGI TLS
    extension, ``scope["extensions"]["tls"]["client_cert_chain"]``, PEM), or None."""
    tls = (request.scope.get("extensions") or {}).get("tls") or {}
    chain = tls.get("client_cert_chain") or []
    if not chain:
        return None
    try:
        return ssl.PEM_cert_to_DER_cert(chain[0])
    except ValueError:
        return None


def _marked(rule: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def mark(fn: Callable[..., Any]) -> Callable[..., Any]:
        fn.proofplane_access = rule  # type: ignore[attr-defined]
        return fn

    return mark


def requires(permission: Permission) -> Callable[..., Awaitable[Actor]]:
    """The caller must hold ``permission`` in some scope (tenant scope is the service's)."""

    @_marked(permission)
    async def dependency(actor: Actor = Depends(caller)) -> Actor:
        _not_enrolling(actor)
        authorize(actor, permission)
        return actor

    return dependency


def agent_or(permission: Permission) -> Callable[..., Awaitable[Actor]]:
    """A node's agent credential (which acts only for its own node: the service checks the
    node), or anyone holding ``permission``. Declared as ``permission`` in the route matrix:
    agents are not users and hold no role."""

    @_marked(permission)
    async def dependency(actor: Actor = Depends(caller)) -> Actor:
        if not actor.roles and actor.name.startswith("node:") and actor.token_id is not None:
            return actor
        _not_enrolling(actor)
        authorize(actor, permission)
        return actor

    return dependency


def _not_enrolling(actor: Actor) -> None:
    if actor.enrollment_only:
        raise Forbidden(
            "enroll a TOTP authenticator first (POST /api/v1/auth/mfa/enroll), then log in again",
            code="mfa_enrollment_required",
        )


@_marked("signed-in")
async def signed_in(actor: Actor = Depends(caller)) -> Actor:
    """Any authenticated identity, acting on its own things (its tokens, itself)."""
    _not_enrolling(actor)
    return actor


@_marked("enrolling")
async def enrolling(actor: Actor = Depends(caller)) -> Actor:
    """Also an MFA-enrollment session: the routes that let a user finish enrolling."""
    return actor


@_marked("public")
async def public() -> None:
    """No authentication: health probes, the API description, logging in."""


def access_rule(dependency: Callable[..., Any]) -> Any:
    return getattr(dependency, "proofplane_access", None)
