"""Identity and access use cases: users, logins with TOTP and lockout, single sign-on,
tokens, MFA, the first administrator and node agents' credentials.

One module per seam: ``users``, ``sessions`` (password and federated logins, bearer-token
authentication, logout), ``lockout`` (failed logins counted by source address and unknown
username), ``oidc`` (the single sign-on flow), ``mfa``, ``tokens``,
``bootstrap`` (the first admin, node agents); ``common`` holds what they share. Callers import
from this package: ``from proofplane.service import access`` or
``from proofplane.service.access import login``.
"""

from proofplane.service.access.bootstrap import bootstrap_admin, issue_agent_credential
from proofplane.service.access.common import (
    MAX_TOKEN_TTL,
    MIN_TOKEN_TTL,
    USERNAME_PATTERN,
    AccountLocked,
    IssuedToken,
    TokenInfo,
    User,
    token_from_row,
    user_from_row,
)
from proofplane.service.access.lockout import (
    LOCK_AFTER,
    LOCK_FOR,
    THROTTLE_FORGET,
    THROTTLE_FREE,
    THROTTLE_MAX_DELAY,
    TooManyAttempts,
    source_key,
    throttle_delay,
)
from proofplane.service.access.mfa import ISSUER, mfa_begin, mfa_confirm
from proofplane.service.access.oidc import (
    LOGIN_TTL,
    InvalidOidcState,
    OidcProviderError,
    OidcSession,
    begin_oidc_login,
    check_return_to,
    complete_oidc_login,
)
from proofplane.service.access.sessions import (
    ALERT_AFTER,
    ENROLLMENT_TTL,
    SPRAY_ALERT,
    SPRAY_WINDOW,
    authenticate,
    cached_actor,
    login,
    login_federated,
    logout,
    token_is_known,
)
from proofplane.service.access.tokens import (
    issue_token,
    list_tokens,
    revoke_token,
    rotate_token,
)
from proofplane.service.access.users import (
    create_user,
    get_user,
    list_users,
    unlock_user,
    update_user,
)

__all__ = [
    "ALERT_AFTER",
    "ENROLLMENT_TTL",
    "ISSUER",
    "LOCK_AFTER",
    "LOCK_FOR",
    "LOGIN_TTL",
    "MAX_TOKEN_TTL",
    "MIN_TOKEN_TTL",
    "SPRAY_ALERT",
    "SPRAY_WINDOW",
    "THROTTLE_FORGET",
    "THROTTLE_FREE",
    "THROTTLE_MAX_DELAY",
    "USERNAME_PATTERN",
    "AccountLocked",
    "InvalidOidcState",
    "IssuedToken",
    "OidcProviderError",
    "OidcSession",
    "TokenInfo",
    "TooManyAttempts",
    "User",
    "authenticate",
    "cached_actor",
    "token_is_known",
    "begin_oidc_login",
    "bootstrap_admin",
    "check_return_to",
    "complete_oidc_login",
    "create_user",
    "get_user",
    "issue_agent_credential",
    "issue_token",
    "list_tokens",
    "list_users",
    "login",
    "login_federated",
    "logout",
    "mfa_begin",
    "mfa_confirm",
    "revoke_token",
    "rotate_token",
    "source_key",
    "throttle_delay",
    "token_from_row",
    "unlock_user",
    "update_user",
    "user_from_row",
]
