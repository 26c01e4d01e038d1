"""Execution wired into the flows, end to end through the API, with real local processes.

The store carries the engine (``Store.backend``): a submit dispatches at once, a cancel kills
the process group, a node that fails drains in the engine and its work is cancelled there and
re-placed only on a compliant node, a preemption stops the victim's process, an unreachable
engine leaves the workload Pending with ``backend_unavailable`` until a sync retries it.
SQLite and PostgreSQL (``client`` and ``store`` run on both).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from proofplane.access import SYSTEM
from proofplane.api.app import create_app
from proofplane.backends.base import BackendUnavailable, Change, JobRejected, JobSpec
from proofplane.backends.local import LimitMode, LocalExecutor
from proofplane.config import ExecutionSettings, Settings
from proofplane.model import GpuRequest
from proofplane.service import execution, reconcile
from proofplane.service.access import bootstrap_admin
from proofplane.service.context import Store
from proofplane.service.workloads import WorkloadSpec, insert_workload
from proofplane.store.tables import EventRow

API = "/api/v1"
PY = sys.executable
TOKEN = "ppt_e2e-admin-token-0123456789abcdef"
# Prints the GPUs it was given, starts a child in its process group, then waits to be stopped.
LOOP = (
    "import os, subprocess, sys, time\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
    "print('gpus=' + os.environ['CUDA_VISIBLE_DEVICES'], 'child=' + str(child.pid), flush=True)\n"
    "time.sleep(60)\n"
)


def local(tmp_path: Path) -> LocalExecutor:
    return LocalExecutor(
        tmp_path / "executor", limit_mode=LimitMode("rlimit", "test"), kill_grace_s=1
    )


@pytest.fixture
def backend(store: Store, tmp_path: Path) -> Iterator[LocalExecutor]:
    """The store's engine for this test; every process it started is stopped afterwards."""
    engine = local(tmp_path)
    store.backend = engine
    yield engine
    store.backend = None
    execution.stop_jobs(engine, engine.adopt())


def node(client: TestClient, name: str, gpus: int = 2, certs: dict[str, str] | None = None) -> None:
    body = {
        "name": name,
        "region": "eu",
        "zone": "eu-1",
        "gpus": [
            {"index": i, "uuid": f"GPU-{name}-{i}", "model": "H100-80GB"} for i in range(gpus)
        ],
    }
    assert client.post(f"{API}/nodes", json=body).status_code == 201
    assert client.post(f"{API}/nodes/{name}/state", json={"state": "admitted"}).status_code == 200
    for key, value in (certs or {}).items():
        cert = {"key": key, "value": value}
        assert client.post(f"{API}/nodes/{name}/certifications", json=cert).status_code == 200


def tenant(client: TestClient, name: str, **profile: Any) -> None:
    r = client.post(f"{API}/tenants", json={"name": name, "profile": profile})
    assert r.status_code == 201, r.text


def submit(client: TestClient, name: str, tenant: str = "t1", **kw: Any) -> dict[str, Any]:
    body = {"name": name, "tenant": tenant, "gpus": {"count": 1}, "command": [PY, "-c", LOOP]}
    r = client.post(f"{API}/workloads", json={**body, **kw})
    assert r.status_code == 201, r.text
    return r.json()


def get(client: TestClient, name: str) -> dict[str, Any]:
    return client.get(f"{API}/workloads/{name}").json()


def jobs(client: TestClient, name: str) -> list[dict[str, Any]]:
    return client.get(f"{API}/workloads/{name}/jobs").json()["items"]  # type: ignore[no-any-return]


def placed_uuids(w: dict[str, Any]) -> str:
    return ",".join(d["gpu_uuid"] for d in w["placement"]["devices"])


def output(client: TestClient, name: str) -> str:
    """The workload's first line of output, once its process has written it."""
    deadline = time.monotonic() + 10
    while True:
        text = client.get(f"{API}/workloads/{name}/logs").json()["text"]
        if text or time.monotonic() > deadline:
            return text  # type: ignore[no-any-return]
        time.sleep(0.05)


def pids(engine: LocalExecutor, job_id: str, text: str) -> tuple[int, int]:
    """(process group of the job, the host pid of the child its command started: the job
    prints the pid it sees in its sandbox's PID namespace)."""
    pgid = int(execution_state(engine, job_id)["pgid"])
    inner = text.split("child=")[1].split()[0]
    for entry in Path("/proc").iterdir():
        try:
            status = (entry / "status").read_text() if entry.name.isdigit() else ""
            group = os.getpgid(int(entry.name)) if status else None
        except OSError:  # ended meanwhile
            continue
        nspids = next((ln.split()[1:] for ln in status.splitlines() if ln.startswith("NSpid:")), [])
        if nspids and nspids[-1] == inner and group == pgid:
            return pgid, int(entry.name)
    raise AssertionError(f"no process of group {pgid} has the pid {inner} in its namespace")


def execution_state(engine: LocalExecutor, job_id: str) -> dict[str, Any]:
    return json.loads((engine.jobs_dir / job_id / "state.json").read_text())  # type: ignore[no-any-return]


def gone(pid: int, group: bool = False) -> bool:
    """Whether a process (or process group) has ended; waits up to 5 s for it."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            (os.killpg if group else os.kill)(pid, 0)
        except ProcessLookupError:
            return True
        try:  # a zombie child of ours (the supervisor) counts as ended
            if Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z"):
                return True
        except OSError:
            return True
        time.sleep(0.02)
    return False


def actions(store: Store, target: str) -> list[tuple[str, str]]:
    with store.read() as s:
        rows = s.scalars(
            select(EventRow).where(EventRow.target_id == target).order_by(EventRow.seq)
        )
        return [(r.action, r.outcome) for r in rows]


def test_submit_runs_a_process_with_its_gpus_and_cancel_kills_the_group(
    client: TestClient, store: Store, backend: LocalExecutor
) -> None:
    node(client, "n1")
    tenant(client, "t1")
    w = submit(client, "job", gpus={"count": 2})
    assert w["status"] == "placed"
    (job,) = jobs(client, "job")  # dispatched in the submitting transaction
    assert job["backend"] == "local" and job["state"] == "submitted"
    assert job["job_id"].startswith("t1.job.")
    text = output(client, "job")
    assert text.startswith(f"gpus={placed_uuids(w)} ")  # CUDA_VISIBLE_DEVICES = placed UUIDs
    assert placed_uuids(w) == "GPU-n1-0,GPU-n1-1"
    reconcile.sync(store, backend)
    assert get(client, "job")["status"] == "running"
    pgid, child = pids(backend, job["job_id"], text)

    r = client.post(f"{API}/workloads/job/cancel", json={"reason": "done"})
    assert r.status_code == 200 and r.json()["status"] == "cancelled"
    assert gone(child) and gone(pgid, group=True)  # the command and what it started
    assert [j["state"] for j in jobs(client, "job")] == ["cancelled"]
    assert ("workload.engine_cancel", "success") in actions(store, "job")
    # Nothing is left for the reconciliation to do, and it does not undo the cancel.
    report = reconcile.sync(store, backend)
    assert report.orphans_cancelled == [] and get(client, "job")["status"] == "cancelled"


def test_a_failed_node_drains_cancels_and_replaces_only_on_compliant_nodes(
    client: TestClient, store: Store, backend: LocalExecutor
) -> None:
    tenant(client, "clinic", required_tags={"hipaa": "true"})
    node(client, "h1", certs={"hipaa": "true"})
    node(client, "h2", certs={"hipaa": "true"})
    node(client, "plain", gpus=8)  # idle and larger, but not certified
    first = submit(client, "scan", "clinic")
    on = first["placement"]["node"]
    other = "h2" if on == "h1" else "h1"
    (job1,) = jobs(client, "scan")
    text1 = output(client, "scan")
    pgid1, _ = pids(backend, job1["job_id"], text1)

    r = client.post(f"{API}/nodes/{on}/state", json={"state": "failed", "reason": "PSU"})
    assert r.status_code == 200
    assert gone(pgid1, group=True)  # the job on the failed node is stopped
    again = get(client, "scan")
    assert again["status"] == "placed" and again["placement"]["node"] == other
    old, new = jobs(client, "scan")
    assert old["state"] == "cancelled" and new["state"] == "submitted"
    assert output(client, "scan").startswith(f"gpus={placed_uuids(again)} ")
    assert ("node.engine_drain", "success") in actions(store, on)

    # The last compliant node fails too: the workload waits, the uncertified node stays idle.
    assert client.post(f"{API}/nodes/{other}/state", json={"state": "failed"}).status_code == 200
    waiting = get(client, "scan")
    assert waiting["status"] == "pending" and waiting["placement"] is None
    assert [j["state"] for j in jobs(client, "scan")] == ["cancelled", "cancelled"]
    assert client.get(f"{API}/workloads", params={"node": "plain"}).json()["items"] == []

    # Back in service: the engine resumes the node and the workload runs there again.
    assert client.post(f"{API}/nodes/{on}/state", json={"state": "admitted"}).status_code == 200
    assert ("node.engine_resume", "success") in actions(store, on)
    back = get(client, "scan")
    assert back["status"] == "placed" and back["placement"]["node"] == on
    assert [j["state"] for j in jobs(client, "scan")] == ["cancelled", "cancelled", "submitted"]


def test_preemption_stops_the_victims_process(
    client: TestClient, store: Store, backend: LocalExecutor
) -> None:
    node(client, "n1")
    tenant(client, "t1")
    submit(client, "low", gpus={"count": 2}, priority=1)
    (low_job,) = jobs(client, "low")
    pgid, _ = pids(backend, low_job["job_id"], output(client, "low"))
    high = submit(client, "high", gpus={"count": 2}, priority=5)
    assert high["status"] == "placed"
    low = get(client, "low")
    assert low["status"] == "pending" and low["reason"] == "preempted"
    assert gone(pgid, group=True)
    assert [j["state"] for j in jobs(client, "low")] == ["cancelled"]
    assert [j["state"] for j in jobs(client, "high")] == ["submitted"]


class Switchable(LocalExecutor):
    """The local executor behind a switch: while ``down`` it cannot be reached."""

    down = True

    def _check(self) -> None:
        if self.down:
            raise BackendUnavailable("executor state directory is on a lost mount")

    def submit(self, job: JobSpec) -> str:
        self._check()
        return super().submit(job)

    def cancel(self, job_id: str) -> None:
        self._check()
        super().cancel(job_id)

    def sync(self, job_ids: Collection[str]) -> list[Change]:
        self._check()
        return super().sync(job_ids)

    def drain(self, node: str, reason: str) -> None:
        self._check()

    def resume(self, node: str) -> None:
        self._check()


def test_an_unreachable_engine_leaves_work_pending_and_a_sync_retries_it(
    client: TestClient, store: Store, backend: LocalExecutor
) -> None:
    engine = Switchable(backend.state_dir, limit_mode=backend.limit_mode, kill_grace_s=1)
    store.backend = engine
    node(client, "n1")
    tenant(client, "t1")
    w = submit(client, "job")
    assert w["status"] == "pending" and w["reason"] == "backend_unavailable"
    assert "lost mount" in w["reason_details"]["message"]
    assert jobs(client, "job") == []
    assert ("workload.dispatch", "failure") in actions(store, "job")
    # A drain that fails is reported as an event, not ignored; the node still leaves service.
    assert client.post(f"{API}/nodes/n1/state", json={"state": "cordoned"}).status_code == 200
    assert ("node.engine_drain", "failure") in actions(store, "n1")
    assert client.post(f"{API}/nodes/n1/state", json={"state": "admitted"}).status_code == 200
    assert get(client, "job")["reason"] == "backend_unavailable"  # tried again, still down

    assert reconcile.sync(store, engine).error is not None  # nothing changes while down
    assert get(client, "job")["status"] == "pending"
    engine.down = False
    report = reconcile.sync(store, engine)
    assert report.dispatched == ["job"]
    assert output(client, "job").startswith("gpus=GPU-n1-")
    reconcile.sync(store, engine)
    assert get(client, "job")["status"] == "running"

    # A cancel while the engine is down: proofplane cancels, the next sync stops the process.
    engine.down = True
    (job,) = jobs(client, "job")
    pgid = int(execution_state(engine, job["job_id"])["pgid"])
    assert client.post(f"{API}/workloads/job/cancel", json={}).status_code == 200
    assert ("workload.engine_cancel", "failure") in actions(store, "job")
    os.killpg(pgid, 0)  # still running
    assert jobs(client, "job")[0]["state"] == "running"
    engine.down = False
    assert reconcile.sync(store, engine).orphans_cancelled == [job["job_id"]]
    assert gone(pgid, group=True)


class Picky(LocalExecutor):
    """Refuses the workload named ``bad``, like an engine that rejects a job spec."""

    def submit(self, job: JobSpec) -> str:
        if job.workload == "bad":
            raise JobRejected("Invalid generic resource (gres) specification")
        return super().submit(job)


def test_a_rejected_job_fails_and_its_capacity_goes_to_waiting_work(
    client: TestClient, store: Store, backend: LocalExecutor
) -> None:
    store.backend = Picky(backend.state_dir, limit_mode=backend.limit_mode, kill_grace_s=1)
    node(client, "n1")
    tenant(client, "t1")
    # "waiter" cannot be placed while the first one holds both GPUs.
    submit(client, "first", gpus={"count": 2}, priority=10)  # not preemptible by "bad"
    assert submit(client, "waiter", gpus={"count": 2})["status"] == "pending"
    assert submit(client, "bad", gpus={"count": 1}, priority=9)["status"] == "pending"
    assert client.post(f"{API}/workloads/first/cancel", json={}).status_code == 200
    # Cancelling frees both GPUs: "bad" (higher priority) is placed, rejected by the engine and
    # fails with its message; the GPU it held goes back, and "waiter" runs in the same flow.
    bad = get(client, "bad")
    assert bad["status"] == "failed" and bad["reason"] == "job_rejected"
    assert "gres" in bad["reason_details"]["message"]
    assert get(client, "waiter")["status"] == "placed"
    assert [j["state"] for j in jobs(client, "waiter")] == ["submitted"]


def test_a_rolled_back_dispatch_stops_its_process(
    client: TestClient, store: Store, backend: LocalExecutor
) -> None:
    node(client, "n1")
    tenant(client, "t1")
    spec = WorkloadSpec("job", "t1", command=(PY, "-c", LOOP))
    with pytest.raises(RuntimeError), store.write(SYSTEM) as tx:
        insert_workload(tx, spec, GpuRequest())
        (job_dir,) = backend.jobs_dir.iterdir()  # the process started…
        raise RuntimeError("a later step of the same transaction fails")
    # …and no row remembers it, so the rollback stopped it.
    assert (job_dir / "cancel.json").exists()
    assert gone(int(execution_state(backend, job_dir.name)["pgid"]), group=True)
    assert client.get(f"{API}/workloads/job").status_code == 404


def test_the_server_runs_the_engine_and_its_sync_worker(store: Store, tmp_path: Path) -> None:
    bootstrap_admin(store, TOKEN)
    engine = local(tmp_path)
    store.backend = engine
    settings = ExecutionSettings(sync_interval_s=0.1)
    app = create_app(store, Settings(), settings)
    try:
        with TestClient(app, headers={"Authorization": f"Bearer {TOKEN}"}) as c:
            assert app.state.execution_sync is not None
            node(c, "n1")
            tenant(c, "t1")
            submit(c, "job")
            deadline = time.monotonic() + 10
            while get(c, "job")["status"] != "running":  # the worker syncs; no manual call
                assert time.monotonic() < deadline, get(c, "job")
                time.sleep(0.05)
            (configured,) = [b for b in c.get(f"{API}/backends").json()["items"] if b["configured"]]
            assert configured["name"] == "local"
            assert c.post(f"{API}/workloads/job/cancel", json={}).status_code == 200
        assert not app.state.execution_sync.running  # stopped with the server
    finally:
        store.backend = None
        execution.stop_jobs(engine, engine.adopt())


def test_without_a_backend_nothing_is_dispatched(client: TestClient, store: Store) -> None:
    """The default for the API tests and the simulator: placements are decisions only."""
    node(client, "n1")
    tenant(client, "t1")
    assert submit(client, "job")["status"] == "placed"
    assert jobs(client, "job") == []
    assert store.backend is None
