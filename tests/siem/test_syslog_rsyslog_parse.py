"""What a real rsyslog parses out of our messages, field by field (issue 21, part 8).

Events with hostile text (quotes, backslashes, brackets, ``=``, line breaks, control
characters, non-ASCII, and one event larger than rsyslog's default 8 KiB limit) go through the
real export path: a store, a syslog sink made through ``proofplane.service.sinks``, mutual TLS,
octet counting. The receiver writes what its RFC 5424 parser made of each message (PRI,
facility, severity, TIMESTAMP, HOSTNAME, APP-NAME, PROCID, MSGID, the structured data raw and
parsed by mmpstrucdata, MSG) as one JSON line; the test compares each with what we sent.

Receiver settings that matter (tests/syslog_receiver.py): ``maxMessageSize="64k"`` (the 8k
default cuts the large event: a production receiver must raise it too) and
``parser.escapeControlCharactersOnReceive="off"`` (by default rsyslog rewrites control
characters, a TAB included, as ``#ooo``). Even with that off, rsyslog rewrites a NUL as
``#000``; the last test pins that.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest

from proofplane import __version__
from proofplane.access import SYSTEM, Actor, Role
from proofplane.audit.canonical import event_leaf_hash
from proofplane.audit.export import cef, syslog
from proofplane.audit.export.config import SinkPolicy
from proofplane.model import Event, Outcome
from proofplane.service import sinks as svc
from proofplane.service.context import Store
from proofplane.service.events import event_from_row
from proofplane.siem.transport import SyslogTlsTransport
from proofplane.store import migrate
from proofplane.store.tables import EventRow
from syslog_receiver import Pki, Rsyslog, make_pki, rsyslogd_or_skip

NO_SLEEP = svc.RetryPolicy(attempts=2, base_delay_s=0.01, sleep=lambda _s: None)
HOSTILE = 'Zoë 東京 🚀 "double" \\back\\ ]close [open =eq a=b | pipe'
BREAKS = "line\nbreak\rCR\r\nCRLF\ttab\x01soh\x7fdel\x85nel\u2028ls"
BIG = ("Zoë 東京 🚀 " * 1500)[:20000]  # about 36 KiB of UTF-8 in the details
ENV = {
    "PROOFPLANE_SINK_DIR": None,  # set per module below
    "PROOFPLANE_SINK_TLS_DIR": "/",
    "PROOFPLANE_SINK_ALLOW_INSECURE": "1",
    "PROOFPLANE_SINK_ALLOW_HOSTS": "127.0.0.1",
}


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def rsyslog(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rsyslog]:
    """One rsyslogd for the module; every test reads only the messages it sent."""
    receiver = Rsyslog(rsyslogd_or_skip(), pki, tmp_path_factory.mktemp("rsyslog"))
    receiver.start()
    yield receiver
    receiver.stop()


def _sink(pki: Pki, port: int) -> dict[str, Any]:
    return {
        "url": f"tls://127.0.0.1:{port}",
        "server_name": "localhost",
        "ca_file": str(pki.ca),
        "cert_file": str(pki.client_cert),
        "key_file": str(pki.client_key),
        "hostname": "cp-test",
        "batch_size": 4,
        "timeout_s": 5,
    }


@pytest.fixture(scope="module")
def delivered(
    rsyslog: Rsyslog, pki: Pki, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[list[Event], list[dict[str, str]]]]:
    """Hostile events exported once through the real path: (events, what rsyslog parsed)."""
    where = tmp_path_factory.mktemp("store")
    with pytest.MonkeyPatch.context() as mp:
        for name, value in {**ENV, "PROOFPLANE_SINK_DIR": str(where)}.items():
            mp.setenv(name, value)
        store = Store(f"sqlite:///{where / 'pp.db'}")
        migrate.upgrade(store.engine)
        try:
            hostile_actor = Actor(HOSTILE, frozenset({Role.ADMIN}))
            with store.write(hostile_actor) as tx:
                tx.record("node.register", HOSTILE, HOSTILE, details={HOSTILE: HOSTILE})
                tx.record(
                    "auth.login",
                    "user",
                    BREAKS,
                    outcome=Outcome.DENIED,
                    details={"source_ip": "192.0.2.7", "why": BREAKS},
                )
            with store.write(SYSTEM) as tx:
                tx.record("node.attest", "node", "gpu-big", details={"blob": BIG})
                tx.record(
                    "alert.auth_failure_burst",
                    "user",
                    "x]y",
                    outcome=Outcome.FAILURE,
                    details={"source_ip": "2001:db8::7"},
                )
                tx.record("workload.submit", "workload", " spaces  ", details={"": ""})
            skip = rsyslog.received()
            svc.create_sink(store, SYSTEM, "siem", "syslog", _sink(pki, rsyslog.port))
            [result] = svc.export_once(store, retry=NO_SLEEP)
            with store.read() as session:
                events = [event_from_row(r) for r in session.query(EventRow).order_by(EventRow.seq)]
            # the five above, the secrets key's creation (the sink's key file path is the first
            # secret sealed) and the sink's own creation event
            assert result.error is None and result.delivered == len(events) == 7, result
        finally:
            store.dispose()
    got = rsyslog.wait_for(len(skip) + len(events))[len(skip) :]
    assert len(got) == len(events), rsyslog.log.read_text()
    yield events, got


def _sent(ev: Event) -> tuple[bytes, str]:
    """The message the exporter sends for ``ev`` and its CEF body."""
    leaf = event_leaf_hash(ev)
    body = cef.format_event(ev, leaf, product_version=__version__)
    return syslog.event_message(ev, leaf, body, hostname="cp-test"), body


def test_rsyslog_parses_every_header_field_as_sent(delivered) -> None:
    events, got = delivered
    for ev, rec in zip(events, got, strict=True):
        sev = syslog.severity(ev)
        assert rec["pri"] == str(13 * 8 + sev)
        assert (rec["facility"], rec["severity"]) == ("13", str(sev))
        assert rec["time"] == syslog.timestamp(ev.ts)
        assert rec["hostname"] == "cp-test"
        assert rec["app"] == "proofplane" and rec["msgid"] == "audit"
        assert rec["procid"] == "-"  # NILVALUE: rsyslog gives it back as "-"
    assert [r["severity"] for r in got[:5]] == ["5", "4", "5", "2", "5"]


def test_rsyslog_structured_data_is_exactly_ours(delivered) -> None:
    events, got = delivered
    for ev, rec in zip(events, got, strict=True):
        leaf = event_leaf_hash(ev).hex()
        assert rec["sd"] == f'[proofplane@32473 seq="{ev.seq}" leaf="{leaf}"]'
        parsed = json.loads(rec["sd_parsed"])
        assert parsed == {"proofplane@32473": {"seq": str(ev.seq), "leaf": leaf}}


def test_rsyslog_msg_is_our_cef_body_byte_for_byte(delivered) -> None:
    events, got = delivered
    for ev, rec in zip(events, got, strict=True):
        message, body = _sent(ev)
        assert rec["msg"] == body
        assert rec["raw"] == message.decode("utf-8")
        header, ext = cef.parse(rec["msg"])
        assert ext["suser"] == ev.actor and ext["cs2"] == ev.target_id
        assert json.loads(ext["msg"]) == ev.details
    assert cef.parse(got[0]["msg"])[0][5] == f"node.register {HOSTILE}/{HOSTILE}"
    assert cef.parse(got[1]["msg"])[1]["src"] == "192.0.2.7"
    assert cef.parse(got[3]["msg"])[1]["c6a2"] == "2001:db8::7"


def test_a_message_over_8_kib_arrives_whole(delivered) -> None:
    events, got = delivered
    message, body = _sent(events[2])
    assert len(message) > 16 * 1024  # over rsyslog's default limit, and over one TLS record
    assert got[2]["msg"] == body
    assert json.loads(cef.parse(got[2]["msg"])[1]["msg"]) == {"blob": BIG}


def _transport(rsyslog: Rsyslog, pki: Pki) -> SyslogTlsTransport:
    """The product's syslog transport, for messages the export path does not make."""
    return SyslogTlsTransport(
        "127.0.0.1",
        rsyslog.port,
        ca_file=str(pki.ca),
        cert_file=str(pki.client_cert),
        key_file=str(pki.client_key),
        server_name="localhost",
        policy=SinkPolicy(allow_hosts=("127.0.0.1",)),
    )


SD_VALUES = {
    "quote": 'say "hi"',
    "backslash": "C:\\dir\\",
    "bracket": "a]b[c]",
    "equals": "k=v x=y",
    "mixed": '\\"]\\]"\\',
    "breaks": BREAKS,
    "unicode": "Zoë 東京 🚀",
    "empty": "",
}


def test_rsyslog_unescapes_our_structured_data_values(rsyslog: Rsyslog, pki: Pki) -> None:
    """The export path only puts digits and hex in SD; this sends hostile PARAM-VALUEs (and
    sanitized hostile PARAM-NAMEs) through the same transport to check the escaping with
    rsyslog's own SD parser."""
    names = {"a=b": "x", 'q"': "y", "c]": "z", "sp ace": "w"}
    params = {**SD_VALUES, **names}
    message = syslog.format_message(
        facility=13,
        severity=5,
        ts=datetime.now(UTC),
        hostname="cp-test",
        app_name="proofplane",
        procid=None,
        msgid="sdcheck",
        structured_data={"check@32473": params},
        msg="body",
    )
    skip = len(rsyslog.received())
    _transport(rsyslog, pki).send([message])
    [rec] = rsyslog.wait_for(skip + 1)[skip:]
    assert rec["msgid"] == "sdcheck" and rec["msg"] == "body"
    parsed = json.loads(rec["sd_parsed"])["check@32473"]
    expected = {**SD_VALUES, "a_b": "x", "q_": "y", "c_": "z", "sp_ace": "w"}
    assert parsed == expected
    # the raw structured data is our escaped text, unchanged
    assert rec["sd"] == message.decode().split(" ", 6)[6].removesuffix(" body")


def test_a_nul_reaches_rsyslog_as_hash_000(rsyslog: Rsyslog, pki: Pki) -> None:
    """CEF has no escape for NUL, so a NUL in a value goes out raw; rsyslog always rewrites it
    as ``#000`` (escapeControlCharactersOnReceive off or not). Pinned here so a change in
    either shows."""
    ev = Event(1, datetime(2026, 1, 2, tzinfo=UTC), "a\x00b", "x.y", "t", "id", Outcome.SUCCESS, {})
    message, body = _sent(ev)
    skip = len(rsyslog.received())
    _transport(rsyslog, pki).send([message])
    [rec] = rsyslog.wait_for(skip + 1)[skip:]
    assert rec["msg"] == body.replace("\x00", "#000")


def test_a_bom_would_stay_in_front_of_the_cef_record(rsyslog: Rsyslog, pki: Pki) -> None:
    """Why the body is MSG-ANY without a BOM (RFC 5424 §6.4 allows it): rsyslog keeps a BOM
    as the first characters of the message it hands on, so a CEF record after one would no
    longer start with ``CEF:0|``. Pinned here so a change in rsyslog shows."""
    ev = Event(1, datetime(2026, 1, 2, tzinfo=UTC), "alice", "x.y", "t", "id", Outcome.SUCCESS, {})
    message, body = _sent(ev)
    assert body.startswith("CEF:0|") and message.endswith(body.encode())
    with_bom = message[: -len(body.encode())] + "\ufeff".encode() + body.encode()
    skip = len(rsyslog.received())
    _transport(rsyslog, pki).send([with_bom, message])
    [bom, plain] = rsyslog.wait_for(skip + 2)[skip:]
    assert plain["msg"] == body
    assert bom["msg"] == "\ufeff" + body
