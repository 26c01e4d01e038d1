"""The Splunk HEC envelope, the pure part (issue 21, part 9): every key of an event object, the
``time`` written to the millisecond (truncated, as CEF and OCSF) with exactly three decimals
whatever the timestamp, ``index`` only when set, indexed ``fields`` as strings (what
/services/collector/event accepts), the batch framing (concatenated objects, no array) read
back by ``split_batch``, and the helpers of the indexer acknowledgement protocol (channels, ack
paths, answers, the HEC code table)."""

from __future__ import annotations

import json
import re
import uuid
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proofplane.audit.canonical import event_leaf_hash
from proofplane.audit.export import config, hec
from proofplane.errors import ValidationFailed
from proofplane.model import Event, Outcome
from proofplane.siem.sink import build

TS = datetime(2024, 11, 25, 14, 0, 0, 123000, tzinfo=UTC)  # 1732543200.123
LEAF = bytes(range(32))
NASTY = 'back\\slash|pipe=equals\nnew\rline\r\n"quote"]bracket ünï 🙂 \u2028 ' + "\t\x00"
TIME_RE = re.compile(rb'"time":(-?\d+\.\d{3})[,}]')


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


def time_of(record: bytes) -> str:
    found = TIME_RE.findall(record)
    assert len(found) == 1, record
    return found[0].decode()


# --- the envelope ------------------------------------------------------------------------------


def test_every_key_of_the_envelope():
    obj = json.loads(
        hec.encode(
            hec.event_payload(
                event(), LEAF, host="cp-1", source="pp", sourcetype="pp:audit", index="audit"
            )
        )
    )
    assert set(obj) == {"time", "host", "source", "sourcetype", "index", "event", "fields"}
    assert obj["time"] == 1732543200.123
    assert (obj["host"], obj["source"], obj["sourcetype"], obj["index"]) == (
        "cp-1",
        "pp",
        "pp:audit",
        "audit",
    )
    assert obj["event"] == {
        "seq": 7,
        "leaf_hash": LEAF.hex(),
        "ts": TS.isoformat(),
        "actor": "alice",
        "action": "node.register",
        "target_type": "node",
        "target_id": "gpu-01",
        "outcome": "success",
        "details": {"gpus": 8},
    }
    assert obj["fields"] == {"seq": "7", "leaf_hash": LEAF.hex()}


def test_defaults_and_index_and_host_omitted_when_unset():
    obj = hec.event_payload(event(), LEAF)
    assert "index" not in obj and "host" not in obj
    assert obj["source"] == "proofplane" and obj["sourcetype"] == "proofplane:audit"
    assert "index" not in hec.event_payload(event(), LEAF, index="")
    assert "index" not in json.loads(hec.encode(obj))


def test_a_built_sink_sets_host_and_omits_an_unset_index():
    cfg = config.validate(config.SPLUNK_HEC, {"url": "https://s:8088", "token": "t"})
    sink = build(config.SPLUNK_HEC, cfg, hostname="cp-7")
    obj = json.loads(sink.encode(event(), LEAF))
    assert obj["host"] == "cp-7" and "index" not in obj
    cfg = config.validate(
        config.SPLUNK_HEC, {"url": "https://s:8088", "token": "t", "index": "a", "host": "h"}
    )
    obj = json.loads(build(config.SPLUNK_HEC, cfg, hostname="cp-7").encode(event(), LEAF))
    assert obj["host"] == "h" and obj["index"] == "a"


def test_indexed_fields_are_strings_only():
    for seq in (0, 1, 7, 2**53 + 1, 10**20):
        fields = hec.event_payload(event(seq=seq), LEAF)["fields"]
        assert all(isinstance(v, str) for v in fields.values()), fields
        assert fields["seq"] == str(seq)
        decoded = json.loads(hec.encode(hec.event_payload(event(seq=seq), LEAF)))
        assert decoded["event"]["seq"] == seq  # the event keeps the number
        assert int(decoded["fields"]["seq"]) == seq


# --- time --------------------------------------------------------------------------------------

AWKWARD = [
    # (timestamp, the text HEC gets)
    (datetime(2024, 11, 25, 14, 0, 0, 123000, tzinfo=UTC), "1732543200.123"),
    (datetime(2024, 11, 25, 14, 0, 0, 500000, tzinfo=UTC), "1732543200.500"),  # not .5
    (datetime(2024, 11, 25, 14, 0, 0, tzinfo=UTC), "1732543200.000"),  # not 1732543200.0
    (datetime(2024, 11, 25, 14, 0, 0, 100000, tzinfo=UTC), "1732543200.100"),
    (datetime(2024, 11, 25, 14, 0, 0, 300000, tzinfo=UTC), "1732543200.300"),  # 0.1+0.2
    (datetime(2024, 11, 25, 14, 0, 0, 1499, tzinfo=UTC), "1732543200.001"),
    (datetime(2024, 11, 25, 14, 0, 0, 1500, tzinfo=UTC), "1732543200.001"),  # truncated
    (datetime(2024, 11, 25, 14, 0, 0, 999500, tzinfo=UTC), "1732543200.999"),  # no carry
    (datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=UTC), "1767323045.678"),  # as CEF, OCSF
    (datetime(1970, 1, 1, 0, 0, 1, 1000, tzinfo=UTC), "1.001"),  # float *1000 reads 1000.99…
    (datetime(1970, 1, 1, 0, 0, 0, 10, tzinfo=UTC), "0.000"),  # not 1e-05
    (datetime(1970, 1, 1, 0, 0, 0, 7000, tzinfo=UTC), "0.007"),  # not 0.007 → 7e-03
    (datetime(1969, 12, 31, 23, 59, 59, 999000, tzinfo=UTC), "-0.001"),
    (datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC), "253402300799.999"),
    (datetime(2024, 11, 25, 15, 0, 0, 250000, tzinfo=timezone(timedelta(hours=1))),
     "1732543200.250"),  # an offset: the same instant
]  # fmt: skip


@pytest.mark.parametrize(("ts", "text"), AWKWARD)
def test_time_is_written_with_exactly_three_decimals(ts: datetime, text: str):
    record = hec.encode(hec.event_payload(event(ts=ts), LEAF))
    assert time_of(record) == text
    # read back, it is the number with that decimal value
    assert json.loads(record)["time"] == float(text)


@settings(max_examples=300, deadline=None)
@given(
    st.datetimes(
        min_value=datetime(1970, 1, 1),
        max_value=datetime(2200, 1, 1),
        timezones=st.just(UTC),
    )
)
def test_time_is_the_millisecond_truncated_for_any_timestamp(ts: datetime):
    record = hec.encode(hec.event_payload(event(ts=ts), LEAF))
    text = time_of(record)
    seconds, millis = text.split(".")
    exact_us = (ts - datetime(1970, 1, 1, tzinfo=UTC)) // timedelta(microseconds=1)
    assert int(seconds) * 1000 + int(millis) == exact_us // 1000
    assert 0 <= exact_us - (int(seconds) * 1_000_000 + int(millis) * 1000) < 1000


def test_naive_time_is_refused():
    with pytest.raises(ValueError, match="naive"):
        hec.event_payload(event(ts=datetime(2024, 11, 25, 14, 0, 0, 42000)), LEAF)


def test_encode_writes_a_given_time_exactly_and_other_keys_as_json():
    assert hec.encode({"time": 1732543200.12, "event": "x"}) == (
        b'{"event":"x","time":1732543200.120}'
    )
    assert hec.encode({"time": 5, "event": "x"}) == b'{"event":"x","time":5.000}'
    assert hec.encode({"time": 0.1 + 0.2, "event": 1}) == b'{"event":1,"time":0.300}'
    assert (
        hec.encode({"event": {"b": 1, "a": [1, "ü"]}}) == '{"event":{"a":[1,"ü"],"b":1}}'.encode()
    )
    assert hec.time_text(-1500) == "-1.500" and hec.time_text(0) == "0.000"


# --- batch framing -----------------------------------------------------------------------------


def test_a_batch_is_concatenated_objects_and_reads_back():
    nested = {"x": NASTY, "list": [1, {"deep": [NASTY, None, True, 1.5]}], NASTY: {"k": "v"}}
    events = [
        event(seq=1),
        event(seq=2, details=nested, actor="jörg 🙂", target_id="gpu-ü"),
        event(seq=3, details={}),
    ]
    records = [hec.encode(hec.event_payload(e, event_leaf_hash(e), index="audit")) for e in events]
    body = hec.batch_body(records)
    assert body == b"".join(records)
    assert not body.startswith(b"[") and b"}{" in body and b"\n" not in body
    body.decode("utf-8")  # UTF-8, not \u escapes
    assert "jörg 🙂".encode() in body
    objs = hec.split_batch(body)
    assert [o["event"]["seq"] for o in objs] == [1, 2, 3]
    assert objs[1]["event"]["details"] == nested
    assert objs[1]["event"]["actor"] == "jörg 🙂"
    for obj, ev in zip(objs, events, strict=True):
        assert obj["event"]["leaf_hash"] == event_leaf_hash(ev).hex() == obj["fields"]["leaf_hash"]
    # whitespace between objects (what other clients send) reads the same
    assert hec.split_batch(b"\n".join(records) + b"\n") == objs
    assert hec.split_batch(b"") == []
    with pytest.raises(ValueError):
        hec.split_batch(b'{"event":1}[')


# --- indexer acknowledgement helpers -----------------------------------------------------------


def test_derived_channel_is_a_stable_uuid_that_follows_url_and_token():
    a = hec.derived_channel("https://s:8088/services/collector/event", "tok")
    assert uuid.UUID(a).version == 5 and str(uuid.UUID(a)) == a
    assert a == hec.derived_channel("https://s:8088/services/collector/event", "tok")
    assert a != hec.derived_channel("https://s:8088/services/collector/event", "tok2")
    assert a != hec.derived_channel("https://t:8088/services/collector/event", "tok")
    assert "tok" not in a


def test_canonical_channel():
    u = "0F3E2D1C-AAAA-4BBB-8CCC-0123456789AB"
    assert hec.canonical_channel(u) == u.lower()
    assert hec.canonical_channel("{" + u + "}") == u.lower()
    for bad in ("", "abc", "0f3e2d1c-aaaa-4bbb-8ccc", "g" * 32, u + "0"):
        assert hec.canonical_channel(bad) is None


def test_ack_path():
    assert hec.ack_path("/services/collector/event") == "/services/collector/ack"
    assert hec.ack_path("/services/collector/event/") == "/services/collector/ack"
    assert hec.ack_path("/services/collector/event/1.0") == "/services/collector/ack"
    assert hec.ack_path("/services/collector") == "/services/collector/ack"
    assert hec.ack_path("/splunk/services/collector/event") == "/splunk/services/collector/ack"
    assert hec.ack_path("/splunk/hec") is None
    assert hec.ack_path("/services/collector/raw") is None


def test_answers():
    assert hec.answer_code(b'{"text":"Success","code":0,"ackId":3}') == 0
    assert hec.ack_id(b'{"text":"Success","code":0,"ackId":3}') == 3
    assert hec.ack_id(b'{"text":"Success","code":0}') is None
    assert hec.ack_id(b'{"ackId":"3"}') is None and hec.ack_id(b'{"ackId":true}') is None
    assert hec.answer_code(b"<html>busy</html>") is None
    assert hec.answer_code(b'{"code":"9"}') is None and hec.answer_code(b"[1]") is None
    assert hec.answer_code(b'{"code":9}' + b" " * 70000) is None  # too big to be HEC's
    assert hec.ack_body([4, 5]) == b'{"acks":[4,5]}'
    assert hec.ack_status(b'{"acks":{"4":true,"5":false}}', [4, 5, 6]) == {
        4: True,
        5: False,
        6: False,
    }
    assert hec.ack_status(b'{"acks":{"4":"true"}}', [4]) == {4: False}
    assert hec.ack_status(b'{"text":"ACK is disabled","code":14}', [4]) is None


def test_code_table():
    assert hec.code_meaning(10) == "HEC code 10 (Data channel is missing)"
    assert hec.code_meaning(14) == "HEC code 14 (ACK is disabled)"
    assert hec.code_meaning(9) == "HEC code 9 (Server is busy)"
    assert hec.code_meaning(99) == "HEC code 99"
    assert [hec.CODES[n] for n in range(5)] == [
        "Success",
        "Token disabled",
        "Token is required",
        "Invalid authorization",
        "Invalid token",
    ]


# --- configuration -----------------------------------------------------------------------------


def _code(cfg: dict[str, Any]) -> str:
    with pytest.raises(ValidationFailed) as info:
        config.validate(config.SPLUNK_HEC, {"url": "https://s:8088", "token": "t", **cfg})
    return info.value.code


def test_ack_configuration():
    cfg = config.validate(config.SPLUNK_HEC, {"url": "https://s:8088", "token": "t"})
    assert cfg["ack"] is False and cfg["ack_timeout_s"] == 30 and "channel" not in cfg
    u = "0F3E2D1C-AAAA-4BBB-8CCC-0123456789AB"
    cfg = config.validate(
        config.SPLUNK_HEC,
        {"url": "https://s:8088", "token": "t", "ack": True, "channel": u, "ack_timeout_s": 0.5},
    )
    assert cfg["ack"] is True and cfg["channel"] == u.lower() and cfg["ack_timeout_s"] == 0.5
    assert config.redact(cfg)["channel"] == u.lower()  # not a secret
    for bad in (
        {"ack": "true"},
        {"ack": 1},
        {"channel": "not-a-uuid"},
        {"channel": 5},
        {"ack_timeout_s": 0},
        {"ack_timeout_s": -1},
        {"ack_timeout_s": 601},
        {"ack_timeout_s": True},
        {"ack_timeout_s": "30"},
        {"ack": True, "url": "https://proxy/splunk/hec"},
    ):
        assert _code(bad) == "invalid_sink_config", bad
    # a proxy path without ack is used as it is
    config.validate(config.SPLUNK_HEC, {"url": "https://proxy/splunk/hec", "token": "t"})
    config.validate(
        config.SPLUNK_HEC,
        {"url": "https://proxy/x/services/collector/event", "token": "t", "ack": True},
    )


def test_other_sink_kinds_still_refuse_booleans():
    with pytest.raises(ValidationFailed):
        config.validate(config.OCSF_FILE, {"path": "x", "batch_size": True})
    with pytest.raises(ValidationFailed):
        config.validate(config.OCSF_FILE, {"path": "x", "ack": True})
