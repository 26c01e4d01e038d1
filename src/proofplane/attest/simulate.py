"""A software "TPM" that produces quotes with a software AK: for demos, tests and benchmarks.

It marshals real TPM 2.0 structures (TPMS_ATTEST, TPMT_SIGNATURE, TPMT_PUBLIC), so the verifier
cannot tell its quotes apart from a TPM's; that is exactly why evidence from it proves nothing
about hardware. The server must accept a simulated node only in an explicit demo mode and must
mark it as simulated wherever it shows it. Deterministic given its key and inputs (no clock).
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

from proofplane.attest import eventlog as el
from proofplane.attest import tpm
from proofplane.attest.credential import CFB, TOOLS_MAGIC, CredentialError, kdfa
from proofplane.attest.verifier import Evidence

_BANKS = {"sha1": hashlib.sha1, "sha256": hashlib.sha256}


@dataclass
class SoftTpm:
    """PCR banks, a clock and an AK held in software."""

    ak: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey
    clock: int = 1000
    reset_count: int = 1
    restart_count: int = 0
    firmware_version: int = 0x2019102300163636
    pcrs: dict[str, list[bytes]] = field(
        default_factory=lambda: {b: [bytes(f().digest_size)] * 24 for b, f in _BANKS.items()}
    )
    #: the name the quote reports as its signer (a TPM reports the AK's qualified name under
    #: the EK hierarchy); None: the AK's plain name
    signer_name: bytes | None = None

    @property
    def ak_public(self) -> bytes:
        """TPMT_PUBLIC of the AK, with the attributes a TPM-made AK has."""
        return tpm.marshal_public_from_key(self.ak.public_key())

    def extend(self, pcr: int, digests: dict[str, bytes]) -> None:
        for bank, d in digests.items():
            if bank in self.pcrs:
                self.pcrs[bank][pcr] = _BANKS[bank](self.pcrs[bank][pcr] + d).digest()

    def reboot(self) -> None:
        for bank, f in _BANKS.items():
            self.pcrs[bank] = [bytes(f().digest_size)] * 24
        self.reset_count += 1

    def quote(
        self, nonce: bytes, pcrs: list[int], bank: str = "sha256", *, advance_ms: int = 50
    ) -> tuple[bytes, bytes, dict[str, dict[int, bytes]]]:
        """(TPMS_ATTEST, TPMT_SIGNATURE, {bank: {pcr: value}}) like tpm2_quote gives."""
        self.clock += advance_ms
        sel = (tpm.PcrSelection(tpm.BANK_ALGS[bank], tuple(sorted(pcrs))),)
        values = {i: self.pcrs[bank][i] for i in sorted(pcrs)}
        att = tpm.Attest(
            magic=tpm.TPM_GENERATED_VALUE,
            type=tpm.TPM_ST_ATTEST_QUOTE,
            qualified_signer=self._name(),
            extra_data=nonce,
            clock_info=tpm.ClockInfo(self.clock, self.reset_count, self.restart_count, True),
            firmware_version=self.firmware_version,
            pcr_select=sel,
            pcr_digest=hashlib.sha256(b"".join(values.values())).digest(),
        )
        msg = tpm.marshal_attest(att)
        if isinstance(self.ak, ec.EllipticCurvePrivateKey):
            r, s = decode_dss_signature(self.ak.sign(msg, ec.ECDSA(hashes.SHA256())))
            sig = tpm.Signature(tpm.TPM_ALG_ECDSA, tpm.TPM_ALG_SHA256, r=r, s=s)
        else:
            raw = self.ak.sign(msg, padding.PKCS1v15(), hashes.SHA256())
            sig = tpm.Signature(tpm.TPM_ALG_RSASSA, tpm.TPM_ALG_SHA256, sig=raw)
        return msg, tpm.marshal_signature(sig), {bank: values}

    def _name(self) -> bytes:
        if self.signer_name is not None:
            return self.signer_name
        return tpm.parse_public(self.ak_public).name


# --- a whole simulated attester: EK, AK, measured boot ------------------------------------------

EK_ATTRIBUTES = (
    tpm.FIXED_TPM | tpm.FIXED_PARENT | tpm.SENSITIVE_DATA_ORIGIN | tpm.RESTRICTED | tpm.DECRYPT
)


def _tpm2b(data: bytes) -> bytes:
    return struct.pack(">H", len(data)) + data


def rsa_ek_public(key: rsa.RSAPublicKey) -> bytes:
    """TPMT_PUBLIC of an RSA storage EK (nameAlg SHA-256, AES-128-CFB), as a TPM shows it."""
    bits = key.key_size
    n = key.public_numbers().n.to_bytes(bits // 8, "big")
    head = struct.pack(">HHI", tpm.TPM_ALG_RSA, tpm.TPM_ALG_SHA256, EK_ATTRIBUTES) + _tpm2b(b"")
    params = struct.pack(
        ">HHHHHI", tpm.TPM_ALG_AES, 128, tpm.TPM_ALG_CFB, tpm.TPM_ALG_NULL, bits, 0
    )
    return head + params + _tpm2b(n)


def activate_credential(ek: rsa.RSAPrivateKey, ak_name: bytes, credential_file: bytes) -> bytes:
    """The TPM's side of TPM2_ActivateCredential, in software: recover the secret of a
    tpm2-tools credential file made for ``ak_name`` under this EK. Checks the outer HMAC, as a
    TPM does; CredentialError when the file is not for this EK and AK."""
    if len(credential_file) < 8 or struct.unpack(">I", credential_file[:4])[0] != TOOLS_MAGIC:
        raise CredentialError("not a tpm2-tools credential file")
    rest = credential_file[8:]
    size = int.from_bytes(rest[:2], "big")
    id_object, rest = rest[2 : 2 + size], rest[2 + size :]
    enc_seed = rest[2 : 2 + int.from_bytes(rest[:2], "big")]
    hmac_size = int.from_bytes(id_object[:2], "big")
    outer, enc_identity = id_object[2 : 2 + hmac_size], id_object[2 + hmac_size :]
    h = hashes.SHA256()
    try:
        seed = ek.decrypt(
            enc_seed, padding.OAEP(mgf=padding.MGF1(h), algorithm=h, label=b"IDENTITY\0")
        )
    except ValueError:
        raise CredentialError("the credential was not made for this EK") from None
    hmac_key = kdfa(tpm.TPM_ALG_SHA256, seed, b"INTEGRITY", b"", b"", 256)
    want = hmac.new(hmac_key, enc_identity + ak_name, "sha256").digest()
    if not hmac.compare_digest(want, outer):
        raise CredentialError("the credential was not made for this AK")
    key = kdfa(tpm.TPM_ALG_SHA256, seed, b"STORAGE", ak_name, b"", 128)
    dec = Cipher(algorithms.AES(key), CFB(bytes(16))).decryptor()
    plain = dec.update(enc_identity) + dec.finalize()
    return plain[2 : 2 + int.from_bytes(plain[:2], "big")]


def _app_event(image: bytes) -> tuple[bytes, dict[str, bytes]]:
    """An EFI boot application load: its digest is the image's hash, not H(event data)."""
    data = struct.pack("<QQQQ", 0x7E000000, 0x100000, 0, 0)
    return data, {b: f(image).digest() for b, f in _BANKS.items()}


def demo_boot_log(
    kernel: bytes, *, bootloaders: tuple[bytes, ...] = (b"shimx64.efi", b"grubx64.efi")
) -> bytes:
    """A synthetic UEFI measured-boot log: Secure Boot on, the given boot applications in
    PCR 4, ``kernel`` measured by the bootloader into PCR 9 (digest = H(kernel))."""

    def var(name: str, data: bytes, guid: Any = el.EFI_GLOBAL_VARIABLE) -> bytes:
        return el.encode_efi_variable(guid, name, data)

    events: list[tuple[Any, ...]] = [
        (0, el.EV_S_CRTM_VERSION, "1.0".encode("utf-16-le") + b"\0\0"),
        (0, el.EV_EFI_PLATFORM_FIRMWARE_BLOB, struct.pack("<QQ", 0xFFC00000, 0x400000)),
        (7, el.EV_EFI_VARIABLE_DRIVER_CONFIG, var("SecureBoot", b"\x01")),
        (7, el.EV_EFI_VARIABLE_DRIVER_CONFIG, var("PK", b"demo-pk")),
        (
            7,
            el.EV_EFI_VARIABLE_DRIVER_CONFIG,
            var("db", b"demo-db", el.EFI_IMAGE_SECURITY_DATABASE),
        ),
        *[(pcr, el.EV_SEPARATOR, b"\0\0\0\0") for pcr in range(8)],
        *[(4, el.EV_EFI_BOOT_SERVICES_APPLICATION, *_app_event(b)) for b in bootloaders],
        (8, el.EV_IPL, b"grub_cmd: linux /vmlinuz root=/dev/nvme0n1p2\0"),
        (9, el.EV_IPL, b"/boot/vmlinuz\0", {b: f(kernel).digest() for b, f in _BANKS.items()}),
        (5, el.EV_EFI_ACTION, b"Exit Boot Services Invocation"),
    ]
    return el.build_eventlog(events, banks=("sha1", "sha256"))


def boot_app_digest(image: bytes, bank: str = "sha256") -> bytes:
    """The digest ``demo_boot_log`` measures for a boot application image."""
    return _BANKS[bank](image).digest()


@dataclass
class SimulatedAttester:
    """A node's whole attester in software: an RSA EK, an ECC AK, PCRs extended from a
    synthetic boot log. Its evidence is TPM-format and verifies, and it proves nothing about
    hardware: the server accepts it only in demo mode and marks it as simulated."""

    ek: rsa.RSAPrivateKey
    soft: SoftTpm
    eventlog: bytes = b""

    @classmethod
    def create(cls, *, ek_bits: int = 2048) -> SimulatedAttester:
        soft = SoftTpm(ec.generate_private_key(ec.SECP256R1()))
        self = cls(rsa.generate_private_key(65537, ek_bits), soft)
        soft.signer_name = tpm.ak_qualified_name(
            tpm.parse_public(self.ek_public), tpm.parse_public(soft.ak_public)
        )
        return self

    @property
    def ek_public(self) -> bytes:
        return rsa_ek_public(self.ek.public_key())

    @property
    def ak_public(self) -> bytes:
        return self.soft.ak_public

    def activate(self, credential_file: bytes) -> bytes:
        return activate_credential(self.ek, tpm.parse_public(self.ak_public).name, credential_file)

    def boot(self, log: bytes) -> None:
        """Reboot and measure ``log`` into the PCRs, as firmware and bootloader would."""
        self.soft.reboot()
        for ev in el.parse_eventlog(log).events:
            if ev.extended:
                self.soft.extend(ev.pcr, {b: d for b, d in ev.digests.items() if b in _BANKS})
        self.eventlog = log

    def evidence(
        self, nonce: bytes, pcrs: list[int], bank: str = "sha256",
        inventory: Mapping[str, Any] | None = None,
    ) -> Evidence:  # fmt: skip
        quote, sig, values = self.soft.quote(nonce, pcrs, bank)
        return Evidence(quote, sig, values, self.eventlog or None, inventory)
