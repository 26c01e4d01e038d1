"""RFC 5424 / RFC 6587 conformance of the syslog encoder (issue 21, part 8).

Messages are read back with ``parse_5424`` below, a strict parser written from the RFC's ABNF
(section 6) for this test: PRI, VERSION, the five header fields, structured data with its
escapes (section 6.3.3) and MSG.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proofplane.audit.export import syslog
from proofplane.model import Event, Outcome

TS = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)
LEAF = bytes(range(32))
BOM = b"\xef\xbb\xbf"

# --- an independent RFC 5424 reader --------------------------------------------------------------

_TIMESTAMP = re.compile(
    r"(\d{4})-(\d{2})-(\d{2})T(\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,6}))?(Z|[+-]\d{2}:\d{2})"
)
_LIMITS = {"hostname": 255, "app_name": 48, "procid": 128, "msgid": 32}
_SD_NAME_EXCLUDED = {ord("="), ord(" "), ord("]"), ord('"')}


def _printusascii(text: str, limit: int) -> str:
    assert 1 <= len(text) <= limit, (text, limit)
    assert all(33 <= ord(c) <= 126 for c in text), text
    return text


def _check_sd_name(name: str) -> str:
    assert 1 <= len(name) <= 32, name
    assert all(33 <= ord(c) <= 126 and ord(c) not in _SD_NAME_EXCLUDED for c in name), name
    return name


def _timestamp(text: str) -> datetime | None:
    if text == "-":
        return None
    m = _TIMESTAMP.fullmatch(text)
    assert m, text
    year, month, day, hour, minute, second, frac, offset = m.groups()
    if offset == "Z":
        tz = UTC
    else:
        sign = 1 if offset[0] == "+" else -1
        tz = timezone(sign * timedelta(hours=int(offset[1:3]), minutes=int(offset[4:6])))
    micro = int((frac or "0").ljust(6, "0"))
    return datetime(int(year), int(month), int(day), int(hour), int(minute), int(second), micro, tz)


def parse_5424(data: bytes) -> dict[str, Any]:
    """One SYSLOG-MSG: ``<PRI>VERSION SP TIMESTAMP SP HOSTNAME SP APP-NAME SP PROCID SP MSGID
    SP STRUCTURED-DATA [SP MSG]``."""
    m = re.match(rb"<(0|[1-9][0-9]{0,2})>([1-9][0-9]{0,2}) ", data)
    assert m, data[:40]
    pri = int(m.group(1))
    assert 0 <= pri <= 191
    out: dict[str, Any] = {"pri": pri, "facility": pri // 8, "severity": pri % 8}
    out["version"] = int(m.group(2))
    pos = m.end()
    fields = []
    for _ in range(5):
        end = data.index(b" ", pos)
        fields.append(data[pos:end].decode("ascii"))  # header fields: US-ASCII only
        pos = end + 1
    out["timestamp"] = _timestamp(fields[0])
    for name, text in zip(["hostname", "app_name", "procid", "msgid"], fields[1:], strict=True):
        out[name] = None if text == "-" else _printusascii(text, _LIMITS[name])
    # STRUCTURED-DATA = NILVALUE / 1*SD-ELEMENT
    sd: dict[str, list[tuple[str, str]]] = {}
    if data[pos : pos + 1] == b"-":
        pos += 1
    else:
        assert data[pos : pos + 1] == b"[", data[pos : pos + 20]
        while data[pos : pos + 1] == b"[":
            pos += 1
            start = pos
            while data[pos : pos + 1] not in (b" ", b"]"):
                pos += 1
            sd_id = _check_sd_name(data[start:pos].decode("ascii"))
            assert sd_id not in sd, f"SD-ID {sd_id} twice"
            params: list[tuple[str, str]] = []
            while data[pos : pos + 1] == b" ":
                pos += 1
                eq = data.index(b"=", pos)
                name = _check_sd_name(data[pos:eq].decode("ascii"))
                assert data[eq + 1 : eq + 2] == b'"'
                pos = eq + 2
                value = bytearray()
                while True:
                    ch = data[pos : pos + 1]
                    assert ch, "unterminated PARAM-VALUE"
                    if ch == b"\\":
                        nxt = data[pos + 1 : pos + 2]
                        if nxt in (b'"', b"\\", b"]"):
                            value += nxt
                            pos += 2
                        else:  # any other backslash is an ordinary character (6.3.3)
                            value += ch
                            pos += 1
                        continue
                    if ch == b'"':
                        pos += 1
                        break
                    assert ch != b"]", "an unescaped ']' in a PARAM-VALUE"
                    value += ch
                    pos += 1
                params.append((name, value.decode("utf-8")))
            assert data[pos : pos + 1] == b"]", data[pos : pos + 20]
            pos += 1
            sd[sd_id] = params
    out["sd"] = sd
    if pos == len(data):
        out["msg"] = None
    else:
        assert data[pos : pos + 1] == b" "
        body = data[pos + 1 :]
        out["bom"] = body.startswith(BOM)
        out["msg"] = body
    return out


def printable(value: str | None, limit: int) -> str | None:
    """What RFC 5424 allows of a header field: printable US-ASCII, up to ``limit``."""
    if not value:
        return None
    return "".join(c if 33 <= ord(c) <= 126 else "_" for c in value)[:limit]


def sd_name(value: str) -> str:
    cleaned = "".join(
        c if 33 <= ord(c) <= 126 and ord(c) not in _SD_NAME_EXCLUDED else "_" for c in value
    )
    return cleaned[:32] or "_"


def message(**kw: Any) -> bytes:
    base: dict[str, Any] = {
        "facility": 13,
        "severity": 5,
        "ts": TS,
        "hostname": "cp-1",
        "app_name": "proofplane",
        "procid": None,
        "msgid": "audit",
        "structured_data": None,
        "msg": "body",
    }
    base.update(kw)
    return syslog.format_message(**base)


def event(**kw: Any) -> Event:
    base: dict[str, Any] = {
        "seq": 7,
        "ts": TS,
        "actor": "alice",
        "action": "node.register",
        "target_type": "node",
        "target_id": "gpu-01",
        "outcome": Outcome.SUCCESS,
        "details": {},
    }
    base.update(kw)
    return Event(**base)


# --- tables ---------------------------------------------------------------------------------------


def test_pri_is_facility_times_8_plus_severity_for_every_pair() -> None:
    for facility in range(24):
        for severity in range(8):
            got = parse_5424(message(facility=facility, severity=severity))
            assert got["pri"] == facility * 8 + severity
            assert (got["facility"], got["severity"], got["version"]) == (facility, severity, 1)


@pytest.mark.parametrize(("facility", "severity"), [(-1, 0), (24, 0), (0, -1), (0, 8)])
def test_pri_out_of_range_is_refused(facility: int, severity: int) -> None:
    with pytest.raises(ValueError):
        message(facility=facility, severity=severity)


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("hostname", "cp-1.example.org", "cp-1.example.org"),
        ("hostname", "host with spaces", "host_with_spaces"),
        ("hostname", "Zoë", "Zo_"),
        ("hostname", "h" * 300, "h" * 255),
        ("hostname", "", None),
        ("hostname", None, None),
        ("app_name", "a" * 60, "a" * 48),
        ("app_name", "app\nname", "app_name"),
        ("procid", "p" * 200, "p" * 128),
        ("procid", "1234", "1234"),
        ("msgid", "m" * 40, "m" * 32),
        ("msgid", "\x00\x7f", "__"),
        ("msgid", '"[=]"', '"[=]"'),  # header fields may carry these; only SD-NAMEs may not
    ],
)
def test_header_fields_are_printable_ascii_within_their_limits(
    field: str, value: str | None, expected: str | None
) -> None:
    got = parse_5424(message(**{field: value}))
    assert got[field] == expected


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("seq", "seq"),
        ("proofplane@32473", "proofplane@32473"),
        ("a=b", "a_b"),
        ('quo"te', "quo_te"),
        ("br]acket", "br_acket"),
        ("sp ace", "sp_ace"),
        ("[open", "[open"),  # '[' is allowed in an SD-NAME
        ("ünï", "_n_"),
        ("tab\t", "tab_"),
        ("", "_"),
        ("n" * 40, "n" * 32),
    ],
)
def test_sd_names_follow_the_sd_name_rule(name: str, expected: str) -> None:
    assert syslog.sd_name(name) == expected
    got = parse_5424(message(structured_data={name: {name: "v"}}))
    assert got["sd"] == {expected: [(expected, "v")]}


@pytest.mark.parametrize(
    ("value", "escaped"),
    [
        ("", ""),
        ("plain", "plain"),
        ('"', '\\"'),
        ("\\", "\\\\"),
        ("]", "\\]"),
        ("[", "["),
        ("=", "="),
        ('\\"', '\\\\\\"'),  # the backslash first
        ("trailing\\", "trailing\\\\"),
        ("line\nbreak\r", "line\nbreak\r"),  # PARAM-VALUE is any UTF-8; no escape exists
        ("Zoë 東京 🚀", "Zoë 東京 🚀"),
    ],
)
def test_sd_param_values_escape_quote_backslash_and_bracket(value: str, escaped: str) -> None:
    assert syslog.escape_sd_value(value) == escaped
    got = parse_5424(message(structured_data={"x@1": {"k": value}}))
    assert got["sd"] == {"x@1": [("k", value)]}


def test_a_duplicate_sd_id_after_sanitizing_is_refused() -> None:
    with pytest.raises(ValueError):
        message(structured_data={"a=b": {}, "a]b": {}})


def test_msg_is_msg_any_without_a_bom() -> None:
    got = parse_5424(message(msg="CEF:0|x"))
    assert got["bom"] is False and got["msg"] == b"CEF:0|x"
    with pytest.raises(ValueError):
        message(msg="\ufeffCEF:0|x")
    assert parse_5424(message(msg=""))["msg"] == b""


def test_the_timestamp_is_utc_with_at_most_six_fraction_digits() -> None:
    local = TS.astimezone(timezone(timedelta(hours=-5, minutes=-30)))
    text = message(ts=local).split(b" ")[1].decode()
    assert text == "2026-01-02T03:04:05.678901Z"
    assert parse_5424(message(ts=local))["timestamp"] == TS


def test_the_event_message() -> None:
    leaf = LEAF.hex()
    for outcome, action, sev in [
        (Outcome.SUCCESS, "node.register", 5),
        (Outcome.FAILURE, "node.register", 4),
        (Outcome.DENIED, "auth.login", 4),
        (Outcome.SUCCESS, "alert.auth_failure_burst", 2),
    ]:
        ev = event(outcome=outcome, action=action)
        got = parse_5424(syslog.event_message(ev, LEAF, "CEF:0|b", hostname="cp-1"))
        assert got["pri"] == 13 * 8 + sev
        assert (got["app_name"], got["procid"], got["msgid"]) == ("proofplane", None, "audit")
        assert got["sd"] == {"proofplane@32473": [("seq", "7"), ("leaf", leaf)]}
        assert got["msg"] == b"CEF:0|b" and got["timestamp"] == TS


def test_octet_counting_counts_utf8_bytes() -> None:
    msg = message(msg="Zoë 東京 🚀\n")
    framed = syslog.frame(msg)
    count, _, rest = framed.partition(b" ")
    assert int(count) == len(msg) == len(rest) and rest == msg
    assert len(msg) > len(msg.decode())


# --- the property ---------------------------------------------------------------------------------

SPECIAL = ['"', "\\", "]", "[", "=", " ", "\n", "\r", "\x00", "\ufeff", "@", '\\"', "\\]"]
hostile = st.lists(st.one_of(st.sampled_from(SPECIAL), st.text(max_size=4)), max_size=10).map(
    "".join
)


@settings(max_examples=300, deadline=None)
@given(
    facility=st.integers(0, 23),
    severity=st.integers(0, 7),
    ts=st.datetimes(
        min_value=datetime(1970, 1, 1),
        max_value=datetime(9998, 12, 31),
        timezones=st.sampled_from(
            [UTC, timezone(timedelta(hours=9)), timezone(-timedelta(hours=3))]
        ),
    ),
    hostname=st.none() | hostile,
    app_name=hostile,
    procid=st.none() | hostile,
    msgid=st.none() | hostile,
    sd=st.none()
    | st.dictionaries(hostile, st.dictionaries(hostile, hostile, max_size=3), max_size=3),
    msg=hostile,
)
def test_any_message_reads_back_field_by_field(
    facility: int,
    severity: int,
    ts: datetime,
    hostname: str | None,
    app_name: str,
    procid: str | None,
    msgid: str | None,
    sd: dict[str, dict[str, str]] | None,
    msg: str,
) -> None:
    kw = dict(
        facility=facility, severity=severity, ts=ts, hostname=hostname, app_name=app_name,
        procid=procid, msgid=msgid, structured_data=sd, msg=msg,
    )  # fmt: skip
    sd_ids = [sd_name(k) for k in sd or {}]
    if msg.startswith("\ufeff") or len(set(sd_ids)) != len(sd_ids):
        with pytest.raises(ValueError):
            syslog.format_message(**kw)  # type: ignore[arg-type]
        return
    data = syslog.format_message(**kw)  # type: ignore[arg-type]
    got = parse_5424(data)
    assert got["pri"] == facility * 8 + severity and got["version"] == 1
    assert got["timestamp"] == ts
    assert got["hostname"] == printable(hostname, 255)
    assert got["app_name"] == printable(app_name, 48)
    assert got["procid"] == printable(procid, 128)
    assert got["msgid"] == printable(msgid, 32)
    expected_sd = {
        sd_name(sd_id): [(sd_name(k), v) for k, v in params.items()]
        for sd_id, params in (sd or {}).items()
    }
    assert got["sd"] == expected_sd
    assert got["msg"] == msg.encode("utf-8") and got["bom"] is False
    # and the frame carries exactly these bytes
    assert syslog.unframe(syslog.frame(data)) == ([data], b"")
