"""The canonical bytes of an audit event: RFC 8785 (JCS) JSON, and the event's leaf hash.

An event's entry in the Merkle log is the JCS serialization of this object::

    {"action": …, "actor": …, "details": {…}, "outcome": …, "seq": <int>,
     "target_id": …, "target_type": …, "ts": "YYYY-MM-DDTHH:MM:SS.ffffffZ", "v": 1}

* ``seq`` is the event's sequence number (its log index is ``seq - 1``);
* ``ts`` is the event time in UTC with exactly six fractional digits and a ``Z``;
* ``outcome`` is the outcome's string value (``success`` | ``failure`` | ``denied``);
* ``details`` is the event's details object as stored;
* ``v`` is the entry format version (1); a new field means a new version.

Anyone holding an exported event can rebuild these bytes and its leaf hash
(SHA-256(0x00 ‖ bytes)) with any RFC 8785 implementation. ``entry_bytes`` and
``event_leaf_hash`` are a stable interface (the SIEM exporters call them).

JCS, implemented here from the RFC: object members sorted by the UTF-16 code units of their
names, no insignificant whitespace, strings with the minimal escaping (``\\"``, ``\\\\``, the
short forms ``\\b \\f \\n \\r \\t`` and ``\\u00xx`` for other control characters; everything
else as UTF-8), numbers formatted as ECMAScript's ``Number.prototype.toString`` does. Values
JSON cannot carry exactly (NaN, infinities, integers no double equals, lone surrogates,
non-string keys) are refused with ``ValueError``.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from enum import Enum
from typing import Any, Protocol

from proofplane.audit.merkle import leaf_hash

__all__ = [
    "ENTRY_VERSION",
    "AuditableEvent",
    "canonical_json",
    "entry_bytes",
    "entry_frame",
    "entry_leaf_hashes",
    "entry_object",
    "entry_text",
    "event_leaf_hash",
    "fast_canonical_json",
    "format_ts",
    "quote_string",
    "stored_details",
]

ENTRY_VERSION = 1
_MAX_SAFE_INT = 2**53 - 1
_sha256 = hashlib.sha256


class AuditableEvent(Protocol):
    """What ``entry_bytes`` reads: ``proofplane.model.Event`` and ``store.tables.EventRow``
    both fit."""

    @property
    def seq(self) -> int: ...
    @property
    def ts(self) -> datetime: ...
    @property
    def actor(self) -> str: ...
    @property
    def action(self) -> str: ...
    @property
    def target_type(self) -> str: ...
    @property
    def target_id(self) -> str: ...
    @property
    def outcome(self) -> Any: ...  # Outcome or its string value
    @property
    def details(self) -> Mapping[str, Any]: ...


def format_ts(ts: datetime) -> str:
    """UTC, microseconds, ``Z``: the one spelling of an event time in an entry."""
    if ts.tzinfo is None:
        raise ValueError("naive datetime in an audit event")
    return ts.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def entry_object(event: AuditableEvent) -> dict[str, Any]:
    """The JSON object an entry canonicalizes (see the module docstring)."""
    outcome = event.outcome
    return {
        "action": event.action,
        "actor": event.actor,
        "details": dict(event.details or {}),
        "outcome": outcome.value if isinstance(outcome, Enum) else str(outcome),
        "seq": int(event.seq),
        "target_id": event.target_id,
        "target_type": event.target_type,
        "ts": format_ts(event.ts),
        "v": ENTRY_VERSION,
    }


def entry_bytes(event: AuditableEvent) -> bytes:
    """The canonical (RFC 8785) bytes of an event: what its Merkle leaf hashes."""
    return canonical_json(entry_object(event))


def event_leaf_hash(event: AuditableEvent) -> bytes:
    """The event's RFC 9162 leaf hash, SHA-256(0x00 ‖ entry_bytes(event)) (32 bytes)."""
    return leaf_hash(entry_bytes(event))


# --- the fast path: an entry laid out from its parts ----------------------------------------
#
# The canonical entry has one fixed shape (members in JCS order, all strings but ``details``,
# ``seq`` and ``v``), so where the details' canonical text is already at hand the entry is
# text laid out around it: that is what the event writer (``Tx.record``) and the fast
# verifier (``store.audit_verify``) do, through these three functions and nothing else.


def entry_frame(
    ts: str, actor: str, action: str, target_type: str, outcome: str
) -> tuple[str, str, str]:
    """``(head, mid, tail)``: the fixed text of an entry around the parts that change from
    one event of a batch to the next (the details, the seq, the target id)::

        head + details_json + mid + str(seq) + ',"target_id":' + quote_string(target_id) + tail

    ``ts`` is the entry's spelling of the time (``format_ts``), ``outcome`` its string
    value. ``TypeError`` when a part is no ``str``."""
    q = quote_string
    return (
        f'{{"action":{q(action)},"actor":{q(actor)},"details":',
        f',"outcome":{q(outcome)},"seq":',
        f',"target_type":{q(target_type)},"ts":"{ts}","v":{ENTRY_VERSION}}}',
    )


def entry_text(
    seq: int,
    ts: str,
    actor: str,
    action: str,
    target_type: str,
    target_id: str,
    outcome: str,
    details_json: str,
) -> str:
    """The canonical entry as text, from its parts in final form: ``ts`` as ``format_ts``
    spells it, ``outcome`` its string value, ``details_json`` the details' canonical JSON
    text (``stored_details``, ``fast_details_json``). Encoded as UTF-8 it is
    ``entry_bytes`` of the same event, byte for byte (tested)."""
    head, mid, tail = entry_frame(ts, actor, action, target_type, outcome)
    return f'{head}{details_json}{mid}{seq},"target_id":{quote_string(target_id)}{tail}'


def entry_leaf_hashes(
    ts: str, actor: str, events: Iterable[tuple[int, str, str, str, str, str]]
) -> list[bytes]:
    """The leaf hashes of entries that share a time (``format_ts`` spelling) and an actor, as
    a transaction's events do: ``events`` are ``(seq, action, target_type, target_id,
    outcome, details_json)``, each hashed as ``leaf_hash(entry_text(...).encode())`` is
    (tested), with the frame of each (action, target type, outcome) laid out once.
    ``ValueError`` (``UnicodeEncodeError``) for text that is not valid Unicode."""
    frames: dict[tuple[str, str, str], tuple[str, str, str]] = {}
    q, sha = quote_string, _sha256
    out: list[bytes] = []
    keep = out.append
    for seq, action, target_type, target_id, outcome, details in events:
        key = (action, target_type, outcome)
        frame = frames.get(key)
        if frame is None:
            head, mid, tail = entry_frame(ts, actor, action, target_type, outcome)
            frame = frames[key] = ("\x00" + head, mid, tail)  # 0x00: the RFC 9162 leaf prefix
        head, mid, tail = frame
        keep(sha(f'{head}{details}{mid}{seq},"target_id":{q(target_id)}{tail}'.encode()).digest())
    return out


def canonical_json(value: Any) -> bytes:
    """RFC 8785 serialization of a JSON value, as UTF-8 bytes."""
    out: list[str] = []
    _write(value, out)
    try:
        return "".join(out).encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError("a string holds a lone surrogate: not valid Unicode") from exc


def _write(value: Any, out: list[str]) -> None:
    # bool before int: bool is an int subclass
    if value is None:
        out.append("null")
    elif value is True:
        out.append("true")
    elif value is False:
        out.append("false")
    elif isinstance(value, str):
        out.append(_string(value))
    elif isinstance(value, int):
        if -_MAX_SAFE_INT <= value <= _MAX_SAFE_INT:
            out.append(str(int(value)))
        else:  # JSON numbers are doubles: fine only where the double is exactly this integer
            try:
                exact = int(float(value)) == value
            except OverflowError:
                exact = False
            if not exact:
                raise ValueError(f"integer {value} is not exactly representable as a JSON number")
            out.append(format_number(float(value)))
    elif isinstance(value, float):
        out.append(format_number(value))
    elif isinstance(value, Mapping):
        items = []
        for key in value:
            if not isinstance(key, str):
                raise ValueError(f"object key {key!r} is not a string")
            items.append((key.encode("utf-16-be", "surrogatepass"), key))
        items.sort()
        out.append("{")
        for i, (_, key) in enumerate(items):
            if i:
                out.append(",")
            out.append(_string(key))
            out.append(":")
            _write(value[key], out)
        out.append("}")
    elif isinstance(value, list | tuple):
        out.append("[")
        for i, item in enumerate(value):
            if i:
                out.append(",")
            _write(item, out)
        out.append("]")
    else:
        raise ValueError(f"{type(value).__name__} is not a JSON value")


_NEEDS_ESCAPE = re.compile(r'[\x00-\x1f"\\]')
_SHORT = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(match: re.Match[str]) -> str:
    ch = match.group()
    return _SHORT.get(ch) or f"\\u{ord(ch):04x}"


def _string(s: str) -> str:
    return '"' + _NEEDS_ESCAPE.sub(_escape, s) + '"'


def format_number(x: float) -> str:
    """ECMAScript Number.prototype.toString for a finite double (RFC 8785 §3.2.2.3)."""
    if x != x or x in (float("inf"), float("-inf")):
        raise ValueError("NaN and infinities are not JSON numbers")
    if x == 0:
        return "0"  # also -0
    sign = "-" if x < 0 else ""
    # repr gives the shortest digits that round-trip, as ECMAScript requires
    mantissa, _, exp = repr(abs(x)).partition("e")
    whole, _, frac = mantissa.partition(".")
    raw = (whole + frac).lstrip("0")
    digits = raw.rstrip("0")
    # value = int(digits) × 10^(exp − len(frac) + trailing zeros) = 0.<digits> × 10^n
    n = len(digits) + (int(exp) if exp else 0) - len(frac) + (len(raw) - len(digits))
    k = len(digits)
    if k <= n <= 21:
        body = digits + "0" * (n - k)
    elif 0 < n <= 21:
        body = digits[:n] + "." + digits[n:]
    elif -6 < n <= 0:
        body = "0." + "0" * (-n) + digits
    else:
        e = n - 1
        e_str = ("+" if e >= 0 else "-") + str(abs(e))
        body = digits[0] + ("." + digits[1:] if k > 1 else "") + "e" + e_str
    return sign + body


def fast_details_json(text: str) -> str | None:
    """The canonical form of a stored details JSON text through the C json module, or None
    when the fast path does not apply (floats, non-ASCII text). Used by bulk verification;
    equal to ``canonical_json`` wherever it answers (tested)."""
    if not text.isascii() or "\\u" in text:
        return None
    saw_float = False

    def _float(s: str) -> float:
        nonlocal saw_float
        saw_float = True
        return float(s)

    def _int(s: str) -> int:
        nonlocal saw_float
        value = int(s)
        if not -_MAX_SAFE_INT <= value <= _MAX_SAFE_INT:
            saw_float = True  # let the strict path refuse it
        return value

    value = json.loads(text, parse_float=_float, parse_int=_int)
    if saw_float or not isinstance(value, dict):
        return None
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


# --- fast paths (the C json encoder where it gives the JCS bytes) ---------------------------


def _refuse(value: Any) -> Any:
    raise TypeError(f"{type(value).__name__} is not a JSON value")


# The C encoder, made once (json.dumps builds one per call): sorted keys, compact separators,
# UTF-8 left as is, NaN refused. No circular-reference markers: only values that passed
# ``_jcs_simple`` (whose recursion would already have failed on a cycle) get here.
if json.encoder.c_make_encoder is not None:  # type: ignore[attr-defined]
    _c_encode = json.encoder.c_make_encoder(  # type: ignore[attr-defined]
        None, _refuse, json.encoder.encode_basestring, None, ":", ",", True, False, False
    )

    def _dumps_compact(value: Any) -> str:
        return "".join(_c_encode(value, 0))

else:  # pragma: no cover - interpreters without the _json accelerator
    _py_encoder = json.JSONEncoder(
        ensure_ascii=False, allow_nan=False, sort_keys=True, separators=(",", ":")
    )

    def _dumps_compact(value: Any) -> str:
        return _py_encoder.encode(value)


quote_string = json.encoder.encode_basestring
"""JCS string quoting for a ``str`` (C): the same minimal escapes (lowercase ``\\u00xx``
for control characters, short forms for the five that have them), everything else as is."""
# astral characters (key order) and lone surrogates (not UTF-8): the exact path decides
_NOT_FAST = re.compile("[\U00010000-\U0010ffff\ud800-\udfff]")


def _jcs_simple(value: Any) -> bool:
    """True when the C json encoder gives this value's JCS text: only dicts with ``str``
    keys, lists, ``str``, ``bool``, ``None``, ``int`` within ±(2^53 − 1) and floats whose
    Python repr is already the ECMAScript spelling (exact types: no subclasses)."""
    t = type(value)
    if t is str or t is bool or value is None:
        return True
    if t is int:
        n: int = value
        return -_MAX_SAFE_INT <= n <= _MAX_SAFE_INT
    if t is dict or t is list:
        # a loop with the scalar cases inline: this runs for every recorded event
        for k, v in value.items() if t is dict else enumerate(value):
            if t is dict and type(k) is not str:
                return False
            tv = type(v)
            if tv is str or tv is bool:
                continue
            if tv is int:
                if -_MAX_SAFE_INT <= v <= _MAX_SAFE_INT:
                    continue
                return False
            if not _jcs_simple(v):
                return False
        return True
    if t is float:
        if value != value or value in (float("inf"), float("-inf")):
            return False
        return repr(value) == format_number(value)
    return False


def _fast_text(value: Any) -> str | None:
    """The JCS text of ``value`` via the C encoder, or None where that may differ."""
    if not _jcs_simple(value):
        return None
    text = _dumps_compact(value)
    # sort_keys orders by code point, JCS by UTF-16 unit: they differ only around astral
    # characters (in keys). Any astral character or lone surrogate: the exact path.
    if not text.isascii() and _NOT_FAST.search(text):
        return None
    return text


def fast_canonical_json(value: Any) -> bytes:
    """``canonical_json(value)``, byte for byte, through the C json encoder when the value
    is simple enough (see ``_jcs_simple``), else through the exact encoder."""
    text = _fast_text(value)
    return canonical_json(value) if text is None else text.encode("utf-8")


def stored_details(details: Mapping[str, Any] | None) -> tuple[dict[str, Any], str, str]:
    """(details as the database gives them back, the JSON text to store, their canonical
    JSON text).

    A JSON column round-trips values through ``json``: tuples come back as lists, non-string
    keys as strings; the entry hashes what comes back, so that is normalized first where
    needed. The text to store is the canonical text itself wherever reading it back gives
    the same values (the common case); where it would not (integers beyond 2^53, floats
    whose ECMAScript spelling reads back as an integer) it is plain ``json`` text, exactly
    as before. Raises ``ValueError`` for what JCS cannot carry (NaN, lone surrogates,
    integers no double equals)."""
    value: Any = {} if details is None else details
    text = _fast_text(value)
    if text is not None:
        return value, text, text
    normalized = json.loads(json.dumps(value))
    if not isinstance(normalized, dict):
        raise ValueError("event details must be a JSON object")
    canonical = canonical_json(normalized).decode("utf-8")
    stored = json.dumps(normalized, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    return normalized, stored, canonical
