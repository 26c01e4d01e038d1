"""Identity and access over HTTP: login, MFA, users, tokens, node-agent credentials."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request, Response, status
from pydantic import BaseModel, Field

from proofplane.access import Actor
from proofplane.access import Permission as P
from proofplane.api.deps import (
    clear_session_cookies,
    client_address,
    enrolling,
    get_settings,
    get_store,
    public,
    requires,
    set_session_cookies,
    signed_in,
)
from proofplane.api.errors import error_response, status_for
from proofplane.api.schemas import BodyIn, ErrorResponse, Name, Page
from proofplane.config import Settings
from proofplane.service import access as svc
from proofplane.service.context import Store

router = APIRouter(
    prefix="/api/v1",
    responses={  # type: ignore[dict-item]
        401: {"model": ErrorResponse, "description": "not authenticated"},
        403: {"model": ErrorResponse, "description": "not allowed"},
        404: {"model": ErrorResponse, "description": "not found"},
        422: {"model": ErrorResponse, "description": "invalid input"},
    },
)
StoreDep = Annotated[Store, Depends(get_store)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
Username = Annotated[str, Field(pattern=svc.USERNAME_PATTERN)]


# --- bodies ------------------------------------------------------------------------------------


class LoginIn(BodyIn):
    username: str = Field(max_length=255)
    password: str = Field(max_length=1024)
    totp: str | None = Field(None, max_length=64, description="TOTP code or a recovery code")
    cookie: bool = Field(False, description="also set a browser session cookie (+ CSRF cookie)")


class TokenOut(BaseModel):
    token: str = Field(description="shown once; only its id is ever shown again")
    id: str
    kind: str
    expires_at: datetime
    mfa_enrollment_required: bool = False
    csrf_token: str | None = None

    @classmethod
    def of(cls, t: svc.IssuedToken, csrf: str | None = None) -> TokenOut:
        return cls(
            token=t.token,
            id=t.id,
            kind=t.kind,
            expires_at=t.expires_at,
            mfa_enrollment_required=t.mfa_enrollment_required,
            csrf_token=csrf,
        )


class MeOut(BaseModel):
    username: str
    roles: list[str]
    tenants: list[str]
    token_id: str | None
    mfa_enrollment_required: bool


class MfaEnrollOut(BaseModel):
    secret: str = Field(description="base32 TOTP seed, shown once, for manual entry")
    otpauth_uri: str


class MfaConfirmIn(BodyIn):
    totp: str = Field(max_length=16)


class RecoveryCodesOut(BaseModel):
    recovery_codes: list[str] = Field(description="single-use; shown once")


class UserIn(BodyIn):
    username: Username
    password: str | None = Field(None, max_length=1024, description="omit for SSO-only users")
    roles: list[str] = Field(default_factory=list, max_length=10)
    tenants: list[str] = Field(default_factory=list, max_length=100)


class UserPatch(BodyIn):
    roles: list[str] | None = Field(None, max_length=10)
    tenants: list[str] | None = Field(None, max_length=100)
    disabled: bool | None = None
    password: str | None = Field(None, max_length=1024)


class UserOut(BaseModel):
    username: str
    roles: list[str]
    tenants: list[str]
    source: str
    mfa_enabled: bool
    disabled: bool
    locked_until: datetime | None
    failed_logins: int
    created_at: datetime
    updated_at: datetime

    @classmethod
    def of(cls, u: svc.User) -> UserOut:
        return cls(
            username=u.username,
            roles=list(u.roles),
            tenants=list(u.tenants),
            source=u.source,
            mfa_enabled=u.mfa_enabled,
            disabled=u.disabled,
            locked_until=u.locked_until,
            failed_logins=u.failed_logins,
            created_at=u.created_at,
            updated_at=u.updated_at,
        )


class TokenIn(BodyIn):
    roles: list[str] | None = Field(None, max_length=10, description="default: all of yours")
    tenants: list[str] | None = Field(None, max_length=100, description="default: all of yours")
    expires_in: int = Field(ge=1, le=2**31, description="seconds; at most 90 days")
    name: str = Field("", max_length=255)


class RotateIn(BodyIn):
    expires_in: int | None = Field(None, ge=1, le=2**31)


class TokenInfoOut(BaseModel):
    id: str
    kind: str
    name: str
    owner: str
    roles: list[str]
    tenants: list[str]
    created_at: datetime
    expires_at: datetime
    revoked_at: datetime | None
    last_used_at: datetime | None
    parent_id: str | None = Field(None, description="the session or API token it was minted with")

    @classmethod
    def of(cls, t: svc.TokenInfo) -> TokenInfoOut:
        return cls(
            id=t.id,
            kind=t.kind,
            name=t.name,
            owner=t.owner,
            roles=list(t.roles),
            tenants=list(t.tenants),
            created_at=t.created_at,
            expires_at=t.expires_at,
            revoked_at=t.revoked_at,
            last_used_at=t.last_used_at,
            parent_id=t.parent_id,
        )


class AgentCredentialIn(BodyIn):
    ttl_days: int = Field(90, ge=1, le=90)


# --- auth --------------------------------------------------------------------------------------


@router.post(
    "/auth/login",
    tags=["auth"],
    dependencies=[Depends(public)],
    response_model=TokenOut,
    responses={
        423: {"model": ErrorResponse, "description": "account locked"},
        429: {"model": ErrorResponse, "description": "too many failures from this address"},
    },
)
def login(
    body: LoginIn, request: Request, store: StoreDep, settings: SettingsDep, response: Response
) -> Any:
    """Password (+ TOTP) → a short-lived session token. 10 failures lock the account for
    30 minutes (423 ``account_locked``; a username no account has answers the same). After 10
    failures from one address, each further attempt from it waits a doubling delay (429
    ``too_many_attempts`` with ``Retry-After``)."""
    try:
        issued = svc.login(
            store,
            body.username,
            body.password,
            body.totp,
            session_ttl=settings.session_ttl,
            source=client_address(request),
        )
    except svc.TooManyAttempts as exc:
        refused = error_response(status_for(exc), exc.code, exc.message, exc.details)
        refused.headers["Retry-After"] = str(exc.details["retry_after"])
        return refused
    csrf = set_session_cookies(response, issued, settings) if body.cookie else None
    return TokenOut.of(issued, csrf)


@router.post("/auth/logout", tags=["auth"], status_code=status.HTTP_204_NO_CONTENT)
def logout(
    store: StoreDep,
    actor: Annotated[Actor, Depends(enrolling)],
    request: Request,
    response: Response,
) -> Response:
    svc.logout(store, actor, source=client_address(request))
    clear_session_cookies(response)
    response.status_code = status.HTTP_204_NO_CONTENT
    return response


@router.get("/auth/me", tags=["auth"])
def me(actor: Annotated[Actor, Depends(enrolling)]) -> MeOut:
    return MeOut(
        username=actor.name,
        roles=sorted(r.value for r in actor.roles),
        tenants=sorted(actor.tenants),
        token_id=actor.token_id,
        mfa_enrollment_required=actor.enrollment_only,
    )


@router.post("/auth/mfa/enroll", tags=["auth"])
def mfa_enroll(store: StoreDep, actor: Annotated[Actor, Depends(enrolling)]) -> MfaEnrollOut:
    """Start TOTP enrollment; confirm with a first code to activate it."""
    secret, uri = svc.mfa_begin(store, actor)
    return MfaEnrollOut(secret=secret, otpauth_uri=uri)


@router.post("/auth/mfa/confirm", tags=["auth"])
def mfa_confirm(
    body: MfaConfirmIn, store: StoreDep, actor: Annotated[Actor, Depends(enrolling)]
) -> RecoveryCodesOut:
    return RecoveryCodesOut(recovery_codes=svc.mfa_confirm(store, actor, body.totp))


# --- users -------------------------------------------------------------------------------------


@router.post("/users", tags=["users"], status_code=status.HTTP_201_CREATED)
def create_user(
    body: UserIn, store: StoreDep, actor: Annotated[Actor, Depends(requires(P.USERS_WRITE))]
) -> UserOut:
    return UserOut.of(
        svc.create_user(store, actor, body.username, body.password, body.roles, body.tenants)
    )


@router.get("/users", tags=["users"])
def list_users(
    store: StoreDep,
    actor: Annotated[Actor, Depends(requires(P.USERS_READ))],
    limit: Annotated[int, Query(ge=1, le=500)] = 100,
    cursor: str | None = None,
) -> Page[UserOut]:
    page = svc.list_users(store, actor, limit=limit, cursor=cursor)
    return Page(items=[UserOut.of(u) for u in page.items], next=page.next)


@router.get("/users/{username}", tags=["users"])
def get_user(
    username: str, store: StoreDep, actor: Annotated[Actor, Depends(requires(P.USERS_READ))]
) -> UserOut:
    return UserOut.of(svc.get_user(store, actor, username))


@router.patch("/users/{username}", tags=["users"])
def update_user(
    username: str,
    body: UserPatch,
    store: StoreDep,
    actor: Annotated[Actor, Depends(requires(P.USERS_WRITE))],
) -> UserOut:
    return UserOut.of(
        svc.update_user(
            store,
            actor,
            username,
            roles=body.roles,
            tenants=body.tenants,
            disabled=body.disabled,
            password=body.password,
        )
    )


@router.post("/users/{username}/unlock", tags=["users"])
def unlock_user(
    username: str, store: StoreDep, actor: Annotated[Actor, Depends(requires(P.USERS_WRITE))]
) -> UserOut:
    return UserOut.of(svc.unlock_user(store, actor, username))


# --- tokens ------------------------------------------------------------------------------------


@router.post("/tokens", tags=["tokens"], status_code=status.HTTP_201_CREATED)
def issue_token(
    body: TokenIn, store: StoreDep, actor: Annotated[Actor, Depends(signed_in)]
) -> TokenOut:
    """An API token for yourself: a subset of your roles and tenants, expiring within 90 days,
    and no later than the API token you call with (422 ``expiry_beyond_parent``); revoking
    that token revokes this one. The token is in this answer only."""
    return TokenOut.of(
        svc.issue_token(
            store,
            actor,
            roles=body.roles,
            tenants=body.tenants,
            expires_in=body.expires_in,
            name=body.name,
        )
    )


@router.get("/tokens", tags=["tokens"])
def list_tokens(
    store: StoreDep,
    actor: Annotated[Actor, Depends(signed_in)],
    owner: str | None = None,
    include_inactive: bool = False,
) -> Page[TokenInfoOut]:
    items = svc.list_tokens(store, actor, owner=owner, include_inactive=include_inactive)
    return Page(items=[TokenInfoOut.of(t) for t in items], next=None)


@router.delete("/tokens/{token_id}", tags=["tokens"])
def revoke_token(
    token_id: str, store: StoreDep, actor: Annotated[Actor, Depends(signed_in)]
) -> TokenInfoOut:
    return TokenInfoOut.of(svc.revoke_token(store, actor, token_id))


@router.post("/tokens/{token_id}/rotate", tags=["tokens"], status_code=status.HTTP_201_CREATED)
def rotate_token(
    token_id: str,
    store: StoreDep,
    actor: Annotated[Actor, Depends(signed_in)],
    body: RotateIn | None = None,
) -> TokenOut:
    """Replace your own API token with a new secret (the old one and the tokens it minted stop
    working). Only the owner rotates: another user's token answers 403 to whoever may revoke
    it (an admin revokes instead), 404 to anyone else."""
    return TokenOut.of(svc.rotate_token(store, actor, token_id, body.expires_in if body else None))


@router.post("/nodes/{name}/agent-credentials", tags=["nodes"], status_code=status.HTTP_201_CREATED)
def agent_credential(
    name: Name,
    store: StoreDep,
    actor: Annotated[Actor, Depends(requires(P.AGENT_CREDENTIALS))],
    body: AgentCredentialIn | None = None,
) -> TokenOut:
    """A credential for the node's agent; it grants no user or tenant access."""
    return TokenOut.of(
        svc.issue_agent_credential(store, actor, name, body.ttl_days if body else 90)
    )
