"""``serve --workers N`` and replicas (issue 20 §3), with real processes.

Several worker processes on one SQLite file, and two ``serve`` replicas on one PostgreSQL
database: requests are answered by every process, concurrent submissions through different
processes never allocate a GPU twice (each process's scheduler cache catches up from the
event stream), the background loops run in exactly one process (the leader lease), and when
the leader is killed another process takes the loops over."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from sqlalchemy import func, select

from dbtest import ADMIN_TOKEN, demo_text, pg_admin
from dbtest import pg_url as pg_url_of
from live_server import free_port
from proofplane.access import SYSTEM
from proofplane.hardware.cluster_file import parse_cluster
from proofplane.service.access import bootstrap_admin
from proofplane.service.cluster import load_cluster
from proofplane.service.context import Store
from proofplane.store import migrate
from proofplane.store.tables import AuditCheckpointRow

AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


class Serve:
    def __init__(self, db: str, tmp: Path, *args: str) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = tmp / f"serve-{self.port}.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("PROOFPLANE_")}
        env |= {
            "HOME": str(tmp),
            "PROOFPLANE_MASTER_KEY_FILE": str(tmp / "master.key"),
            "PROOFPLANE_AUDIT_KEY_FILE": str(tmp / "audit.key"),
            "PROOFPLANE_AUDIT_CHECKPOINT_INTERVAL_SECONDS": "1",
            "PROOFPLANE_SIEM_EXPORT_INTERVAL_SECONDS": "0",
            "PROOFPLANE_EXECUTION_SYNC_SECONDS": "0",
        }
        cmd = [sys.executable, "-m", "proofplane.cli.main", "serve", "--db", db]
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [*cmd, "--port", str(self.port), *args], env=env, stdout=out, stderr=out
            )
        deadline = time.monotonic() + 120
        while not self._healthy():
            assert self.proc.poll() is None, self.log.read_text()
            assert time.monotonic() < deadline, self.log.read_text()
            time.sleep(0.2)

    def _healthy(self) -> bool:
        try:
            return httpx.get(f"{self.base}/readyz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def background(self, tries: int = 1) -> Counter[str]:
        """What /readyz says of background work, over ``tries`` fresh connections."""
        seen: Counter[str] = Counter()
        for _ in range(tries):
            try:
                seen[httpx.get(f"{self.base}/readyz", timeout=5).json()["background"]] += 1
            except httpx.HTTPError:
                seen["unreachable"] += 1
        return seen

    def children(self) -> list[int]:
        """The worker processes (not multiprocessing's resource tracker)."""
        kids: list[int] = []
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
            for kid in (task / "children").read_text().split():
                try:
                    cmdline = Path(f"/proc/{kid}/cmdline").read_bytes()
                except OSError:
                    continue
                if b"multiprocessing.spawn" in cmdline:
                    kids.append(int(kid))
        return kids

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _prepare(url: str) -> None:
    store = Store(url)
    try:
        migrate.upgrade(store.engine)
        # without their commands: serve's local executor would run the demo's workloads as
        # processes that outlive the test (an engine's jobs outlive a control-plane restart)
        spec = parse_cluster(demo_text())
        spec = dataclasses.replace(
            spec, workloads=tuple(dataclasses.replace(w, command=()) for w in spec.workloads)
        )
        load_cluster(store, SYSTEM, spec)
        bootstrap_admin(store, ADMIN_TOKEN)
    finally:
        store.dispose()


def _checkpoints(url: str) -> int:
    store = Store(url)
    try:
        with store.read() as session:
            return session.scalar(select(func.count()).select_from(AuditCheckpointRow)) or 0
    finally:
        store.dispose()


def _until(check: object, timeout: float = 90.0, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-3000:] if log is not None else ""
            raise AssertionError(f"timed out waiting for {check}\n{tail}")
        time.sleep(0.3)


def _submit_concurrently(bases: list[str], n: int, prefix: str = "c") -> list[dict[str, object]]:
    def one(i: int) -> dict[str, object]:
        body = {"name": f"{prefix}-{i}", "tenant": "research-lab", "gpus": {"count": 1}}
        with httpx.Client(base_url=bases[i % len(bases)], headers=AUTH, timeout=60) as c:
            r = c.post("/api/v1/workloads", json=body)
            assert r.status_code in (200, 201), r.text
            return r.json()  # type: ignore[no-any-return]

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, range(n)))


def _assert_no_device_twice(base: str) -> int:
    with httpx.Client(base_url=base, headers=AUTH, timeout=60) as c:
        items = c.get("/api/v1/workloads", params={"limit": 500}).json()["items"]
    # thousandths of each GPU (or MIG instance) held: a whole GPU is 1000, a share its milli
    used: Counter[tuple[str, int, object]] = Counter()
    for w in items:
        p = w.get("placement")
        if not p:
            continue
        for part in p.get("parts") or [p]:
            for d in part["devices"]:
                slot = (part["node"], d["gpu_index"], d["mig_start"])
                used[slot] += d["share_milli"] or 1000
    assert used and max(used.values()) <= 1000, [k for k, v in used.items() if v > 1000]
    return sum(1 for w in items if w.get("placement"))


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'pp.db'}"
    _prepare(url)
    return url


@pytest.fixture
def pg_url(pg_template: str) -> Iterator[str]:
    """A fresh PostgreSQL database (the conftest's template: missing PostgreSQL fails in CI)."""
    name = f"pp_workers_{uuid.uuid4().hex[:8]}"
    with pg_admin() as conn:
        conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{pg_template}"')
    url = pg_url_of(name)
    try:
        _prepare(url)
        yield url
    finally:
        with pg_admin() as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_worker_processes_share_the_work_and_one_leads(sqlite_url: str, tmp_path: Path) -> None:
    server = Serve(sqlite_url, tmp_path, "--workers", "2")
    try:
        _until(lambda: len(server.children()) == 2, log=server.log)
        placed = _submit_concurrently([server.base], 24)
        assert sum(1 for w in placed if w.get("placement")) >= 8
        assert _assert_no_device_twice(server.base) >= 8
        lease = Path(sqlite_url.removeprefix("sqlite:///") + ".leader")
        _until(lambda: lease.exists() and int(lease.read_text()) in server.children())
        leader = int(lease.read_text())
        before = _checkpoints(sqlite_url)
        # new events after that count (the leader may have signed the submissions already)
        _submit_concurrently([server.base], 1, prefix="early")
        _until(lambda: _checkpoints(sqlite_url) > before)  # the leader signs
        os.kill(leader, signal.SIGKILL)
        # uvicorn replaces the dead worker; one of the two live ones takes the lease over
        _until(
            lambda: int(lease.read_text()) != leader and int(lease.read_text()) in server.children()
        )
        after = _checkpoints(sqlite_url)
        _submit_concurrently([server.base], 1, prefix="late")  # new events to sign
        _until(lambda: _checkpoints(sqlite_url) > after)
        seen = server.background(8)  # each process answers for itself: leader or follower
        assert set(seen) <= {"leader", "follower"} and sum(seen.values()) == 8, seen
    finally:
        server.stop()
    assert server.proc.returncode is not None


def test_two_replicas_on_postgresql_one_leader_and_a_takeover(pg_url: str, tmp_path: Path) -> None:
    a = Serve(pg_url, tmp_path, "--workers", "1")
    b = Serve(pg_url, tmp_path, "--workers", "1")
    try:
        _until(lambda: sorted([*a.background(), *b.background()]) == ["follower", "leader"])
        placed = _submit_concurrently([a.base, b.base], 24)  # alternating replicas
        assert sum(1 for w in placed if w.get("placement")) >= 8
        assert _assert_no_device_twice(a.base) == _assert_no_device_twice(b.base)
        leader, follower = (a, b) if a.background()["leader"] else (b, a)
        leader.proc.kill()  # SIGKILL: no shutdown, the database session just ends
        leader.proc.wait()
        _until(lambda: follower.background()["leader"] == 1)
        after = _checkpoints(pg_url)
        _submit_concurrently([follower.base], 1, prefix="late")  # new events to sign
        _until(lambda: _checkpoints(pg_url) > after)  # the survivor signs now
    finally:
        a.stop()
        b.stop()


def test_worker_connections_turn_nagle_off() -> None:
    """The listening socket uvicorn hands its worker processes has proto 0, so asyncio leaves
    Nagle on and every keep-alive answer waited out the client's delayed ACK (44 ms measured
    per request with --workers 2, 1 ms with one process); the workers' protocol turns it off."""
    import socket

    from proofplane.cli.worker_app import _NoDelay

    class Base:
        def connection_made(self, transport: object) -> None:
            self.transport = transport

    class Proto(_NoDelay, Base):
        pass

    class Transport:
        def __init__(self, sock: socket.socket) -> None:
            self.sock = sock

        def get_extra_info(self, name: str) -> object:
            return self.sock if name == "socket" else None

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # proto 0, as uvicorn binds
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    client = socket.create_connection(listener.getsockname())
    conn, _ = listener.accept()
    try:
        assert conn.proto == 0
        assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 0
        proto = Proto()
        transport = Transport(conn)
        proto.connection_made(transport)
        assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
        assert proto.transport is transport
    finally:
        conn.close()
        client.close()
        listener.close()


def test_plain_workers_parse_with_httptools(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``serve --workers N`` over plain HTTP runs uvicorn's httptools protocol (its C parser,
    as the one-process server does), Nagle off; h11 cost the workers more CPU a request
    (issue 12's profile of ``--workers 2``)."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    from proofplane import config
    from proofplane.cli import server
    from proofplane.cli.worker_app import SERVE_URL_ENV, _NoDelay
    from proofplane.service.context import Store

    monkeypatch.setenv(SERVE_URL_ENV, "restored-after-the-test")  # _serve sets it for the workers
    seen: dict[str, object] = {}
    monkeypatch.setattr(server.uvicorn, "run", lambda *a, **kw: seen.update(kw))
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path / "prom"))
    store = Store(f"sqlite:///{tmp_path / 'w.db'}")
    server._serve(store, "127.0.0.1", 0, config.Settings(), config.ExecutionSettings(), workers=2)
    protocol = seen["http"]
    assert isinstance(protocol, type)
    assert issubclass(protocol, HttpToolsProtocol) and issubclass(protocol, _NoDelay)
    assert seen["workers"] == 2
