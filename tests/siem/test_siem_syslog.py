"""The syslog sink against a real rsyslog receiver: RFC 5424 over TCP with RFC 6587 octet
counting, mutual TLS (RFC 5425), CEF bodies. rsyslog parses each frame and writes what it
parsed; the test compares that with what the exporter sent."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from proofplane.access import SYSTEM
from proofplane.audit.canonical import event_leaf_hash
from proofplane.audit.export import cef
from proofplane.service import sinks as svc
from proofplane.service.context import Store
from proofplane.service.events import event_from_row
from proofplane.store import migrate
from proofplane.store.tables import EventRow
from syslog_receiver import Pki, Rsyslog, make_pki, rsyslogd_or_skip

NO_SLEEP = svc.RetryPolicy(attempts=2, base_delay_s=0.01, sleep=lambda _s: None)
NASTY = 'pipe|eq=back\\slash\nnew line "q" ]br ünï'


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def rsyslog(pki: Pki, tmp_path: Path) -> Iterator[Rsyslog]:
    receiver = Rsyslog(rsyslogd_or_skip(), pki, tmp_path / "rsyslog")
    receiver.start()
    yield receiver
    receiver.stop()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store(f"sqlite:///{tmp_path / 'pp.db'}")
    migrate.upgrade(s.engine)
    yield s
    s.dispose()


def syslog_config(pki: Pki, port: int, *, cert: Path | None = None, key: Path | None = None):
    return {
        "url": f"tls://127.0.0.1:{port}",
        "server_name": "localhost",
        "ca_file": str(pki.ca),
        "cert_file": str(cert or pki.client_cert),
        "key_file": str(key or pki.client_key),
        "hostname": "cp-test",
        "batch_size": 3,
        "timeout_s": 5,
    }


def test_rsyslog_receives_cef_over_mutual_tls_with_octet_framing(store, rsyslog, pki):
    with store.write(SYSTEM) as tx:
        for i in range(4):
            tx.record("node.register", "node", f"gpu-{i}", details={"note": NASTY, "i": i})
        tx.record("auth.login", "user", NASTY, details={})
    # + key.create (the key file's path is the first secret sealed) and sink.create
    svc.create_sink(store, SYSTEM, "siem", "syslog", syslog_config(pki, rsyslog.port))
    [result] = svc.export_once(store, retry=NO_SLEEP)
    assert result.error is None and result.delivered == 7

    got = rsyslog.wait_for(7)
    assert len(got) == 7, rsyslog.log.read_text()
    with store.read() as session:
        events = [event_from_row(r) for r in session.query(EventRow).order_by(EventRow.seq)]
    for msg, ev in zip(got, events, strict=True):
        leaf = event_leaf_hash(ev).hex()
        # rsyslog split the stream into exactly our messages (octet counting understood) ...
        assert msg["raw"].startswith("<")
        assert msg["hostname"] == "cp-test" and msg["app"] == "proofplane"
        assert msg["msgid"] == "audit"
        assert msg["sd"] == f'[proofplane@32473 seq="{ev.seq}" leaf="{leaf}"]'
        # ... and its message body is our CEF record, unchanged
        body = msg["msg"]  # MSG as sent: rsyslog adds no leading space to RFC 5424 messages
        header, ext = cef.parse(body)
        assert header[0] == "CEF:0" and header[4] == ev.action
        assert ext["externalId"] == str(ev.seq) and ext["cs6"] == leaf
        assert ext["cs2"] == ev.target_id
    assert int(got[0]["pri"]) == 13 * 8 + 5
    assert svc.get_sink(store, SYSTEM, "siem").cursor == events[-1].seq


def test_rsyslog_down_then_up_catches_up_and_a_wrong_client_cert_is_not_delivery(
    store, rsyslog, pki, tmp_path
):
    with store.write(SYSTEM) as tx:
        for i in range(2):
            tx.record("workload.submit", "workload", f"w{i}")
    svc.create_sink(store, SYSTEM, "siem", "syslog", syslog_config(pki, rsyslog.port))
    rogue = syslog_config(pki, rsyslog.port, cert=pki.rogue_cert, key=pki.rogue_key)
    svc.create_sink(store, SYSTEM, "rogue", "syslog", rogue)

    rsyslog.stop()
    results = {r.name: r for r in svc.export_once(store, retry=NO_SLEEP)}
    assert results["siem"].error and results["siem"].cursor == 0

    rsyslog.start()
    results = {r.name: r for r in svc.export_once(store, retry=NO_SLEEP)}
    # The receiver refuses a certificate from another CA: not acknowledged, cursor unmoved.
    assert results["rogue"].error and results["rogue"].cursor == 0
    siem = results["siem"]
    assert siem.error is None
    got = rsyslog.wait_for(siem.delivered)
    seqs = [int(m["sd"].split('seq="')[1].split('"')[0]) for m in got]
    assert seqs == list(range(1, siem.cursor + 1))


def test_missing_tls_files_fail_the_pass_not_the_server(store, pki, tmp_path):
    key = tmp_path / "client.key"
    key.write_bytes(pki.client_key.read_bytes())
    cfg = syslog_config(pki, 1, key=key)
    svc.create_sink(store, SYSTEM, "siem", "syslog", cfg)
    key.unlink()  # gone after configuration
    [result] = svc.export_once(store, retry=NO_SLEEP)
    assert result.error and "TLS files" in result.error and result.cursor == 0
