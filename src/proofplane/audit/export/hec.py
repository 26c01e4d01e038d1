"""Splunk HTTP Event Collector payloads. Pure.

A batch is the concatenation of one JSON object per event (no array, no separator), posted to
``/services/collector/event`` with ``Authorization: Splunk <token>``; Splunk answers 200 with
``{"text": "Success", "code": 0}`` once it accepted the whole batch.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from proofplane.model import Event

EVENT_PATH = "/services/collector/event"


def event_payload(
    event: Event,
    leaf_hash: bytes,
    *,
    host: str | None = None,
    source: str = "proofplane",
    sourcetype: str = "proofplane:audit",
    index: str | None = None,
) -> dict[str, Any]:
    """One HEC event object; ``time`` is epoch seconds with millisecond precision."""
    out: dict[str, Any] = {
        "time": round(event.ts.timestamp(), 3),
        "source": source,
        "sourcetype": sourcetype,
        "event": {
            "seq": event.seq,
            "leaf_hash": leaf_hash.hex(),
            "ts": event.ts.isoformat(),
            "actor": event.actor,
            "action": event.action,
            "target_type": event.target_type,
            "target_id": event.target_id,
            "outcome": event.outcome.value,
            "details": event.details,
        },
        "fields": {"seq": event.seq, "leaf_hash": leaf_hash.hex()},
    }
    if host:
        out["host"] = host
    if index:
        out["index"] = index
    return out


def encode(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, sort_keys=True).encode()


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
