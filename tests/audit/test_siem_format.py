"""SIEM export, the pure parts: CEF escaping, RFC 5424 messages and RFC 6587 framing, the OCSF
mapping, Splunk HEC payloads, sink configuration checks and redaction, retries with backoff."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proofplane.audit.canonical import event_leaf_hash
from proofplane.audit.export import cef, config, hec, ocsf, syslog
from proofplane.errors import ValidationFailed
from proofplane.model import Event, Outcome
from proofplane.siem.sink import backoff_delays, build, deliver, hec_url
from proofplane.siem.transport import DeliveryError

TS = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)
LEAF = bytes(range(32))
NASTY = 'back\\slash|pipe=equals\nnew\rline\r\n"quote"]bracket ünï 🙂 ' + "\t"


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


# --- CEF ---------------------------------------------------------------------------------------


def test_cef_header_escapes_backslash_and_pipe_only():
    assert cef.escape_header("a|b\\c=d") == "a\\|b\\\\c=d"
    # no escape for line breaks exists in the header: they become spaces
    assert cef.escape_header("x\ny\r\nz\rw") == "x y z w"


def test_cef_extension_escapes_backslash_equals_and_newlines():
    assert cef.escape_extension("a|b\\c=d") == "a|b\\\\c\\=d"
    assert cef.escape_extension("x\ny\r\nz\rw") == "x\\ny\\r\\nz\\rw"


def test_cef_backslash_is_escaped_before_the_rest():
    # "\=" in the input must become "\\\=", not "\\=" (which would read back as "\" "=")
    assert cef.escape_extension("\\=") == "\\\\\\="
    assert cef.escape_header("\\|") == "\\\\\\|"


def test_cef_record_layout():
    rec = cef.format_event(event(), LEAF, product_version="1.2.3")
    header, ext = cef.parse(rec)
    assert header == [
        "CEF:0",
        "proofplane",
        "proofplane",
        "1.2.3",
        "node.register",
        "node.register node/gpu-01",
        "3",
    ]
    assert ext["externalId"] == "7"
    assert ext["cs6Label"] == "leafHash" and ext["cs6"] == LEAF.hex()
    assert ext["rt"] == str(int(TS.timestamp() * 1000))
    assert ext["suser"] == "alice" and ext["outcome"] == "success"
    assert json.loads(ext["msg"]) == {"gpus": 8}


def test_cef_nasty_characters_round_trip_and_stay_on_one_line():
    ev = event(actor=NASTY, target_id=NASTY, action="a|b\\c", details={NASTY: NASTY})
    rec = cef.format_event(ev, LEAF, product_version="v|1")
    assert "\n" not in rec and "\r" not in rec
    header, ext = cef.parse(rec)
    assert len(header) == 7
    assert header[3] == "v|1"
    assert header[4] == "a|b\\c"
    assert ext["suser"] == NASTY
    assert ext["cs2"] == NASTY
    assert json.loads(ext["msg"]) == {NASTY: NASTY}


def test_cef_severity():
    assert cef.severity(event()) == 3
    assert cef.severity(event(outcome=Outcome.FAILURE)) == 5
    assert cef.severity(event(outcome=Outcome.DENIED)) == 7
    assert cef.severity(event(action="alert.auth_failure_burst")) == 8


def test_cef_refuses_bad_extension_keys():
    with pytest.raises(ValueError):
        cef.extension([("bad key", "v")])


@settings(max_examples=200, deadline=None)
@given(st.text(), st.text(), st.text(min_size=1))
def test_cef_escaping_round_trips(actor: str, target: str, action: str):
    ev = event(actor=actor, target_id=target, action=action)
    header, ext = cef.parse(cef.format_event(ev, LEAF, product_version="1"))
    flat = action.replace("\r\n", " ").replace("\r", " ").replace("\n", " ")
    assert header[4] == flat
    assert ext["suser"] == actor
    assert ext["cs2"] == target


# --- RFC 5424 + RFC 6587 -----------------------------------------------------------------------


def test_syslog_message_layout():
    msg = syslog.event_message(event(), LEAF, "CEF:0|x", hostname="cp-1")
    text = msg.decode()
    assert text == (
        "<109>1 2026-01-02T03:04:05.678901Z cp-1 proofplane - audit "
        f'[proofplane@32473 seq="7" leaf="{LEAF.hex()}"] CEF:0|x'
    )
    assert not msg.startswith(b"\xef\xbb\xbf")


def test_syslog_priority_follows_outcome():
    def pri(ev: Event) -> int:
        return int(syslog.event_message(ev, LEAF, "m", hostname="h").split(b">")[0][1:])

    assert pri(event()) == 13 * 8 + 5
    assert pri(event(outcome=Outcome.DENIED)) == 13 * 8 + 4
    assert pri(event(action="alert.auth_failure_spray")) == 13 * 8 + 2


def test_syslog_header_fields_are_sanitized_and_sd_values_escaped():
    msg = syslog.format_message(
        facility=1,
        severity=6,
        ts=TS,
        hostname="host with spaces",
        app_name="a" * 60,
        procid=None,
        msgid="",
        structured_data={"x@1": {"k": 'q"b\\r]'}},
        msg="body",
    ).decode()
    parts = msg.split(" ", 6)
    assert parts[2] == "host_with_spaces"
    assert parts[3] == "a" * 48
    assert parts[4] == "-" and parts[5] == "-"
    assert parts[6] == '[x@1 k="q\\"b\\\\r\\]"] body'


def test_syslog_refuses_naive_time_and_bad_priority():
    with pytest.raises(ValueError):
        syslog.timestamp(datetime(2026, 1, 1))
    with pytest.raises(ValueError):
        syslog.format_message(
            facility=24, severity=0, ts=TS, hostname=None, app_name="a", procid=None,
            msgid=None, structured_data=None, msg="",
        )  # fmt: skip


def test_octet_counting_frames_count_bytes_not_characters():
    msg = "ünï 🙂\n2".encode()
    framed = syslog.frame(msg)
    assert framed == str(len(msg)).encode() + b" " + msg
    assert len(msg) != len(msg.decode())
    frames, rest = syslog.unframe(framed + syslog.frame(b"second") + b"12 partial")
    assert frames == [msg, b"second"] and rest == b"12 partial"


def test_unframe_refuses_garbage():
    with pytest.raises(ValueError):
        syslog.unframe(b"abc def")
    with pytest.raises(ValueError):
        syslog.unframe(b"012 x")


# --- OCSF --------------------------------------------------------------------------------------

MAPPING = [
    ("auth.login", 3002, 3, 1),
    ("auth.logout", 3002, 3, 2),
    ("mfa.recovery_code.use", 3002, 3, 1),
    ("user.create", 3001, 3, 1),
    ("account.lock", 3001, 3, 9),
    ("account.unlock", 3001, 3, 99),
    ("mfa.enroll", 3001, 3, 10),
    ("token.issue", 3001, 3, 99),
    ("node.register", 5001, 5, 1),
    ("node.state", 5001, 5, 1),
    ("node.certification.grant", 2003, 2, 1),
    ("node.certification.revoke", 2003, 2, 3),
    ("node.attest", 2003, 2, 1),
    ("attest.policy.set", 6003, 6, 3),
    ("alert.auth_failure_burst", 2004, 2, 1),
    ("tenant.create", 6003, 6, 1),
    ("workload.submit", 6003, 6, 1),
    ("workload.place", 6003, 6, 3),
    ("sink.delete", 6003, 6, 4),
    ("cluster.load", 6003, 6, 1),
    ("something.unheard_of", 6003, 6, 99),
]


@pytest.mark.parametrize(("action", "class_uid", "category_uid", "activity_id"), MAPPING)
def test_ocsf_class_category_and_type(action, class_uid, category_uid, activity_id):
    out = ocsf.to_ocsf(event(action=action), LEAF, product_version="1")
    assert out["class_uid"] == class_uid
    assert out["category_uid"] == category_uid
    assert out["activity_id"] == activity_id
    assert out["type_uid"] == class_uid * 100 + activity_id
    assert out["class_name"] == ocsf.CLASS_NAMES[class_uid]


def test_ocsf_base_fields_and_provenance():
    out = ocsf.to_ocsf(event(outcome=Outcome.DENIED), LEAF, product_version="9")
    assert out["time"] == int(TS.timestamp() * 1000)
    assert out["metadata"]["version"].startswith("1.")
    assert out["metadata"]["sequence"] == 7
    assert out["metadata"]["uid"] == LEAF.hex()
    assert out["metadata"]["product"]["version"] == "9"
    assert (out["status_id"], out["status"]) == (2, "Failure")
    assert out["severity_id"] == 3
    raw = out["unmapped"]["proofplane"]
    assert raw["seq"] == 7 and raw["leaf_hash"] == LEAF.hex() and raw["details"] == {"gpus": 8}
    json.dumps(out)  # serializable


def test_ocsf_class_specific_fields():
    auth = ocsf.to_ocsf(event(action="auth.login", target_type="user", target_id="bob"), LEAF,
                        product_version="1")  # fmt: skip
    assert auth["user"]["name"] == "bob"
    device = ocsf.to_ocsf(event(), LEAF, product_version="1")
    assert device["device"]["hostname"] == "gpu-01"
    finding = ocsf.to_ocsf(event(action="alert.auth_failure_spray"), LEAF, product_version="1")
    assert finding["finding_info"]["uid"] == "proofplane-7" and finding["severity_id"] == 4
    failed = ocsf.to_ocsf(event(action="node.attest", outcome=Outcome.FAILURE), LEAF,
                          product_version="1")  # fmt: skip
    assert failed["compliance"]["status"] == "Fail" and failed["compliance"]["control"] == "SI-7"
    api = ocsf.to_ocsf(event(action="tenant.create"), LEAF, product_version="1")
    assert api["api"]["operation"] == "tenant.create"


# --- Splunk HEC --------------------------------------------------------------------------------


def test_hec_payload_and_batch():
    a = hec.encode(hec.event_payload(event(), LEAF, host="cp", index="audit"))
    b = hec.encode(hec.event_payload(event(seq=8, details={"x": NASTY}), LEAF))
    objs = hec.split_batch(hec.batch_body([a, b]))
    assert [o["event"]["seq"] for o in objs] == [7, 8]
    assert objs[0]["host"] == "cp" and objs[0]["index"] == "audit"
    assert "index" not in objs[1]
    assert objs[0]["time"] == 1767323045.678  # TS is .678901: truncated, as in every format
    assert objs[0]["sourcetype"] == "proofplane:audit"
    assert objs[0]["event"]["leaf_hash"] == LEAF.hex()
    assert objs[1]["event"]["details"] == {"x": NASTY}


def test_hec_url():
    assert hec_url("https://splunk:8088") == "https://splunk:8088/services/collector/event"
    assert hec_url("https://splunk:8088/") == "https://splunk:8088/services/collector/event"
    assert hec_url("https://proxy/splunk/hec") == "https://proxy/splunk/hec"


def test_exported_leaf_hash_is_the_audit_leaf_hash():
    ev = event(details={"k": NASTY})
    sink = build(config.SPLUNK_HEC, config.validate(config.SPLUNK_HEC,
                 {"url": "https://x", "token": "t"}))  # fmt: skip
    obj = json.loads(sink.encode(ev, event_leaf_hash(ev)))
    e = obj["event"]
    rebuilt = Event(
        e["seq"],
        datetime.fromisoformat(e["ts"]),
        e["actor"],
        e["action"],
        e["target_type"],
        e["target_id"],
        Outcome(e["outcome"]),
        e["details"],
    )
    assert event_leaf_hash(rebuilt).hex() == e["leaf_hash"]


# --- configuration -----------------------------------------------------------------------------


def _code(kind: str, cfg: dict[str, Any], **kw: Any) -> str:
    with pytest.raises(ValidationFailed) as info:
        config.validate(kind, cfg, **kw)
    return info.value.code


def test_config_codes():
    tls = {"ca_file": "/ca", "cert_file": "/c", "key_file": "/k"}
    assert _code("kafka", {}) == "unknown_sink_type"
    assert _code("syslog", {"url": "tcp://h:514", **tls}) == "invalid_sink_url"
    assert _code("syslog", {"url": "tls://h", **tls}) == "invalid_sink_url"
    assert _code("syslog", {"url": "tls://h:99999", **tls}) == "invalid_sink_url"
    assert _code("splunk-hec", {"url": "ftp://h", "token": "t"}) == "invalid_sink_url"
    assert _code("splunk-hec", {"url": "http://u:p@h", "token": "t"}) == "invalid_sink_url"
    assert _code("splunk-hec", {"url": "not a url", "token": "t"}) == "invalid_sink_url"
    assert _code("splunk-hec", {"url": "http://h"}) == "invalid_sink_config"
    assert _code("splunk-hec", {"url": "http://h", "token": "t", "x": 1}) == "invalid_sink_config"
    assert _code("splunk-hec", {"url": "http://h", "token": 5}) == "invalid_sink_config"
    assert _code("ocsf-file", {"path": "../escape.jsonl"}) == "invalid_sink_path"
    assert _code("ocsf-file", {"path": "/x", "batch_size": 0}) == "invalid_sink_config"
    assert _code("ocsf-file", {"path": "/x", "batch_size": True}) == "invalid_sink_config"
    missing = _code("syslog", {"url": "tls://h:6514", **tls}, is_file=lambda p: p != "/k")
    assert missing == "tls_file_missing"


def test_missing_key_file_error_does_not_echo_the_path():
    cfg = {"url": "tls://h:6514", "ca_file": "/ca", "cert_file": "/c", "key_file": "/secret/k"}
    with pytest.raises(ValidationFailed) as info:
        config.validate("syslog", cfg, is_file=lambda p: p != "/secret/k")
    assert "/secret/k" not in info.value.message + json.dumps(info.value.details)


def test_config_defaults_and_redaction():
    cfg = config.validate("splunk-hec", {"url": "https://s:8088", "token": "hunter2"})
    assert cfg["batch_size"] == 500 and cfg["sourcetype"] == "proofplane:audit"
    shown = config.redact(cfg)
    assert shown["token"] == config.REDACTED and "hunter2" not in json.dumps(shown)
    tls = config.validate(
        "syslog",
        {"url": "tls://h:6514", "ca_file": "/ca", "cert_file": "/c", "key_file": "/k"},
        is_file=lambda _p: True,
    )
    assert config.redact(tls)["key_file"] == config.REDACTED
    assert config.redact(tls)["cert_file"] == "/c"


# --- retries -----------------------------------------------------------------------------------


def test_backoff_is_exponential_and_capped():
    assert backoff_delays(1, 0.5, 30) == []
    assert backoff_delays(5, 0.5, 3) == [0.5, 1.0, 2.0, 3]


class Flaky:
    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls = 0

    def send(self, records: Any) -> None:
        self.calls += 1
        if self.calls <= self.failures:
            raise DeliveryError(f"down ({self.calls})")


def test_deliver_retries_with_backoff_then_succeeds():
    slept: list[float] = []
    t = Flaky(2)
    deliver(t, [b"x"], attempts=3, base_delay_s=0.5, sleep=slept.append)
    assert t.calls == 3 and slept == [0.5, 1.0]


def test_deliver_gives_up_after_the_last_attempt():
    slept: list[float] = []
    t = Flaky(10)
    with pytest.raises(DeliveryError, match=r"down \(4\)"):
        deliver(t, [b"x"], attempts=4, base_delay_s=1, max_delay_s=2, sleep=slept.append)
    assert slept == [1, 2, 2]
