"""TPM 2.0 structures the verifier reads: TPMS_ATTEST (quote), TPMT_SIGNATURE, TPMT_PUBLIC.

Everything here is big-endian TPM marshalling (TPM 2.0 Library, Part 2). Parsers take bytes and
return frozen values, or raise :class:`TpmStructError` with a reason; they never trust a length
field without checking it against the bytes actually present. The ``marshal_*`` functions are the
inverse, used by the simulated attester and by tests that build evidence with a software key.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from proofplane.attest.errors import TpmStructError

# --- constants (TPM 2.0 Library, Part 2) ---------------------------------------------------------
TPM_GENERATED_VALUE: Final = 0xFF544347
TPM_ST_ATTEST_QUOTE: Final = 0x8018

TPM_ALG_RSA: Final = 0x0001
TPM_ALG_SHA1: Final = 0x0004
TPM_ALG_HMAC: Final = 0x0005
TPM_ALG_AES: Final = 0x0006
TPM_ALG_KEYEDHASH: Final = 0x0008
TPM_ALG_SHA256: Final = 0x000B
TPM_ALG_SHA384: Final = 0x000C
TPM_ALG_SHA512: Final = 0x000D
TPM_ALG_NULL: Final = 0x0010
TPM_ALG_SM3_256: Final = 0x0012
TPM_ALG_RSASSA: Final = 0x0014
TPM_ALG_RSAPSS: Final = 0x0016
TPM_ALG_OAEP: Final = 0x0017
TPM_ALG_ECDSA: Final = 0x0018
TPM_ALG_ECDAA: Final = 0x001A
TPM_ALG_ECSCHNORR: Final = 0x001C
TPM_ALG_ECC: Final = 0x0023
TPM_ALG_SYMCIPHER: Final = 0x0025
TPM_ALG_CFB: Final = 0x0043

TPM_ECC_NIST_P256: Final = 0x0003
TPM_ECC_NIST_P384: Final = 0x0004
TPM_ECC_NIST_P521: Final = 0x0005

TPM_RH_ENDORSEMENT: Final = 0x4000000B

# TPMA_OBJECT bits
FIXED_TPM: Final = 1 << 1
ST_CLEAR: Final = 1 << 2
FIXED_PARENT: Final = 1 << 4
SENSITIVE_DATA_ORIGIN: Final = 1 << 5
USER_WITH_AUTH: Final = 1 << 6
ADMIN_WITH_POLICY: Final = 1 << 7
NO_DA: Final = 1 << 10
ENCRYPTED_DUPLICATION: Final = 1 << 11
RESTRICTED: Final = 1 << 16
DECRYPT: Final = 1 << 17
SIGN_ENCRYPT: Final = 1 << 18

OBJECT_ATTRIBUTE_NAMES: Final = {
    FIXED_TPM: "fixedTPM",
    ST_CLEAR: "stClear",
    FIXED_PARENT: "fixedParent",
    SENSITIVE_DATA_ORIGIN: "sensitiveDataOrigin",
    USER_WITH_AUTH: "userWithAuth",
    ADMIN_WITH_POLICY: "adminWithPolicy",
    NO_DA: "noDA",
    ENCRYPTED_DUPLICATION: "encryptedDuplication",
    RESTRICTED: "restricted",
    DECRYPT: "decrypt",
    SIGN_ENCRYPT: "sign",
}

#: hash algorithm id → (bank name, digest size, hashlib name)
HASH_ALGS: Final[dict[int, tuple[str, int, str]]] = {
    TPM_ALG_SHA1: ("sha1", 20, "sha1"),
    TPM_ALG_SHA256: ("sha256", 32, "sha256"),
    TPM_ALG_SHA384: ("sha384", 48, "sha384"),
    TPM_ALG_SHA512: ("sha512", 64, "sha512"),
    TPM_ALG_SM3_256: ("sm3_256", 32, "sm3"),
}
BANK_ALGS: Final[dict[str, int]] = {v[0]: k for k, v in HASH_ALGS.items()}

_CRYPTO_HASHES: Final[dict[int, type[hashes.HashAlgorithm]]] = {
    TPM_ALG_SHA1: hashes.SHA1,
    TPM_ALG_SHA256: hashes.SHA256,
    TPM_ALG_SHA384: hashes.SHA384,
    TPM_ALG_SHA512: hashes.SHA512,
}
_CURVES: Final[dict[int, type[ec.EllipticCurve]]] = {
    TPM_ECC_NIST_P256: ec.SECP256R1,
    TPM_ECC_NIST_P384: ec.SECP384R1,
    TPM_ECC_NIST_P521: ec.SECP521R1,
}
_CURVE_IDS: Final[dict[str, int]] = {
    "secp256r1": TPM_ECC_NIST_P256,
    "secp384r1": TPM_ECC_NIST_P384,
    "secp521r1": TPM_ECC_NIST_P521,
}


def hash_name(alg: int) -> str:
    """The hashlib name of a TPM hash algorithm id; TpmStructError for an unknown one."""
    try:
        return HASH_ALGS[alg][2]
    except KeyError:
        raise TpmStructError(
            f"unsupported hash algorithm 0x{alg:04x}", reason="unsupported_hash"
        ) from None


def crypto_hash(alg: int) -> hashes.HashAlgorithm:
    """The ``cryptography`` hash object for a TPM hash algorithm id."""
    try:
        return _CRYPTO_HASHES[alg]()
    except KeyError:
        raise TpmStructError(
            f"unsupported hash algorithm 0x{alg:04x}", reason="unsupported_hash"
        ) from None


def digest(alg: int, data: bytes) -> bytes:
    """H_alg(data)."""
    return hashlib.new(hash_name(alg), data).digest()


# --- reader ---------------------------------------------------------------------------------------
_Unpack = Callable[[bytes, int], tuple[int]]  # one unsigned integer at an offset
_BE8: Final[_Unpack] = struct.Struct(">B").unpack_from
_BE16: Final[_Unpack] = struct.Struct(">H").unpack_from
_BE32: Final[_Unpack] = struct.Struct(">I").unpack_from
_BE64: Final[_Unpack] = struct.Struct(">Q").unpack_from


class Reader:
    """A bounds-checked big-endian cursor over bytes."""

    __slots__ = ("buf", "pos", "what", "size")

    def __init__(self, buf: bytes, what: str = "structure") -> None:
        self.buf = bytes(buf)
        self.pos = 0
        self.what = what
        self.size = len(self.buf)

    def _short(self, n: int) -> TpmStructError:
        return TpmStructError(
            f"{self.what} truncated: need {n} bytes at offset {self.pos}, "
            f"have {self.size - self.pos}",
            reason="truncated",
        )

    def take(self, n: int) -> bytes:
        pos = self.pos
        end = pos + n
        if n < 0 or end > self.size:
            raise self._short(n)
        self.pos = end
        return self.buf[pos:end]

    # The fixed-size reads unpack in place (no intermediate slice): parsing a quote, its
    # signature and the AK is on every verdict's path.
    def u8(self) -> int:
        pos = self.pos
        if pos + 1 > self.size:
            raise self._short(1)
        self.pos = pos + 1
        return _BE8(self.buf, pos)[0]

    def u16(self) -> int:
        pos = self.pos
        if pos + 2 > self.size:
            raise self._short(2)
        self.pos = pos + 2
        return _BE16(self.buf, pos)[0]

    def u32(self) -> int:
        pos = self.pos
        if pos + 4 > self.size:
            raise self._short(4)
        self.pos = pos + 4
        return _BE32(self.buf, pos)[0]

    def u64(self) -> int:
        pos = self.pos
        if pos + 8 > self.size:
            raise self._short(8)
        self.pos = pos + 8
        return _BE64(self.buf, pos)[0]

    def tpm2b(self, limit: int | None = None) -> bytes:
        size = self.u16()
        if limit is not None and size > limit:
            raise TpmStructError(
                f"{self.what}: TPM2B size {size} exceeds {limit}", reason="oversize"
            )
        return self.take(size)

    def done(self) -> None:
        if self.pos != self.size:
            raise TpmStructError(
                f"{self.what}: {self.size - self.pos} trailing bytes", reason="trailing_bytes"
            )


def _b(data: bytes) -> bytes:
    """Marshal a TPM2B: u16 size ‖ data."""
    return struct.pack(">H", len(data)) + data


# --- PCR selection --------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class PcrSelection:
    """One TPMS_PCR_SELECTION: a hash bank and the PCR indexes selected in it (ascending)."""

    hash_alg: int
    pcrs: tuple[int, ...]

    @property
    def bank(self) -> str:
        return HASH_ALGS.get(self.hash_alg, (f"0x{self.hash_alg:04x}",))[0]


def parse_pcr_selection(r: Reader) -> tuple[PcrSelection, ...]:
    count = r.u32()
    if count > 16:
        raise TpmStructError(f"TPML_PCR_SELECTION count {count} > 16", reason="oversize")
    out = []
    for _ in range(count):
        alg = r.u16()
        size = r.u8()
        if size > 4:  # 32 PCRs at most; real TPMs use 3
            raise TpmStructError(f"sizeofSelect {size} > 4", reason="oversize")
        out.append(PcrSelection(alg, _selected(r.take(size))))
    return tuple(out)


# bit positions set in each byte value: pcrSelect bitmaps are read a byte at a time
_BITS: Final = tuple(tuple(i for i in range(8) if b >> i & 1) for b in range(256))


def _selected(bits: bytes) -> tuple[int, ...]:
    """The PCR indexes set in a pcrSelect bitmap, ascending."""
    return tuple(8 * k + i for k, b in enumerate(bits) for i in _BITS[b])


def marshal_pcr_selection(selections: tuple[PcrSelection, ...]) -> bytes:
    out = bytearray(struct.pack(">I", len(selections)))
    for sel in selections:
        bits = bytearray(3)
        for i in sel.pcrs:
            if not 0 <= i < 24:
                raise ValueError(f"PCR index {i} out of range")
            bits[i // 8] |= 1 << (i % 8)
        out += struct.pack(">HB", sel.hash_alg, 3) + bits
    return bytes(out)


# --- TPMS_ATTEST ----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ClockInfo:
    """TPMS_CLOCK_INFO: the TPM's monotonic clock (ms), reboot and restart counters."""

    clock: int
    reset_count: int
    restart_count: int
    safe: bool

    def to_json(self) -> dict[str, int | bool]:
        return {
            "clock": self.clock,
            "reset_count": self.reset_count,
            "restart_count": self.restart_count,
            "safe": self.safe,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ClockInfo:
        return cls(
            clock=int(data["clock"]),
            reset_count=int(data["reset_count"]),
            restart_count=int(data["restart_count"]),
            safe=bool(data["safe"]),
        )


@dataclass(frozen=True, slots=True)
class Attest:
    """A parsed TPMS_ATTEST of type TPM_ST_ATTEST_QUOTE (other types are rejected)."""

    magic: int
    type: int
    qualified_signer: bytes
    extra_data: bytes
    clock_info: ClockInfo
    firmware_version: int
    pcr_select: tuple[PcrSelection, ...]
    pcr_digest: bytes


def parse_attest(data: bytes) -> Attest:
    """Parse TPMS_ATTEST bytes (the message a quote signs). Checks magic and type."""
    r = Reader(data, "TPMS_ATTEST")
    magic = r.u32()
    if magic != TPM_GENERATED_VALUE:
        raise TpmStructError(f"magic 0x{magic:08x} is not TPM_GENERATED_VALUE", reason="bad_magic")
    typ = r.u16()
    if typ != TPM_ST_ATTEST_QUOTE:
        raise TpmStructError(f"attestation type 0x{typ:04x} is not a quote", reason="not_a_quote")
    signer = r.tpm2b(limit=2 + 64)
    extra = r.tpm2b(limit=64)
    clock = ClockInfo(r.u64(), r.u32(), r.u32(), bool(r.u8()))
    fw = r.u64()
    sel = parse_pcr_selection(r)
    pcr_digest = r.tpm2b(limit=64)
    r.done()
    return Attest(magic, typ, signer, extra, clock, fw, sel, pcr_digest)


def marshal_attest(att: Attest) -> bytes:
    c = att.clock_info
    return (
        struct.pack(">IH", att.magic, att.type)
        + _b(att.qualified_signer)
        + _b(att.extra_data)
        + struct.pack(">QIIB", c.clock, c.reset_count, c.restart_count, int(c.safe))
        + struct.pack(">Q", att.firmware_version)
        + marshal_pcr_selection(att.pcr_select)
        + _b(att.pcr_digest)
    )


# --- TPMT_SIGNATURE -------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Signature:
    """TPMT_SIGNATURE: RSASSA/RSAPSS carry ``sig``; ECDSA carries ``r`` and ``s``."""

    sig_alg: int
    hash_alg: int
    sig: bytes = b""
    r: int = 0
    s: int = 0


def parse_signature(data: bytes) -> Signature:
    """Parse TPMT_SIGNATURE (RSASSA, RSAPSS or ECDSA)."""
    rd = Reader(data, "TPMT_SIGNATURE")
    alg = rd.u16()
    if alg in (TPM_ALG_RSASSA, TPM_ALG_RSAPSS):
        h = rd.u16()
        crypto_hash(h)
        sig = rd.tpm2b(limit=512)
        rd.done()
        return Signature(alg, h, sig=sig)
    if alg == TPM_ALG_ECDSA:
        h = rd.u16()
        crypto_hash(h)
        r = int.from_bytes(rd.tpm2b(limit=66), "big")
        s = int.from_bytes(rd.tpm2b(limit=66), "big")
        rd.done()
        return Signature(alg, h, r=r, s=s)
    raise TpmStructError(f"signature algorithm 0x{alg:04x} not supported", reason="unsupported_sig")


def marshal_signature(sig: Signature) -> bytes:
    if sig.sig_alg == TPM_ALG_ECDSA:
        n = max(32, (max(sig.r.bit_length(), sig.s.bit_length()) + 7) // 8)
        return (
            struct.pack(">HH", sig.sig_alg, sig.hash_alg)
            + _b(sig.r.to_bytes(n, "big"))
            + _b(sig.s.to_bytes(n, "big"))
        )
    return struct.pack(">HH", sig.sig_alg, sig.hash_alg) + _b(sig.sig)


# --- TPMT_PUBLIC ----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Public:
    """A parsed TPMT_PUBLIC of an RSA or ECC key. ``raw`` is the TPMT_PUBLIC marshalling."""

    type: int
    name_alg: int
    object_attributes: int
    auth_policy: bytes
    symmetric: int  # TPM_ALG_NULL for signing keys
    sym_bits: int
    sym_mode: int
    scheme: int
    scheme_hash: int
    rsa_bits: int = 0
    exponent: int = 0
    modulus: bytes = b""
    curve: int = 0
    kdf: int = TPM_ALG_NULL
    x: bytes = b""
    y: bytes = b""
    raw: bytes = b""

    @property
    def name(self) -> bytes:
        """TPM name: nameAlg ‖ H_nameAlg(TPMT_PUBLIC)."""
        return struct.pack(">H", self.name_alg) + digest(self.name_alg, self.raw)

    def attribute_names(self) -> list[str]:
        return [n for bit, n in OBJECT_ATTRIBUTE_NAMES.items() if self.object_attributes & bit]

    def public_key(self) -> rsa.RSAPublicKey | ec.EllipticCurvePublicKey:
        """The key as a ``cryptography`` public key."""
        if self.type == TPM_ALG_RSA:
            e = self.exponent or 65537
            return rsa.RSAPublicNumbers(e, int.from_bytes(self.modulus, "big")).public_key()
        try:
            curve = _CURVES[self.curve]()
        except KeyError:
            raise TpmStructError(
                f"curve 0x{self.curve:04x} not supported", reason="unsupported_curve"
            ) from None
        nums = ec.EllipticCurvePublicNumbers(
            int.from_bytes(self.x, "big"), int.from_bytes(self.y, "big"), curve
        )
        try:
            return nums.public_key()
        except ValueError as exc:
            raise TpmStructError(f"ECC point not on curve: {exc}", reason="bad_point") from None


def _sym_def(r: Reader) -> tuple[int, int, int]:
    alg = r.u16()
    if alg == TPM_ALG_NULL:
        return alg, 0, 0
    if alg == TPM_ALG_AES:
        return alg, r.u16(), r.u16()
    raise TpmStructError(f"symmetric algorithm 0x{alg:04x} not supported", reason="unsupported_sym")


def _scheme(r: Reader) -> tuple[int, int]:
    scheme = r.u16()
    if scheme == TPM_ALG_NULL:
        return scheme, TPM_ALG_NULL
    h = r.u16()
    if scheme == TPM_ALG_ECDAA:
        r.u16()  # count
    return scheme, h


def parse_public(data: bytes) -> Public:
    """Parse a TPMT_PUBLIC, or a TPM2B_PUBLIC (size-prefixed, as tpm2_createak -f tss writes)."""
    if len(data) >= 2 and int.from_bytes(data[:2], "big") == len(data) - 2:
        data = data[2:]
    r = Reader(data, "TPMT_PUBLIC")
    typ = r.u16()
    name_alg = r.u16()
    hash_name(name_alg)
    attrs = r.u32()
    policy = r.tpm2b(limit=64)
    if typ == TPM_ALG_RSA:
        sym, sym_bits, sym_mode = _sym_def(r)
        scheme, scheme_hash = _scheme(r)
        bits = r.u16()
        exponent = r.u32()
        modulus = r.tpm2b(limit=512)
        r.done()
        if bits not in (1024, 2048, 3072, 4096) or len(modulus) * 8 != bits:
            raise TpmStructError(
                f"RSA keyBits {bits} does not match modulus of {len(modulus)} bytes",
                reason="bad_rsa_key",
            )
        return Public(
            typ,
            name_alg,
            attrs,
            policy,
            sym,
            sym_bits,
            sym_mode,
            scheme,
            scheme_hash,
            rsa_bits=bits,
            exponent=exponent,
            modulus=modulus,
            raw=data,
        )
    if typ == TPM_ALG_ECC:
        sym, sym_bits, sym_mode = _sym_def(r)
        scheme, scheme_hash = _scheme(r)
        curve = r.u16()
        kdf, _ = _scheme(r)
        x = r.tpm2b(limit=66)
        y = r.tpm2b(limit=66)
        r.done()
        return Public(
            typ,
            name_alg,
            attrs,
            policy,
            sym,
            sym_bits,
            sym_mode,
            scheme,
            scheme_hash,
            curve=curve,
            kdf=kdf,
            x=x,
            y=y,
            raw=data,
        )
    raise TpmStructError(f"public key type 0x{typ:04x} not supported", reason="unsupported_key")


def marshal_public_from_key(
    key: rsa.RSAPublicKey | ec.EllipticCurvePublicKey,
    *,
    attributes: int = FIXED_TPM
    | FIXED_PARENT
    | SENSITIVE_DATA_ORIGIN
    | USER_WITH_AUTH
    | RESTRICTED
    | SIGN_ENCRYPT,
    name_alg: int = TPM_ALG_SHA256,
    scheme: int | None = None,
    scheme_hash: int = TPM_ALG_SHA256,
) -> bytes:
    """TPMT_PUBLIC for a signing key (an AK by default), as a TPM would report it."""
    head = struct.pack(
        ">HHI",
        TPM_ALG_RSA if isinstance(key, rsa.RSAPublicKey) else TPM_ALG_ECC,
        name_alg,
        attributes,
    ) + _b(b"")
    if isinstance(key, rsa.RSAPublicKey):
        nums = key.public_numbers()
        n = nums.n.to_bytes(key.key_size // 8, "big")
        exp = 0 if nums.e == 65537 else nums.e
        sch = TPM_ALG_RSASSA if scheme is None else scheme
        return (
            head + struct.pack(">HHHHI", TPM_ALG_NULL, sch, scheme_hash, key.key_size, exp) + _b(n)
        )
    curve_id = _CURVE_IDS[key.curve.name]
    size = (key.curve.key_size + 7) // 8
    pn = key.public_numbers()
    sch = TPM_ALG_ECDSA if scheme is None else scheme
    return (
        head
        + struct.pack(">HHHHH", TPM_ALG_NULL, sch, scheme_hash, curve_id, TPM_ALG_NULL)
        + _b(pn.x.to_bytes(size, "big"))
        + _b(pn.y.to_bytes(size, "big"))
    )


def qualified_name(parent_qualified_name: bytes, name: bytes) -> bytes:
    """QN(object) = nameAlg ‖ H(QN(parent) ‖ Name(object)), nameAlg taken from ``name``."""
    alg = int.from_bytes(name[:2], "big")
    return name[:2] + digest(alg, parent_qualified_name + name)


def ak_qualified_name(ek: Public, ak: Public) -> bytes:
    """The qualified name a quote reports as qualifiedSigner for an AK made under a primary EK."""
    ek_qn = qualified_name(struct.pack(">I", TPM_RH_ENDORSEMENT), ek.name)
    return qualified_name(ek_qn, ak.name)
