"""TLS for the API: throwaway certificates, checks of an operator's files, and the policy.

The policy is one function, :func:`server_context`: TLS 1.2 or 1.3 only; for TLS 1.2 only
forward-secret AEAD suites (ECDHE with AES-GCM or ChaCha20-Poly1305; the TLS 1.3 suites are
all of that kind and fixed by OpenSSL); with a client CA, a client certificate signed by it is
required at the handshake. :func:`client_context` is the other end, for the CLI and the tests.

:func:`check_pair` reads an operator's certificate and key before a server starts, so that a
wrong path, a key that belongs to another certificate or an expired certificate is one
``tls_files_invalid`` error naming the file, never an ``ssl.SSLError`` at start-up. Its messages
name files, never key material.

The ``make_*`` functions issue ECDSA P-256 certificates with ``cryptography`` (no openssl
binary): a CA, server certificates (SANs: DNS names and IP addresses, EKU serverAuth) and
client certificates (EKU clientAuth). ``proofplane up --tls`` uses them for its demo; tests use
them for real handshakes. Private keys are written 0600.
"""

from __future__ import annotations

import ipaddress
import os
import ssl
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.types import PrivateKeyTypes
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from proofplane.errors import ValidationFailed

CODE = "tls_files_invalid"
MIN_VERSION = ssl.TLSVersion.TLSv1_2
# TLS 1.2: forward secrecy (ECDHE) and AEAD only; TLS 1.3 suites are not set by this string.
TLS12_CIPHERS = "ECDHE+AESGCM:ECDHE+CHACHA20:!aNULL:!eNULL:!MD5:!DSS:!SHA1"
DEMO_DAYS = 30
_SKEW = timedelta(minutes=5)  # not-before this far back: clocks of client and server differ


@dataclass(frozen=True)
class ServerTls:
    """The files a TLS server runs on; ``client_ca``: client certificates are required (or,
    ``client_optional``, checked when a client shows one: node agents authenticate with their
    certificates, people with tokens)."""

    cert: Path
    key: Path
    client_ca: Path | None = None
    client_optional: bool = False

    def context(self) -> ssl.SSLContext:
        return server_context(self.cert, self.key, self.client_ca, self.client_optional)


# --- the policy --------------------------------------------------------------------------------


def server_context(
    cert: str | os.PathLike[str],
    key: str | os.PathLike[str],
    client_ca: str | os.PathLike[str] | None = None,
    client_optional: bool = False,
) -> ssl.SSLContext:
    """A server-side context: TLS 1.2+, ECDHE+AEAD suites for TLS 1.2, the server's preference
    order; with ``client_ca``, clients must present a certificate it signed (CERT_REQUIRED), or
    with ``client_optional`` a certificate they show must be one it signed (CERT_OPTIONAL)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = MIN_VERSION
    ctx.set_ciphers(TLS12_CIPHERS)
    ctx.options |= ssl.OP_CIPHER_SERVER_PREFERENCE | ssl.OP_NO_COMPRESSION
    ctx.options |= ssl.OP_NO_RENEGOTIATION
    ctx.load_cert_chain(os.fspath(cert), os.fspath(key))
    if client_ca is not None:
        ctx.load_verify_locations(cafile=os.fspath(client_ca))
        ctx.verify_mode = ssl.CERT_OPTIONAL if client_optional else ssl.CERT_REQUIRED
    return ctx


def client_context(
    ca_file: str | os.PathLike[str] | None = None,
    cert: str | os.PathLike[str] | None = None,
    key: str | os.PathLike[str] | None = None,
) -> ssl.SSLContext:
    """A client-side context that verifies the server (host name included) against ``ca_file``
    (the system's CAs when None), TLS 1.2+; ``cert``/``key``: a client certificate to show."""
    ctx = ssl.create_default_context(
        ssl.Purpose.SERVER_AUTH, cafile=None if ca_file is None else os.fspath(ca_file)
    )
    ctx.minimum_version = MIN_VERSION
    if cert is not None:
        ctx.load_cert_chain(os.fspath(cert), None if key is None else os.fspath(key))
    return ctx


# --- checking an operator's files --------------------------------------------------------------


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise ValidationFailed(f"the TLS {what} {path} does not exist", code=CODE) from None
    except IsADirectoryError:
        raise ValidationFailed(f"the TLS {what} {path} is a directory", code=CODE) from None
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
        raise ValidationFailed(f"cannot read the TLS {what} {path}: {why}", code=CODE) from None


def _certificates(path: Path, what: str) -> list[x509.Certificate]:
    data = _read(path, what)
    try:
        certs = x509.load_pem_x509_certificates(data)
    except ValueError:
        certs = []
    if not certs:
        raise ValidationFailed(
            f"the TLS {what} {path} holds no PEM certificate (-----BEGIN CERTIFICATE-----)",
            code=CODE,
        )
    return certs


def _private_key(path: Path, what: str) -> PrivateKeyTypes:
    data = _read(path, what)
    try:
        return serialization.load_pem_private_key(data, password=None)
    except TypeError:
        raise ValidationFailed(
            f"the TLS {what} {path} is encrypted; proofplane needs an unencrypted key "
            "(readable by the server's user only)",
            code=CODE,
        ) from None
    except (ValueError, UnsupportedAlgorithm):
        raise ValidationFailed(
            f"the TLS {what} {path} holds no usable PEM private key (-----BEGIN PRIVATE KEY-----)",
            code=CODE,
        ) from None


def check_pair(
    cert_path: str | os.PathLike[str],
    key_path: str | os.PathLike[str],
    *,
    now: datetime | None = None,
) -> None:
    """Raise ValidationFailed (``tls_files_invalid``) unless ``cert_path`` holds a PEM
    certificate (chain) valid at ``now`` and ``key_path`` an unencrypted PEM private key that
    belongs to its first certificate, together loadable by OpenSSL. The messages name the files
    and what is wrong with them, never the key's content."""
    cert_file, key_file = Path(cert_path), Path(key_path)
    leaf = _certificates(cert_file, "certificate")[0]
    key = _private_key(key_file, "key")
    spki = serialization.PublicFormat.SubjectPublicKeyInfo
    der = serialization.Encoding.DER
    if key.public_key().public_bytes(der, spki) != leaf.public_key().public_bytes(der, spki):
        raise ValidationFailed(
            f"the TLS key {key_file} does not belong to the certificate {cert_file} "
            "(their public keys differ)",
            code=CODE,
        )
    at = now or datetime.now(UTC)
    if at > leaf.not_valid_after_utc:
        raise ValidationFailed(
            f"the TLS certificate {cert_file} expired on "
            f"{leaf.not_valid_after_utc.isoformat(timespec='seconds')}",
            code=CODE,
        )
    if at < leaf.not_valid_before_utc:
        raise ValidationFailed(
            f"the TLS certificate {cert_file} is not valid before "
            f"{leaf.not_valid_before_utc.isoformat(timespec='seconds')}",
            code=CODE,
        )
    try:
        server_context(cert_file, key_file)
    except (ssl.SSLError, OSError) as exc:
        why = getattr(exc, "reason", None) or type(exc).__name__
        raise ValidationFailed(
            f"OpenSSL refuses the TLS certificate {cert_file} with key {key_file}: {why}",
            code=CODE,
        ) from None


def check_ca_file(path: str | os.PathLike[str], what: str = "client CA file") -> None:
    """Raise ValidationFailed (``tls_files_invalid``) unless ``path`` holds PEM certificates
    OpenSSL can load as trust anchors."""
    file = Path(path)
    _certificates(file, what)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_verify_locations(cafile=os.fspath(file))
    except (ssl.SSLError, OSError) as exc:
        why = getattr(exc, "reason", None) or type(exc).__name__
        raise ValidationFailed(f"OpenSSL refuses the TLS {what} {file}: {why}", code=CODE) from None


def check_server_files(
    cert: str | os.PathLike[str],
    key: str | os.PathLike[str],
    client_ca: str | os.PathLike[str] | None = None,
) -> ServerTls:
    """The checked files of a TLS server (:func:`check_pair`, :func:`check_ca_file`)."""
    check_pair(cert, key)
    if client_ca is not None:
        check_ca_file(client_ca)
    return ServerTls(Path(cert), Path(key), None if client_ca is None else Path(client_ca))


# --- issuing -----------------------------------------------------------------------------------


def _write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` readable by its owner only, whatever the umask or an older
    file's mode (a link in its place is refused)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, data)
    finally:
        os.close(fd)


def _write_public(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def _save(
    directory: Path, name: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey
) -> tuple[Path, Path]:
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    cert_path, key_path = directory / f"{name}.crt", directory / f"{name}.key"
    _write_private(
        key_path,
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
    )
    _write_public(cert_path, cert.public_bytes(serialization.Encoding.PEM))
    return cert_path, key_path


def _load_ca(
    ca_cert: str | os.PathLike[str], ca_key: str | os.PathLike[str]
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    cert = _certificates(Path(ca_cert), "CA certificate")[0]
    key = _private_key(Path(ca_key), "CA key")
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValidationFailed(f"the CA key {ca_key} is not an EC key", code=CODE)
    return cert, key


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _builder(
    subject: str, issuer: x509.Name, key: ec.EllipticCurvePrivateKey, days: int, now: datetime
) -> x509.CertificateBuilder:
    return (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _SKEW)
        .not_valid_after(now + timedelta(days=days))
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    )


def make_ca(
    directory: str | os.PathLike[str],
    name: str,
    *,
    days: int = DEMO_DAYS,
    now: datetime | None = None,
) -> tuple[Path, Path]:
    """A self-signed CA (ECDSA P-256, may sign end-entity certificates only) written to
    ``directory/name.crt`` and ``directory/name.key`` (0600); returns (cert, key)."""
    at = now or datetime.now(UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        _builder(name, _name(name), key, days, at)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
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
        )
        .sign(key, hashes.SHA256())
    )
    return _save(Path(directory), name, cert, key)


def _leaf(
    ca_cert: str | os.PathLike[str],
    ca_key: str | os.PathLike[str],
    common_name: str,
    sans: list[x509.GeneralName],
    usage: x509.ObjectIdentifier,
    directory: str | os.PathLike[str],
    name: str,
    days: int,
    now: datetime | None,
) -> tuple[Path, Path]:
    issuer, issuer_key = _load_ca(ca_cert, ca_key)
    key = ec.generate_private_key(ec.SECP256R1())
    builder = (
        _builder(common_name, issuer.subject, key, days, now or datetime.now(UTC))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
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
        )
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()),
            critical=False,
        )
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = builder.sign(issuer_key, hashes.SHA256())
    return _save(Path(directory), name, cert, key)


def _san(host: str) -> x509.GeneralName:
    text = host.strip().strip("[]")
    try:
        return x509.IPAddress(ipaddress.ip_address(text))
    except ValueError:
        pass
    if not text or not all(part and part.isascii() for part in text.split(".")):
        raise ValidationFailed(f"{host!r} is neither an IP address nor a DNS name", code=CODE)
    return x509.DNSName(text.lower())


def make_server_cert(
    ca_cert: str | os.PathLike[str],
    ca_key: str | os.PathLike[str],
    hosts: list[str],
    directory: str | os.PathLike[str],
    *,
    name: str = "server",
    days: int = DEMO_DAYS,
    now: datetime | None = None,
) -> tuple[Path, Path]:
    """A server certificate signed by the CA for ``hosts`` (each an IP address or a DNS name:
    one SAN each), EKU serverAuth, ECDSA P-256; written to ``directory/name.crt|.key`` (0600);
    returns (cert, key)."""
    if not hosts:
        raise ValidationFailed("a server certificate needs at least one host", code=CODE)
    sans = list(dict.fromkeys(_san(h) for h in hosts))
    return _leaf(
        ca_cert, ca_key, hosts[0], sans, ExtendedKeyUsageOID.SERVER_AUTH, directory, name, days, now
    )


def make_client_cert(
    ca_cert: str | os.PathLike[str],
    ca_key: str | os.PathLike[str],
    common_name: str,
    directory: str | os.PathLike[str],
    *,
    name: str = "client",
    days: int = DEMO_DAYS,
    now: datetime | None = None,
) -> tuple[Path, Path]:
    """A client certificate signed by the CA (subject CN ``common_name``, EKU clientAuth, ECDSA
    P-256); written to ``directory/name.crt|.key`` (0600); returns (cert, key)."""
    return _leaf(
        ca_cert,
        ca_key,
        common_name,
        [],
        ExtendedKeyUsageOID.CLIENT_AUTH,
        directory,
        name,
        days,
        now,
    )
