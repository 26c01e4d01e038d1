"""ArcSight Common Event Format (CEF) for exported events. Pure: values in, text out.

A CEF record is ``CEF:0|Vendor|Product|Version|SignatureID|Name|Severity|Extension``. The two
parts escape differently, and mixing them up is the classic CEF bug:

* header fields escape ``\\`` and ``|`` (a ``=`` is literal there); a line break has no escape
  in the header and would end the record, so it becomes a space;
* extension values escape ``\\``, ``=`` and line breaks (``\\n``, ``\\r``); a ``|`` is literal.

(Micro Focus, "Implementing ArcSight CEF", revision 25.) Extension keys come from the CEF
dictionary only; custom values travel in the labelled custom fields (``cs1``/``cs1Label``, …).

Every record carries the event's sequence number (``externalId``) and its Merkle leaf hash
(``cs6``, labelled ``leafHash``), so a SIEM can de-duplicate and cross-check against the log.
``rt`` is the event time in milliseconds since the Unix epoch (truncated, as in every format:
``times.epoch_millis``). A ``source_ip`` in the event's
details (the client address of a login) becomes ``src`` when it is an IPv4 address; the
dictionary's ``src`` is IPv4 only, so an IPv6 address goes in ``c6a2``, the custom IPv6 field
ArcSight reserves for the source (label "Source IPv6 Address").
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Iterable

from proofplane.audit.export.times import epoch_millis
from proofplane.model import Event, Outcome

CEF_VERSION = 0
VENDOR = "proofplane"
PRODUCT = "proofplane"

_KEY = re.compile(r"^[A-Za-z0-9]+$")
SOURCE_IPV6_LABEL = "Source IPv6 Address"


def escape_header(value: str) -> str:
    """Escape one CEF header field: backslash and pipe; line breaks become spaces."""
    out = value.replace("\\", "\\\\").replace("|", "\\|")
    return out.replace("\r\n", " ").replace("\r", " ").replace("\n", " ")


def escape_extension(value: str) -> str:
    """Escape one CEF extension value: backslash, equals sign, and line breaks."""
    out = value.replace("\\", "\\\\").replace("=", "\\=")
    return out.replace("\n", "\\n").replace("\r", "\\r")


def severity(event: Event) -> int:
    """CEF severity 0-10: alerts 8 (not an alert's resolution), denials 7, failures 5, the
    rest 3."""
    if event.action.startswith("alert.") and event.action != "alert.resolve":
        return 8
    if event.outcome is Outcome.DENIED:
        return 7
    if event.outcome is Outcome.FAILURE:
        return 5
    return 3


def source_address(details: dict[str, object]) -> list[tuple[str, str]]:
    """The extension pairs for ``details["source_ip"]``: ``src`` for IPv4 (an IPv4-mapped IPv6
    address included), ``c6a2`` with its label for IPv6, nothing when it is not an address."""
    value = details.get("source_ip")
    if not isinstance(value, str):
        return []
    try:
        addr = ipaddress.ip_address(value)
    except ValueError:
        return []
    if isinstance(addr, ipaddress.IPv6Address):
        if addr.ipv4_mapped is not None:
            return [("src", str(addr.ipv4_mapped))]
        # a zone index (fe80::1%eth0) is local to the sender's host: not part of the address
        bare = ipaddress.IPv6Address(addr.packed)
        return [("c6a2Label", SOURCE_IPV6_LABEL), ("c6a2", str(bare))]
    return [("src", str(addr))]


def extension(pairs: Iterable[tuple[str, str]]) -> str:
    """``key=value`` pairs, space separated, values escaped. Keys are CEF keys (alphanumeric)."""
    parts = []
    for key, value in pairs:
        if not _KEY.fullmatch(key):
            raise ValueError(f"invalid CEF extension key {key!r}")
        parts.append(f"{key}={escape_extension(value)}")
    return " ".join(parts)


def format_event(event: Event, leaf_hash: bytes, *, product_version: str) -> str:
    """One event as one CEF record (a single line: no raw line breaks survive escaping)."""
    millis = epoch_millis(event.ts)
    details = json.dumps(event.details, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    header = [
        f"CEF:{CEF_VERSION}",
        escape_header(VENDOR),
        escape_header(PRODUCT),
        escape_header(product_version),
        escape_header(event.action),
        escape_header(f"{event.action} {event.target_type}/{event.target_id}"),
        str(severity(event)),
    ]
    ext = extension(
        [
            ("rt", str(millis)),
            ("externalId", str(event.seq)),
            ("suser", event.actor),
            *source_address(event.details),
            ("act", event.action),
            ("outcome", event.outcome.value),
            ("cs1Label", "targetType"),
            ("cs1", event.target_type),
            ("cs2Label", "targetId"),
            ("cs2", event.target_id),
            ("cs6Label", "leafHash"),
            ("cs6", leaf_hash.hex()),
            ("msg", details),
        ]
    )
    return "|".join(header) + "|" + ext


def _unescape(text: str, specials: str) -> str:
    out: list[str] = []
    i = 0
    while i < len(text):
        ch = text[i]
        if ch == "\\" and i + 1 < len(text):
            nxt = text[i + 1]
            if nxt in specials:
                out.append(nxt)
            elif nxt == "n":
                out.append("\n")
            elif nxt == "r":
                out.append("\r")
            else:
                out.append(ch + nxt)
            i += 2
            continue
        out.append(ch)
        i += 1
    return "".join(out)


def parse(record: str) -> tuple[list[str], dict[str, str]]:
    """Split a CEF record back into its 7 unescaped header fields and its extension map.

    The inverse of ``format_event`` for records it wrote; tests and receivers use it.
    """
    fields: list[str] = []
    current: list[str] = []
    i = 0
    while len(fields) < 7:
        if i >= len(record):
            raise ValueError("a CEF record has 7 header fields before its extension")
        ch = record[i]
        if ch == "\\" and i + 1 < len(record):
            current.append(record[i : i + 2])
            i += 2
            continue
        if ch == "|":
            fields.append(_unescape("".join(current), "\\|"))
            current = []
        else:
            current.append(ch)
        i += 1
    rest = record[i:]
    ext: dict[str, str] = {}
    # A key starts after an unescaped space and ends at the first unescaped '='.
    for match in re.finditer(r"(?:^| )([A-Za-z0-9]+)=((?:\\.|[^\\=])*?)(?= [A-Za-z0-9]+=|$)", rest):
        ext[match.group(1)] = _unescape(match.group(2), "\\=")
    return fields, ext
