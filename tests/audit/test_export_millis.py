"""Every SIEM format says the same millisecond for an event (``times.epoch_millis``): truncated,
computed in integers. An event at ``.678901`` is at ms 678 in CEF ``rt``, OCSF ``time`` and
``finding_info.created_time``, the HEC ``time``, and the RFC 5424 TIMESTAMP (which carries the
microseconds: its first three fraction digits are the same 678)."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proofplane.audit.export import cef, hec, ocsf, syslog, times
from proofplane.model import Event, Outcome

LEAF = bytes(range(32))


def _event(ts: datetime, action: str = "tenant.create") -> Event:
    return Event(7, ts, "alice", action, "tenant", "acme", Outcome.SUCCESS, {})


def _millis_everywhere(ts: datetime) -> dict[str, int]:
    """The event time each format writes, as integer milliseconds since the epoch."""
    out: dict[str, int] = {}
    line = cef.format_event(_event(ts), LEAF, product_version="1")
    rt = re.search(r"[|\s]rt=(\d+)(?:\s|$)", line)
    assert rt is not None, line
    out["cef rt"] = int(rt.group(1))
    out["ocsf time"] = ocsf.to_ocsf(_event(ts), LEAF, product_version="1")["time"]
    finding = ocsf.to_ocsf(_event(ts, "alert.x"), LEAF, product_version="1")
    out["ocsf created_time"] = finding["finding_info"]["created_time"]
    record = hec.encode(hec.event_payload(_event(ts), LEAF))
    text = re.search(rb'"time":(\d+)\.(\d{3})[,}]', record)
    assert text is not None, record
    out["hec time"] = int(text.group(1)) * 1000 + int(text.group(2))
    message = syslog.event_message(_event(ts), LEAF, "x", hostname="cp")
    stamp = message.split(b" ")[1].decode()
    parsed = datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC)
    out["syslog TIMESTAMP"] = times.epoch_millis(parsed)
    return out


@pytest.mark.parametrize(
    ("ts", "millis"),
    [
        (datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=UTC), 1767323045678),
        (datetime(2026, 1, 2, 4, 4, 5, 678901, tzinfo=timezone(timedelta(hours=1))),
         1767323045678),  # an offset: the same instant
        (datetime(2024, 11, 25, 14, 0, 0, 999999, tzinfo=UTC), 1732543200999),  # no carry
        (datetime(1970, 1, 1, 0, 0, 1, 1000, tzinfo=UTC), 1001),  # float: 1.001 * 1000 < 1001
        (datetime(2026, 1, 1, tzinfo=UTC), 1767225600000),
    ],
)  # fmt: skip
def test_point_678901_is_678_in_every_format(ts: datetime, millis: int) -> None:
    assert times.epoch_millis(ts) == millis
    assert _millis_everywhere(ts) == dict.fromkeys(_millis_everywhere(ts), millis)
    assert hec.time_text(millis).endswith(f".{millis % 1000:03d}")


@settings(max_examples=200, deadline=None)
@given(st.datetimes(min_value=datetime(1970, 1, 1), max_value=datetime(9999, 1, 1),
                    timezones=st.just(UTC)))  # fmt: skip
def test_every_format_agrees_and_truncates(ts: datetime) -> None:
    exact_us = (ts - datetime(1970, 1, 1, tzinfo=UTC)) // timedelta(microseconds=1)
    got = _millis_everywhere(ts)
    assert set(got.values()) == {exact_us // 1000}, got


def test_a_naive_time_is_refused_by_every_format() -> None:
    naive: Any = _event(datetime(2026, 1, 1, 0, 0, 0, 678901))
    for format_one in (
        lambda: cef.format_event(naive, LEAF, product_version="1"),
        lambda: ocsf.to_ocsf(naive, LEAF, product_version="1"),
        lambda: hec.event_payload(naive, LEAF),
        lambda: syslog.event_message(naive, LEAF, "x", hostname="cp"),
    ):
        with pytest.raises(ValueError, match="naive"):
            format_one()
