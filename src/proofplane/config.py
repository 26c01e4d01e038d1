"""Runtime settings, read once from the environment (``PROOFPLANE_*``) at the edge."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from proofplane.errors import ValidationFailed


@dataclass(frozen=True, slots=True)
class OidcSettings:
    """An OpenID Connect provider for SSO (authorization code + PKCE)."""

    issuer: str
    client_id: str
    client_secret: str | None
    redirect_uri: str
    scopes: tuple[str, ...] = ("openid", "profile", "email", "groups")
    groups_claim: str = "groups"
    username_claim: str = "preferred_username"
    # group → {"roles": [...], "tenants": [...]}; a user gets the union over their groups.
    group_map: dict[str, dict[str, list[str]]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Settings:
    session_ttl: timedelta = timedelta(hours=1)
    cookie_secure: bool = True
    admin_token: str | None = None
    oidc: OidcSettings | None = None


def _json(name: str, raw: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValidationFailed(f"{name} is not valid JSON: {exc}", code="invalid_setting") from exc


def from_env(env: dict[str, str] | None = None) -> Settings:
    """Settings from ``PROOFPLANE_*`` variables; a malformed one is an error, not a default."""
    env = dict(os.environ if env is None else env)
    oidc = None
    if env.get("PROOFPLANE_OIDC_ISSUER"):
        missing = [
            k
            for k in ("PROOFPLANE_OIDC_CLIENT_ID", "PROOFPLANE_OIDC_REDIRECT_URI")
            if not env.get(k)
        ]
        if missing:
            raise ValidationFailed(
                f"OIDC is configured but {', '.join(missing)} is not set", code="invalid_setting"
            )
        group_map = _json("PROOFPLANE_OIDC_GROUP_MAP", env.get("PROOFPLANE_OIDC_GROUP_MAP", "{}"))
        oidc = OidcSettings(
            issuer=env["PROOFPLANE_OIDC_ISSUER"].rstrip("/"),
            client_id=env["PROOFPLANE_OIDC_CLIENT_ID"],
            client_secret=env.get("PROOFPLANE_OIDC_CLIENT_SECRET") or None,
            redirect_uri=env["PROOFPLANE_OIDC_REDIRECT_URI"],
            scopes=tuple(env.get("PROOFPLANE_OIDC_SCOPES", "openid profile email groups").split()),
            groups_claim=env.get("PROOFPLANE_OIDC_GROUPS_CLAIM", "groups"),
            username_claim=env.get("PROOFPLANE_OIDC_USERNAME_CLAIM", "preferred_username"),
            group_map=group_map,
        )
    ttl = env.get("PROOFPLANE_SESSION_TTL_SECONDS", "3600")
    if not ttl.isdigit() or not 60 <= int(ttl) <= 86400:
        raise ValidationFailed(
            "PROOFPLANE_SESSION_TTL_SECONDS must be 60..86400", code="invalid_setting"
        )
    admin_token = env.get("PROOFPLANE_ADMIN_TOKEN") or None
    if admin_token is not None and not 16 <= len(admin_token) <= 256:
        raise ValidationFailed(
            "PROOFPLANE_ADMIN_TOKEN must be 16..256 characters", code="invalid_setting"
        )
    return Settings(
        session_ttl=timedelta(seconds=int(ttl)),
        cookie_secure=env.get("PROOFPLANE_COOKIE_SECURE", "true").lower() != "false",
        admin_token=admin_token,
        oidc=oidc,
    )
