"""Sinks must not become a way into the host (issue 19, §5). Each test performs the attack an
operator's credentials allowed before: appending to any file, posting to loopback services and
the cloud metadata address (directly, through a name, and by DNS rebinding after
configuration), sending HEC tokens over plain HTTP, reading a loopback service's answer back
through delivery errors, and finding a deleted sink's token in the database files."""

from __future__ import annotations

import json
import os
import socket
import stat
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from proofplane.access import SYSTEM
from proofplane.api.app import create_app
from proofplane.audit.export.config import SinkPolicy
from proofplane.errors import ValidationFailed
from proofplane.service import sinks as svc
from proofplane.service.access import bootstrap_admin
from proofplane.service.context import Store
from proofplane.siem import guard
from proofplane.store import migrate

API = "/api/v1"
ADMIN_TOKEN = "ppt_sink-hardening-admin-token-0123"
SECRET = "TOPSECRET-loopback-answer-4242"
HEC_TOKEN = "aaaaaaaa-bbbb-cccc-dddd-0123456789ab"
NO_SLEEP = svc.RetryPolicy(attempts=1, base_delay_s=0.01, sleep=lambda _s: None)


@pytest.fixture
def sink_dir(tmp_path: Path) -> Path:
    path = tmp_path / "sinks"
    path.mkdir()
    return path


@pytest.fixture
def store(tmp_path: Path, sink_dir: Path) -> Iterator[Store]:
    """A SQLite store under the strict policy: no insecure HTTP, nothing allow-listed."""
    s = Store(f"sqlite:///{tmp_path / 'pp.db'}")
    migrate.upgrade(s.engine)
    s.sink_policy = SinkPolicy(sink_dir=str(sink_dir))
    yield s
    s.dispose()


@pytest.fixture
def api(store: Store) -> Iterator[TestClient]:
    bootstrap_admin(store, ADMIN_TOKEN)
    with TestClient(
        create_app(store),
        raise_server_exceptions=False,
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
    ) as c:
        yield c


def allow(store: Store, *hosts: str, insecure: bool = True) -> None:
    assert store.sink_policy is not None
    store.sink_policy = SinkPolicy(store.sink_policy.sink_dir, insecure, hosts)


class Receiver:
    """A loopback HTTP service that answers every POST with ``status`` and a secret body (and
    a secret reason phrase), or, with ``garbage``, with a secret that is not HTTP at all."""

    def __init__(self, status: int = 500, *, garbage: bool = False) -> None:
        self.hits = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_a: Any) -> None:
                pass

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", "0")))
                outer.hits += 1
                if garbage:
                    self.wfile.write(f"{SECRET} {SECRET}\r\n\r\n".encode())
                    return
                body = json.dumps({"secret": SECRET}).encode()
                self.send_response(status, f"reason {SECRET}")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(
            target=lambda: self.server.serve_forever(poll_interval=0.05), daemon=True
        ).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


def post_sink(api: TestClient, kind: str, config: dict[str, Any], name: str = "s") -> Any:
    return api.post(f"{API}/sinks", json={"name": name, "type": kind, "config": config})


def hec_status(api: TestClient, url: str, name: str = "s") -> int:
    """The status of adding a Splunk HEC sink for ``url``."""
    return int(post_sink(api, "splunk-hec", {"url": url, "token": HEC_TOKEN}, name).status_code)


# --- file sinks: only under the sink directory, by name ---------------------------------------


@pytest.mark.parametrize(
    "path",
    ["/etc/cron.d/proofplane", "/tmp/x.jsonl", "../x.jsonl", "sub/x.jsonl", ".bashrc",
     "{sink_dir}/../x.jsonl", "{sink_dir}/sub/x.jsonl", "{sink_dir}/../../etc/passwd"],
)  # fmt: skip
def test_a_file_sink_outside_the_sink_directory_is_refused(api, sink_dir, path):
    r = post_sink(api, "ocsf-file", {"path": path.format(sink_dir=sink_dir)})
    assert r.status_code == 422, r.text
    assert r.json()["error"]["code"] == "invalid_sink_path"
    assert api.get(f"{API}/sinks").json()["items"] == []


def test_a_file_sink_writes_its_name_in_the_sink_directory_0600(api, store, sink_dir):
    old = os.umask(0o022)
    try:
        by_name = post_sink(api, "ocsf-file", {"path": "audit.jsonl"}, "a")
        by_path = post_sink(api, "ocsf-file", {"path": str(sink_dir / "b.jsonl")}, "b")
        assert by_name.status_code == by_path.status_code == 201, by_path.text
        assert by_path.json()["config"]["path"] == "b.jsonl"  # stored by name
        results = svc.export_once(store, retry=NO_SLEEP)
    finally:
        os.umask(old)
    assert [r.error for r in results] == [None, None]
    for name in ("audit.jsonl", "b.jsonl"):
        assert stat.S_IMODE((sink_dir / name).stat().st_mode) == 0o600
        assert (sink_dir / name).read_text().count("\n") >= 3


def test_a_file_sink_does_not_follow_a_link_out_of_the_sink_directory(store, sink_dir, tmp_path):
    target = tmp_path / "outside.txt"
    target.write_text("untouched\n")
    svc.create_sink(store, SYSTEM, "lake", "ocsf-file", {"path": "lake.jsonl"})
    (sink_dir / "lake.jsonl").symlink_to(target)
    [result] = svc.export_once(store, retry=NO_SLEEP)
    assert result.error and result.cursor == 0
    assert str(target) not in result.error
    assert target.read_text() == "untouched\n"


def test_a_stored_path_outside_the_sink_directory_is_not_written(store, sink_dir, tmp_path):
    """A sink stored before the rule (or under another sink directory) writes nowhere else."""
    svc.create_sink(store, SYSTEM, "lake", "ocsf-file", {"path": "lake.jsonl"})
    escape = tmp_path / "escape.jsonl"
    with store.write(SYSTEM) as tx:
        from proofplane.store.tables import SinkRow

        row = tx.session.query(SinkRow).one()
        row.config = {**row.config, "path": str(escape)}
    [result] = svc.export_once(store, retry=NO_SLEEP)
    assert result.error and "sink directory" in result.error
    assert not escape.exists()


# --- HTTP sinks: https only, unless allowed ----------------------------------------------------


def test_plain_http_hec_is_refused_unless_insecure_is_allowed(api, store):
    cfg = {"url": "http://splunk.invalid:8088", "token": HEC_TOKEN}
    r = post_sink(api, "splunk-hec", cfg)
    assert r.status_code == 422 and r.json()["error"]["code"] == "insecure_sink_url"
    assert HEC_TOKEN not in r.text
    r = post_sink(api, "ocsf-http", {"url": "http://lake.invalid/ingest", "bearer_token": "b"})
    assert r.json()["error"]["code"] == "insecure_sink_url"
    assert hec_status(api, "https://splunk.invalid:8088") == 201
    allow(store, insecure=True)
    assert post_sink(api, "splunk-hec", cfg, "plain").status_code == 201


# --- destinations: no loopback, link-local, unspecified or metadata address -------------------

REFUSED = [
    "https://127.0.0.1:8089/services/collector",
    "https://127.1.2.3/",
    "https://[::1]:8088",
    "https://[::ffff:127.0.0.1]:8088",
    "https://169.254.169.254/latest/meta-data/",
    "https://[fd00:ec2::254]/",
    "https://169.254.10.10/",
    "https://[fe80::1]/",
    "https://0.0.0.0:8088",
    "https://[::]:8088",
    "https://localhost:8088",  # a name that resolves to loopback
    "https://2130706433:8088",  # 127.0.0.1 spelled as one number
]


@pytest.mark.parametrize("url", REFUSED)
def test_loopback_link_local_and_metadata_destinations_are_refused(api, url):
    r = post_sink(api, "splunk-hec", {"url": url, "token": HEC_TOKEN})
    assert r.status_code == 422, r.text
    assert r.json()["error"]["code"] == "forbidden_sink_destination"
    assert api.get(f"{API}/sinks").json()["items"] == []


def test_syslog_to_loopback_is_refused(api, tmp_path):
    for name in ("ca", "c", "k"):
        (tmp_path / name).write_text("x")
    cfg = {"url": "tls://127.0.0.1:6514", "ca_file": str(tmp_path / "ca"),
           "cert_file": str(tmp_path / "c"), "key_file": str(tmp_path / "k")}  # fmt: skip
    r = post_sink(api, "syslog", cfg)
    assert r.status_code == 422 and r.json()["error"]["code"] == "forbidden_sink_destination"


def test_the_allow_list_lets_a_listed_host_through_and_only_it(api, store):
    allow(store, "127.0.0.1", "localhost", "169.254.0.0/16")
    assert hec_status(api, "https://127.0.0.1:8088", "a") == 201
    assert hec_status(api, "https://localhost:8088", "b") == 201
    assert hec_status(api, "https://169.254.3.4", "c") == 201
    # 127.0.0.2 is not listed; the metadata address needs its exact address, not a network
    for url in ("https://127.0.0.2:8088", "https://169.254.169.254/"):
        r = post_sink(api, "splunk-hec", {"url": url, "token": HEC_TOKEN}, "d")
        assert r.json()["error"]["code"] == "forbidden_sink_destination", url
    allow(store, "169.254.169.254")
    assert hec_status(api, "https://169.254.169.254/", "d") == 201


def test_dns_rebinding_after_configuration_is_refused_at_connect_time(store, receiver, monkeypatch):
    """The name resolved to a public address when the sink was added; at delivery it answers
    loopback (where a service waits): the exporter refuses to connect, nothing reaches it."""
    allow(store, insecure=True)  # plain HTTP allowed, loopback not
    answer = ["203.0.113.7"]
    real = socket.getaddrinfo

    def fake(host: str, port: Any, *args: Any, **kw: Any) -> Any:
        if host == "siem.rebind.test":
            return real(answer[0], port, *args, **kw)
        return real(host, port, *args, **kw)

    monkeypatch.setattr(guard.socket, "getaddrinfo", fake)
    url = f"http://siem.rebind.test:{receiver.port}"
    svc.create_sink(store, SYSTEM, "splunk", "splunk-hec", {"url": url, "token": HEC_TOKEN})
    answer[0] = "127.0.0.1"
    [result] = svc.export_once(store, retry=NO_SLEEP)
    assert result.error and "loopback" in result.error and result.cursor == 0
    assert receiver.hits == 0
    with pytest.raises(svc.DeliveryFailed):
        svc.test_sink(store, SYSTEM, "splunk")
    assert receiver.hits == 0
    # and at configuration, the same name is refused outright
    with pytest.raises(ValidationFailed) as info:
        svc.create_sink(store, SYSTEM, "again", "splunk-hec", {"url": url, "token": HEC_TOKEN})
    assert info.value.code == "forbidden_sink_destination"


# --- delivery errors: a status and a short reason, never the remote body ----------------------


def test_delivery_errors_never_echo_the_receivers_answer(api, store, receiver):
    allow(store, "127.0.0.1", insecure=True)
    url = f"http://127.0.0.1:{receiver.port}/ingest"
    assert post_sink(api, "ocsf-http", {"url": url}, "lake").status_code == 201
    test = api.post(f"{API}/sinks/lake/test")
    assert test.status_code == 502 and receiver.hits == 1
    assert SECRET not in test.text
    assert "500 Internal Server Error" in test.text  # the status and its standard phrase
    flush = api.post(f"{API}/sinks/flush")
    assert flush.status_code == 200 and receiver.hits >= 2  # the pass retried
    assert SECRET not in flush.text and "500" in flush.text
    shown = api.get(f"{API}/sinks/lake")
    assert SECRET not in shown.text and "500" in shown.json()["last_error"]
    events = api.get(f"{API}/events", params={"action": "sink.*"}).json()["items"]
    assert "sink.delivery_failed" in [e["action"] for e in events]
    assert SECRET not in json.dumps(events)


def test_a_receiver_that_answers_garbage_is_not_echoed_either(api, store):
    garbage = Receiver(garbage=True)
    try:
        allow(store, "127.0.0.1", insecure=True)
        url = f"http://127.0.0.1:{garbage.port}/"
        assert post_sink(api, "splunk-hec", {"url": url, "token": HEC_TOKEN}).status_code == 201
        test = api.post(f"{API}/sinks/s/test")
        assert test.status_code == 502 and garbage.hits == 1
        assert SECRET not in test.text and "not valid HTTP" in test.text
    finally:
        garbage.close()


# --- a deleted sink's secrets are erased ----------------------------------------------------


def test_a_deleted_sinks_token_is_gone_from_the_database_files(api, store, tmp_path):
    token = "ffffffff-eeee-dddd-cccc-deleted-sink-tok"
    r = post_sink(api, "splunk-hec", {"url": "https://splunk.invalid:8088", "token": token})
    assert r.status_code == 201

    def on_disk() -> bytes:
        return b"".join(p.read_bytes() for p in tmp_path.iterdir() if p.name.startswith("pp.db"))

    from proofplane.store.tables import SinkRow

    with store.read() as session:
        sealed = session.query(SinkRow).one().config["token"]
    assert sealed.startswith("ppk1.secrets.")  # only its KMS ciphertext is stored (issue 13)
    assert token.encode() not in on_disk() and sealed.encode() in on_disk()
    assert api.delete(f"{API}/sinks/s").status_code == 200
    assert sealed.encode() not in on_disk()  # ... and that is erased, not just unlisted
    with store.read() as session:
        assert session.query(SinkRow).count() == 0


def test_unloadable_syslog_tls_files_do_not_echo_the_key_path(tmp_path):
    from proofplane.siem.transport import SyslogTlsTransport, TlsFilesInvalid

    key = tmp_path / "secret-client-key.pem"
    for name in ("ca.pem", "cert.pem"):
        (tmp_path / name).write_text("not pem\n")
    key.write_text("not a key\n")
    transport = SyslogTlsTransport(
        "siem.example.com",
        6514,
        ca_file=str(tmp_path / "ca.pem"),
        cert_file=str(tmp_path / "cert.pem"),
        key_file=str(key),
    )
    with pytest.raises(TlsFilesInvalid) as raised:
        transport.send([b"x"])
    shown = raised.value.message + json.dumps(raised.value.details)
    assert key.name not in shown
