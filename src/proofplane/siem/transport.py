"""The I/O of the sinks, kept thin: each ``send`` delivers one batch of encoded records or
raises ``DeliveryError``. Returning means the receiver acknowledged the batch:

* syslog over mutual TLS: the server accepted our client certificate, and every frame was
  written and flushed on that connection (syslog has no application-level acknowledgement);
* HTTP (HEC, OCSF): a 2xx answer; for HEC with indexer acknowledgement, the batch's ``ackId``
  reported indexed by the collector's ack endpoint;
* file: written, flushed and fsync'd.

Sinks must not become a way into the host (issue 19, §5): network transports connect only to
addresses ``proofplane.siem.guard`` checked against the ``SinkPolicy`` (resolved at each
connection, so a DNS answer changed after configuration cannot point a sink at loopback or the
metadata service); a file sink opens one name in the sink directory, without following links;
and a ``DeliveryError`` carries a status and a short reason, never what the receiver answered
(the error is shown to operators and recorded in events).

A fresh connection per batch is deliberate: a long-lived TLS connection to a receiver that died
accepts the next write into the kernel's buffer and loses it; a new handshake proves the receiver
is there before anything is counted as delivered.
"""

from __future__ import annotations

import contextlib
import os
import select
import ssl
import stat
import time
from collections.abc import Callable, Sequence
from http import HTTPStatus
from pathlib import Path
from typing import Protocol
from urllib.parse import urlencode, urlsplit, urlunsplit

import httpx

from proofplane.audit.export import hec
from proofplane.audit.export.config import REDACTED, SinkPolicy
from proofplane.audit.export.syslog import frame
from proofplane.errors import ProofplaneError, ValidationFailed
from proofplane.siem import guard


class DeliveryError(ProofplaneError):
    """A batch was not acknowledged; it will be sent again."""

    code = "delivery_error"


class TlsFilesInvalid(ValidationFailed, DeliveryError, OSError):
    """A sink's CA file (or a syslog sink's client certificate or key) cannot be loaded
    (missing, or no certificate or key in it): its configuration
    is wrong, which no retry mends; testing the sink answers 422. Still a ``DeliveryError`` and
    the ``OSError`` that ``ssl.SSLError`` was, so an export pass records it on the sink and
    skips it as before."""

    code = "tls_file_invalid"


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
        policy: SinkPolicy | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.policy = policy or SinkPolicy()
        self.server_name = server_name or host
        self.timeout_s = timeout_s
        self._files = (ca_file, cert_file, key_file)

    def _context(self) -> ssl.SSLContext:
        ca_file, cert_file, key_file = self._files
        try:
            ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca_file)
            ctx.minimum_version = ssl.TLSVersion.TLSv1_2
            ctx.load_cert_chain(cert_file, key_file)
        except (OSError, ssl.SSLError) as exc:  # a configuration no retry mends: 422 on test
            raise TlsFilesInvalid(
                f"cannot load the TLS files: {exc}",
                # the key's path is a secret (``SECRET_FIELDS``): not echoed back
                details={"ca_file": ca_file, "cert_file": cert_file, "key_file": REDACTED},
            ) from None
        return ctx

    def send(self, records: Sequence[bytes]) -> None:
        data = b"".join(frame(r) for r in records)
        ctx = self._context()
        try:
            with (
                guard.open_connection(self.host, self.port, self.policy, self.timeout_s) as raw,
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
        except (guard.DestinationRefused, guard.Unresolvable) as exc:
            raise DeliveryError(f"syslog {self.host}:{self.port}: {exc.message}") from exc


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
        policy: SinkPolicy | None = None,
    ) -> None:
        self.url = url
        self.policy = policy or SinkPolicy()
        self.headers = headers
        self.joiner = joiner  # (prefix, separator, suffix) around the records
        self._client = client
        self._verify: ssl.SSLContext | bool = True
        if ca_file:
            try:
                self._verify = ssl.create_default_context(cafile=ca_file)
            except (OSError, ssl.SSLError) as exc:  # ssl.SSLError: no certificate in the file
                raise TlsFilesInvalid(
                    f"cannot load the CA file {ca_file!r}: {exc}", details={"ca_file": ca_file}
                ) from None
        self.timeout_s = timeout_s

    def send(self, records: Sequence[bytes]) -> None:
        prefix, sep, suffix = self.joiner
        response = self._post(prefix + sep.join(records) + suffix)
        if not 200 <= response.status_code < 300:
            # The status and its standard phrase only: the receiver's body (and its own reason
            # phrase) could carry anything, a loopback service's secrets included.
            raise DeliveryError(
                f"POST {shown_url(self.url)}: HTTP {status_line(response.status_code)}"
            )

    def _post(
        self, body: bytes, *, url: str | None = None, headers: dict[str, str] | None = None
    ) -> httpx.Response:
        """POST ``body`` to ``url`` (default: the sink's) through the destination guard; a
        failure to get an answer is a ``DeliveryError`` that quotes nothing the peer sent."""
        url = url or self.url
        headers = headers if headers is not None else self.headers
        shown = shown_url(url)
        try:
            if self._client is not None:
                return self._client.post(url, content=body, headers=headers)
            return self._post_pinned(body, url=url, headers=headers)
        except (guard.DestinationRefused, guard.Unresolvable) as exc:
            raise DeliveryError(f"POST {shown}: {exc.message}") from exc
        except (httpx.ProtocolError, httpx.DecodingError) as exc:
            # h11 quotes the offending bytes of the answer: not shown.
            raise DeliveryError(f"POST {shown}: the answer is not valid HTTP") from exc
        except httpx.HTTPError as exc:
            raise DeliveryError(f"POST {shown}: {type(exc).__name__}: {exc}"[:300]) from exc

    def _post_pinned(
        self, body: bytes, *, url: str | None = None, headers: dict[str, str] | None = None
    ) -> httpx.Response:
        """POST to an address ``guard`` checked: the URL's host resolved now, each address
        checked, and the connection made to that address (Host header and TLS server name
        stay the URL's host, so certificate checks are unchanged). No proxy from the
        environment: it would resolve the name again, out of our sight."""
        target = httpx.URL(url or self.url)
        port = target.port or (443 if target.scheme == "https" else 80)
        addresses = guard.connect_addresses(target.host, port, self.policy)
        host_header = target.netloc.decode("ascii")
        sent = headers if headers is not None else self.headers
        last: httpx.HTTPError | None = None
        with httpx.Client(verify=self._verify, timeout=self.timeout_s, trust_env=False) as client:
            for address in addresses:
                try:
                    return client.post(
                        target.copy_with(host=address.ip),
                        content=body,
                        headers={**sent, "Host": host_header},
                        extensions={"sni_hostname": target.host},
                    )
                except httpx.ConnectError as exc:
                    last = exc
        assert last is not None
        raise last


class HecTransport(HttpTransport):
    """Splunk HEC: POST a batch of concatenated event objects; a 2xx answer is delivery, or,
    with indexer acknowledgement (``ack``), the batch's ``ackId`` reported indexed by
    ``/services/collector/ack`` within ``ack_timeout_s``.

    With ``ack`` every request (event and poll) names the sink's ``channel``; the poll waits
    0.2 s, then twice as long each time (at most ``ACK_POLL_MAX_S``), until the deadline. An
    ack that stays false is a ``DeliveryError``: the batch is sent again (at least once; the
    receiver may then hold it twice, told apart by ``seq`` and ``leaf_hash``). A refusal
    names the HEC code and our own text for it (``hec.CODES``), never the receiver's words.
    """

    def __init__(
        self,
        url: str,
        *,
        token: str,
        ack: bool = False,
        channel: str | None = None,
        ack_timeout_s: float = 30.0,
        ca_file: str | None = None,
        timeout_s: float = 10.0,
        client: httpx.Client | None = None,
        policy: SinkPolicy | None = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        headers = {"Authorization": f"Splunk {token}", "Content-Type": "application/json"}
        if ack and channel is None:
            channel = hec.derived_channel(url, token)
        if channel is not None:
            headers[hec.CHANNEL_HEADER] = channel
        super().__init__(
            url,
            headers=headers,
            ca_file=ca_file,
            timeout_s=timeout_s,
            client=client,
            policy=policy,
        )
        self.ack = ack
        self.channel = channel
        self.ack_timeout_s = ack_timeout_s
        self._sleep = sleep
        self._clock = clock
        path = hec.ack_path(urlsplit(url).path) if ack else None
        if ack and path is None:
            raise ValueError("the HEC URL has no acknowledgement endpoint beside it")
        self.ack_url = (
            urlunsplit(urlsplit(url)._replace(path=path, query=urlencode({"channel": channel})))
            if path is not None
            else None
        )

    def send(self, records: Sequence[bytes]) -> None:
        shown = shown_url(self.url)
        response = self._post(hec.batch_body(records))
        if not 200 <= response.status_code < 300:
            raise DeliveryError(f"POST {shown}: {self._refusal(response)}")
        if not self.ack:
            return
        ack_id = hec.ack_id(response.content)
        if ack_id is None:
            raise DeliveryError(
                f"POST {shown}: the answer has no ackId, so the batch cannot be confirmed "
                'indexed: turn on indexer acknowledgement for the token, or set "ack": false'
            )
        self._await_ack(ack_id)

    def _refusal(self, response: httpx.Response) -> str:
        """``HTTP 400 Bad Request, HEC code 10 (Data channel is missing)``, and what to do."""
        text = f"HTTP {status_line(response.status_code)}"
        code = hec.answer_code(response.content)
        if code is None:
            return text
        text += f", {hec.code_meaning(code)}"
        if code == hec.CHANNEL_MISSING and not self.ack:
            text += (
                ': the token has indexer acknowledgement on; set "ack": true in the sink\'s config'
            )
        elif code == hec.ACK_DISABLED:
            text += ': the token has indexer acknowledgement off; set "ack": false'
        return text

    def _await_ack(self, ack_id: int) -> None:
        assert self.ack_url is not None
        shown = shown_url(self.ack_url)
        deadline = self._clock() + self.ack_timeout_s
        wait = ACK_POLL_FIRST_S
        why = "not yet indexed"
        while True:
            self._sleep(max(0.0, min(wait, deadline - self._clock())))
            wait = min(wait * 2, ACK_POLL_MAX_S)
            try:
                response = self._post(hec.ack_body([ack_id]), url=self.ack_url)
            except DeliveryError as exc:
                why = str(exc)  # unreachable for a moment: the ack state waits on the server
            else:
                if 200 <= response.status_code < 300:
                    status = hec.ack_status(response.content, [ack_id])
                    if status is None:
                        raise DeliveryError(f"POST {shown}: the answer is not a HEC ack status")
                    if status[ack_id]:
                        return
                    why = "not yet indexed"
                elif response.status_code >= 500 or response.status_code == 429:
                    why = self._refusal(response)  # busy: ask again
                else:
                    raise DeliveryError(f"POST {shown}: {self._refusal(response)}")
            if self._clock() >= deadline:
                raise DeliveryError(
                    f"POST {shown_url(self.url)}: ackId {ack_id} not confirmed indexed within "
                    f"{self.ack_timeout_s:g} s ({why}); the batch will be sent again"
                )


ACK_POLL_FIRST_S = 0.2
ACK_POLL_MAX_S = 5.0


def shown_url(url: str) -> str:
    """A sink URL fit for an error message: scheme, host, port and path (no query)."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}{parts.path}"


def status_line(status: int) -> str:
    """``503 Service Unavailable``: the status and its standard phrase."""
    try:
        return f"{status} {HTTPStatus(status).phrase}"
    except ValueError:
        return str(status)


class FileTransport:
    """Append records (each ending in a newline) to the file ``name`` in the sink directory,
    durably. The directory is created 0700 and the file 0600; the name is opened relative to
    the directory without following a link, and only a regular file is written to."""

    def __init__(self, sink_dir: str, name: str) -> None:
        self.sink_dir = Path(sink_dir)
        self.name = name

    @property
    def path(self) -> Path:
        return self.sink_dir / self.name

    def send(self, records: Sequence[bytes]) -> None:
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            self.sink_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            dir_fd = os.open(self.sink_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                # O_NONBLOCK: a FIFO planted under the name must not hang the exporter.
                fd = os.open(self.name, flags | os.O_NONBLOCK, 0o600, dir_fd=dir_fd)
            finally:
                os.close(dir_fd)
            with os.fdopen(fd, "ab") as fh:
                if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                    raise DeliveryError(f"sink file {self.name}: not a regular file")
                os.set_blocking(fh.fileno(), True)
                fh.write(b"".join(records))
                fh.flush()
                os.fsync(fh.fileno())
        except OSError as exc:
            raise DeliveryError(f"sink file {self.name}: {exc.strerror or exc}") from exc
