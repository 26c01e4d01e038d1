"""The backend interface every KMS backend implements, and choosing one from the settings."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from proofplane.keys import KmsError


class Backend(Protocol):
    """Where key material lives. Handles are opaque to callers (bytes stored with each key
    version); material never leaves an HSM or OpenBao, and leaves the embedded keyring only
    sealed under the master key."""

    kind: str  # "local" | "pkcs11" | "openbao"

    def generate(self, purpose: str, label: str) -> bytes:
        """New material for one version of a key (``label``: ``<name>-v<version>``)."""
        ...

    def wrap(self, handle: bytes, data_key: bytes, aad: bytes) -> bytes: ...

    def unwrap(self, handle: bytes, wrapped: bytes, aad: bytes) -> bytes:
        """The data key, or ``DecryptFailed`` (tampered, wrong AAD, another version's)."""
        ...

    def sign(self, handle: bytes, message: bytes) -> bytes:
        """An Ed25519 signature (64 bytes) of ``message``."""
        ...

    def public_key(self, handle: bytes) -> bytes:
        """The raw Ed25519 public key (32 bytes) of a ``sign`` version."""
        ...

    def destroy(self, handle: bytes) -> None:
        """Erase one version's material for good (what it sealed no longer opens)."""
        ...

    def check(self) -> None:
        """Raise ``KmsUnavailable`` when the backend cannot be used now."""
        ...


KINDS = ("local", "pkcs11", "openbao")


def backend_from_env(env: Mapping[str, str]) -> Backend:
    """The backend ``PROOFPLANE_KMS`` names (default ``local``), configured from the rest of
    the environment; a missing or malformed setting is a ``KmsError`` naming it."""
    kind = (env.get("PROOFPLANE_KMS") or "local").strip().lower()
    if kind == "local":
        from proofplane.kms.local import LocalBackend, default_master_key_file

        path = env.get("PROOFPLANE_MASTER_KEY_FILE") or default_master_key_file()
        return LocalBackend.from_file(path, create=True)
    if kind == "pkcs11":
        from proofplane.kms import pkcs11

        return pkcs11.backend_from_env(env)  # type: ignore[no-any-return]
    if kind == "openbao":
        from proofplane.kms import openbao

        return openbao.backend_from_env(env)  # type: ignore[no-any-return]
    raise KmsError(
        f"PROOFPLANE_KMS={kind!r} is not a KMS backend; one of {', '.join(KINDS)}",
        code="invalid_setting",
    )
