"""SIEM sinks end to end (without syslog, see test_siem_syslog.py): the API and its bad input,
redaction, the durable cursor, the OCSF file sink, and Splunk HEC against a local HTTP server
that checks the real request shape, including a receiver that is down and comes back."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from proofplane.access import SYSTEM
from proofplane.api.app import create_app
from proofplane.audit.canonical import event_leaf_hash
from proofplane.audit.export import hec
from proofplane.cli.main import app as cli
from proofplane.model import Event, Outcome
from proofplane.service import sinks as svc
from proofplane.service.access import bootstrap_admin
from proofplane.service.context import Store
from proofplane.service.events import event_from_row
from proofplane.store import migrate
from proofplane.store.tables import EventRow
from proofplane.workers import ExportWorker, export_worker

API = "/api/v1"
ADMIN_TOKEN = "ppt_siem-test-admin-token-0123456789"
HEC_TOKEN = "11111111-2222-3333-4444-555555555555"
NO_SLEEP = svc.RetryPolicy(attempts=2, base_delay_s=0.01, sleep=lambda _s: None)


# --- a Splunk HEC-shaped receiver --------------------------------------------------------------


class Hec:
    """An HTTP server that checks each request the way Splunk HEC does and records the events
    of the requests it acknowledged. ``fail_next`` requests get a 503 (a busy indexer)."""

    def __init__(self) -> None:
        self.accepted: list[dict[str, Any]] = []
        self.problems: list[str] = []
        self.requests = 0
        self.fail_next = 0
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_args: Any) -> None:
                pass

            def _answer(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                with outer.lock:
                    outer.requests += 1
                    if self.path != "/services/collector/event":
                        outer.problems.append(f"path {self.path}")
                        return self._answer(404, {"text": "not found", "code": 404})
                    if self.headers.get("Authorization") != f"Splunk {HEC_TOKEN}":
                        outer.problems.append(f"auth {self.headers.get('Authorization')}")
                        return self._answer(401, {"text": "Token is required", "code": 2})
                    try:
                        events = hec.split_batch(body)
                    except ValueError:
                        outer.problems.append("body is not concatenated JSON objects")
                        return self._answer(400, {"text": "Invalid data format", "code": 6})
                    bad = [e for e in events if not isinstance(e, dict) or "event" not in e]
                    if not events or bad:
                        outer.problems.append(f"bad events {bad!r}")
                        return self._answer(400, {"text": "Event field is required", "code": 12})
                    if outer.fail_next > 0:
                        outer.fail_next -= 1
                        return self._answer(503, {"text": "Server is busy", "code": 9})
                    outer.accepted.extend(events)
                return self._answer(200, {"text": "Success", "code": 0})

            def do_GET(self) -> None:
                with outer.lock:
                    outer.problems.append(f"GET {self.path}")
                self._answer(405, {"text": "method not allowed"})

        self.handler = Handler
        self.port = 0
        self.server: ThreadingHTTPServer | None = None

    def start(self) -> None:
        """Listen (again, on the same port after a ``stop``)."""
        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), self.handler)
        self.port = self.server.server_address[1]
        server = self.server
        threading.Thread(
            target=lambda: server.serve_forever(poll_interval=0.05), daemon=True
        ).start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def seqs(self) -> list[int]:
        return [e["event"]["seq"] for e in self.accepted]


@pytest.fixture
def hec_server() -> Iterator[Hec]:
    server = Hec()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def lite(tmp_path: Path) -> Iterator[Store]:
    """A migrated SQLite store, for the tests whose behaviour does not depend on the database
    (the cursor and the API lifecycle run on PostgreSQL too, through ``store``/``client``)."""
    s = Store(f"sqlite:///{tmp_path / 'lite.db'}")
    migrate.upgrade(s.engine)
    yield s
    s.dispose()


@pytest.fixture
def lite_client(lite: Store) -> Iterator[TestClient]:
    bootstrap_admin(lite, ADMIN_TOKEN)
    with TestClient(
        create_app(lite),
        raise_server_exceptions=False,
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
    ) as c:
        yield c


def make_events(store: Store, n: int, *, nasty: bool = False) -> None:
    with store.write(SYSTEM) as tx:
        for i in range(n):
            details = {"i": i, "note": 'x|y=z\\\n"q"' if nasty else "ok"}
            tx.record("node.update", "node", f"n{i}", details=details)


def all_events(store: Store) -> list[Event]:
    with store.read() as session:
        return [event_from_row(r) for r in session.query(EventRow).order_by(EventRow.seq)]


def head(store: Store) -> int:
    events = all_events(store)
    return events[-1].seq if events else 0


def hec_sink(store: Store, url: str, name: str = "splunk", **cfg: Any) -> svc.SinkView:
    config = {"url": url, "token": HEC_TOKEN, "batch_size": 4, **cfg}
    return svc.create_sink(store, SYSTEM, name, "splunk-hec", config)


# --- API: configuration ------------------------------------------------------------------------


def test_sink_lifecycle_over_the_api_redacts_secrets(client, tmp_path):
    cfg = {"url": "https://splunk.example:8088", "token": HEC_TOKEN, "index": "audit"}
    body = {"name": "splunk", "type": "splunk-hec", "config": cfg}
    r = client.post(f"{API}/sinks", json=body)
    assert r.status_code == 201, r.text
    assert r.headers["location"] == f"{API}/sinks/splunk"
    assert HEC_TOKEN not in r.text
    out = r.json()
    assert out["config"]["token"] == "<redacted>" and out["config"]["index"] == "audit"
    assert out["cursor"] == 0 and out["lag"] == out["head"] > 0

    f = client.post(
        f"{API}/sinks",
        json={"name": "lake", "type": "ocsf-file", "config": {"path": str(tmp_path / "o.jsonl")},
              "start_at": "end"},
    )  # fmt: skip
    assert f.status_code == 201, f.text
    assert f.json()["cursor"] == f.json()["head"] - 1  # its own creation event is still to go

    listed = client.get(f"{API}/sinks").json()
    assert [s["name"] for s in listed["items"]] == ["lake", "splunk"]
    assert HEC_TOKEN not in json.dumps(listed)
    shown = client.get(f"{API}/sinks/splunk")
    assert shown.status_code == 200 and HEC_TOKEN not in shown.text

    # the configuration changes are events, and they carry no secret
    events = client.get(f"{API}/events", params={"action": "sink.*"}).json()["items"]
    assert [e["action"] for e in events] == ["sink.create", "sink.create"]
    assert HEC_TOKEN not in json.dumps(events)
    assert events[0]["details"]["config"]["token"] == "<redacted>"

    assert client.post(f"{API}/sinks", json=body).json()["error"]["code"] == "conflict"
    d = client.delete(f"{API}/sinks/splunk")
    assert d.status_code == 200 and d.json()["name"] == "splunk"
    assert client.get(f"{API}/sinks/splunk").json()["error"]["code"] == "not_found"
    assert client.delete(f"{API}/sinks/splunk").status_code == 404
    deleted = client.get(f"{API}/events", params={"action": "sink.delete"}).json()["items"]
    assert len(deleted) == 1 and HEC_TOKEN not in json.dumps(deleted)


BAD_INPUT = [
    ({"type": "kafka", "config": {}}, 422, "unknown_sink_type"),
    ({"type": "splunk-hec", "config": {"url": "splunk:8088", "token": "t"}}, 422,
     "invalid_sink_url"),
    ({"type": "ocsf-http", "config": {"url": "http://[::1"}}, 422, "invalid_sink_url"),
    ({"type": "syslog", "config": {"url": "udp://h:514", "ca_file": "/nope", "cert_file": "/n",
                                   "key_file": "/n"}}, 422, "invalid_sink_url"),
    ({"type": "syslog", "config": {"url": "tls://127.0.0.1:6514", "ca_file": "/nope/ca.pem",
                                   "cert_file": "/nope/c.pem", "key_file": "/nope/k.pem"}}, 422,
     "tls_file_missing"),
    ({"type": "splunk-hec", "config": {"url": "http://h"}}, 422, "invalid_sink_config"),
    ({"type": "ocsf-file", "config": {"path": "/tmp/x", "colour": "red"}}, 422,
     "invalid_sink_config"),
    ({"type": "ocsf-file", "config": "/tmp/x"}, 422, "validation_failed"),
    ({"type": "ocsf-file", "config": {"path": "/tmp/x"}, "start_at": "middle"}, 422,
     "validation_failed"),
]  # fmt: skip


def test_bad_sink_input_is_refused_and_leaves_nothing(lite_client):
    client = lite_client
    before = client.get(f"{API}/events", params={"limit": 500}).json()["items"]
    for extra, status, code in BAD_INPUT:
        r = client.post(f"{API}/sinks", json={"name": "bad", **extra})
        assert r.status_code == status, (extra, r.text)
        assert r.json()["error"]["code"] == code, (extra, r.text)
        assert "/nope/k.pem" not in r.text  # a key's path is never echoed
    assert client.get(f"{API}/sinks").json()["items"] == []
    after = client.get(f"{API}/events", params={"limit": 500}).json()["items"]
    assert after == before


def test_bad_sink_name_and_unknown_sink(lite_client):
    client = lite_client
    r = client.post(f"{API}/sinks", json={"name": "Bad Name", "type": "ocsf-file",
                                         "config": {"path": "/tmp/x"}})  # fmt: skip
    assert r.status_code == 422
    assert client.post(f"{API}/sinks/nope/test").json()["error"]["code"] == "not_found"
    r = client.post(f"{API}/sinks/flush", params={"name": "nope"})
    assert r.status_code == 404


def test_test_message_reports_an_unreachable_receiver(lite_client, hec_server):
    client = lite_client
    body = {"name": "splunk", "type": "splunk-hec",
            "config": {"url": hec_server.url, "token": HEC_TOKEN}}  # fmt: skip
    assert client.post(f"{API}/sinks", json=body).status_code == 201
    ok = client.post(f"{API}/sinks/splunk/test")
    assert ok.status_code == 200, ok.text
    assert hec_server.accepted[-1]["event"]["action"] == "sink.test"
    assert hec_server.accepted[-1]["event"]["seq"] == 0
    assert ok.json()["cursor"] == 0  # a test does not move the cursor
    hec_server.fail_next = 1
    down = client.post(f"{API}/sinks/splunk/test")
    assert down.status_code == 502 and down.json()["error"]["code"] == "delivery_failed"


# --- delivery ----------------------------------------------------------------------------------


def test_hec_delivers_everything_in_order_with_seq_and_leaf_hash(lite, hec_server):
    store = lite
    make_events(store, 9, nasty=True)
    hec_sink(store, hec_server.url)  # + key.create (its token is the first secret sealed)
    [result] = svc.export_once(store, retry=NO_SLEEP)
    assert result.error is None and result.cursor == head(store) == 11
    assert hec_server.problems == []
    assert hec_server.requests == 3  # batches of 4: 4 + 4 + 3
    assert hec_server.seqs() == list(range(1, 12))
    by_seq = {e.seq: e for e in all_events(store)}
    for obj in hec_server.accepted:
        seq = obj["event"]["seq"]
        assert obj["event"]["leaf_hash"] == event_leaf_hash(by_seq[seq]).hex()
        assert datetime.fromisoformat(obj["event"]["ts"]) == by_seq[seq].ts
    assert svc.get_sink(store, SYSTEM, "splunk").cursor == 11
    # nothing new: a second pass sends nothing
    assert svc.export_once(store, retry=NO_SLEEP)[0].delivered == 0
    assert hec_server.requests == 3


def test_a_receiver_down_then_up_loses_nothing_and_skips_nothing(store, hec_server):
    make_events(store, 5)
    hec_sink(store, hec_server.url)

    # Down (every request refused, even after retries): the cursor stays where it is.
    hec_server.fail_next = 10**6
    [r1] = svc.export_once(store, retry=NO_SLEEP)
    assert r1.error and "503" in r1.error and r1.cursor == 0 and r1.delivered == 0
    view = svc.get_sink(store, SYSTEM, "splunk")
    assert view.cursor == 0 and view.consecutive_failures == 1 and "503" in view.last_error
    failed = [e for e in all_events(store) if e.action == "sink.delivery_failed"]
    assert len(failed) == 1 and failed[0].outcome is Outcome.FAILURE

    # Still down, more events arrive; a second failure records no second event.
    make_events(store, 3)
    svc.export_once(store, retry=NO_SLEEP)
    assert len([e for e in all_events(store) if e.action == "sink.delivery_failed"]) == 1
    assert svc.get_sink(store, SYSTEM, "splunk").consecutive_failures == 2

    # Up for one batch, then down again mid-backlog: the cursor stops after that batch.
    hec_server.fail_next = 0
    [r2] = svc.export_once(store, retry=NO_SLEEP, max_batches=1)
    assert r2.error is None and r2.delivered == 4 and r2.cursor == 4
    hec_server.fail_next = 10**6
    [r3] = svc.export_once(store, retry=NO_SLEEP)
    assert r3.error and r3.cursor == 4

    # The port closed entirely (connection refused) is a failure too.
    hec_server.stop()
    [r4] = svc.export_once(store, retry=NO_SLEEP)
    assert r4.error and r4.cursor == 4

    # Back up: catch up from the cursor, to the head, exactly once each.
    hec_server.fail_next = 0
    hec_server.start()
    [r5] = svc.export_once(store, retry=NO_SLEEP)
    assert r5.error is None
    final = head(store)
    assert r5.cursor == final
    assert hec_server.seqs() == list(range(1, final + 1)), "a gap or a duplicate"
    assert hec_server.problems == []
    # two outages (before and after the one good batch): each opened and closed by one event
    actions = [e.action for e in all_events(store) if e.action.startswith("sink.delivery")]
    assert actions == ["sink.delivery_failed", "sink.delivery_recovered"] * 2
    # the recovery event itself is delivered by the next pass
    svc.export_once(store, retry=NO_SLEEP)
    assert hec_server.seqs() == list(range(1, head(store) + 1))
    assert svc.get_sink(store, SYSTEM, "splunk").consecutive_failures == 0


def test_the_cursor_is_durable_across_processes(db_url, hec_server):
    first = Store(db_url)
    make_events(first, 6)
    hec_sink(first, hec_server.url)
    svc.export_once(first, retry=NO_SLEEP, max_batches=1)
    first.dispose()
    second = Store(db_url)  # a restarted exporter
    try:
        assert svc.get_sink(second, SYSTEM, "splunk").cursor == 4
        svc.export_once(second, retry=NO_SLEEP)
        assert hec_server.seqs() == list(range(1, head(second) + 1))
    finally:
        second.dispose()


def test_ocsf_file_sink_writes_json_lines(lite, tmp_path):
    store = lite
    store_path = tmp_path / "ocsf.jsonl"
    make_events(store, 2, nasty=True)
    with store.write(SYSTEM) as tx:
        tx.record("auth.login", "user", "bob", outcome=Outcome.DENIED, details={"reason": "mfa"})
    svc.create_sink(store, SYSTEM, "lake", "ocsf-file", {"path": str(store_path)})
    [result] = svc.export_once(store, retry=NO_SLEEP)
    assert result.error is None
    lines = [json.loads(line) for line in store_path.read_text().splitlines()]
    assert [o["metadata"]["sequence"] for o in lines] == list(range(1, 5))
    by_seq = {e.seq: e for e in all_events(store)}
    for o in lines:
        assert o["metadata"]["uid"] == event_leaf_hash(by_seq[o["metadata"]["sequence"]]).hex()
        assert o["type_uid"] == o["class_uid"] * 100 + o["activity_id"]
    login = lines[2]
    assert (login["class_uid"], login["activity_id"], login["status_id"]) == (3002, 1, 2)
    assert login["status_detail"] == "mfa"
    assert lines[3]["class_uid"] == 6003 and lines[3]["activity_id"] == 1  # sink.create


def test_ocsf_http_sink_posts_a_json_array(lite, tmp_path):
    store = lite
    got: list[Any] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *_a: Any) -> None:
            pass

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            got.append((self.path, self.headers.get("Authorization"), json.loads(body)))
            self.send_response(204)
            self.end_headers()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=lambda: server.serve_forever(poll_interval=0.05), daemon=True).start()
    try:
        make_events(store, 3)
        url = f"http://127.0.0.1:{server.server_address[1]}/ingest"
        cfg = {"url": url, "bearer_token": "s3cret", "batch_size": 2}
        svc.create_sink(store, SYSTEM, "lake", "ocsf-http", cfg)
        assert svc.export_once(store, retry=NO_SLEEP)[0].error is None
    finally:
        server.shutdown()
        server.server_close()
    # 3 events + key.create (the bearer token is the first secret sealed) + sink.create: 5
    assert [(p, a) for p, a, _ in got] == [("/ingest", "Bearer s3cret")] * 3
    assert [o["metadata"]["sequence"] for _, _, batch in got for o in batch] == [1, 2, 3, 4, 5]


def test_disabled_sinks_wait_and_a_deleted_sink_stops(lite, tmp_path):
    store = lite
    out = tmp_path / "o.jsonl"
    make_events(store, 2)
    svc.create_sink(store, SYSTEM, "off", "ocsf-file", {"path": str(out)}, enabled=False)
    assert svc.export_once(store, retry=NO_SLEEP) == []
    assert not out.exists()
    assert svc.export_once(store, names=["off"], retry=NO_SLEEP)[0].delivered == 3


def test_export_worker_backs_off_a_failing_sink_and_catches_up(lite, hec_server):
    store = lite
    make_events(store, 3)
    hec_sink(store, hec_server.url)
    now = [1000.0]
    worker = ExportWorker(store, interval_s=5, max_backoff_s=60, retry=NO_SLEEP,
                              clock=lambda: now[0])  # fmt: skip
    hec_server.fail_next = 10**6
    waits = []
    for _ in range(6):
        worker.run_once()
        waits.append(worker._next_try["splunk"] - now[0])
        now[0] = worker._next_try["splunk"]
    assert waits == [5, 10, 20, 40, 60, 60]
    requests = hec_server.requests
    now[0] -= 1  # not due yet: no pass, no request
    assert worker.run_once() == [] and hec_server.requests == requests
    hec_server.fail_next = 0
    now[0] += 1
    [r] = worker.run_once()
    assert r.error is None
    assert hec_server.seqs() == list(range(1, r.cursor + 1))


def test_export_worker_thread_starts_and_stops(lite, hec_server):
    store = lite
    make_events(store, 2)
    hec_sink(store, hec_server.url)
    with export_worker(store, 0.05) as worker:
        assert worker is not None and worker.running
        deadline = datetime.now().timestamp() + 5
        while len(hec_server.seqs()) < 3 and datetime.now().timestamp() < deadline:
            threading.Event().wait(0.02)
    assert not worker.running
    assert hec_server.seqs()[:3] == [1, 2, 3]
    with export_worker(store, None) as none:
        assert none is None


def test_cli_flush_on_the_database(tmp_path, hec_server):
    url = f"sqlite:///{tmp_path / 'pp.db'}"
    runner = CliRunner()
    from proofplane.store import migrate

    store = Store(url)
    migrate.upgrade(store.engine)
    make_events(store, 3)
    hec_sink(store, hec_server.url)
    store.dispose()
    done = runner.invoke(cli, ["sinks", "flush", "--db", url, "--json"])
    assert done.exit_code == 0, done.output
    assert json.loads(done.output)["results"][0]["delivered"] == 5  # + key.create
    hec_server.fail_next = 10**6
    store = Store(url)
    make_events(store, 1)
    store.dispose()
    failed = runner.invoke(cli, ["sinks", "flush", "--db", url, "--attempts", "1"])
    assert failed.exit_code == 1 and "FAILED" in failed.output
