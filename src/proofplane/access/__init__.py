"""Identities and authorization. Every API route and service call goes through ``authorize``."""

from proofplane.access.authz import (
    SYSTEM,
    Actor,
    Forbidden,
    Unauthenticated,
    authorize,
    parse_roles,
)
from proofplane.access.roles import Permission, Role

__all__ = [
    "SYSTEM",
    "Actor",
    "Forbidden",
    "Permission",
    "Role",
    "Unauthenticated",
    "authorize",
    "parse_roles",
]
