"""EK certificates: does this TPM come from a manufacturer we trust?

The EK certificate must chain to a root in the configured CA bundle (TPM vendors publish theirs),
through intermediates the node or the operator supplies. Verification uses ``cryptography``'s
X.509 path validation with the Web PKI profile for the CAs and a permissive profile for the leaf:
EK certificates carry no DNS name, an empty subject, a critical SAN with a directoryName of TPM
attributes, and the EKU tcg-kp-EKCertificate (2.23.133.8.1) instead of serverAuth/clientAuth.
The certified key must be the EK public key the TPM reports: one EK key everywhere.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from cryptography import x509
from cryptography.x509 import verification
from cryptography.x509.oid import ExtendedKeyUsageOID

from proofplane.attest import tpm
from proofplane.attest.errors import CertificateError

TCG_KP_EK_CERTIFICATE = x509.ObjectIdentifier("2.23.133.8.1")
_PEM = re.compile(rb"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", re.S)


@dataclass(frozen=True, slots=True)
class EkCertificate:
    """A verified EK certificate: its chain (leaf first) and what it says."""

    certificate: x509.Certificate
    chain: tuple[x509.Certificate, ...]
    has_ek_eku: bool

    @property
    def issuer(self) -> str:
        return self.certificate.issuer.rfc4514_string()


def load_certificates(blob: bytes) -> list[x509.Certificate]:
    """Every certificate in a PEM bundle, or the one DER certificate in ``blob``."""
    try:
        pems = _PEM.findall(blob)
        if pems:
            return [x509.load_pem_x509_certificate(p) for p in pems]
        return [x509.load_der_x509_certificate(blob)]
    except ValueError as exc:
        raise CertificateError(f"not a certificate: {exc}", reason="ek_cert_malformed") from None


def verify_ek_certificate(
    cert: bytes,
    ca_bundle: bytes,
    now: datetime,
    *,
    intermediates: Sequence[bytes] = (),
    ek_public: bytes | None = None,
) -> EkCertificate:
    """Verify an EK certificate (DER or PEM) against a PEM CA bundle as of ``now``.

    Raises CertificateError with reason ``ek_cert_malformed``, ``ca_bundle_invalid``,
    ``ek_cert_untrusted`` or ``ek_cert_key_mismatch``.
    """
    leaf = load_certificates(cert)[0]
    try:
        roots = load_certificates(ca_bundle)
    except CertificateError as exc:
        raise CertificateError(f"CA bundle: {exc.message}", reason="ca_bundle_invalid") from None
    inter = [c for blob in intermediates for c in load_certificates(blob)]
    try:
        verifier = (
            verification.PolicyBuilder()
            .store(verification.Store(roots))
            .time(now)
            .extension_policies(
                ca_policy=verification.ExtensionPolicy.webpki_defaults_ca(),
                ee_policy=verification.ExtensionPolicy.permit_all(),
            )
            .build_client_verifier()
        )
        verified = verifier.verify(leaf, inter)
    except (verification.VerificationError, ValueError) as exc:
        raise CertificateError(f"EK certificate does not chain to the CA bundle: {exc}",
                               reason="ek_cert_untrusted") from None  # fmt: skip
    try:
        eku = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        has_eku = TCG_KP_EK_CERTIFICATE in eku or ExtendedKeyUsageOID.ANY_EXTENDED_KEY_USAGE in eku
    except x509.ExtensionNotFound:
        has_eku = False
    if ek_public is not None:
        ek_key = tpm.parse_public(ek_public).public_key()
        if ek_key.public_numbers() != leaf.public_key().public_numbers():  # type: ignore[union-attr]
            raise CertificateError("the certificate certifies another key than the TPM's EK",
                                   reason="ek_cert_key_mismatch")  # fmt: skip
    return EkCertificate(leaf, tuple(verified.chain), has_eku)
