"""TPM2_MakeCredential on the server: bind an AK to an EK (TPM 2.0 Library Part 1, §24).

The registrar encrypts a random secret so that only the TPM holding the EK's private key can
recover it, and only for an object whose name is the AK's name (TPM2_ActivateCredential checks
it). A node that answers with the secret proves that AK and EK live in the same TPM.

For an RSA EK (the common case; nameAlg SHA-256, AES-128-CFB symmetric):

    seed        random, |H| bytes
    secret_enc  RSA-OAEP(EK, seed, hash = nameAlg, label = "IDENTITY\\0")
    symKey      KDFa(nameAlg, seed, "STORAGE", name(AK), "", 128)
    encIdentity AES-128-CFB(symKey, IV = 0, TPM2B_DIGEST(secret))
    hmacKey     KDFa(nameAlg, seed, "INTEGRITY", "", "", |H| * 8)
    outerHMAC   HMAC(hmacKey, encIdentity ‖ name(AK))
    credential  TPM2B_ID_OBJECT(TPM2B_DIGEST(outerHMAC) ‖ encIdentity)

ECC EKs (ECDH seed) are not supported yet: :class:`CredentialError` says so.
"""

from __future__ import annotations

import hmac
import os
import struct
from collections.abc import Callable

from cryptography.hazmat.primitives.asymmetric import padding, rsa
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

try:  # cryptography >= 47 moved CFB to the "decrepit" module
    from cryptography.hazmat.decrepit.ciphers.modes import CFB
except ImportError:  # pragma: no cover - older cryptography
    from cryptography.hazmat.primitives.ciphers.modes import CFB  # type: ignore[no-redef]

from proofplane.attest import tpm
from proofplane.attest.errors import AttestError

TOOLS_MAGIC = 0xBADCC0DE  # tpm2-tools' credential file header (tpm2_makecredential -o)
TOOLS_VERSION = 1


class CredentialError(AttestError):
    reason = "credential_error"


def kdfa(hash_alg: int, key: bytes, label: bytes, context_u: bytes, context_v: bytes,
         bits: int) -> bytes:  # fmt: skip
    """KDFa (SP 800-108 counter mode with HMAC), as TPM 2.0 Part 1 §11.4.10.2 defines it.
    ``label`` is given without its terminating zero byte; it is added here."""
    name = tpm.hash_name(hash_alg)
    out = bytearray()
    counter = 1
    while len(out) * 8 < bits:
        msg = struct.pack(">I", counter) + label + b"\0" + context_u + context_v
        out += hmac.new(key, msg + struct.pack(">I", bits), name).digest()
        counter += 1
    return bytes(out[: (bits + 7) // 8])


def make_credential(
    ek_public: bytes, ak_name: bytes, secret: bytes, *, rng: Callable[[int], bytes] = os.urandom
) -> tuple[bytes, bytes]:
    """(TPM2B_ID_OBJECT credential blob, TPM2B_ENCRYPTED_SECRET) for the EK and AK name.

    ``rng`` is injectable so tests can be deterministic; production uses ``os.urandom``.
    """
    ek = tpm.parse_public(ek_public)
    if ek.type != tpm.TPM_ALG_RSA:
        raise CredentialError(
            "only RSA EKs are supported for MakeCredential", reason="ek_unsupported"
        )
    if ek.symmetric != tpm.TPM_ALG_AES or ek.sym_mode != tpm.TPM_ALG_CFB:
        raise CredentialError(
            "the EK's symmetric algorithm is not AES-CFB", reason="ek_unsupported"
        )
    if not ek.object_attributes & tpm.RESTRICTED or not ek.object_attributes & tpm.DECRYPT:
        raise CredentialError("the EK is not a restricted decryption key", reason="ek_unsupported")
    digest_size = tpm.HASH_ALGS[ek.name_alg][1]
    if len(secret) > digest_size:
        raise CredentialError(f"the secret is longer than {digest_size} bytes")
    key = ek.public_key()
    assert isinstance(key, rsa.RSAPublicKey)
    h = tpm.crypto_hash(ek.name_alg)
    seed = rng(digest_size)
    enc_seed = key.encrypt(
        seed, padding.OAEP(mgf=padding.MGF1(h), algorithm=h, label=b"IDENTITY\0")
    )
    sym_key = kdfa(ek.name_alg, seed, b"STORAGE", ak_name, b"", ek.sym_bits)
    plain = struct.pack(">H", len(secret)) + secret
    enc = Cipher(algorithms.AES(sym_key), CFB(bytes(16))).encryptor()
    enc_identity = enc.update(plain) + enc.finalize()
    hmac_key = kdfa(ek.name_alg, seed, b"INTEGRITY", b"", b"", digest_size * 8)
    outer = hmac.new(hmac_key, enc_identity + ak_name, tpm.hash_name(ek.name_alg)).digest()
    id_object = struct.pack(">H", len(outer)) + outer + enc_identity
    return (
        struct.pack(">H", len(id_object)) + id_object,
        struct.pack(">H", len(enc_seed)) + enc_seed,
    )


def tpm2_tools_credential_file(credential_blob: bytes, encrypted_secret: bytes) -> bytes:
    """The file ``tpm2_activatecredential -i`` reads: magic, version, both TPM2B structures."""
    return struct.pack(">II", TOOLS_MAGIC, TOOLS_VERSION) + credential_blob + encrypted_secret
