"""The CLI and the node agent back off from an overloaded server (issue 20, §4).

A 429 or 503 with ``Retry-After`` is waited out (at least that long, with jitter, longer each
try, at most 30 s in all) and the request sent again when it may be: a read, or any request the
server refused before running it (``too_many_requests``: an agent's nonce and evidence too).
After that, one line saying the server is overloaded and a non-zero exit.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from proofplane.cli import client as client_mod
from proofplane.cli.agent import attest_once
from proofplane.cli.client import (
    RETRY_BUDGET_S,
    ApiClient,
    ApiError,
    backoff_s,
    may_retry,
    retry_after_s,
)
from proofplane.cli.main import app

runner = CliRunner()
OVERLOADED = {
    "error": {
        "code": "too_many_requests",
        "message": "the server is at its limit of 32 read requests in flight; retry after 1 s",
        "details": {"level": "read", "reason": "level_full", "limit": 32, "retry_after_s": 1},
    }
}


def overloaded(status: int = 429, retry_after: str | None = "1", body: Any = OVERLOADED):
    headers = {} if retry_after is None else {"Retry-After": retry_after}
    return httpx.Response(status, json=body, headers=headers)


class Script:
    """A fake server: answers each request with the next of ``answers`` (the last repeats)."""

    def __init__(self, *answers: Callable[[], httpx.Response] | httpx.Response) -> None:
        self.answers = list(answers)
        self.seen: list[tuple[str, str, bytes]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.seen.append((request.method, request.url.path, request.content))
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        return answer() if callable(answer) else answer


@pytest.fixture
def sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    waited: list[float] = []
    monkeypatch.setattr(ApiClient, "sleep", staticmethod(waited.append))
    return waited


def api(script: Script) -> ApiClient:
    return ApiClient("http://cp.test", token="ppt_x", transport=httpx.MockTransport(script))


def test_a_read_is_retried_after_retry_after(sleeps: list[float]) -> None:
    script = Script(overloaded(), overloaded(503, "2"), httpx.Response(200, json={"ok": 1}))
    assert api(script).get("/api/v1/nodes") == {"ok": 1}
    assert len(script.seen) == 3
    assert 1 <= sleeps[0] <= 1.5 and 4 <= sleeps[1] <= 6  # Retry-After, doubled, + jitter


def test_a_refused_write_is_retried_but_no_other_error(sleeps: list[float]) -> None:
    script = Script(overloaded(), httpx.Response(201, json={"name": "w1"}))
    assert api(script).post("/api/v1/workloads", {"name": "w1"}) == {"name": "w1"}
    assert [m for m, *_ in script.seen] == ["POST", "POST"] and len(sleeps) == 1
    assert script.seen[0][2] == script.seen[1][2]  # the same body again
    # a 429 that is not the server's overload refusal (the login throttle): the request may
    # have counted; a 503 to a write: it may have run; a 503 without Retry-After: not retried
    throttle = {"error": {"code": "too_many_attempts", "message": "wait", "details": None}}
    for answer, method in (
        (overloaded(429, "60", throttle), "POST"),
        (overloaded(503, "1", {"error": {"code": "backend_unavailable", "message": "x"}}), "POST"),
        (overloaded(503, None), "GET"),
        (overloaded(429, None), "GET"),
    ):
        once = Script(answer)
        with pytest.raises(ApiError):
            api(once).request(method, "/api/v1/login")
        assert len(once.seen) == 1, answer
    assert len(sleeps) == 1


def test_persistent_overload_gives_up_within_the_budget_with_one_line(
    sleeps: list[float],
) -> None:
    script = Script(overloaded())
    with pytest.raises(ApiError) as err:
        api(script).get("/api/v1/nodes")
    e = err.value
    assert e.status == 429 and e.code == "too_many_requests" and e.exit_code == 1
    assert 2 <= len(script.seen) <= client_mod.RETRY_TRIES
    assert sum(sleeps) <= RETRY_BUDGET_S and all(s >= 1 for s in sleeps)
    assert "the server is overloaded: gave up after" in e.message and e.lines == []
    assert "\n" not in e.message


def test_a_retry_after_longer_than_the_budget_is_not_waited(sleeps: list[float]) -> None:
    script = Script(overloaded(429, "120"))
    with pytest.raises(ApiError) as err:
        api(script).get("/api/v1/nodes")
    assert len(script.seen) == 1 and sleeps == []
    assert "gave up after 1 tries over 0 s" in err.value.message


def test_retry_after_forms_and_the_backoff() -> None:
    def resp(value: str) -> httpx.Response:
        return httpx.Response(429, headers={"Retry-After": value})

    assert retry_after_s(resp("3")) == 3.0
    assert retry_after_s(resp("-3")) == 0.0
    assert retry_after_s(resp("soon")) is None
    assert retry_after_s(httpx.Response(429)) is None
    later = datetime(2030, 1, 1, tzinfo=UTC)
    now = (later - timedelta(seconds=5)).timestamp()
    assert retry_after_s(resp(format_datetime(later, usegmt=True)), now) == pytest.approx(5)
    assert backoff_s(resp("1"), 1, lambda: 0.0) == 1.0
    assert backoff_s(resp("1"), 1, lambda: 1.0) == 1.5
    assert backoff_s(resp("1"), 3, lambda: 0.0) == 4.0
    assert backoff_s(httpx.Response(503), 1, lambda: 0.0) == client_mod.RETRY_BASE_S
    assert may_retry("GET", resp("1")) and may_retry("HEAD", resp("1"))
    assert not may_retry("POST", resp("1"))  # no body saying it never ran
    assert not may_retry("GET", httpx.Response(500, headers={"Retry-After": "1"}))


class FakeTpm:
    def quote(self, nonce: bytes, bank: str, pcrs: list[int], ak: str):
        return b"quote:" + nonce, b"sig", {bank: {i: b"\0" * 32 for i in pcrs}}


def test_an_agent_round_rides_out_an_overloaded_server(sleeps: list[float]) -> None:
    nonce = {"nonce": "ab" * 16, "pcr_bank": "sha256", "pcrs": [0, 7]}
    verdict = {"verdict": {"ok": True, "reasons": []}, "state": "admitted"}
    script = Script(
        overloaded(), httpx.Response(201, json=nonce),  # the nonce: refused, then issued
        overloaded(), overloaded(), httpx.Response(200, json=verdict),  # the evidence
    )  # fmt: skip
    assert attest_once(api(script), "gpu-a", FakeTpm()) == verdict  # type: ignore[arg-type]
    paths = [p.rsplit("/", 1)[-1] for _, p, _ in script.seen]
    assert paths == ["nonce", "nonce", "evidence", "evidence", "evidence"]
    sent = {json.loads(body)["nonce"] for _, p, body in script.seen if p.endswith("evidence")}
    assert sent == {nonce["nonce"]}  # the refused evidence never used its nonce
    assert len(sleeps) == 3


# -- the commands, against a real HTTP server ----------------------------------------------------


@pytest.fixture
def fake_server() -> Iterator[tuple[str, list[tuple[int, dict[str, Any]]]]]:
    """An HTTP server answering every request with the next scripted (status, body) (the last
    repeats); a 429 carries ``Retry-After: 1``."""
    script: list[tuple[int, dict[str, Any]]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self._answer()

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self._answer()

        def _answer(self) -> None:
            status, body = script.pop(0) if len(script) > 1 else script[0]
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if status == 429:
                self.send_header("Retry-After", "1")
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *_a: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", script
    finally:
        server.shutdown()
        server.server_close()


def test_a_command_retries_and_succeeds(fake_server: Any, sleeps: list[float]) -> None:
    url, script = fake_server
    script += [(429, OVERLOADED), (200, {"name": "gpu-a", "state": "admitted"})]
    result = runner.invoke(app, ["--server", url, "--token", "ppt_x", "nodes", "show", "gpu-a",
                                 "--json"])  # fmt: skip
    assert result.exit_code == 0, (result.output, result.exception)
    assert json.loads(result.stdout)["name"] == "gpu-a" and len(sleeps) == 1


def test_a_command_against_a_persistently_overloaded_server_fails_in_one_line(
    fake_server: Any, sleeps: list[float]
) -> None:
    url, script = fake_server
    script.append((429, OVERLOADED))
    result = runner.invoke(app, ["--server", url, "--token", "ppt_x", "nodes", "show", "gpu-a"])
    assert result.exit_code == 1, (result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "too_many_requests" in lines[0], lines
    assert "the server is overloaded: gave up after" in lines[0]
    assert "Traceback" not in result.output and sum(sleeps) <= RETRY_BUDGET_S


def test_the_agent_once_against_an_overloaded_server_exits_non_zero(
    fake_server: Any, sleeps: list[float], tmp_path: Path
) -> None:
    url, script = fake_server
    script.append((429, OVERLOADED))  # the nonce, refused every time
    (tmp_path / "boot.bin").write_bytes(b"")
    (tmp_path / "inv.json").write_text("{}")
    args = ["agent", "--server", url, "--token", "ppa_x", "--node", "gpu-a",
            "--tcti", "device:/dev/null", "--eventlog", str(tmp_path / "boot.bin"),
            "--inventory", str(tmp_path / "inv.json"), "--once"]  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 1, (result.output, result.exception)
    assert "the server is overloaded: gave up after" in result.stderr
    assert "Traceback" not in result.output and len(sleeps) >= 1
