"""Splunk HTTP Event Collector payloads and answers. Pure.

A batch is the concatenation of one JSON object per event (no array, no separator), posted to
``/services/collector/event`` with ``Authorization: Splunk <token>``; Splunk answers 200 with
``{"text": "Success", "code": 0}`` once it accepted the whole batch.

Each object is the HEC envelope: ``time`` (epoch seconds, written with exactly three decimals,
``1732543200.123``, never in exponent form), ``host``, ``source``, ``sourcetype``, ``index``
(only when configured), ``event`` (the audit event, ``seq`` and ``leaf_hash`` included) and
``fields``: indexed fields, whose values Splunk wants as strings (or arrays of strings), so
``seq`` is written there as a decimal string.

With indexer acknowledgement on the token, every request names a channel
(``X-Splunk-Request-Channel``), the answer carries an ``ackId``, and the batch is indexed only
once ``/services/collector/ack`` says ``{"acks": {"<ackId>": true}}``: ``ack_body`` and
``ack_status`` build and read those polls. ``answer_code`` reads the ``code`` of an answer and
``code_meaning`` gives its standard meaning, so errors can say what went wrong without echoing
the receiver's own text.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from typing import Any

from proofplane.audit.export.times import epoch_millis
from proofplane.model import Event

EVENT_PATH = "/services/collector/event"
ACK_PATH = "/services/collector/ack"
CHANNEL_HEADER = "X-Splunk-Request-Channel"

#: The HEC status codes (Splunk, "Troubleshoot HTTP Event Collector") and what they mean.
CODES: dict[int, str] = {
    0: "Success",
    1: "Token disabled",
    2: "Token is required",
    3: "Invalid authorization",
    4: "Invalid token",
    5: "No data",
    6: "Invalid data format",
    7: "Incorrect index",
    8: "Internal server error",
    9: "Server is busy",
    10: "Data channel is missing",
    11: "Invalid data channel",
    12: "Event field is required",
    13: "Event field cannot be blank",
    14: "ACK is disabled",
    15: "Error in handling indexed fields",
    16: "Query string authorization is not enabled",
    17: "HEC is healthy",
    18: "HEC is unhealthy, queues are full",
    19: "HEC is unhealthy, ack service unavailable",
    20: "HEC is unhealthy, queues are full, ack service unavailable",
}
CHANNEL_MISSING = 10
INVALID_CHANNEL = 11
ACK_DISABLED = 14

#: the namespace of derived channels: uuid5(namespace, url + token)
_CHANNEL_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "urn:proofplane:splunk-hec:channel")
_MAX_ANSWER = 64 * 1024  # a HEC answer is a few dozen bytes; a bigger body is not parsed


def time_text(millis: int) -> str:
    """``1732543200.123``: seconds with exactly three decimals, never exponent form."""
    sign = "-" if millis < 0 else ""
    whole, frac = divmod(abs(millis), 1000)
    return f"{sign}{whole}.{frac:03d}"


def event_payload(
    event: Event,
    leaf_hash: bytes,
    *,
    host: str | None = None,
    source: str = "proofplane",
    sourcetype: str = "proofplane:audit",
    index: str | None = None,
) -> dict[str, Any]:
    """One HEC event object. ``time`` is epoch seconds to the millisecond, truncated like every
    format's (``times.epoch_millis``; a float here: the nearest float to the three-decimal
    value, which ``encode`` writes exactly)."""
    leaf = leaf_hash.hex()
    out: dict[str, Any] = {
        "time": epoch_millis(event.ts) / 1000,
        "source": source,
        "sourcetype": sourcetype,
        "event": {
            "seq": event.seq,
            "leaf_hash": leaf,
            "ts": event.ts.isoformat(),
            "actor": event.actor,
            "action": event.action,
            "target_type": event.target_type,
            "target_id": event.target_id,
            "outcome": event.outcome.value,
            "details": event.details,
        },
        # indexed fields: string values only (Splunk's /services/collector/event)
        "fields": {"seq": str(event.seq), "leaf_hash": leaf},
    }
    if host:
        out["host"] = host
    if index:
        out["index"] = index
    return out


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, sort_keys=True)


def encode(obj: dict[str, Any]) -> bytes:
    """Compact JSON, keys sorted, UTF-8; a numeric top-level ``time`` is written with exactly
    three decimals (``json`` would write ``1732543200.5`` for ``.500``, ``1e-05`` for tiny
    values)."""
    parts = []
    for key in sorted(obj):
        value = obj[key]
        if key == "time" and isinstance(value, int | float) and not isinstance(value, bool):
            text = time_text(round(value * 1000)) if isinstance(value, float) else f"{value}.000"
        else:
            text = _dumps(value)
        parts.append(f"{_dumps(key)}:{text}")
    return ("{" + ",".join(parts) + "}").encode()


def batch_body(records: Iterable[bytes]) -> bytes:
    """The request body of one batch: the event objects, concatenated."""
    return b"".join(records)


def split_batch(body: bytes) -> list[Any]:
    """Parse a concatenated batch back into its objects (tests, and any HEC-shaped receiver)."""
    text = body.decode("utf-8")
    decoder = json.JSONDecoder()
    out: list[Any] = []
    pos = 0
    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos >= len(text):
            return out
        obj, pos = decoder.raw_decode(text, pos)
        out.append(obj)


# --- answers and indexer acknowledgement ----------------------------------------------------


def derived_channel(url: str, token: str) -> str:
    """The channel a sink uses when none is configured: a UUID derived from its URL and token,
    so it is the same after a restart and on every replica (no new channel per process for
    Splunk to keep), and changes with the token."""
    return str(uuid.uuid5(_CHANNEL_NAMESPACE, f"{url}\n{token}"))


def canonical_channel(value: str) -> str | None:
    """The channel as a canonical UUID (``8-4-4-4-12``, lower case), or None if not a UUID."""
    try:
        return str(uuid.UUID(value.strip()))
    except (ValueError, AttributeError):
        return None


def ack_path(event_path: str) -> str | None:
    """The acknowledgement endpoint beside an event endpoint: ``…/services/collector/event``
    (or ``…/event/1.0``, or ``…/collector``) gives ``…/services/collector/ack``; a path that
    is not a collector endpoint gives None."""
    path = event_path.rstrip("/")
    for tail in ("/event/1.0", "/event"):
        if path.endswith(tail):
            return path[: -len(tail)] + "/ack"
    if path.endswith("/collector"):
        return path + "/ack"
    return None


def _answer(body: bytes) -> dict[str, Any] | None:
    if len(body) > _MAX_ANSWER:
        return None
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    return obj if isinstance(obj, dict) else None


def answer_code(body: bytes) -> int | None:
    """The ``code`` of a HEC answer (``{"text": …, "code": N}``), or None."""
    obj = _answer(body)
    code = None if obj is None else obj.get("code")
    return code if isinstance(code, int) and not isinstance(code, bool) else None


def ack_id(body: bytes) -> int | None:
    """The ``ackId`` of a 2xx answer to an ack-enabled token, or None."""
    obj = _answer(body)
    value = None if obj is None else obj.get("ackId")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def code_meaning(code: int) -> str:
    """``HEC code 9 (Server is busy)``: the number and our table's text for it."""
    meaning = CODES.get(code)
    return f"HEC code {code} ({meaning})" if meaning else f"HEC code {code}"


def ack_body(ack_ids: Iterable[int]) -> bytes:
    """The body of an acknowledgement poll: ``{"acks":[N,…]}``."""
    return _dumps({"acks": list(ack_ids)}).encode()


def ack_status(body: bytes, ack_ids: Iterable[int]) -> dict[int, bool] | None:
    """Which of ``ack_ids`` the poll's answer ``{"acks":{"N":true|false}}`` says are indexed
    (an id missing from the answer: not yet); None if the answer is not of that shape."""
    obj = _answer(body)
    acks = None if obj is None else obj.get("acks")
    if not isinstance(acks, dict):
        return None
    return {n: acks.get(str(n)) is True for n in ack_ids}
