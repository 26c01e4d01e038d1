"""The internal CA that gives node agents their channel certificates (issue 13, part 5).

A node's agent generates its own key (in its TPM when it has one, else on disk 0600) and sends
a CSR; the server signs it only after the node's attestation passed. The certificate names the
node in a URI SAN, ``spiffe://<cluster-id>/node/<name>`` (the SPIFFE ID form), is a client
certificate only (EKU clientAuth), and is short-lived (24 h by default): the agent renews it on
each passing round, and a node that is quarantined, fails or is decommissioned gets no renewal
and its serials go on the CRL at once.

Everything here is built with ``cryptography``: the CA (ECDSA P-256, self-signed), the
certificates it issues, the CRL (DER), and reading a presented certificate back to the node it
names. The CA's private key is kept sealed by the KMS (``proofplane.service.pki``).
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from proofplane.errors import ValidationFailed

DEFAULT_TTL = dt.timedelta(hours=24)
CA_TTL = dt.timedelta(days=3650)
BACKDATE = dt.timedelta(minutes=5)  # clock skew between the server and the nodes
_NODE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
_CLUSTER_ID = re.compile(r"^[a-z0-9][a-z0-9.-]{0,62}$")


class CsrRefused(ValidationFailed):
    """A CSR that cannot become a certificate for this node."""

    code = "csr_invalid"


@dataclass(frozen=True, slots=True)
class Issued:
    serial: int
    pem: str
    not_before: dt.datetime
    not_after: dt.datetime
    fingerprint: str  # SHA-256 of the DER, hex


def spiffe_id(cluster_id: str, node: str) -> str:
    return f"spiffe://{cluster_id}/node/{node}"


def new_ca(cluster_id: str, now: dt.datetime) -> tuple[str, bytes]:
    """(CA certificate PEM, CA private key as PKCS#8 DER) for ``cluster_id``."""
    if not _CLUSTER_ID.fullmatch(cluster_id):
        raise ValidationFailed(f"invalid cluster id {cluster_id!r}", code="invalid_cluster_id")
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "proofplane"),
            x509.NameAttribute(NameOID.COMMON_NAME, f"proofplane agent CA {cluster_id}"),
        ]
    )
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(now + CA_TTL)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )  # fmt: skip
        .add_extension(ski, critical=False)
        .sign(key, hashes.SHA256())
    )
    key_der = key.private_bytes(
        serialization.Encoding.DER,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return cert.public_bytes(serialization.Encoding.PEM).decode("ascii"), key_der


def _ca_key(key_der: bytes) -> ec.EllipticCurvePrivateKey:
    key = serialization.load_der_private_key(key_der, password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValidationFailed("the agent CA key is not an EC key", code="pki_ca_invalid")
    return key


def load_ca_cert(pem: str) -> x509.Certificate:
    return x509.load_pem_x509_certificate(pem.encode("ascii"))


def parse_csr(pem: str) -> x509.CertificateSigningRequest:
    """A CSR whose self-signature holds and whose key is strong enough, or CsrRefused."""
    if not isinstance(pem, str) or "BEGIN CERTIFICATE REQUEST" not in pem or len(pem) > 16384:
        raise CsrRefused("send a PEM certificate signing request (BEGIN CERTIFICATE REQUEST)")
    try:
        csr = x509.load_pem_x509_csr(pem.encode("ascii"))
    except (ValueError, UnicodeEncodeError):
        raise CsrRefused("the CSR is not a valid PEM certificate signing request") from None
    if not csr.is_signature_valid:
        raise CsrRefused("the CSR's signature does not verify (the key is not the requester's)")
    key = csr.public_key()
    if isinstance(key, rsa.RSAPublicKey) and key.key_size < 2048:
        raise CsrRefused("an RSA key must be at least 2048 bits")
    if isinstance(key, ec.EllipticCurvePublicKey) and key.curve.name not in (
        "secp256r1",
        "secp384r1",
    ):
        raise CsrRefused("an EC key must be on P-256 or P-384")
    if not isinstance(key, rsa.RSAPublicKey | ec.EllipticCurvePublicKey | ed25519.Ed25519PublicKey):
        raise CsrRefused("the key must be RSA, ECDSA (P-256/P-384) or Ed25519")
    return csr


def _names_in(csr: x509.CertificateSigningRequest) -> set[str]:
    """The names a CSR asks for: its CN, DNS names and URIs."""
    names = {a.value for a in csr.subject.get_attributes_for_oid(NameOID.COMMON_NAME)}
    try:
        san = csr.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return {str(n) for n in names}
    names |= set(san.get_values_for_type(x509.DNSName))
    names |= set(san.get_values_for_type(x509.UniformResourceIdentifier))
    return {str(n) for n in names}


def issue(
    *,
    ca_pem: str,
    ca_key_der: bytes,
    csr_pem: str,
    node: str,
    cluster_id: str,
    now: dt.datetime,
    ttl: dt.timedelta = DEFAULT_TTL,
) -> Issued:
    """Sign the node's CSR: subject CN and URI SAN name ``node``, whatever the CSR asked for,
    but a CSR that names another node (or anything else) is refused outright."""
    if not _NODE_NAME.fullmatch(node):
        raise CsrRefused(f"invalid node name {node!r}")
    csr = parse_csr(csr_pem)
    allowed = {node, spiffe_id(cluster_id, node)}
    other = sorted(_names_in(csr) - allowed)
    if other:
        raise CsrRefused(
            f"the CSR names {other[0]!r}, not node {node!r}: a node gets a certificate for "
            "itself only",
            code="csr_wrong_node",
            details={"node": node, "requested": other},
        )
    ca_cert, ca_key = load_ca_cert(ca_pem), _ca_key(ca_key_der)
    serial = x509.random_serial_number()
    not_before, not_after = now - BACKDATE, now + ttl
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node)]))
        .issuer_name(ca_cert.subject)
        .public_key(csr.public_key())
        .serial_number(serial)
        .not_valid_before(not_before)
        .not_valid_after(min(not_after, ca_cert.not_valid_after_utc))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.UniformResourceIdentifier(spiffe_id(cluster_id, node))]
            ),
            critical=False,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )  # fmt: skip
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    return Issued(
        serial=serial,
        pem=cert.public_bytes(serialization.Encoding.PEM).decode("ascii"),
        not_before=cert.not_valid_before_utc,
        not_after=cert.not_valid_after_utc,
        fingerprint=cert.fingerprint(hashes.SHA256()).hex(),
    )


def crl(
    *,
    ca_pem: str,
    ca_key_der: bytes,
    revoked: list[tuple[int, dt.datetime]],
    now: dt.datetime,
    next_update: dt.timedelta = dt.timedelta(hours=1),
) -> bytes:
    """The CRL (DER) listing ``revoked`` (serial, when), signed by the CA."""
    ca_cert, ca_key = load_ca_cert(ca_pem), _ca_key(ca_key_der)
    builder = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(ca_cert.subject)
        .last_update(now)
        .next_update(now + next_update)
    )
    for serial, when in revoked:
        builder = builder.add_revoked_certificate(
            x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(when).build()
        )
    return builder.sign(ca_key, hashes.SHA256()).public_bytes(serialization.Encoding.DER)


def node_of(cert_der: bytes, *, ca_pem: str, cluster_id: str, now: dt.datetime) -> tuple[str, int]:
    """(node name, serial) of a presented client certificate, checked here as well as by the
    TLS layer: issued by our CA (signature), in its validity period, a client certificate with
    our SPIFFE ID. ``ValidationFailed`` (code ``agent_certificate_invalid``) otherwise."""

    def bad(why: str) -> ValidationFailed:
        return ValidationFailed(f"client certificate refused: {why}",
                                code="agent_certificate_invalid")  # fmt: skip

    try:
        cert = x509.load_der_x509_certificate(cert_der)
    except ValueError:
        raise bad("not an X.509 certificate") from None
    ca = load_ca_cert(ca_pem)
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        raise bad("not issued by this cluster's agent CA") from None
    if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
        raise bad("expired or not yet valid")
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        raise bad("no SPIFFE ID") from None
    prefix = f"spiffe://{cluster_id}/node/"
    uris = [u for u in san.get_values_for_type(x509.UniformResourceIdentifier)
            if u.startswith(prefix)]  # fmt: skip
    if len(uris) != 1 or not _NODE_NAME.fullmatch(uris[0][len(prefix) :]):
        raise bad("no SPIFFE ID of this cluster")
    return uris[0][len(prefix) :], cert.serial_number
