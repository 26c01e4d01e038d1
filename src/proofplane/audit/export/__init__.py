"""SIEM export: the audit events, delivered at least once to the operator's sinks.

Pure formatters: ``cef`` (ArcSight CEF), ``syslog`` (RFC 5424 messages, RFC 6587 framing),
``ocsf`` (OCSF 1.1 classes), ``hec`` (Splunk HTTP Event Collector payloads). Checked input:
``config`` (what each sink type accepts; redaction of secrets). Thin I/O: ``transport``
(syslog over mutual TLS, HTTP, file). ``sink`` pairs an encoder with a transport and delivers a
batch with retries and exponential backoff. The cursors and the export loop live in
``proofplane.service.sinks``.

Every exported event carries its sequence number and its Merkle leaf hash
(``proofplane.audit.canonical.event_leaf_hash``), so a SIEM can de-duplicate redeliveries and
check any event against a signed checkpoint.
"""

from proofplane.audit.export.config import REDACTED, SINK_TYPES, redact, validate
from proofplane.audit.export.sink import Sink, backoff_delays, build, deliver
from proofplane.audit.export.transport import DeliveryError

__all__ = [
    "REDACTED",
    "SINK_TYPES",
    "DeliveryError",
    "Sink",
    "backoff_delays",
    "build",
    "deliver",
    "redact",
    "validate",
]
