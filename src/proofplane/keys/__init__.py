"""Keys: the KMS's values and its ciphertext format. Pure.

``model``: named keys with a purpose (``encrypt``: AES-256-GCM key wrapping for envelope
encryption; ``sign``: Ed25519) and versions, and the errors a KMS answers with. ``envelope``:
how a secret is sealed (a fresh AES-256-GCM data key per secret, wrapped by the key's current
version; the ciphertext names key and version). The backends that hold the key material
(embedded, PKCS#11, OpenBao transit) live in :mod:`proofplane.kms`; the key inventory and its
lifecycle in :mod:`proofplane.service.keys`.
"""

from proofplane.keys.model import (
    ALGORITHMS,
    ENCRYPT,
    PURPOSES,
    SIGN,
    DecryptFailed,
    KeyDisabled,
    KeyExists,
    KeyNotFound,
    KmsError,
    KmsUnavailable,
    WrongPurpose,
    check_key_name,
)

__all__ = [
    "ALGORITHMS",
    "ENCRYPT",
    "PURPOSES",
    "SIGN",
    "DecryptFailed",
    "KeyDisabled",
    "KeyExists",
    "KeyNotFound",
    "KmsError",
    "KmsUnavailable",
    "WrongPurpose",
    "check_key_name",
]
