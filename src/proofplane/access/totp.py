"""TOTP (RFC 6238, HMAC-SHA1, 6 digits, 30-second steps), pure: the caller passes the time.

A code is accepted for the current step and one step either side (clock drift), and only for
a step later than the last one accepted, so a code, once used, never works again
(NIST SP 800-63B 5.1.4.2).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import struct
from urllib.parse import quote, urlencode

STEP_SECONDS = 30
DIGITS = 6
DRIFT_STEPS = 1


def new_secret() -> str:
    """A 160-bit secret in unpadded base32, as authenticator apps expect."""
    return base64.b32encode(secrets.token_bytes(20)).decode().rstrip("=")


def _key(secret: str) -> bytes:
    return base64.b32decode(secret.upper() + "=" * (-len(secret) % 8))


def step_at(unix_time: float) -> int:
    return int(unix_time // STEP_SECONDS)


def code_at_step(secret: str, step: int, *, digits: int = DIGITS, digest: str = "sha1") -> str:
    """The HOTP value (RFC 4226) for counter ``step``."""
    mac = hmac.new(_key(secret), struct.pack(">Q", step), getattr(hashlib, digest)).digest()
    offset = mac[-1] & 0x0F
    value = struct.unpack(">I", mac[offset : offset + 4])[0] & 0x7FFFFFFF
    return str(value % 10**digits).zfill(digits)


def verify(secret: str, code: str, unix_time: float, last_step: int | None) -> int | None:
    """The step ``code`` matches (to store as the new ``last_step``), or None.

    None for a wrong code, a code outside ±1 step, or a code for a step not later than
    ``last_step`` (a replay).
    """
    code = code.strip().replace(" ", "")
    if len(code) != DIGITS or not code.isdigit():
        return None
    now = step_at(unix_time)
    for step in range(now - DRIFT_STEPS, now + DRIFT_STEPS + 1):
        if last_step is not None and step <= last_step:
            continue
        if hmac.compare_digest(code_at_step(secret, step), code):
            return step
    return None


def provisioning_uri(secret: str, account: str, issuer: str) -> str:
    """The ``otpauth://`` URI authenticator apps read (usually from a QR code)."""
    label = quote(f"{issuer}:{account}", safe="")
    query = urlencode(
        {
            "secret": secret,
            "issuer": issuer,
            "algorithm": "SHA1",
            "digits": DIGITS,
            "period": STEP_SECONDS,
        }
    )
    return f"otpauth://totp/{label}?{query}"
