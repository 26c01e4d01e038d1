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

For an ECC EK (Part 1 §24.4 and Annex C.6.4, "Secret Sharing" with one-pass ECDH) only the
seed differs; everything from symKey on is the same:

    d_e, Q_e    ephemeral key pair on the EK's curve (fresh for every credential)
    Z           x-coordinate of d_e · Q_ek, padded to the curve's size
    seed        KDFe(nameAlg, Z, "IDENTITY\\0", Q_e.x, Q_ek.x, |H| * 8)
    secret_enc  TPMS_ECC_POINT(Q_e)

NIST P-256, P-384 and P-521 EKs are supported; other curves (BN, SM2) raise
:class:`CredentialError`, as does an EK whose point is not on its curve.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from collections.abc import Callable

from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

try:  # cryptography >= 47 moved CFB to the "decrepit" module
    from cryptography.hazmat.decrepit.ciphers.modes import CFB
except ImportError:  # pragma: no cover - older cryptography
    from cryptography.hazmat.primitives.ciphers.modes import CFB

from proofplane.attest import tpm
from proofplane.attest.errors import AttestError, TpmStructError

__all__ = [
    "CFB",  # re-exported: the mode TPM 2.0 credential blobs use, from wherever cryptography has it
    "TOOLS_MAGIC",
    "TOOLS_VERSION",
    "CredentialError",
    "kdfa",
    "kdfe",
    "make_credential",
    "tpm2_tools_credential_file",
]

TOOLS_MAGIC = 0xBADCC0DE  # tpm2-tools' credential file header (tpm2_makecredential -o)
TOOLS_VERSION = 1


class CredentialError(AttestError):
    code = "credential_error"


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


#: Group orders of the curves an ECC EK may use (SEC 2 / FIPS 186-4), for the ephemeral scalar.
_CURVE_ORDERS = {
    tpm.TPM_ECC_NIST_P256: int(
        "ffffffff00000000ffffffffffffffffbce6faada7179e84f3b9cac2fc632551", 16
    ),
    tpm.TPM_ECC_NIST_P384: int(
        "ffffffffffffffffffffffffffffffffffffffffffffffffc7634d81f4372ddf"
        "581a0db248b0a77aecec196accc52973",
        16,
    ),
    tpm.TPM_ECC_NIST_P521: int(
        "01ffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff"
        "fa51868783bf2f966b7fcc0148f709a5d03bb5c9b8899c47aebb6fb71e91386409",
        16,
    ),
}


def kdfe(hash_alg: int, z: bytes, use: bytes, party_u: bytes, party_v: bytes,
         bits: int) -> bytes:  # fmt: skip
    """KDFe (SP 800-56A concatenation KDF), as TPM 2.0 Part 1 §11.4.10.3 defines it:
    H(counter ‖ Z ‖ use ‖ PartyUInfo ‖ PartyVInfo) for counter = 1, 2, …, truncated to ``bits``.
    ``use`` is given without its terminating zero byte; it is added here."""
    name = tpm.hash_name(hash_alg)
    out = bytearray()
    counter = 1
    while len(out) * 8 < bits:
        h = hashlib.new(name, struct.pack(">I", counter) + z + use + b"\0" + party_u + party_v)
        out += h.digest()
        counter += 1
    return bytes(out[: (bits + 7) // 8])


def _rsa_seed(ek: tpm.Public, digest_size: int, rng: Callable[[int], bytes]) -> tuple[bytes, bytes]:
    """(seed, TPM2B_ENCRYPTED_SECRET contents) for an RSA EK: OAEP with label "IDENTITY"."""
    key = ek.public_key()
    assert isinstance(key, rsa.RSAPublicKey)
    h = tpm.crypto_hash(ek.name_alg)
    seed = rng(digest_size)
    enc_seed = key.encrypt(
        seed, padding.OAEP(mgf=padding.MGF1(h), algorithm=h, label=b"IDENTITY\0")
    )
    return seed, enc_seed


def _ecc_seed(ek: tpm.Public, digest_size: int, rng: Callable[[int], bytes]) -> tuple[bytes, bytes]:
    """(seed, TPMS_ECC_POINT of the ephemeral key) for an ECC EK: one-pass ECDH + KDFe."""
    order = _CURVE_ORDERS.get(ek.curve)
    if order is None:
        raise CredentialError(
            f"the EK's curve 0x{ek.curve:04x} is not supported (NIST P-256/384/521 only)",
            reason="ek_unsupported",
        )
    try:
        ek_key = ek.public_key()
    except TpmStructError as exc:
        raise CredentialError(f"the EK is not a valid ECC key: {exc.message}",
                              reason="ek_invalid") from None  # fmt: skip
    assert isinstance(ek_key, ec.EllipticCurvePublicKey)
    size = (ek_key.curve.key_size + 7) // 8
    # the ephemeral scalar from rng: 64 extra bits make the reduction's bias negligible
    # (FIPS 186-4 B.4.1); rng stays the only source of randomness, so tests are deterministic
    scalar = int.from_bytes(rng(size + 8), "big") % (order - 1) + 1
    ephemeral = ec.derive_private_key(scalar, ek_key.curve)
    z = ephemeral.exchange(ec.ECDH(), ek_key)  # x-coordinate of d_e·Q_ek, padded to size
    pub = ephemeral.public_key().public_numbers()
    qx, qy = pub.x.to_bytes(size, "big"), pub.y.to_bytes(size, "big")
    seed = kdfe(ek.name_alg, z, b"IDENTITY", qx, ek.x, digest_size * 8)
    point = struct.pack(">H", len(qx)) + qx + struct.pack(">H", len(qy)) + qy
    return seed, point


def make_credential(
    ek_public: bytes, ak_name: bytes, secret: bytes, *, rng: Callable[[int], bytes] = os.urandom
) -> tuple[bytes, bytes]:
    """(TPM2B_ID_OBJECT credential blob, TPM2B_ENCRYPTED_SECRET) for the EK and AK name.

    ``rng`` is injectable so tests can be deterministic; production uses ``os.urandom``.
    """
    try:
        ek = tpm.parse_public(ek_public)
    except TpmStructError as exc:
        raise CredentialError(f"the EK public area is invalid: {exc.message}",
                              reason="ek_invalid") from None  # fmt: skip
    if ek.type not in (tpm.TPM_ALG_RSA, tpm.TPM_ALG_ECC):
        raise CredentialError(
            "only RSA and ECC EKs are supported for MakeCredential", reason="ek_unsupported"
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
    if ek.type == tpm.TPM_ALG_RSA:
        seed, enc_seed = _rsa_seed(ek, digest_size, rng)
    else:
        seed, enc_seed = _ecc_seed(ek, digest_size, rng)
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
