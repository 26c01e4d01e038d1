"""When ``proofplane up`` stops, the demo's running workloads stop with it, and the log says
so: each is cancelled through the cancel use case (``workload.engine_cancel`` and
``workload.cancel`` with up's reason, one transaction each), no process is left running, and
capacity the cancels free starts nothing new (the waiting workload stays pending, saying the
engine was unavailable). Real local processes; SQLite."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from proofplane import config
from proofplane.backends.local import LimitMode, LocalExecutor
from proofplane.cli import server
from proofplane.service import execution, reconcile
from proofplane.service.context import Store
from proofplane.store.tables import EventRow

API = "/api/v1"
SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]


def setup_cluster(client: TestClient) -> None:
    gpus = [{"index": i, "uuid": f"GPU-n1-{i}", "model": "H100-80GB"} for i in range(2)]
    body = {"name": "n1", "region": "eu", "zone": "eu-1", "gpus": gpus}
    assert client.post(f"{API}/nodes", json=body).status_code == 201
    assert client.post(f"{API}/nodes/n1/state", json={"state": "admitted"}).status_code == 200
    assert client.post(f"{API}/tenants", json={"name": "t1"}).status_code == 201


def submit(client: TestClient, name: str, command: list[str]) -> None:
    body = {"name": name, "tenant": "t1", "gpus": {"count": 1}, "command": command}
    r = client.post(f"{API}/workloads", json=body)
    assert r.status_code == 201, r.text


def status(client: TestClient, name: str) -> dict[str, Any]:
    return dict(client.get(f"{API}/workloads/{name}").json())


def local(tmp_path: Path) -> LocalExecutor:
    return LocalExecutor(
        tmp_path / "executor", limit_mode=LimitMode("rlimit", "test"), kill_grace_s=1
    )


def actions(store: Store, name: str) -> list[tuple[str, str]]:
    return [(e.action, e.outcome) for e in _events(store, name)]


def _events(store: Store, name: str) -> list[EventRow]:
    with store.read() as s:
        q = select(EventRow).where(EventRow.target_id == name).order_by(EventRow.seq)
        rows = list(s.scalars(q))
        s.expunge_all()
        return rows


def _running_demo(client: TestClient, store: Store, tmp_path: Path) -> tuple[Store, Any]:
    setup_cluster(client)  # one node, two GPUs
    for name in ("a", "b", "c"):  # c waits for a GPU
        submit(client, name, SLEEP)
    submit(client, "reservation-free", [])  # no command: pending too, nothing to stop
    backend = local(tmp_path)
    with_engine = Store(str(store.engine.url.render_as_string(hide_password=False)),
                        backend=backend)  # fmt: skip
    reconcile.sync(with_engine, backend)
    for _ in range(200):
        reconcile.sync(with_engine, backend)
        if status(client, "a")["status"] == status(client, "b")["status"] == "running":
            break
    assert status(client, "a")["status"] == status(client, "b")["status"] == "running"
    assert status(client, "c")["status"] == "pending"
    return with_engine, backend


def _check_stopped(client: TestClient, store: Store, backend: Any) -> None:
    for name in ("a", "b"):
        assert status(client, name)["status"] == "cancelled"
        got = actions(store, name)
        assert ("workload.engine_cancel", "success") in got, got
        assert got[-1] == ("workload.cancel", "success"), got
        (cancel,) = [e for e in _events(store, name) if e.action == "workload.cancel"]
        assert cancel.details["reason"] == server.UP_STOPPED
        assert cancel.details["from_status"] == "running"
    # the freed GPUs started nothing: c is pending again, saying why
    c = status(client, "c")
    assert c["status"] == "pending", c
    assert execution.live_job_ids(store, backend) == []
    for job in backend.sync([j["job_id"] for j in execution.jobs_of(store, 1)]):
        assert job.kind.value != "running"


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_stop_demo_workloads_records_each(
    client: TestClient, store: Store, tmp_path: Path, db_url: str
) -> None:
    with_engine, backend = _running_demo(client, store, tmp_path)
    try:
        assert sorted(server.stop_demo_workloads(with_engine)) == ["a", "b"]
        assert with_engine.backend is backend  # restored
        _check_stopped(client, store, backend)
    finally:
        with_engine.dispose()


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_ups_shutdown_path_records_them(
    client: TestClient,
    store: Store,
    tmp_path: Path,
    db_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``_serve(stop_jobs=True)`` (up's): when the server returns, the workloads are stopped
    and recorded, and the line says so."""
    with_engine, backend = _running_demo(client, store, tmp_path)
    monkeypatch.setattr(server.uvicorn, "run", lambda *a, **k: None)  # Ctrl-C at once
    server._serve(
        with_engine, "127.0.0.1", 0, config.Settings(cookie_secure=False),
        config.ExecutionSettings(), stop_jobs=True,
    )  # fmt: skip
    out = capsys.readouterr().out
    assert "stopped 2 demo workload process(es)" in out and "recorded cancelled" in out
    _check_stopped(client, store, backend)
