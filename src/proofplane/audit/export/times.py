"""The event time as every SIEM format writes it. Pure.

One rule for all formats (CEF ``rt``, OCSF ``time``/``created_time``, the HEC ``time``, and the
RFC 5424 TIMESTAMP's first three fraction digits): milliseconds since the Unix epoch,
**truncated** (an event at ``.678901`` is at ms ``678`` everywhere, as a clock reading would
say), computed in integers so no float ever sees the microseconds (``ts.timestamp() * 1000``
reads ``999.9999…`` for ``.001`` and would truncate it to the wrong millisecond).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MILLISECOND = timedelta(milliseconds=1)


def epoch_millis(ts: datetime) -> int:
    """Milliseconds since the Unix epoch, truncated toward the past (floor), exactly.

    A naive ``ts`` is refused (``ValueError``): the log's timestamps are aware UTC, and a naive
    one would be read in the server's local zone by ``timestamp()``."""
    if ts.tzinfo is None:
        raise ValueError("naive datetime")
    return (ts - _EPOCH) // _MILLISECOND
