"""The I/O of the sinks, kept thin: each ``send`` delivers one batch of encoded records or
raises ``DeliveryError``. Returning means the receiver acknowledged the batch:

* syslog over mutual TLS: the server accepted our client certificate, and every frame was
  written and flushed on that connection (syslog has no application-level acknowledgement);
* HTTP (HEC, OCSF): a 2xx answer;
* file: written, flushed and fsync'd.

A fresh connection per batch is deliberate: a long-lived TLS connection to a receiver that died
accepts the next write into the kernel's buffer and loses it; a new handshake proves the receiver
is there before anything is counted as delivered.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import ssl
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import httpx

from proofplane.audit.export.syslog import frame
from proofplane.errors import ProofplaneError


class DeliveryError(ProofplaneError):
    """A batch was not acknowledged; it will be sent again."""

    code = "delivery_error"


class Transport(Protocol):
    def send(self, records: Sequence[bytes]) -> None: ...


class SyslogTlsTransport:
    """RFC 5425: syslog over TLS with client certificates, RFC 6587 octet-counted frames."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        ca_file: str,
        cert_file: str,
        key_file: str,
        server_name: str | None = None,
        timeout_s: float = 10.0,
    ) -> None:
        self.host = host
        self.port = port
        self.server_name = server_name or host
        self.timeout_s = timeout_s
        self._files = (ca_file, cert_file, key_file)

    def _context(self) -> ssl.SSLContext:
        ca_file, cert_file, key_file = self._files
        try:
            ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca_file)
            ctx.minimum_version = ssl.TLSVersion.TLSv1_2
            ctx.load_cert_chain(cert_file, key_file)
        except (OSError, ssl.SSLError) as exc:
            raise DeliveryError(f"cannot load the TLS files: {exc}") from exc
        return ctx

    def send(self, records: Sequence[bytes]) -> None:
        data = b"".join(frame(r) for r in records)
        ctx = self._context()
        try:
            with (
                socket.create_connection((self.host, self.port), timeout=self.timeout_s) as raw,
                ctx.wrap_socket(raw, server_hostname=self.server_name) as tls,
            ):
                if tls.version() == "TLSv1.3":
                    _await_acceptance(tls, min(self.timeout_s, ACCEPTANCE_WAIT_S))
                tls.sendall(data)
                # close_notify, best effort: the data is written and flushed at this point.
                with contextlib.suppress(OSError):
                    tls.unwrap()
        except (OSError, ssl.SSLError) as exc:
            raise DeliveryError(f"syslog {self.host}:{self.port}: {exc}") from exc


ACCEPTANCE_WAIT_S = 1.0


def _await_acceptance(tls: ssl.SSLSocket, wait_s: float) -> None:
    """Wait until the server has accepted our client certificate.

    In TLS 1.3 the client's handshake ends before the server has checked the client's
    certificate; a server that refuses it answers with an alert that arrives *after* we could
    have written a whole batch into the void. A server that accepts it sends its session
    tickets. So: read (non-blocking) until a ticket arrives (accepted), an alert arrives
    (raises ``ssl.SSLError``), or ``wait_s`` passes (a server without tickets: go on).
    """
    deadline = time.monotonic() + wait_s
    timeout = tls.gettimeout()
    tls.setblocking(False)
    try:
        while True:
            try:
                tls.recv(1)  # a syslog receiver sends no data: this processes TLS records
                return
            except ssl.SSLWantReadError:
                session = tls.session
                if session is not None and session.has_ticket:
                    return
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                select.select([tls], [], [], remaining)
    finally:
        tls.settimeout(timeout)


class HttpTransport:
    """POST one batch; anything but a 2xx answer is a failed delivery."""

    def __init__(
        self,
        url: str,
        *,
        headers: dict[str, str],
        joiner: tuple[bytes, bytes, bytes] = (b"", b"", b""),
        ca_file: str | None = None,
        timeout_s: float = 10.0,
        client: httpx.Client | None = None,
    ) -> None:
        self.url = url
        self.headers = headers
        self.joiner = joiner  # (prefix, separator, suffix) around the records
        self._client = client
        self._verify: ssl.SSLContext | bool = True
        if ca_file:
            self._verify = ssl.create_default_context(cafile=ca_file)
        self.timeout_s = timeout_s

    def send(self, records: Sequence[bytes]) -> None:
        prefix, sep, suffix = self.joiner
        body = prefix + sep.join(records) + suffix
        try:
            if self._client is not None:
                response = self._client.post(self.url, content=body, headers=self.headers)
            else:
                with httpx.Client(verify=self._verify, timeout=self.timeout_s) as client:
                    response = client.post(self.url, content=body, headers=self.headers)
        except httpx.HTTPError as exc:
            raise DeliveryError(f"POST {self.url}: {exc}") from exc
        if not 200 <= response.status_code < 300:
            raise DeliveryError(
                f"POST {self.url}: HTTP {response.status_code} {response.text[:200]!r}"
            )


class FileTransport:
    """Append records (each ending in a newline) to a file, durably."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def send(self, records: Sequence[bytes]) -> None:
        try:
            with self.path.open("ab") as fh:
                fh.write(b"".join(records))
                fh.flush()
                os.fsync(fh.fileno())
        except OSError as exc:
            raise DeliveryError(f"{self.path}: {exc}") from exc
