"""The envelope ciphertext: what a sealed secret looks like at rest. Pure.

``seal`` draws a fresh AES-256-GCM data key, encrypts the plaintext under it, and hands the
data key to ``wrap`` (the KMS key's current version wraps it, in the embedded keyring, the HSM
or OpenBao). The text stored is::

    ppk1.<key name>.<version>.<wrapped data key, base64url>.<nonce ‖ ciphertext ‖ tag, base64url>

The caller's ``aad`` (the row's identity: ``users/42/totp_secret``) is bound into both the
wrapping and the data encryption, together with the key name and version, so a ciphertext
copied to another row, key or version does not open.
"""

from __future__ import annotations

import base64
import binascii
import os
from collections.abc import Callable
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from proofplane.errors import ValidationFailed
from proofplane.keys.model import DecryptFailed, check_key_name

PREFIX = "ppk1"
DATA_KEY_BYTES = 32
NONCE_BYTES = 12

Wrap = Callable[[bytes, bytes], bytes]  # (data key, aad) -> wrapped
Unwrap = Callable[[bytes, bytes], bytes]  # (wrapped, aad) -> data key


@dataclass(frozen=True, slots=True)
class Envelope:
    key: str
    version: int
    wrapped: bytes
    sealed: bytes  # nonce ‖ ciphertext ‖ tag

    def text(self) -> str:
        return ".".join(
            [PREFIX, self.key, str(self.version), _b64(self.wrapped), _b64(self.sealed)]
        )


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def bound_aad(key: str, version: int, aad: bytes) -> bytes:
    """What the data key and the secret are bound to: key, version and the caller's AAD."""
    return f"{PREFIX}:{key}:{version}:".encode() + aad


def is_ciphertext(text: object) -> bool:
    return isinstance(text, str) and text.startswith(PREFIX + ".")


def parse(text: str) -> Envelope:
    """The parts of a stored ciphertext, or DecryptFailed."""
    if not is_ciphertext(text):
        raise DecryptFailed("not a proofplane ciphertext")
    parts = text.split(".")
    if len(parts) != 5 or not parts[2].isdigit():
        raise DecryptFailed("malformed ciphertext")
    try:
        check_key_name(parts[1])
        wrapped, sealed = _unb64(parts[3]), _unb64(parts[4])
    except (binascii.Error, ValueError, ValidationFailed):
        raise DecryptFailed("malformed ciphertext") from None
    if len(sealed) < NONCE_BYTES + 16 or not wrapped:
        raise DecryptFailed("malformed ciphertext")
    return Envelope(parts[1], int(parts[2]), wrapped, sealed)


def seal(
    plaintext: bytes,
    aad: bytes,
    *,
    key: str,
    version: int,
    wrap: Wrap,
    random: Callable[[int], bytes] = os.urandom,
) -> Envelope:
    bound = bound_aad(key, version, aad)
    data_key = random(DATA_KEY_BYTES)
    nonce = random(NONCE_BYTES)
    sealed = nonce + AESGCM(data_key).encrypt(nonce, plaintext, bound)
    return Envelope(key, version, wrap(data_key, bound), sealed)


def open_envelope(envelope: Envelope, aad: bytes, *, unwrap: Unwrap) -> bytes:
    """The plaintext, or DecryptFailed (tampered, or another row's, key's or version's)."""
    bound = bound_aad(envelope.key, envelope.version, aad)
    data_key = unwrap(envelope.wrapped, bound)
    if len(data_key) != DATA_KEY_BYTES:
        raise DecryptFailed("the data key does not unwrap")
    nonce, body = envelope.sealed[:NONCE_BYTES], envelope.sealed[NONCE_BYTES:]
    try:
        return AESGCM(data_key).decrypt(nonce, body, bound)
    except InvalidTag:
        raise DecryptFailed(
            "the ciphertext does not authenticate (tampered, or another row's)"
        ) from None
