"""A real rsyslog receiver for the SIEM-export tests: TCP + mutual TLS (RFC 5425), run
unprivileged in the foreground with its own configuration (see the shared notes on the syslog
receiver), and a throwaway CA with server and client certificates made with ``cryptography``.

``rsyslogd`` comes from the Debian packages ``rsyslog`` and ``rsyslog-openssl``
(scripts/debian-packages.txt). Without it the tests skip, except in CI (CI=true), where a
missing receiver fails: a missing dependency never passes silently.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from ci import unavailable


def rsyslogd_or_skip() -> str:
    path = shutil.which("rsyslogd") or (
        "/usr/sbin/rsyslogd" if os.path.exists("/usr/sbin/rsyslogd") else None
    )
    if path is None:
        why = "rsyslogd is not installed (apt-get install rsyslog rsyslog-openssl)"
        unavailable(why)
    return path


# --- certificates ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    rogue_cert: Path  # a client certificate from another CA
    rogue_key: Path


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> Path:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)
    return path


def _cert(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: x509.Certificate | None,
    issuer_key: ec.EllipticCurvePrivateKey,
    *,
    ca: bool = False,
    usage: ExtendedKeyUsageOID | None = None,
) -> x509.Certificate:
    now = dt.datetime.now(dt.UTC)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer.subject if issuer else name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ca:
        builder = builder.add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), True
        )
    else:
        builder = builder.add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        if usage is not None:
            builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _pem(cert: x509.Certificate, path: Path) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


def make_pki(where: Path) -> Pki:
    """A throwaway CA, a server certificate for localhost/127.0.0.1, a client certificate,
    and a client certificate from an unrelated CA."""
    where.mkdir(parents=True, exist_ok=True)
    ca_key = _key()
    ca = _cert("proofplane test CA", ca_key, None, ca_key, ca=True)
    server_key, client_key = _key(), _key()
    server = _cert("localhost", server_key, ca, ca_key, usage=ExtendedKeyUsageOID.SERVER_AUTH)
    client = _cert("exporter", client_key, ca, ca_key, usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    rogue_ca_key, rogue_key = _key(), _key()
    rogue_ca = _cert("rogue CA", rogue_ca_key, None, rogue_ca_key, ca=True)
    rogue = _cert("rogue", rogue_key, rogue_ca, rogue_ca_key, usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    return Pki(
        ca=_pem(ca, where / "ca.pem"),
        server_cert=_pem(server, where / "server.pem"),
        server_key=_write_key(server_key, where / "server.key"),
        client_cert=_pem(client, where / "client.pem"),
        client_key=_write_key(client_key, where / "client.key"),
        rogue_cert=_pem(rogue, where / "rogue.pem"),
        rogue_key=_write_key(rogue_key, where / "rogue.key"),
    )


# --- the receiver ------------------------------------------------------------------------------

CONFIG = """\
# maxMessageSize: rsyslog's default is 8k and a longer message is truncated; an exported event
# is as long as its details make it, so a real receiver must raise this limit too.
# parser.escapeControlCharactersOnReceive: by default rsyslog rewrites control characters in a
# message as "#ooo" (octal) when it arrives; off, %msg% is the bytes we sent (our CEF body has
# no raw line breaks, but a TAB in an actor or a target id is legal CEF and must stay a TAB).
global(
  workDirectory="{work}"
  maxMessageSize="64k"
  parser.escapeControlCharactersOnReceive="off"
  DefaultNetstreamDriverCAFile="{ca}"
  DefaultNetstreamDriverCertFile="{cert}"
  DefaultNetstreamDriverKeyFile="{key}"
)
module(load="imtcp" StreamDriver.Name="ossl" StreamDriver.Mode="1"
       StreamDriver.AuthMode="x509/certvalid")
# mmpstrucdata parses the structured data into $!rfc5424-sd (SD-IDs and PARAM-NAMEs kept as
# sent, PARAM-VALUEs unescaped); %structured-data% itself is the raw text, escapes and all.
module(load="mmpstrucdata")
# One JSON object per message: the raw message and what rsyslog's RFC 5424 parser made of it.
template(name="parsed" type="list" option.jsonf="on") {{
  property(outname="raw" name="rawmsg" format="jsonf")
  property(outname="pri" name="pri" format="jsonf")
  property(outname="facility" name="syslogfacility" format="jsonf")
  property(outname="severity" name="syslogseverity" format="jsonf")
  property(outname="time" name="timereported" dateFormat="rfc3339" format="jsonf")
  property(outname="hostname" name="hostname" format="jsonf")
  property(outname="app" name="app-name" format="jsonf")
  property(outname="procid" name="procid" format="jsonf")
  property(outname="msgid" name="msgid" format="jsonf")
  property(outname="sd" name="structured-data" format="jsonf")
  property(outname="sd_parsed" name="$!rfc5424-sd" format="jsonf")
  property(outname="msg" name="msg" format="jsonf")
}}
input(type="imtcp" port="{port}")
action(type="mmpstrucdata" sd_name.lowercase="off")
action(type="omfile" file="{out}" template="parsed")
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Rsyslog:
    """One rsyslogd on 127.0.0.1:``port``; what it received is in ``out`` (one JSON object per
    message, with the raw message and the fields rsyslog parsed)."""

    def __init__(self, rsyslogd: str, pki: Pki, where: Path) -> None:
        self.rsyslogd = rsyslogd
        self.where = where
        self.port = free_port()
        self.out = where / "received.jsonl"
        self.conf = where / "rsyslog.conf"
        self.pidfile = where / "rsyslogd.pid"
        self.log = where / "rsyslogd.log"
        work = where / "work"
        work.mkdir(parents=True, exist_ok=True)
        self.conf.write_text(
            CONFIG.format(
                work=work,
                ca=pki.ca,
                cert=pki.server_cert,
                key=pki.server_key,
                port=self.port,
                out=self.out,
            )
        )
        self.proc: subprocess.Popen[bytes] | None = None

    def check_config(self) -> None:
        done = subprocess.run(
            [self.rsyslogd, "-N1", "-f", str(self.conf)], capture_output=True, timeout=30
        )
        assert done.returncode == 0, done.stderr.decode() + done.stdout.decode()

    def start(self) -> None:
        self.check_config()
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [self.rsyslogd, "-n", "-f", str(self.conf), "-i", str(self.pidfile)],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"rsyslogd exited: {self.log.read_text()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        raise AssertionError(f"rsyslogd did not listen on {self.port}: {self.log.read_text()}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self.proc = None

    def received(self) -> list[dict[str, str]]:
        if not self.out.exists():
            return []
        # split on LF only: str.splitlines would also split on NEL, U+2028 and the like, which
        # rsyslog's JSON encoding leaves raw inside a string
        text = self.out.read_text(encoding="utf-8")
        return [json.loads(line) for line in text.split("\n") if line.strip()]

    def wait_for(self, count: int, timeout_s: float = 10.0) -> list[dict[str, str]]:
        deadline = time.monotonic() + timeout_s
        got = self.received()
        while len(got) < count and time.monotonic() < deadline:
            time.sleep(0.05)
            got = self.received()
        return got
