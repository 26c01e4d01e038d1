"""A configured sink: how it encodes one event, and how it delivers a batch with retries.

``build(kind, config)`` pairs a pure encoder (CEF-in-syslog, OCSF JSON, HEC JSON) with a thin
transport. ``deliver`` sends one batch, retrying with exponential backoff; it returns only once
the receiver acknowledged, or raises ``DeliveryError`` after the last attempt, and the caller
then leaves its cursor where it was: delivery is at least once, never at most once.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from proofplane import __version__
from proofplane.audit.export import cef, config, hec, ocsf, syslog
from proofplane.model import Event
from proofplane.siem.transport import (
    DeliveryError,
    FileTransport,
    HecTransport,
    HttpTransport,
    SyslogTlsTransport,
    Transport,
)

Encoder = Callable[[Event, bytes], bytes]


@dataclass(frozen=True)
class Sink:
    kind: str
    encode: Encoder
    transport: Transport
    batch_size: int


def backoff_delays(attempts: int, base_s: float, max_s: float) -> list[float]:
    """The waits between ``attempts`` tries: base, 2·base, 4·base, … capped at ``max_s``."""
    return [min(max_s, base_s * 2**i) for i in range(max(0, attempts - 1))]


def deliver(
    transport: Transport,
    records: Sequence[bytes],
    *,
    attempts: int = 3,
    base_delay_s: float = 0.5,
    max_delay_s: float = 30.0,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Send one batch; retry with exponential backoff; raise the last error if all fail."""
    delays = backoff_delays(attempts, base_delay_s, max_delay_s)
    for attempt in range(attempts):
        try:
            transport.send(records)
            return
        except DeliveryError:
            if attempt == attempts - 1:
                raise
            sleep(delays[attempt])


def _json_line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, sort_keys=True).encode()


def build(
    kind: str,
    cfg: dict[str, Any],
    *,
    hostname: str | None = None,
    policy: config.SinkPolicy | None = None,
) -> Sink:
    """The sink for a validated configuration (``config.validate``), under ``policy`` (default:
    the strict one): where its transport may connect, and the directory a file sink writes in.
    A stored file sink's path is checked again here (ValidationFailed), so a sink configured
    before the rules, or under another sink directory, writes nowhere else."""
    policy = policy or config.SinkPolicy()
    host = hostname or socket.gethostname()
    version = __version__
    transport: Transport
    if kind == config.SYSLOG:
        address = config.syslog_address(cfg["url"])
        sender = cfg.get("hostname") or host
        facility = cfg["facility"]

        def encode(event: Event, leaf: bytes) -> bytes:
            body = cef.format_event(event, leaf, product_version=version)
            return syslog.event_message(event, leaf, body, hostname=sender, facility=facility)

        transport = SyslogTlsTransport(
            *address,
            ca_file=cfg["ca_file"],
            cert_file=cfg["cert_file"],
            key_file=cfg["key_file"],
            server_name=cfg.get("server_name"),
            timeout_s=cfg["timeout_s"],
            policy=policy,
        )
    elif kind in (config.OCSF_FILE, config.OCSF_HTTP):

        def encode(event: Event, leaf: bytes) -> bytes:
            obj = ocsf.to_ocsf(
                event,
                leaf,
                product_version=version,
                ocsf_version=policy.ocsf_version,
                hostname=host,
            )
            line = _json_line(obj)
            return line + b"\n" if kind == config.OCSF_FILE else line

        if kind == config.OCSF_FILE:
            if policy.sink_dir is None:
                raise ValueError("file sinks need a sink directory (PROOFPLANE_SINK_DIR)")
            name = config.sink_file_name(cfg["path"], policy.sink_dir)
            transport = FileTransport(policy.sink_dir, name)
        else:
            headers = {"Content-Type": "application/json"}
            if cfg.get("bearer_token"):
                headers["Authorization"] = f"Bearer {cfg['bearer_token']}"
            transport = HttpTransport(
                cfg["url"],
                headers=headers,
                joiner=(b"[", b",", b"]"),
                ca_file=cfg.get("ca_file"),
                timeout_s=cfg["timeout_s"],
                policy=policy,
            )
    elif kind == config.SPLUNK_HEC:
        event_host = cfg.get("host") or host

        def encode(event: Event, leaf: bytes) -> bytes:
            return hec.encode(
                hec.event_payload(
                    event,
                    leaf,
                    host=event_host,
                    source=cfg["source"],
                    sourcetype=cfg["sourcetype"],
                    index=cfg.get("index"),
                )
            )

        # ack/channel/ack_timeout_s: absent from configurations stored before they existed
        transport = HecTransport(
            hec_url(cfg["url"]),
            token=cfg["token"],
            ack=bool(cfg.get("ack", False)),
            channel=cfg.get("channel"),
            ack_timeout_s=cfg.get("ack_timeout_s", 30),
            ca_file=cfg.get("ca_file"),
            timeout_s=cfg["timeout_s"],
            policy=policy,
        )
    else:
        raise ValueError(f"unknown sink type {kind!r}")
    return Sink(kind, encode, transport, cfg["batch_size"])


def hec_url(url: str) -> str:
    """The collector endpoint: a bare ``https://splunk:8088`` gets ``/services/collector/event``;
    a URL with a path (a proxy in front of Splunk) is used as it is."""
    if urlsplit(url).path in ("", "/"):
        return url.rstrip("/") + hec.EVENT_PATH
    return url


__all__ = ["DeliveryError", "Sink", "backoff_delays", "build", "deliver", "hec_url"]
