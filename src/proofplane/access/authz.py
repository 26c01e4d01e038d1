"""Who is acting, and whether they may. One place decides; everything else asks.

``authorize`` answers three ways: allowed; ``Forbidden`` (403) when no role of the actor
carries the permission at all; ``NotFound`` (404) when the permission is held only for other
tenants, so that another tenant's objects look exactly like objects that do not exist.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from proofplane.access.roles import (
    GLOBAL_ROLES,
    ROLE_PERMISSIONS,
    SCOPED_ROLES,
    Permission,
    Role,
)
from proofplane.errors import NotFound, ProofplaneError, ValidationFailed


class Unauthenticated(ProofplaneError):
    code = "unauthenticated"


class Forbidden(ProofplaneError):
    code = "forbidden"


@dataclass(frozen=True, slots=True)
class Actor:
    """The identity behind a request, as it is written into every event.

    ``tenants`` bounds the scoped roles (developer, tenant-admin). ``token_id`` names the
    credential used, for the record; ``enrollment_only`` marks a session that may do nothing
    but enroll a second factor.
    """

    name: str
    roles: frozenset[Role] = frozenset()
    tenants: frozenset[str] = frozenset()
    token_id: str | None = None
    enrollment_only: bool = False

    def holds(self, permission: Permission) -> bool:
        """Whether any role grants ``permission`` in some scope."""
        return any(permission in ROLE_PERMISSIONS[r] for r in self.roles)

    def holds_globally(self, permission: Permission) -> bool:
        return any(permission in ROLE_PERMISSIONS[r] for r in self.roles if r in GLOBAL_ROLES)

    def visible_tenants(self, permission: Permission) -> frozenset[str] | None:
        """Tenants whose objects the actor may use with ``permission``; None means all."""
        if self.holds_globally(permission):
            return None
        if any(permission in ROLE_PERMISSIONS[r] for r in self.roles if r in SCOPED_ROLES):
            return self.tenants
        return frozenset()


SYSTEM = Actor("system", frozenset({Role.ADMIN}))


def authorize(
    actor: Actor,
    permission: Permission,
    *,
    tenant: str | None = None,
    hidden: NotFound | None = None,
) -> None:
    """Raise unless ``actor`` may use ``permission`` (on ``tenant``'s objects).

    ``hidden`` is the NotFound the caller would raise for a missing object; it is raised
    unchanged when the object belongs to a tenant the actor cannot see.
    """
    if actor.enrollment_only or not actor.holds(permission):
        raise Forbidden(
            f"{actor.name} may not {permission.value}",
            details={"permission": permission.value},
        )
    if tenant is None:
        return
    visible = actor.visible_tenants(permission)
    if visible is not None and tenant not in visible:
        raise hidden or NotFound(f"tenant {tenant!r} not found", details={"tenant": tenant})


def parse_roles(names: Iterable[str]) -> frozenset[Role]:
    out = set()
    for name in names:
        try:
            out.add(Role(name))
        except ValueError:
            raise ValidationFailed(
                f"unknown role {name!r}",
                code="unknown_role",
                details={"role": name, "known": [r.value for r in Role]},
            ) from None
    return frozenset(out)
