"""A software "TPM" that produces quotes with a software AK: for demos, tests and benchmarks.

It marshals real TPM 2.0 structures (TPMS_ATTEST, TPMT_SIGNATURE, TPMT_PUBLIC), so the verifier
cannot tell its quotes apart from a TPM's; that is exactly why evidence from it proves nothing
about hardware. The server must accept a simulated node only in an explicit demo mode and must
mark it as simulated wherever it shows it. Deterministic given its key and inputs (no clock).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature

from proofplane.attest import tpm

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
        return tpm.parse_public(self.ak_public).name
