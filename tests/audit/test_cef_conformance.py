"""CEF conformance (issue 21, part 7), against Micro Focus "Implementing ArcSight CEF" rev 25.

The rules, in the spec's words paraphrased:
* header (prefix) fields: a ``|`` is escaped ``\\|``, a backslash ``\\\\``; an ``=`` is literal;
  multi-line values are allowed only in the extension (we turn header line breaks into spaces);
* extension values: ``=`` is escaped ``\\=``, a backslash ``\\\\``, line breaks are ``\\n`` and
  ``\\r``; a ``|`` is literal;
* extension keys come from the CEF dictionary; ``rt`` is milliseconds since the epoch; severity
  is an integer 0..10; ``src`` is an IPv4 address, IPv6 goes in the custom field ``c6a2``.

Records are read back with ``parse_cef`` below, a parser written from the spec for this test
(not ``cef.parse``), and ``cef.parse`` must agree with it.
"""

from __future__ import annotations

import calendar
import json
import re
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proofplane.audit.export import cef
from proofplane.model import Event, Outcome

TS = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)
LEAF = bytes(range(32))

# The extension keys of the CEF dictionary (rev 25: the key names of the "CEF Key Names For
# Event Producers" and "... For Event Consumers" tables, and the custom field keys).
_DICTIONARY_KEYS = """
    act app c6a1 c6a1Label c6a2 c6a2Label c6a3 c6a3Label c6a4 c6a4Label cat
    cfp1 cfp1Label cfp2 cfp2Label cfp3 cfp3Label cfp4 cfp4Label
    cn1 cn1Label cn2 cn2Label cn3 cn3Label cnt
    cs1 cs1Label cs2 cs2Label cs3 cs3Label cs4 cs4Label cs5 cs5Label cs6 cs6Label
    destinationDnsDomain destinationServiceName destinationTranslatedAddress
    destinationTranslatedPort deviceCustomDate1 deviceCustomDate1Label deviceCustomDate2
    deviceCustomDate2Label deviceDirection deviceDnsDomain deviceExternalId deviceFacility
    deviceInboundInterface deviceNtDomain deviceOutboundInterface devicePayloadId
    deviceProcessName deviceTranslatedAddress dhost dmac dntdom dpid dpriv dproc dpt dst dtz
    duid duser dvc dvchost dvcmac dvcpid end externalId fileCreateTime fileHash fileId
    fileModificationTime filePath filePermission fileType flexDate1 flexDate1Label
    flexString1 flexString1Label flexString2 flexString2Label fname fsize in msg
    oldFileCreateTime oldFileHash oldFileId oldFileModificationTime oldFileName oldFilePath
    oldFilePermission oldFileSize oldFileType out outcome proto reason request
    requestClientApplication requestContext requestCookies requestMethod rt shost smac sntdom
    sourceDnsDomain sourceServiceName sourceTranslatedAddress sourceTranslatedPort spid spriv
    sproc spt src start suid suser type
    agentDnsDomain agentNtDomain agentTranslatedAddress agentTranslatedZoneExternalID
    agentTranslatedZoneURI agentZoneExternalID agentZoneURI agt ahost aid amac art at atz av
    customerExternalID customerURI destinationTranslatedZoneExternalID
    destinationTranslatedZoneURI destinationZoneExternalID destinationZoneURI
    deviceTranslatedZoneExternalID deviceTranslatedZoneURI deviceZoneExternalID deviceZoneURI
    dlat dlong eventId rawEvent slat slong sourceTranslatedZoneExternalID
    sourceTranslatedZoneURI sourceZoneExternalID sourceZoneURI
"""
CEF_DICTIONARY = frozenset(_DICTIONARY_KEYS.split())


def event(**kw: Any) -> Event:
    base: dict[str, Any] = {
        "seq": 7,
        "ts": TS,
        "actor": "alice",
        "action": "node.register",
        "target_type": "node",
        "target_id": "gpu-01",
        "outcome": Outcome.SUCCESS,
        "details": {"gpus": 8},
    }
    base.update(kw)
    return Event(**base)


# --- an independent CEF reader, from the spec ----------------------------------------------------

_EXT_KEY = re.compile(r"[A-Za-z0-9_.\[\]-]+")
_HEADER_ESCAPES = {"\\": "\\", "|": "|"}
_EXTENSION_ESCAPES = {"\\": "\\", "=": "=", "n": "\n", "r": "\r"}


def parse_cef(line: str) -> tuple[list[str], list[tuple[str, str]]]:
    """Header: 7 fields split on unescaped pipes (``\\|`` and ``\\\\`` the only escapes, no
    line breaks). Extension: a key (``[A-Za-z0-9_.[]-]+``) at the start or after a space,
    followed by ``=``; its value runs to the next ``SP key=`` (a value's own ``=`` is always
    escaped, so that is unambiguous). Strict: an unknown escape, a raw ``=`` in a value, a raw
    line break or a dangling backslash is an error."""
    assert line.startswith("CEF:"), line[:20]
    header: list[str] = []
    cur: list[str] = []
    i = 0
    while len(header) < 7:
        ch = line[i]  # IndexError: fewer than 7 header fields
        if ch == "\\":
            cur.append(_HEADER_ESCAPES[line[i + 1]])
            i += 2
        elif ch == "|":
            header.append("".join(cur))
            cur = []
            i += 1
        else:
            assert ch not in "\r\n", "raw line break in the header"
            cur.append(ch)
            i += 1
    ext = line[i:]

    def key_at(pos: int) -> re.Match[str] | None:
        m = _EXT_KEY.match(ext, pos)
        return m if m and ext[m.end() : m.end() + 1] == "=" else None

    pairs: list[tuple[str, str]] = []
    if not ext:
        return header, pairs
    first = key_at(0)
    assert first, f"the extension does not start with a key: {ext[:30]!r}"
    key, i, val = first.group(), first.end() + 1, []
    while i < len(ext):
        ch = ext[i]
        if ch == "\\":
            val.append(_EXTENSION_ESCAPES[ext[i + 1]])
            i += 2
            continue
        assert ch != "=", f"unescaped '=' in the value of {key}"
        assert ch not in "\r\n", f"raw line break in the value of {key}"
        if ch == " " and (nxt := key_at(i + 1)):
            pairs.append((key, "".join(val)))
            key, i, val = nxt.group(), nxt.end() + 1, []
            continue
        val.append(ch)
        i += 1
    pairs.append((key, "".join(val)))
    return header, pairs


def read(line: str) -> tuple[list[str], dict[str, str]]:
    header, pairs = parse_cef(line)
    ext = dict(pairs)
    assert len(ext) == len(pairs), f"a key twice: {[k for k, _ in pairs]}"
    # the product's own parser reads the same record the same way
    assert cef.parse(line) == (header, ext)
    return header, ext


def flat(text: str) -> str:
    return text.replace("\r\n", " ").replace("\r", " ").replace("\n", " ")


# --- escaping, rule by rule ----------------------------------------------------------------------

HEADER_CASES = [
    ("", ""),
    ("plain", "plain"),
    ("|", "\\|"),
    ("\\", "\\\\"),
    ("=", "="),  # literal in the header
    ("a=b", "a=b"),
    ("\n", " "),  # no line breaks in the header
    ("\r", " "),
    ("\r\n", " "),
    ("\n\r", "  "),
    ("a|b|c", "a\\|b\\|c"),
    ("\\|", "\\\\\\|"),  # backslash escaped first, then the pipe
    ("|\\", "\\|\\\\"),
    ("\\\\", "\\\\\\\\"),
    ("\\n", "\\\\n"),  # a backslash before another character: just the backslash escaped
    ("\\=", "\\\\="),
    ("trailing\\", "trailing\\\\"),
    ("  lead and trail  ", "  lead and trail  "),
    ("x=y |z", "x=y \\|z"),
    ("Zoë 東京 🚀", "Zoë 東京 🚀"),
    ("tab\there", "tab\there"),
]

EXTENSION_CASES = [
    ("", ""),
    ("plain", "plain"),
    ("=", "\\="),
    ("\\", "\\\\"),
    ("|", "|"),  # literal in the extension
    ("\n", "\\n"),
    ("\r", "\\r"),
    ("\r\n", "\\r\\n"),
    ("a=b=c", "a\\=b\\=c"),
    ("\\=", "\\\\\\="),  # backslash first: "\=" must not read back as "="
    ("=\\", "\\=\\\\"),
    ("\\n", "\\\\n"),  # a literal backslash-n stays two characters
    ("\\\n", "\\\\\\n"),
    ("\\|", "\\\\|"),
    ("trailing\\", "trailing\\\\"),
    ("  lead and trail  ", "  lead and trail  "),
    (" x=y", " x\\=y"),  # key=value-looking text cannot start a new pair
    (" cs2=forged act=x", " cs2\\=forged act\\=x"),
    ("Zoë 東京 🚀", "Zoë 東京 🚀"),
    ("tab\there", "tab\there"),
]


@pytest.mark.parametrize(("raw", "escaped"), HEADER_CASES)
def test_header_escaping(raw: str, escaped: str) -> None:
    assert cef.escape_header(raw) == escaped


@pytest.mark.parametrize(("raw", "escaped"), EXTENSION_CASES)
def test_extension_escaping(raw: str, escaped: str) -> None:
    assert cef.escape_extension(raw) == escaped


@pytest.mark.parametrize(("raw", "_escaped"), HEADER_CASES)
def test_header_values_read_back(raw: str, _escaped: str) -> None:
    rec = cef.format_event(event(action=raw), LEAF, product_version=raw)
    header, ext = read(rec)
    assert header[3] == flat(raw) and header[4] == flat(raw)
    assert header[5] == flat(f"{raw} node/gpu-01")
    assert ext["act"] == raw  # the extension keeps what the header had to flatten


@pytest.mark.parametrize(("raw", "_escaped"), EXTENSION_CASES)
def test_extension_values_read_back(raw: str, _escaped: str) -> None:
    rec = cef.format_event(
        event(actor=raw, target_type=raw, target_id=raw, details={raw: raw}),
        LEAF,
        product_version="1",
    )
    assert "\n" not in rec and "\r" not in rec
    _, ext = read(rec)
    assert ext["suser"] == raw and ext["cs1"] == raw and ext["cs2"] == raw
    assert json.loads(ext["msg"]) == {raw: raw}
    assert ext["cs1Label"] == "targetType" and ext["cs2Label"] == "targetId"


def test_empty_values_and_spaces_between_pairs_survive() -> None:
    rec = cef.format_event(
        event(actor="", target_type="  ", target_id=" x "), LEAF, product_version=""
    )
    assert "suser= " in rec
    header, ext = read(rec)
    assert header[3] == ""
    assert ext["suser"] == "" and ext["cs1"] == "  " and ext["cs2"] == " x "


# --- keys, severity, time ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "details",
    [
        {},
        {"source_ip": "192.0.2.10"},
        {"source_ip": "2001:db8::1"},
        {"source_ip": "::ffff:192.0.2.10"},
        {"source_ip": "not an address"},
    ],
)
def test_every_extension_key_is_a_cef_dictionary_key(details: dict[str, Any]) -> None:
    _, pairs = parse_cef(cef.format_event(event(details=details), LEAF, product_version="1"))
    keys = [k for k, _ in pairs]
    assert set(keys) <= CEF_DICTIONARY, set(keys) - CEF_DICTIONARY
    assert keys[:2] == ["rt", "externalId"] and keys[-1] == "msg"
    # a custom field always travels with its label, the label first
    for key in keys:
        if key in {"cs1", "cs2", "cs6", "c6a2"}:
            assert keys.index(f"{key}Label") == keys.index(key) - 1


def test_extension_refuses_keys_outside_the_key_syntax() -> None:
    for bad in ("", "bad key", "a=b", "a|b", "ünï", "x\n"):
        with pytest.raises(ValueError):
            cef.extension([(bad, "v")])


@pytest.mark.parametrize("outcome", list(Outcome))
@pytest.mark.parametrize("action", ["node.register", "alert.auth_failure_burst", "auth.login"])
def test_severity_is_an_integer_from_0_to_10(outcome: Outcome, action: str) -> None:
    ev = event(outcome=outcome, action=action)
    header, _ = read(cef.format_event(ev, LEAF, product_version="1"))
    assert re.fullmatch(r"10|[0-9]", header[6])
    assert int(header[6]) == cef.severity(ev)


def millis(ts: datetime) -> int:
    """Milliseconds since the epoch, from the calendar (not from ``timestamp()``)."""
    return calendar.timegm(ts.utctimetuple()) * 1000 + ts.microsecond // 1000


@pytest.mark.parametrize(
    "ts",
    [
        TS,
        datetime(1970, 1, 1, tzinfo=UTC),
        # float seconds * 1000 reads 1000 here: rt must be exact
        datetime(1970, 1, 1, 0, 0, 1, 1000, tzinfo=UTC),
        datetime(9999, 1, 1, 0, 0, 0, 992, tzinfo=UTC),
        datetime(2026, 3, 29, 2, 30, 0, 999999, tzinfo=UTC),
        datetime(2026, 1, 2, 4, 4, 5, 678901, tzinfo=timezone(timedelta(hours=1))),
    ],
)
def test_rt_is_milliseconds_since_the_epoch(ts: datetime) -> None:
    _, ext = read(cef.format_event(event(ts=ts), LEAF, product_version="1"))
    assert ext["rt"] == str(millis(ts))
    assert cef.epoch_millis(ts) == millis(ts)


def test_naive_time_is_refused() -> None:
    with pytest.raises(ValueError):
        cef.format_event(event(ts=datetime(2026, 1, 1)), LEAF, product_version="1")


# --- the client address --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("source_ip", "expected"),
    [
        ("192.0.2.10", {"src": "192.0.2.10"}),
        ("::ffff:192.0.2.10", {"src": "192.0.2.10"}),
        ("2001:db8::1", {"c6a2Label": "Source IPv6 Address", "c6a2": "2001:db8::1"}),
        ("2001:DB8:0:0::1", {"c6a2Label": "Source IPv6 Address", "c6a2": "2001:db8::1"}),
        ("fe80::1%eth0", {"c6a2Label": "Source IPv6 Address", "c6a2": "fe80::1"}),
        ("", {}),
        ("192.0.2.10 act=forged", {}),
        (" 192.0.2.10", {}),
        ("999.0.0.1", {}),
        ("example.org", {}),
        (3232235777, {}),  # not a string
        (None, {}),
    ],
)
def test_source_ip_becomes_src_or_c6a2(source_ip: object, expected: dict[str, str]) -> None:
    rec = cef.format_event(event(details={"source_ip": source_ip}), LEAF, product_version="1")
    _, ext = read(rec)
    got = {k: v for k, v in ext.items() if k in {"src", "c6a2", "c6a2Label"}}
    assert got == expected
    assert json.loads(ext["msg"]) == {"source_ip": source_ip}  # still in the details


# --- the property: anything in, the same fields out -------------------------------------------

SPECIAL = ["|", "\\", "=", "\n", "\r", "\r\n", " ", " x=y", "\\=", "\\|", " cs2=", "CEF:0|", "]"]
hostile = st.lists(st.one_of(st.sampled_from(SPECIAL), st.text(max_size=4)), max_size=8).map(
    "".join
)
json_value = st.one_of(hostile, st.integers(), st.booleans(), st.none())
details_st = st.dictionaries(hostile, json_value, max_size=4) | st.builds(
    lambda d, ip: {**d, "source_ip": ip},
    st.dictionaries(hostile, json_value, max_size=3),
    st.ip_addresses().map(str) | hostile,
)


@settings(max_examples=400, deadline=None)
@given(
    actor=hostile,
    action=hostile,
    target_type=hostile,
    target_id=hostile,
    details=details_st,
    version=hostile,
    outcome=st.sampled_from(list(Outcome)),
    seq=st.integers(min_value=1, max_value=2**63 - 1),
    ts=st.datetimes(
        min_value=datetime(1970, 1, 1), max_value=datetime(9999, 1, 1), timezones=st.just(UTC)
    ),
)
def test_any_event_reads_back_field_by_field(
    actor: str,
    action: str,
    target_type: str,
    target_id: str,
    details: dict[str, Any],
    version: str,
    outcome: Outcome,
    seq: int,
    ts: datetime,
) -> None:
    ev = Event(seq, ts, actor, action, target_type, target_id, outcome, details)
    rec = cef.format_event(ev, LEAF, product_version=version)
    assert "\n" not in rec and "\r" not in rec
    header, ext = read(rec)
    assert header == [
        "CEF:0",
        "proofplane",
        "proofplane",
        flat(version),
        flat(action),
        flat(f"{action} {target_type}/{target_id}"),
        str(cef.severity(ev)),
    ]
    expected = {
        "rt": str(millis(ts)),
        "externalId": str(seq),
        "suser": actor,
        "act": action,
        "outcome": outcome.value,
        "cs1Label": "targetType",
        "cs1": target_type,
        "cs2Label": "targetId",
        "cs2": target_id,
        "cs6Label": "leafHash",
        "cs6": LEAF.hex(),
        **dict(cef.source_address(details)),
    }
    msg = ext.pop("msg")
    assert ext == expected
    assert set(ext) <= CEF_DICTIONARY
    assert json.loads(msg) == details
