"""SIEM delivery, the I/O half of the export (pure formatters: :mod:`proofplane.audit.export`).

``transport`` speaks syslog over mutual TLS (RFC 5425 with RFC 6587 framing), HTTP and files;
``guard`` resolves a sink's host and refuses loopback, link-local, unspecified and metadata
addresses that the ``SinkPolicy`` does not allow (at configuration and at every connection);
``sink`` pairs an encoder with a transport and delivers a batch with retries and exponential
backoff. The cursors and the export loop live in ``proofplane.service.sinks``.
"""

from proofplane.siem.sink import Sink, backoff_delays, build, deliver
from proofplane.siem.transport import DeliveryError

__all__ = ["DeliveryError", "Sink", "backoff_delays", "build", "deliver"]
