"""Syslog messages (RFC 5424) and their TCP framing (RFC 6587 octet counting). Pure.

``format_message`` builds ``<PRI>1 TIMESTAMP HOSTNAME APP-NAME PROCID MSGID [SD] MSG``; the
structured data element ``[proofplane@32473 seq="…" leaf="…"]`` repeats the sequence number and
leaf hash so a receiver can de-duplicate without parsing the message body. (32473 is the private
enterprise number RFC 5612 reserves for documentation; a deployment with its own number passes
``sd_id``.) The message body is sent as MSG-ANY, without a UTF-8 BOM: CEF parsers do not expect
one, and rsyslog would keep it in the text. (MSG-ANY must not begin with a BOM, so a body that
does is refused.)

Header fields are printable US-ASCII (33..126) cut to RFC 5424's lengths (HOSTNAME 255,
APP-NAME 48, PROCID 128, MSGID 32); any other character becomes ``_``. SD-IDs and PARAM-NAMEs
are SD-NAMEs: 1..32 printable US-ASCII characters except ``=``, space, ``]`` and ``"`` (an SD-ID
may carry one ``@``: ``name@enterprise-number``). PARAM-VALUEs are UTF-8 with ``"``, ``\\`` and
``]`` escaped by a backslash (section 6.3.3).

A message is as long as its CEF body makes it: RFC 5425 receivers must accept 2048 octets and
SHOULD accept 8192, and rsyslog's default limit is 8 KiB, so a receiver that gets large events
(big ``details``) has to raise its limit (rsyslog: ``global(maxMessageSize=...)``); a longer
message is cut or dropped by the receiver, never by the exporter.

``frame`` prefixes a message with its length in octets (``LEN SP MSG``), the framing RFC 5425
mandates over TLS; ``unframe`` is its inverse, for tests and receivers.
"""

from __future__ import annotations

from datetime import UTC, datetime

from proofplane.model import Event, Outcome

NIL = "-"
SD_ID = "proofplane@32473"
FACILITY_LOG_AUDIT = 13

# RFC 5424 severities
CRITICAL, WARNING, NOTICE, INFORMATIONAL = 2, 4, 5, 6


def severity(event: Event) -> int:
    """RFC 5424 severity: alerts critical (an alert's resolution is news, not one), denials
    and failures warning, the rest notice."""
    if event.action.startswith("alert.") and event.action != "alert.resolve":
        return CRITICAL
    if event.outcome in (Outcome.DENIED, Outcome.FAILURE):
        return WARNING
    return NOTICE


def _header_token(value: str | None, max_len: int) -> str:
    """A header field: printable US-ASCII without spaces, at most ``max_len``; NIL if empty."""
    if not value:
        return NIL
    cleaned = "".join(ch if 33 <= ord(ch) <= 126 else "_" for ch in value)
    return cleaned[:max_len]


_SD_NAME_FORBIDDEN = frozenset('= ]"')


def sd_name(value: str) -> str:
    """An SD-NAME (SD-ID or PARAM-NAME): 1..32 printable US-ASCII characters except ``=``,
    space, ``]`` and ``"``; anything else becomes ``_``, and an empty name is ``_``."""
    cleaned = "".join(
        ch if 33 <= ord(ch) <= 126 and ch not in _SD_NAME_FORBIDDEN else "_" for ch in value
    )
    return cleaned[:32] or "_"


def timestamp(ts: datetime) -> str:
    """RFC 3339 in UTC with microseconds (RFC 5424 allows at most six fraction digits)."""
    if ts.tzinfo is None:
        raise ValueError("naive datetime")
    return ts.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def escape_sd_value(value: str) -> str:
    """SD-PARAM values escape ``"``, ``\\`` and ``]`` with a backslash (RFC 5424 6.3.3)."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("]", "\\]")


def format_message(
    *,
    facility: int,
    severity: int,
    ts: datetime,
    hostname: str | None,
    app_name: str,
    procid: str | None,
    msgid: str | None,
    structured_data: dict[str, dict[str, str]] | None,
    msg: str,
) -> bytes:
    """One RFC 5424 message as UTF-8 bytes."""
    if not 0 <= facility <= 23 or not 0 <= severity <= 7:
        raise ValueError("facility is 0..23 and severity 0..7")
    if msg.startswith("\ufeff"):
        raise ValueError("MSG-ANY must not begin with a byte order mark")
    if structured_data:
        elements = []
        seen: set[str] = set()
        for sd_id, params in structured_data.items():
            name = sd_name(sd_id)
            if name in seen:
                raise ValueError(f"SD-ID {name!r} twice in one message (RFC 5424 6.3.2)")
            seen.add(name)
            inner = "".join(f' {sd_name(k)}="{escape_sd_value(v)}"' for k, v in params.items())
            elements.append(f"[{name}{inner}]")
        sd = "".join(elements)
    else:
        sd = NIL
    head = " ".join(
        [
            f"<{facility * 8 + severity}>1",
            timestamp(ts),
            _header_token(hostname, 255),
            _header_token(app_name, 48),
            _header_token(procid, 128),
            _header_token(msgid, 32),
            sd,
        ]
    )
    return (head + " " + msg).encode("utf-8")


def event_message(
    event: Event,
    leaf_hash: bytes,
    body: str,
    *,
    hostname: str | None,
    facility: int = FACILITY_LOG_AUDIT,
    sd_id: str = SD_ID,
) -> bytes:
    """The RFC 5424 message that carries one exported event (``body``: its CEF record)."""
    return format_message(
        facility=facility,
        severity=severity(event),
        ts=event.ts,
        hostname=hostname,
        app_name="proofplane",
        procid=None,
        msgid="audit",
        structured_data={sd_id: {"seq": str(event.seq), "leaf": leaf_hash.hex()}},
        msg=body,
    )


def frame(message: bytes) -> bytes:
    """RFC 6587 octet counting: ``MSG-LEN SP SYSLOG-MSG``."""
    return str(len(message)).encode("ascii") + b" " + message


def unframe(stream: bytes) -> tuple[list[bytes], bytes]:
    """Split octet-counted frames off ``stream``: (complete messages, the unconsumed rest)."""
    out: list[bytes] = []
    pos = 0
    while True:
        space = stream.find(b" ", pos)
        if space < 0:
            break
        digits = stream[pos:space]
        if not digits.isdigit() or digits.startswith(b"0"):
            raise ValueError(f"bad octet count {digits[:16]!r} at offset {pos}")
        end = space + 1 + int(digits)
        if end > len(stream):
            break
        out.append(stream[space + 1 : end])
        pos = end
    return out, stream[pos:]
