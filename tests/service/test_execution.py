"""service/execution.py: placed workloads reach the engine, and what the engine says becomes
events and status changes. Real local processes; SQLite and PostgreSQL (``client``)."""

from __future__ import annotations

import sys
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy import select

from proofplane.access import SYSTEM
from proofplane.backends.base import BackendUnavailable, Change, ChangeKind, JobRejected, JobSpec
from proofplane.backends.local import LimitMode, LocalExecutor
from proofplane.service import execution, reconcile
from proofplane.service.context import Store
from proofplane.store.tables import EventRow, WorkloadRow

API = "/api/v1"
PY = sys.executable


def setup_cluster(client: TestClient) -> None:
    body = {
        "name": "n1",
        "region": "eu",
        "zone": "eu-1",
        "gpus": [{"index": i, "uuid": f"GPU-n1-{i}", "model": "H100-80GB"} for i in range(2)],
    }
    assert client.post(f"{API}/nodes", json=body).status_code == 201
    assert client.post(f"{API}/nodes/n1/state", json={"state": "admitted"}).status_code == 200
    assert client.post(f"{API}/tenants", json={"name": "t1"}).status_code == 201


def submit(client: TestClient, name: str, command: list[str], count: int = 1) -> dict[str, Any]:
    body = {"name": name, "tenant": "t1", "gpus": {"count": count}, "command": command}
    r = client.post(f"{API}/workloads", json=body)
    assert r.status_code == 201, r.text
    return r.json()


def status(client: TestClient, name: str) -> dict[str, Any]:
    return client.get(f"{API}/workloads/{name}").json()


def actions(store: Store, name: str) -> list[tuple[str, str]]:
    with store.read() as s:
        rows = s.scalars(select(EventRow).where(EventRow.target_id == name).order_by(EventRow.seq))
        return [(r.action, r.outcome) for r in rows]


def local(tmp_path: Path) -> LocalExecutor:
    return LocalExecutor(
        tmp_path / "executor", limit_mode=LimitMode("rlimit", "test"), kill_grace_s=1
    )


def sync_until(store: Store, backend: Any, client: TestClient, name: str, want: str) -> None:
    deadline = time.monotonic() + 15
    while status(client, name)["status"] != want:
        assert time.monotonic() < deadline, status(client, name)
        reconcile.sync(store, backend)
        time.sleep(0.05)


def test_a_placed_workload_runs_as_a_local_process(
    client: TestClient, store: Store, tmp_path: Path
) -> None:
    setup_cluster(client)
    script = "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])"
    assert submit(client, "hello", [PY, "-c", script])["status"] == "placed"
    submit(client, "reservation", [])  # no command: never dispatched
    backend = local(tmp_path)
    report = reconcile.sync(store, backend)
    assert report.dispatched == ["hello"] and report.error is None
    sync_until(store, backend, client, "hello", "succeeded")
    assert status(client, "reservation")["status"] == "placed"
    (job,) = [j for j in _jobs(store, "hello")]
    assert job["state"] == "succeeded" and job["backend"] == "local"
    assert backend.logs(job["job_id"]).decode().strip().startswith("GPU-n1-")
    got = actions(store, "hello")
    assert got[0] == ("workload.submit", "success")
    assert ("workload.dispatch", "success") in got and got[-1] == ("workload.succeeded", "success")


def _jobs(store: Store, name: str) -> list[dict[str, Any]]:
    with store.read() as s:
        wid = s.scalar(select(WorkloadRow.id).where(WorkloadRow.name == name))
    assert wid is not None
    return execution.jobs_of(store, wid)


def test_failure_and_restart_and_orphan_cancel(
    client: TestClient, store: Store, tmp_path: Path
) -> None:
    setup_cluster(client)
    submit(client, "bad", [PY, "-c", "raise SystemExit(4)"])
    submit(client, "long", [PY, "-c", "import time; time.sleep(60)"])
    backend = local(tmp_path)
    reconcile.sync(store, backend)
    sync_until(store, backend, client, "bad", "failed")
    failed = status(client, "bad")
    assert failed["reason"] == "job_failed"
    sync_until(store, backend, client, "long", "running")
    # The server restarts: a new executor on the same state directory still knows the job.
    restarted = local(tmp_path)
    reconcile.sync(store, restarted)
    assert status(client, "long")["status"] == "running"
    (job,) = _jobs(store, "long")
    # Cancel through the API (the lead's flow clears the placement); sync stops the process.
    assert client.post(f"{API}/workloads/long/cancel", json={"reason": "x"}).status_code == 200
    report = reconcile.sync(store, restarted)
    assert report.orphans_cancelled == [job["job_id"]]
    assert restarted.sync([job["job_id"]])[0].kind is ChangeKind.CANCELLED
    assert _jobs(store, "long")[0]["state"] == "cancelled"


class Flaky:
    """A backend that is down, then rejects one workload, then accepts."""

    name = "flaky"

    def __init__(self) -> None:
        self.down = True
        self.lose_node = False
        self.submitted: list[str] = []

    def submit(self, job: JobSpec) -> str:
        if self.down:
            raise BackendUnavailable("connection refused")
        if job.workload == "rejected":
            raise JobRejected("Invalid generic resource specification")
        self.submitted.append(job.workload)
        return f"job-{len(self.submitted)}"

    def cancel(self, job_id: str) -> None:
        pass

    def sync(self, job_ids: Collection[str]) -> list[Change]:
        if self.down:
            raise BackendUnavailable("connection refused")
        if not self.lose_node:
            return [Change(ChangeKind.RUNNING, j, message="running") for j in job_ids]
        return [Change(ChangeKind.NODE_LOST, node="n1", message="Slurm reports the node down")]

    def drain(self, node: str, reason: str) -> None:
        pass

    def resume(self, node: str) -> None:
        pass

    def describe(self) -> dict[str, Any]:
        return {"name": self.name}


def test_engine_faults_pending_retry_reject_and_node_lost(client: TestClient, store: Store) -> None:
    setup_cluster(client)
    submit(client, "ok", ["true"])
    backend = Flaky()
    report = reconcile.sync(store, backend)
    assert report.error == "connection refused"
    # The placing flow dispatches directly: the engine is down, the workload waits.
    with store.write(SYSTEM) as tx:
        row = tx.session.scalar(select(WorkloadRow).where(WorkloadRow.name == "ok"))
        assert execution.dispatch_placed(tx, backend, row) is None
    pending = status(client, "ok")
    assert pending["status"] == "pending" and pending["reason"] == "backend_unavailable"
    assert ("workload.dispatch", "failure") in actions(store, "ok")
    submit(client, "rejected", ["true"])
    backend.down = False
    report = reconcile.sync(store, backend)  # retried, placed again, dispatched
    assert backend.submitted == ["ok"]
    rejected = status(client, "rejected")
    assert rejected["status"] == "failed" and rejected["reason"] == "job_rejected"
    assert "Invalid generic resource" in str(rejected)
    assert status(client, "ok")["status"] == "placed"
    reconcile.sync(store, backend)
    assert status(client, "ok")["status"] == "running"
    # The engine's node_lost: the node fails in proofplane, its work is evicted.
    backend.lose_node = True
    report = reconcile.sync(store, backend)
    assert report.nodes_failed == ["n1"]
    assert client.get(f"{API}/nodes/n1").json()["state"] == "failed"
    assert status(client, "ok")["status"] == "pending"


def test_api_jobs_logs_backends_and_admission_webhook(
    client: TestClient, store: Store, tmp_path: Path
) -> None:
    setup_cluster(client)
    backend = local(tmp_path)
    client.app.state.backend = backend  # type: ignore[attr-defined]
    submit(client, "talk", [PY, "-c", "import sys; print('out'); print('err', file=sys.stderr)"])
    assert client.get(f"{API}/workloads/talk/logs").json()["job_id"] is None
    reconcile.sync(store, backend)
    sync_until(store, backend, client, "talk", "succeeded")
    jobs = client.get(f"{API}/workloads/talk/jobs").json()
    assert [j["state"] for j in jobs["items"]] == ["succeeded"]
    assert client.get(f"{API}/workloads/talk/logs").json()["text"] == "out\n"
    err = client.get(f"{API}/workloads/talk/logs", params={"stream": "stderr"}).json()
    assert err["text"] == "err\n"
    (configured,) = [b for b in client.get(f"{API}/backends").json()["items"] if b["configured"]]
    assert configured["name"] == "local" and configured["limit_mode"] == "rlimit"
    review = {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "u-1",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "operation": "CREATE",
            "object": {
                "metadata": {"name": "p", "labels": {"compliance.proofplane.io/hipaa": "true"}},
                "spec": {"nodeName": "n1", "containers": [{"name": "c", "image": "i"}]},
            },
        },
    }
    denied = client.post(f"{API}/k8s/admission", json=review).json()["response"]
    assert denied["allowed"] is False and "not certified for hipaa=true" in str(denied)
    cert = {"key": "hipaa", "value": "true"}
    assert client.post(f"{API}/nodes/n1/certifications", json=cert).status_code == 200
    allowed = client.post(f"{API}/k8s/admission", json=review).json()["response"]
    assert allowed == {"uid": "u-1", "allowed": True}
    bad = client.post(f"{API}/k8s/admission", json={"kind": "nope"})
    assert bad.status_code == 422


def test_dispatch_reads_only_placed_workloads_with_a_command(
    client: TestClient, store: Store, tmp_path: Path
) -> None:
    """Placements without a command (reservations, another engine's work) are never read by
    the dispatch pass every placing transaction runs: its cost does not grow with them."""
    from sqlalchemy import event

    setup_cluster(client)
    for i in range(2):
        submit(client, f"reservation-{i}", [], count=1)  # both GPUs held, nothing to run
    submit(client, "job", ["true"], count=1)  # waits: no GPU left
    loaded: list[str] = []

    def count(_session: Any, instance: object) -> None:
        if isinstance(instance, WorkloadRow):
            loaded.append(instance.name)

    backend = local(tmp_path)
    with store.write(SYSTEM) as tx:
        event.listen(tx.session, "loaded_as_persistent", count)
        tx.backend = backend
        assert execution.dispatch_new(tx) == []
    assert loaded == []  # the two placed reservations were not read
    assert client.post(f"{API}/workloads/reservation-0/cancel").status_code == 200
    report = reconcile.sync(store, backend)  # "job" took the freed GPU; dispatched now
    assert status(client, "job")["status"] in ("placed", "running", "succeeded")
    assert "job" in (report.dispatched or []) or _jobs(store, "job")


def test_a_submit_with_an_engine_dispatches_what_has_a_command_and_writes_the_rest_in_bulk(
    client: TestClient, store: Store, db_url: str, tmp_path: Path
) -> None:
    """With an engine, a workload without a command is never dispatched, so its submit takes
    the bulk path (no ORM object); one with a command is dispatched in its submit; and work an
    earlier flow placed without dispatching is dispatched by the next submit, whose answer
    then is what a read gives (issue 20)."""
    from sqlalchemy import event as sa_event

    from proofplane.model import GpuRequest
    from proofplane.service import workloads as workloads_svc

    setup_cluster(client)
    submit(client, "straggler", [PY, "-c", "pass"])  # placed by a store without an engine
    assert actions(store, "straggler")[-1] == ("workload.place", "success")
    engine = Store(db_url, backend=local(tmp_path))
    loaded: list[str] = []

    def on_load(target: WorkloadRow, _context: object) -> None:
        loaded.append(target.name)

    sa_event.listen(WorkloadRow, "load", on_load)
    try:
        spec = workloads_svc.WorkloadSpec("reserve", "t1", gpus=GpuRequest(count=1))
        answer = workloads_svc.submit_workload(engine, SYSTEM, spec)
        assert ("workload.dispatch", "success") in actions(store, "straggler")
        assert answer == workloads_svc.get_workload(store, SYSTEM, "reserve")
        assert answer.placement is not None
        assert [a for a, _ in actions(store, "reserve")] == ["workload.submit", "workload.place"]
        loaded.clear()  # (the straggler's dispatch read the rows back)
        spec = workloads_svc.WorkloadSpec("another", "t1", gpus=GpuRequest(count=0), cpu_milli=100)
        answer = workloads_svc.submit_workload(engine, SYSTEM, spec)
        assert "another" not in loaded  # nothing left to dispatch: nothing read back
        assert answer == workloads_svc.get_workload(store, SYSTEM, "another")
        spec = workloads_svc.WorkloadSpec(
            "run-me", "t1", gpus=GpuRequest(count=0), cpu_milli=100, command=(PY, "-c", "pass")
        )
        workloads_svc.submit_workload(engine, SYSTEM, spec)
        assert ("workload.dispatch", "success") in actions(store, "run-me")
    finally:
        sa_event.remove(WorkloadRow, "load", on_load)
        engine.dispose()


def test_a_cancel_with_an_engine_stops_a_job_and_writes_the_rest_by_core(
    client: TestClient, store: Store, db_url: str, tmp_path: Path
) -> None:
    """With an engine, a cancel loads its workload as an ORM object only when it has a command
    (a job to stop); one without (never dispatched) is cancelled by Core statements (issue
    20). Either way the answer is what a read gives."""
    from sqlalchemy import event as sa_event

    from proofplane.service import workloads as workloads_svc

    setup_cluster(client)
    submit(client, "reserve", [])
    submit(client, "long", [PY, "-c", "import time; time.sleep(60)"])
    backend = local(tmp_path)
    engine = Store(db_url, backend=backend)
    reconcile.sync(store, backend)
    sync_until(store, backend, client, "long", "running")
    loaded: list[str] = []

    def on_load(target: WorkloadRow, _context: object) -> None:
        loaded.append(target.name)

    sa_event.listen(WorkloadRow, "load", on_load)
    try:
        answer = workloads_svc.cancel_workload(engine, SYSTEM, "reserve")
        assert "reserve" not in loaded
        assert answer == workloads_svc.get_workload(store, SYSTEM, "reserve")
        answer = workloads_svc.cancel_workload(engine, SYSTEM, "long")
        assert "long" in loaded  # its job is stopped through the ORM path
        assert answer == workloads_svc.get_workload(store, SYSTEM, "long")
        assert ("workload.engine_cancel", "success") in actions(store, "long")
        assert [j["state"] for j in _jobs(store, "long")] == ["cancelled"]
    finally:
        sa_event.remove(WorkloadRow, "load", on_load)
        engine.dispose()
