"""The embedded KMS backend: each key version's material (an AES-256 key-encryption key or an
Ed25519 seed, 32 random bytes) is sealed with AES-256-GCM under the master key, and the sealed
blob is the version's handle (kept in the key inventory, in the database). The master key is 32
random bytes in ``PROOFPLANE_MASTER_KEY_FILE``, created 0600 on first start; a file other users
can read is refused. Without the master key file nothing the keyring sealed opens."""

from __future__ import annotations

import base64
import binascii
import os
import stat
from pathlib import Path

import platformdirs
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from proofplane.keys import ENCRYPT, PURPOSES, SIGN, DecryptFailed, KmsError

MASTER_KEY_BYTES = 32
_HANDLE = b"ppl1"  # handle format: b"ppl1" ‖ purpose byte ‖ nonce ‖ sealed material
_PURPOSE_BYTE = {ENCRYPT: b"e", SIGN: b"s"}


def default_master_key_file() -> str:
    return str(Path(platformdirs.user_data_dir("proofplane")) / "master.key")


def _insecure(mode: int) -> bool:
    return bool(mode & (stat.S_IRWXG | stat.S_IRWXO))


def read_master_key(path: str | Path, *, create: bool = False) -> bytes:
    """The master key in ``path`` (base64 text of 32 bytes). ``create``: make a fresh one
    (0600, never overwriting) when the file does not exist."""
    p = Path(path)
    if create and not p.exists():
        p.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        key = os.urandom(MASTER_KEY_BYTES)
        try:
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            pass  # another process made it first: read theirs
        else:
            with os.fdopen(fd, "w") as fh:
                fh.write(base64.b64encode(key).decode("ascii") + "\n")
                fh.flush()
                os.fsync(fh.fileno())
    try:
        st = p.stat()
        if not stat.S_ISREG(st.st_mode):
            raise KmsError(f"the master key file {p} is not a regular file",
                           code="master_key_invalid")  # fmt: skip
        if _insecure(st.st_mode):
            raise KmsError(
                f"the master key file {p} can be read by other users: run chmod 600 {p}",
                code="master_key_insecure",
            )
        text = p.read_text("ascii").strip()
    except FileNotFoundError:
        raise KmsError(f"the master key file {p} does not exist (PROOFPLANE_MASTER_KEY_FILE)",
                       code="master_key_missing") from None  # fmt: skip
    except (OSError, UnicodeDecodeError) as exc:
        raise KmsError(f"cannot read the master key file {p}: {exc}",
                       code="master_key_invalid") from None  # fmt: skip
    try:
        key = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        key = b""
    if len(key) != MASTER_KEY_BYTES:
        raise KmsError(f"the master key file {p} does not hold a 32-byte key (base64)",
                       code="master_key_invalid")  # fmt: skip
    return key


class LocalBackend:
    """Key versions sealed under one master key (see the module's docstring)."""

    kind = "local"

    def __init__(self, master_key: bytes) -> None:
        if len(master_key) != MASTER_KEY_BYTES:
            raise KmsError("the master key is 32 bytes", code="master_key_invalid")
        self._master = AESGCM(master_key)
        self._material: dict[bytes, tuple[str, bytes]] = {}
        self._signers: dict[bytes, Ed25519PrivateKey] = {}

    @classmethod
    def from_file(cls, path: str | Path, *, create: bool = False) -> LocalBackend:
        return cls(read_master_key(path, create=create))

    def _open(self, handle: bytes) -> tuple[str, bytes]:
        cached = self._material.get(handle)
        if cached is not None:
            return cached
        if not handle.startswith(_HANDLE) or len(handle) < len(_HANDLE) + 1 + 12 + 16:
            raise DecryptFailed("not a key handle of the local keyring")
        kind = handle[len(_HANDLE) : len(_HANDLE) + 1]
        purpose = next((p for p, b in _PURPOSE_BYTE.items() if b == kind), None)
        if purpose is None:
            raise DecryptFailed("not a key handle of the local keyring")
        nonce = handle[len(_HANDLE) + 1 : len(_HANDLE) + 13]
        try:
            material = self._master.decrypt(nonce, handle[len(_HANDLE) + 13 :], _HANDLE + kind)
        except InvalidTag:
            raise KmsError(
                "a key of the keyring does not open under this master key (wrong "
                "PROOFPLANE_MASTER_KEY_FILE?)",
                code="master_key_mismatch",
            ) from None
        self._material[handle] = (purpose, material)
        return purpose, material

    def _key(self, handle: bytes, purpose: str) -> bytes:
        got, material = self._open(handle)
        if got != purpose:
            raise DecryptFailed(f"this key version is for {got}, not {purpose}")
        return material

    def generate(self, purpose: str, label: str) -> bytes:
        if purpose not in PURPOSES:
            raise KmsError(f"unknown key purpose {purpose!r}", code="key_wrong_purpose")
        material = os.urandom(32)
        kind = _PURPOSE_BYTE[purpose]
        nonce = os.urandom(12)
        handle = _HANDLE + kind + nonce + self._master.encrypt(nonce, material, _HANDLE + kind)
        self._material[handle] = (purpose, material)
        return handle

    def wrap(self, handle: bytes, data_key: bytes, aad: bytes) -> bytes:
        nonce = os.urandom(12)
        return nonce + AESGCM(self._key(handle, ENCRYPT)).encrypt(nonce, data_key, aad)

    def unwrap(self, handle: bytes, wrapped: bytes, aad: bytes) -> bytes:
        kek = self._key(handle, ENCRYPT)
        try:
            return AESGCM(kek).decrypt(wrapped[:12], wrapped[12:], aad)
        except (InvalidTag, ValueError):
            raise DecryptFailed(
                "the data key does not unwrap (tampered, or another row's)"
            ) from None

    def _signer(self, handle: bytes) -> Ed25519PrivateKey:
        signer = self._signers.get(handle)
        if signer is None:
            signer = Ed25519PrivateKey.from_private_bytes(self._key(handle, SIGN))
            self._signers[handle] = signer
        return signer

    def sign(self, handle: bytes, message: bytes) -> bytes:
        return self._signer(handle).sign(message)

    def public_key(self, handle: bytes) -> bytes:
        return self._signer(handle).public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)

    def destroy(self, handle: bytes) -> None:
        # The material is only ever stored sealed in the handle, which the inventory erases;
        # here the process forgets its cached copy.
        self._material.pop(handle, None)
        self._signers.pop(handle, None)

    def check(self) -> None:
        return None
