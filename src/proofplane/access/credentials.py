"""Credentials at rest: argon2id for passwords, SHA-256 for high-entropy tokens and codes.

Tokens and recovery codes carry at least 128 and 80 bits of randomness, so a fast hash is
enough to make a database leak useless; passwords are low-entropy and get a slow, salted hash.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError, VerifyMismatchError

_hasher = PasswordHasher()
# Verified against when the user does not exist, so both paths cost the same time.
_DUMMY_HASH = _hasher.hash("proofplane-timing-equalizer")

MIN_PASSWORD = 12  # PCI DSS 4.0 §8.3.6
MAX_PASSWORD = 256


def hash_password(password: str) -> str:
    return _hasher.hash(password)


def verify_password(password_hash: str | None, password: str) -> bool:
    try:
        return _hasher.verify(password_hash or _DUMMY_HASH, password) and password_hash is not None
    except (VerifyMismatchError, VerificationError, InvalidHashError):
        return False


def needs_rehash(password_hash: str) -> bool:
    return _hasher.check_needs_rehash(password_hash)


def new_token(prefix: str = "ppt") -> str:
    """A bearer token: a recognisable prefix (secret scanners) and 256 random bits."""
    return f"{prefix}_{secrets.token_urlsafe(32)}"


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_recovery_codes(n: int = 10) -> list[str]:
    """Single-use recovery codes: 16 base32 characters (80 bits) in groups of four."""
    alphabet = "abcdefghijkmnpqrstuvwxyz23456789"
    codes = []
    for _ in range(n):
        raw = "".join(secrets.choice(alphabet) for _ in range(16))
        codes.append("-".join(raw[i : i + 4] for i in range(0, 16, 4)))
    return codes


def recovery_hash(code: str) -> str:
    return hashlib.sha256(code.strip().lower().replace("-", "").encode()).hexdigest()


# The browser session (the API's cookie login, SSO, and the web console share them).
SESSION_COOKIE = "proofplane_session"
CSRF_COOKIE = "proofplane_csrf"
CSRF_HEADER = "x-csrf-token"


def csrf_token(session_token: str) -> str:
    """The CSRF token bound to a browser session (double-submit, derived, not stored)."""
    return hmac.new(session_token.encode(), b"proofplane-csrf", hashlib.sha256).hexdigest()
