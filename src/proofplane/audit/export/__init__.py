"""SIEM export: the audit events, delivered at least once to the operator's sinks.

Pure formatters: ``cef`` (ArcSight CEF), ``syslog`` (RFC 5424 messages, RFC 6587 framing),
``ocsf`` (OCSF 1.1 classes), ``hec`` (Splunk HTTP Event Collector payloads), all with one
event millisecond (``times``). Checked input:
``config`` (what each sink type accepts; redaction of secrets). The I/O (transports, delivery
with retries) lives in :mod:`proofplane.siem`; the cursors and the export loop in
``proofplane.service.sinks``.

Every exported event carries its sequence number and its Merkle leaf hash
(``proofplane.audit.canonical.event_leaf_hash``), so a SIEM can de-duplicate redeliveries and
check any event against a signed checkpoint.
"""

from proofplane.audit.export.config import REDACTED, SINK_TYPES, redact, validate

__all__ = ["REDACTED", "SINK_TYPES", "redact", "validate"]
