"""A real Prometheus and a real Alertmanager (Debian ``prometheus``,
``prometheus-alertmanager``) on loopback for the tests of /metrics and of alert delivery, and a
``proofplane serve`` process to scrape.

Both are started by the test under its own temporary directory and stopped at the end; nothing
listens beyond 127.0.0.1 (Alertmanager's cluster gossip is off). Missing programs: skipped
locally, a failure in CI (``ci.unavailable``). Prometheus answers ``/-/ready`` in a fraction of
a second, but the first scraped sample is queryable only after 5–6 s: :func:`query_until`
polls.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

from ci import unavailable
from live_server import free_port


def need(program: str) -> str:
    path = shutil.which(program)
    if path is None:
        unavailable(f"{program} is not installed (Debian: prometheus, prometheus-alertmanager)")
    return path


def _wait_ready(base: str, proc: subprocess.Popen[bytes], log: Path, what: str) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(f"{base}/-/ready", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(
                f"{what} did not start:\n{log.read_text(errors='replace')[-3000:]}"
            )
        time.sleep(0.1)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def prometheus(tmp: Path, target: str, token_file: Path, *, interval: str = "1s") -> Iterator[str]:
    """Prometheus scraping ``target`` (host:port) at /metrics with the bearer token in
    ``token_file``, every ``interval``; yields its base URL. The configuration is checked with
    ``promtool check config`` first."""
    binary = need("prometheus")
    promtool = need("promtool")
    home = tmp / f"prometheus-{free_port()}"
    home.mkdir()
    config = home / "prometheus.yml"
    config.write_text(
        json.dumps(
            {
                "global": {"scrape_interval": interval, "evaluation_interval": interval},
                "scrape_configs": [
                    {
                        "job_name": "proofplane",
                        "metrics_path": "/metrics",
                        "authorization": {"type": "Bearer", "credentials_file": str(token_file)},
                        "static_configs": [{"targets": [target]}],
                    }
                ],
            }
        )
    )
    check = subprocess.run([promtool, "check", "config", str(config)], capture_output=True)
    assert check.returncode == 0, check.stdout.decode() + check.stderr.decode()
    port = free_port()
    log = home / "prometheus.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--web.listen-address=127.0.0.1:{port}",
                f"--storage.tsdb.path={home / 'data'}",
                "--log.level=warn",
            ],
            stdout=out,
            stderr=out,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(base, proc, log, "prometheus")
        yield base
    finally:
        _stop(proc)


def query(base: str, promql: str) -> list[dict[str, Any]]:
    """The instant vector a PromQL query answers now, through Prometheus's HTTP API."""
    r = httpx.get(f"{base}/api/v1/query", params={"query": promql}, timeout=5)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", r.text
    return list(body["data"]["result"])


def query_until(
    base: str, promql: str, ok: Callable[[list[dict[str, Any]]], bool], timeout: float = 30.0
) -> list[dict[str, Any]]:
    """Poll ``promql`` until ``ok`` accepts its answer; the last answer otherwise (the caller
    asserts on it, so a failure shows what Prometheus said)."""
    deadline = time.monotonic() + timeout
    while True:
        found = query(base, promql)
        if ok(found) or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


def value(result: list[dict[str, Any]]) -> float | None:
    """The one sample's value of an instant vector (None when it is empty)."""
    if not result:
        return None
    assert len(result) == 1, result
    return float(result[0]["value"][1])


@contextmanager
def alertmanager(tmp: Path, webhook: str | None = None) -> Iterator[str]:
    """Alertmanager on loopback, gossip off, one receiver (a webhook when given, else none),
    grouping by alert name with no wait; yields its base URL. Checked with ``amtool
    check-config`` first."""
    binary = need("prometheus-alertmanager")
    amtool = need("amtool")
    home = tmp / f"alertmanager-{free_port()}"
    home.mkdir()
    receiver: dict[str, Any] = {"name": "default"}
    if webhook is not None:
        receiver["webhook_configs"] = [{"url": webhook, "send_resolved": True}]
    config = home / "alertmanager.yml"
    config.write_text(
        json.dumps(
            {
                "route": {
                    "receiver": "default",
                    "group_by": ["alertname"],
                    "group_wait": "0s",
                    "group_interval": "1s",
                    "repeat_interval": "1h",
                },
                "receivers": [receiver],
            }
        )
    )
    check = subprocess.run([amtool, "check-config", str(config)], capture_output=True)
    assert check.returncode == 0, check.stdout.decode() + check.stderr.decode()
    port = free_port()
    log = home / "alertmanager.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--web.listen-address=127.0.0.1:{port}",
                f"--storage.path={home / 'data'}",
                "--cluster.listen-address=",
                "--log.level=warn",
            ],
            stdout=out,
            stderr=out,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(base, proc, log, "alertmanager")
        yield base
    finally:
        _stop(proc)


def am_alerts(base: str, **filters: str) -> list[dict[str, Any]]:
    """Alertmanager's alerts (``GET /api/v2/alerts``), active, silenced and inhibited ones."""
    params: dict[str, Any] = {"active": "true", "silenced": "true", "inhibited": "true"}
    if filters:
        params["filter"] = [f'{k}="{v}"' for k, v in filters.items()]
    r = httpx.get(f"{base}/api/v2/alerts", params=params, timeout=5)
    assert r.status_code == 200, r.text
    return list(r.json())


class Serve:
    """``proofplane serve`` on a free loopback port, as its own process (``--workers``
    included), with the environment ``env`` adds to a clean one; stopped by :meth:`stop`."""

    def __init__(self, db: str, tmp: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = tmp / f"serve-{self.port}.log"
        clean = {k: v for k, v in os.environ.items() if not k.startswith("PROOFPLANE_")}
        clean |= {
            "HOME": str(tmp),
            "PROOFPLANE_MASTER_KEY_FILE": str(tmp / "master.key"),
            "PROOFPLANE_AUDIT_KEY_FILE": str(tmp / "audit.key"),
            "PROOFPLANE_SIEM_EXPORT_INTERVAL_SECONDS": "0",
            "PROOFPLANE_EXECUTION_SYNC_SECONDS": "0",
            "PROOFPLANE_CHANGE_CONTROL": "off",
            **(env or {}),
        }
        cmd = [sys.executable, "-m", "proofplane.cli.main", "serve", "--db", db]
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [*cmd, "--port", str(self.port), *args], env=clean, stdout=out, stderr=out
            )
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{self.base}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert self.proc.poll() is None, self.log.read_text()
            assert time.monotonic() < deadline, self.log.read_text()
            time.sleep(0.2)

    def stop(self) -> None:
        _stop(self.proc)


class Receiver:
    """An HTTP receiver on loopback that keeps every POST body (and can refuse them)."""

    def __init__(self) -> None:
        self.bodies: list[Any] = []
        self.headers: list[dict[str, str]] = []
        self.status = 200
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("content-length", "0"))
                receiver.bodies.append(json.loads(self.rfile.read(length) or b"null"))
                receiver.headers.append(dict(self.headers))
                self.send_response(receiver.status)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
