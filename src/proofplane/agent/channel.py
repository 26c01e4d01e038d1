"""The node agent's channel certificate (issue 13, part 5): its key, its CSR, the certificate
the server signed after a passing attestation, kept in the agent's certificate directory.

The key is generated here (ECDSA P-256) and stays in the directory, 0600 (a TPM-resident key
would be the next step: ``tpm2-tools`` can hold it; this agent keeps it on disk). The server
only ever sees the CSR. ``current`` says which certificate to use for the next connection: one
that is still valid for at least a minute."""

from __future__ import annotations

import datetime as dt
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

KEY_FILE = "agent.key"
CERT_FILE = "agent.crt"
CA_FILE = "agent-ca.crt"
MARGIN = dt.timedelta(minutes=1)


def _write(path: Path, data: bytes, mode: int) -> None:
    """Replace ``path`` atomically (a reader never sees half a file), with ``mode``."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
    try:
        os.fchmod(fd, mode)
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def load_or_create_key(cert_dir: Path) -> ec.EllipticCurvePrivateKey:
    cert_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = cert_dir / KEY_FILE
    if path.exists():
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ValueError(f"{path} is not an EC private key")
        return key
    key = ec.generate_private_key(ec.SECP256R1())
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    _write(path, pem, 0o600)
    return key


def make_csr(cert_dir: Path, node: str) -> str:
    """A CSR for ``node`` with the agent's key (made on first use)."""
    key = load_or_create_key(cert_dir)
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node)]))
        .sign(key, hashes.SHA256())
    )
    return csr.public_bytes(serialization.Encoding.PEM).decode("ascii")


def store_certificate(cert_dir: Path, certificate: str, ca: str) -> None:
    _write(cert_dir / CERT_FILE, certificate.encode("ascii"), 0o644)
    _write(cert_dir / CA_FILE, ca.encode("ascii"), 0o644)


def current(cert_dir: Path | None, now: dt.datetime | None = None) -> tuple[str, str] | None:
    """(certificate, key) files to connect with, when the certificate is valid for at least
    another minute; None otherwise (the agent then uses its bearer credential)."""
    if cert_dir is None:
        return None
    cert_path, key_path = cert_dir / CERT_FILE, cert_dir / KEY_FILE
    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    except (OSError, ValueError):
        return None
    when = now or dt.datetime.now(dt.UTC)
    if (
        not key_path.exists()
        or not cert.not_valid_before_utc <= when <= cert.not_valid_after_utc - MARGIN
    ):
        return None
    return str(cert_path), str(key_path)
