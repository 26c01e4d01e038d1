"""Key names, purposes and the KMS's errors. Pure."""

from __future__ import annotations

import re

from proofplane.errors import Conflict, InvalidState, NotFound, Unavailable, ValidationFailed

ENCRYPT = "encrypt"
SIGN = "sign"
PURPOSES = (ENCRYPT, SIGN)
#: the algorithm of each purpose's key material
ALGORITHMS = {ENCRYPT: "aes256-gcm", SIGN: "ed25519"}

_NAME = re.compile(r"^[a-z][a-z0-9-]{0,62}$")


class KmsError(ValidationFailed):
    """A KMS refusal that is the caller's to fix (a wrong PIN, a bad master key file…)."""

    code = "kms_error"


class KmsUnavailable(Unavailable):
    """The KMS cannot be reached or used now (an HSM or OpenBao down): nothing is decrypted
    in the clear, nothing is signed; the caller retries."""

    code = "kms_unavailable"


class KeyNotFound(NotFound):
    code = "key_not_found"


class KeyExists(Conflict):
    code = "key_exists"


class KeyDisabled(InvalidState):
    """The key (or the version a ciphertext names) is disabled or destroyed."""

    code = "key_disabled"


class WrongPurpose(ValidationFailed):
    code = "key_wrong_purpose"


class DecryptFailed(ValidationFailed):
    """Not a ciphertext of ours, tampered with, or sealed for another row (AAD)."""

    code = "decrypt_failed"


def check_key_name(name: str) -> str:
    """A key name: lowercase letters, digits and '-', starting with a letter, at most 63."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValidationFailed(
            "a key name is 1-63 lowercase letters, digits or '-', starting with a letter",
            code="invalid_key_name",
            details={"name": name if isinstance(name, str) else None},
        )
    return name
