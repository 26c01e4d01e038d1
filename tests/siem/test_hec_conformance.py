"""Splunk HEC conformance (issue 21, part 9): a HEC-shaped receiver on 127.0.0.1 that checks the
token, refuses a request without a channel (code 10) when indexer acknowledgement is on, issues
ackIds, and answers ``/services/collector/ack`` false for a while, then true (or never; or with
code 14 when acknowledgement is off), driven through the product path: a sink created by the
service, exported by ``export_once``. A batch counts as delivered (the cursor moves) only once
its ackId is true; an unacknowledged batch leaves the cursor, records the failure, and goes
again later. Errors carry the HEC code and our text for it, never the receiver's words."""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest
from fastapi.testclient import TestClient

from proofplane.access import SYSTEM
from proofplane.api.app import create_app
from proofplane.audit.export import hec
from proofplane.audit.export.config import SinkPolicy
from proofplane.model import Event, Outcome
from proofplane.service import sinks as svc
from proofplane.service.access import bootstrap_admin
from proofplane.service.context import Store
from proofplane.service.events import event_from_row
from proofplane.siem import transport
from proofplane.siem.transport import DeliveryError, HecTransport
from proofplane.store import migrate
from proofplane.store.tables import EventRow

API = "/api/v1"
ADMIN_TOKEN = "ppt_hec-conformance-admin-token-0123456789"
TOKEN = "aaaaaaaa-bbbb-4ccc-8ddd-eeeeeeeeeeee"
SECRET_TEXT = "receiver-said-something-private-7f3a"  # the receiver's words: never echoed
NO_SLEEP = svc.RetryPolicy(attempts=2, base_delay_s=0.01, sleep=lambda _s: None)


# --- a Splunk HEC-shaped receiver with indexer acknowledgement ----------------------------------


class AckHec:
    """Checks each request the way Splunk HEC does. ``ack``: the token has indexer
    acknowledgement on (event requests need a channel, answers carry an ackId);
    ``ack_endpoint``: /services/collector/ack answers (else code 14, ACK is disabled).
    ``false_polls``: how many polls of an ackId answer false before true; ``never``: always
    false. ``indexed`` holds the events of acknowledged batches, ``on_ack`` runs (receiver's
    thread) just before an ackId is first answered true."""

    def __init__(self, *, ack: bool = True, false_polls: int = 2) -> None:
        self.ack = ack
        self.ack_endpoint: bool | None = None  # None: as ``ack``
        self.false_polls = false_polls
        self.never = False
        self.busy_polls = 0  # the next polls answer 503, code 9
        self.received: list[dict[str, Any]] = []
        self.indexed: list[dict[str, Any]] = []
        self.pending: dict[tuple[str, int], tuple[list[dict[str, Any]], int]] = {}
        self.log: list[tuple[str, str | None]] = []  # (path with query, channel header)
        self.problems: list[str] = []
        self.on_ack: Callable[[list[dict[str, Any]]], None] | None = None
        self.next_ack = 0
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

            def _error(self, status: int, code: int) -> None:
                self._answer(status, {"text": f"{hec.CODES[code]} {SECRET_TEXT}", "code": code})

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                channel = self.headers.get(hec.CHANNEL_HEADER)
                with outer.lock:
                    outer.log.append((self.path, channel))
                path = urlsplit(self.path).path
                if self.headers.get("Authorization") != f"Splunk {TOKEN}":
                    return self._error(401, 2)
                if path == "/services/collector/event":
                    return self._event(body, channel)
                if path == "/services/collector/ack":
                    query = parse_qs(urlsplit(self.path).query).get("channel", [None])[0]
                    return self._ack(body, query or channel, channel)
                with outer.lock:
                    outer.problems.append(f"path {self.path}")
                return self._answer(404, {"text": SECRET_TEXT, "code": 404})

            def _event(self, body: bytes, channel: str | None) -> None:
                try:
                    events = hec.split_batch(body)
                except ValueError:
                    return self._error(400, 6)
                if not events or any(not isinstance(e, dict) or "event" not in e for e in events):
                    return self._error(400, 12)
                for e in events:  # indexed fields: strings or arrays of strings only
                    for v in e.get("fields", {}).values():
                        if not isinstance(v, str):
                            with outer.lock:
                                outer.problems.append(f"field value {v!r}")
                            return self._error(400, 15)
                if not outer.ack:
                    with outer.lock:
                        outer.received.extend(events)
                        outer.indexed.extend(events)
                    return self._answer(200, {"text": "Success", "code": 0})
                if channel is None:
                    return self._error(400, 10)
                try:
                    uuid.UUID(channel)
                except ValueError:
                    return self._error(400, 11)
                with outer.lock:
                    outer.received.extend(events)
                    ack_id = outer.next_ack
                    outer.next_ack += 1
                    outer.pending[(channel, ack_id)] = (events, 0)
                return self._answer(200, {"text": "Success", "code": 0, "ackId": ack_id})

            def _ack(self, body: bytes, channel: str | None, header: str | None) -> None:
                enabled = outer.ack if outer.ack_endpoint is None else outer.ack_endpoint
                if not enabled:
                    return self._error(400, 14)
                if channel is None:
                    return self._error(400, 10)
                if header is not None and header != channel:
                    with outer.lock:
                        outer.problems.append("channel header and query differ")
                with outer.lock:
                    if outer.busy_polls > 0:
                        outer.busy_polls -= 1
                        busy = True
                    else:
                        busy = False
                if busy:
                    return self._error(503, 9)
                try:
                    ids = json.loads(body)["acks"]
                except (ValueError, KeyError, TypeError):
                    return self._error(400, 6)
                answer: dict[str, bool] = {}
                for n in ids:
                    with outer.lock:
                        entry = outer.pending.get((channel, n))
                        if entry is None:
                            answer[str(n)] = False
                            continue
                        events, polls = entry
                        done = not outer.never and polls >= outer.false_polls
                        if not done:
                            outer.pending[(channel, n)] = (events, polls + 1)
                            answer[str(n)] = False
                            continue
                        del outer.pending[(channel, n)]
                        hook = outer.on_ack
                    if hook is not None:
                        hook(events)
                    with outer.lock:
                        outer.indexed.extend(events)
                    answer[str(n)] = True
                return self._answer(200, {"acks": answer})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(
            target=lambda: self.server.serve_forever(poll_interval=0.05), daemon=True
        ).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def seqs(self) -> list[int]:
        return [e["event"]["seq"] for e in self.indexed]

    def polls(self) -> list[tuple[str, str | None]]:
        return [entry for entry in self.log if entry[0].startswith("/services/collector/ack")]


@pytest.fixture(autouse=True)
def _quick_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    """Poll from 20 ms instead of 200 ms (the growth and the cap are checked with a clock)."""
    monkeypatch.setattr(transport, "ACK_POLL_FIRST_S", 0.02)


@pytest.fixture
def receiver() -> Iterator[AckHec]:
    r = AckHec()
    yield r
    r.stop()


@pytest.fixture
def lite(tmp_path: Path) -> Iterator[Store]:
    s = Store(f"sqlite:///{tmp_path / 'hec.db'}")
    migrate.upgrade(s.engine)
    yield s
    s.dispose()


@pytest.fixture
def api(lite: Store) -> Iterator[TestClient]:
    bootstrap_admin(lite, ADMIN_TOKEN)
    with TestClient(
        create_app(lite),
        raise_server_exceptions=False,
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
    ) as c:
        yield c


def make_events(store: Store, n: int) -> None:
    with store.write(SYSTEM) as tx:
        for i in range(n):
            tx.record("node.update", "node", f"n{i}", details={"i": i, "note": "ünï 🙂"})


def all_events(store: Store) -> list[Event]:
    with store.read() as session:
        return [event_from_row(r) for r in session.query(EventRow).order_by(EventRow.seq)]


def head(store: Store) -> int:
    return all_events(store)[-1].seq


def sink(store: Store, url: str, **cfg: Any) -> svc.SinkView:
    config = {"url": url, "token": TOKEN, "batch_size": 4, "ack_timeout_s": 2, **cfg}
    return svc.create_sink(store, SYSTEM, "splunk", "splunk-hec", config)


def cursor(store: Store) -> int:
    return svc.get_sink(store, SYSTEM, "splunk").cursor


# --- acknowledged delivery ---------------------------------------------------------------------


def test_the_cursor_moves_only_once_each_ack_is_true(lite: Store, receiver: AckHec):
    make_events(lite, 9)
    sink(lite, receiver.url, ack=True)
    target = head(lite)
    seen: list[tuple[int, int]] = []  # (first seq of the batch, the cursor when it was acked)

    def on_ack(events: list[dict[str, Any]]) -> None:
        seen.append((events[0]["event"]["seq"], cursor(lite)))

    receiver.on_ack = on_ack
    [result] = svc.export_once(lite, retry=NO_SLEEP)
    assert result.error is None and result.cursor == cursor(lite) == target
    assert receiver.problems == []
    # every batch was still ahead of the cursor when its ack came true
    assert seen and all(c == first - 1 for first, c in seen), seen
    assert receiver.seqs() == list(range(1, target + 1))
    # two false answers, then true, for each batch: three polls each
    batches = len(seen)
    assert len(receiver.polls()) == 3 * batches
    # one channel, the derived one, on every request; the polls name it in the query too
    channel = hec.derived_channel(f"{receiver.url}{hec.EVENT_PATH}", TOKEN)
    assert {ch for _, ch in receiver.log} == {channel}
    assert {p for p, _ in receiver.polls()} == {f"/services/collector/ack?channel={channel}"}


def test_a_configured_channel_is_the_one_used(lite: Store, receiver: AckHec):
    make_events(lite, 2)
    chosen = "0F3E2D1C-AAAA-4BBB-8CCC-0123456789AB"
    view = sink(lite, receiver.url, ack=True, channel=chosen)
    assert view.config["channel"] == chosen.lower()
    assert svc.export_once(lite, retry=NO_SLEEP)[0].error is None
    assert {ch for _, ch in receiver.log} == {chosen.lower()}


def test_an_ack_that_never_comes_leaves_the_cursor_and_the_batch_goes_again(
    lite: Store, receiver: AckHec
):
    make_events(lite, 3)
    sink(lite, receiver.url, ack=True, ack_timeout_s=0.2)
    receiver.never = True
    [r1] = svc.export_once(lite, retry=NO_SLEEP)
    assert r1.error and "not confirmed indexed within 0.2 s" in r1.error
    assert r1.cursor == 0 and r1.delivered == 0 and cursor(lite) == 0
    view = svc.get_sink(lite, SYSTEM, "splunk")
    assert view.consecutive_failures == 1 and "ackId" in (view.last_error or "")
    failed = [e for e in all_events(lite) if e.action == "sink.delivery_failed"]
    assert len(failed) == 1 and failed[0].outcome is Outcome.FAILURE
    assert failed[0].details["cursor"] == 0 and "not confirmed" in failed[0].details["error"]
    assert receiver.indexed == [] and len(receiver.received) >= 4  # sent, twice (2 attempts)

    # the indexer catches up: the next pass sends the batch again and it counts
    receiver.never = False
    receiver.false_polls = 1
    [r2] = svc.export_once(lite, retry=NO_SLEEP)
    assert r2.error is None and r2.cursor == cursor(lite) >= 5  # the failure event too
    assert receiver.seqs() == list(range(1, r2.cursor + 1))
    actions = [e.action for e in all_events(lite) if e.action.startswith("sink.delivery")]
    assert actions == ["sink.delivery_failed", "sink.delivery_recovered"]
    # what the receiver got but never acknowledged is there twice: seq and leaf_hash tell
    received = [e["event"]["seq"] for e in receiver.received]
    assert received.count(1) >= 2 and len(set(received)) == r2.cursor
    assert receiver.problems == []


def test_a_busy_ack_endpoint_is_asked_again(lite: Store, receiver: AckHec):
    make_events(lite, 1)
    sink(lite, receiver.url, ack=True, batch_size=10)
    receiver.false_polls = 0
    receiver.busy_polls = 2
    [r] = svc.export_once(lite, retry=NO_SLEEP)
    assert r.error is None and r.cursor == head(lite)
    assert len(receiver.polls()) == 3 and len(receiver.received) == r.cursor  # not resent


# --- refusals: the HEC code and what to do, never the receiver's text ---------------------------


def test_without_ack_a_channel_demanding_token_says_to_set_ack(lite: Store, receiver: AckHec):
    make_events(lite, 2)
    sink(lite, receiver.url)  # ack false, the token wants acknowledgement
    [r] = svc.export_once(lite, retry=NO_SLEEP)
    assert r.error and r.cursor == 0
    assert "HTTP 400 Bad Request" in r.error
    assert "HEC code 10 (Data channel is missing)" in r.error
    assert '"ack": true' in r.error
    assert SECRET_TEXT not in r.error
    failed = [e for e in all_events(lite) if e.action == "sink.delivery_failed"]
    assert len(failed) == 1 and SECRET_TEXT not in json.dumps(failed[0].details)
    assert {ch for _, ch in receiver.log} == {None}  # no channel header without ack


def test_ack_against_a_token_without_acknowledgement(lite: Store):
    off = AckHec(ack=False)
    try:
        make_events(lite, 2)
        sink(lite, off.url, ack=True)
        [r] = svc.export_once(lite, retry=NO_SLEEP)
        assert r.error and r.cursor == 0
        assert "no ackId" in r.error and '"ack": false' in r.error
        # and its ack endpoint, asked anyway, answers code 14
        t = HecTransport(f"{off.url}{hec.EVENT_PATH}", token=TOKEN, ack=True, policy=_policy())
        assert t.ack_url is not None
        answer = httpx.post(
            t.ack_url, content=hec.ack_body([0]), headers=t.headers, trust_env=False
        )
        assert hec.answer_code(answer.content) == hec.ACK_DISABLED
    finally:
        off.stop()


def test_ack_disabled_on_the_ack_endpoint_is_code_14(lite: Store, receiver: AckHec):
    make_events(lite, 1)
    sink(lite, receiver.url, ack=True)
    receiver.ack_endpoint = False
    [r] = svc.export_once(lite, retry=NO_SLEEP)
    assert r.error and r.cursor == 0
    assert "/services/collector/ack" in r.error
    assert "HEC code 14 (ACK is disabled)" in r.error and '"ack": false' in r.error
    assert SECRET_TEXT not in r.error
    # not polled again and again: a 4xx answer ends the wait at once (one poll per attempt)
    assert len(receiver.polls()) == 2


def test_a_wrong_token_and_a_busy_server_name_their_codes(lite: Store, receiver: AckHec):
    make_events(lite, 1)
    svc.create_sink(
        lite, SYSTEM, "splunk", "splunk-hec", {"url": receiver.url, "token": "wrong", "ack": True}
    )
    [r] = svc.export_once(lite, retry=NO_SLEEP)
    assert r.error and "HTTP 401 Unauthorized, HEC code 2 (Token is required)" in r.error
    assert "wrong" not in r.error and SECRET_TEXT not in r.error

    def busy(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, json={"text": SECRET_TEXT, "code": 9})

    t = HecTransport(
        "https://splunk.example:8088/services/collector/event",
        token=TOKEN,
        client=httpx.Client(transport=httpx.MockTransport(busy)),
    )
    with pytest.raises(DeliveryError) as info:
        t.send([b'{"event":1}'])
    assert str(info.value).endswith("HTTP 503 Service Unavailable, HEC code 9 (Server is busy)")


def test_the_test_message_waits_for_its_ack(api: TestClient, receiver: AckHec):
    body = {
        "name": "splunk",
        "type": "splunk-hec",
        "config": {"url": receiver.url, "token": TOKEN, "ack": True, "ack_timeout_s": 2},
    }
    assert api.post(f"{API}/sinks", json=body).status_code == 201
    ok = api.post(f"{API}/sinks/splunk/test")
    assert ok.status_code == 200, ok.text
    assert receiver.indexed[-1]["event"]["action"] == "sink.test"
    receiver.never = True
    body["config"]["ack_timeout_s"] = 0.1
    api.delete(f"{API}/sinks/splunk")
    assert api.post(f"{API}/sinks", json=body).status_code == 201
    down = api.post(f"{API}/sinks/splunk/test")
    assert down.status_code >= 400 and "not confirmed indexed" in down.text
    assert SECRET_TEXT not in down.text


# --- the poll's schedule, on a clock -----------------------------------------------------------


def test_polls_start_at_200_ms_double_up_to_5_s_and_stop_at_the_deadline(
    monkeypatch: pytest.MonkeyPatch,
):
    monkeypatch.setattr(transport, "ACK_POLL_FIRST_S", 0.2)
    now = [0.0]
    waits: list[float] = []
    polls: list[httpx.Request] = []

    def sleep(s: float) -> None:
        waits.append(round(s, 6))
        now[0] += s

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/event"):
            return httpx.Response(200, json={"text": "Success", "code": 0, "ackId": 41})
        polls.append(request)
        return httpx.Response(200, json={"acks": {"41": False}})

    t = HecTransport(
        "https://splunk.example:8088/services/collector/event",
        token=TOKEN,
        ack=True,
        ack_timeout_s=12,
        client=httpx.Client(transport=httpx.MockTransport(answer)),
        sleep=sleep,
        clock=lambda: now[0],
    )
    with pytest.raises(DeliveryError) as info:
        t.send([b'{"event":1}'])
    assert waits == [0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 0.8]  # the last one up to the deadline
    assert now[0] == pytest.approx(12.0)
    assert len(polls) == len(waits)
    assert "ackId 41 not confirmed indexed within 12 s" in str(info.value)
    first = polls[0]
    assert first.url.path == "/services/collector/ack"
    assert first.url.params["channel"] == t.channel == first.headers[hec.CHANNEL_HEADER]
    assert json.loads(first.content) == {"acks": [41]}
    assert first.headers["Authorization"] == f"Splunk {TOKEN}"


def test_an_ack_poll_is_pinned_and_guarded_like_the_post(
    receiver: AckHec, monkeypatch: pytest.MonkeyPatch
):
    """The poll goes through the same destination guard as the POST: the host resolved and
    checked at each request, the connection made to the checked address."""
    checked: list[tuple[str, int]] = []
    real = transport.guard.connect_addresses

    def spy(host: str, port: int, policy: SinkPolicy) -> Any:
        checked.append((host, port))
        return real(host, port, policy)

    monkeypatch.setattr(transport.guard, "connect_addresses", spy)
    receiver.false_polls = 1
    t = HecTransport(f"{receiver.url}{hec.EVENT_PATH}", token=TOKEN, ack=True, policy=_policy())
    t.send([b'{"event":1}'])
    assert checked == [("127.0.0.1", receiver.port)] * 3  # the POST and two polls
    # under the strict policy, loopback is refused: nothing is sent, nothing polled
    strict = HecTransport(f"{receiver.url}{hec.EVENT_PATH}", token=TOKEN, ack=True)
    before = len(receiver.log)
    with pytest.raises(DeliveryError) as info:
        strict.send([b'{"event":1}'])
    assert "loopback" in str(info.value) and len(receiver.log) == before


# --- bad configuration: 422 invalid_sink_config, nothing stored ---------------------------------

BAD_CONFIG = [
    {"ack": "yes"},
    {"ack": 1},
    {"ack": None, "channel": "not-a-uuid"},
    {"ack": True, "channel": "0f3e2d1c-aaaa-4bbb-8ccc"},
    {"channel": 42},
    {"ack_timeout_s": 0},
    {"ack_timeout_s": -3},
    {"ack_timeout_s": 601},
    {"ack_timeout_s": True},
    {"ack_timeout_s": "30"},
    {"ack": True, "url": "http://127.0.0.1:8088/splunk/hec"},
]


def test_bad_ack_configuration_is_refused_and_leaves_nothing(api: TestClient, receiver: AckHec):
    before = api.get(f"{API}/events", params={"limit": 500}).json()["items"]
    for extra in BAD_CONFIG:
        cfg = {"url": receiver.url, "token": TOKEN, **extra}
        r = api.post(f"{API}/sinks", json={"name": "bad", "type": "splunk-hec", "config": cfg})
        assert r.status_code == 422, (extra, r.text)
        assert r.json()["error"]["code"] == "invalid_sink_config", (extra, r.text)
        assert TOKEN not in r.text
    assert api.get(f"{API}/sinks").json()["items"] == []
    assert api.get(f"{API}/events", params={"limit": 500}).json()["items"] == before
    assert receiver.log == []


def _policy() -> SinkPolicy:
    return SinkPolicy(allow_insecure=True, allow_hosts=("127.0.0.1",))
