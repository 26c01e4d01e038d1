"""Execution: hand placed workloads to the engine and turn what the engine says into events.

The engine is told about decisions; it never makes them. The store carries the engine
(``Store.backend``, handed to every transaction as ``Tx.backend``; None: nothing is executed)
and the flows call in here:

* ``dispatch_placed(tx, backend, row)`` — right after a placement, in the placing
  transaction (``dispatch_new`` does it for every placed workload without a job: submit,
  cancel, node state and certification flows call it). An unreachable engine puts the
  workload back to Pending with reason ``backend_unavailable`` (retried by ``sync``); a job
  the engine rejects fails the workload with the engine's message. A transaction that rolls
  back after a dispatch cancels the job it started.
* ``cancel(tx, backend, row)`` — in the cancel flow, before the placement is cleared, and on
  every eviction (node failure, lost certification, preemption: ``scheduling._evict_row``).
* ``node_state_changed(tx, node, before, after, reason)`` — drain the node in the engine when
  it leaves service (cordoned, quarantined, failed, decommissioned), resume it when it is
  admitted again; a failed drain is an event with outcome failure.
* ``sync(store, backend)`` — the reconciliation pass (a background worker runs it): cancels
  engine jobs whose workload lost its placement (evictions from any flow), applies the
  engine's status changes, marks nodes the engine lost as failed, dispatches placed workloads
  that have no job yet (a crash between placement and dispatch loses nothing), and retries
  ``backend_unavailable`` workloads.

Workloads without a command are reservations (the simulator's and the scheduler tests'
workloads): they are never dispatched.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import event as sa_event
from sqlalchemy import select

from proofplane.access import SYSTEM, Actor, Permission, authorize
from proofplane.backends.base import (
    Backend,
    BackendError,
    BackendUnavailable,
    Change,
    ChangeKind,
    DrainFailed,
    JobRejected,
    JobSpec,
)
from proofplane.config import ExecutionSettings
from proofplane.errors import InvalidState
from proofplane.model import NodeState, Outcome, WorkloadStatus, can_transition
from proofplane.service.context import Store, Tx
from proofplane.service.scheduling import ClusterView, evict, reschedule_pending
from proofplane.store.repo import WORKLOAD_LOAD, node_from_row, workload_from_row, workload_row
from proofplane.store.tables import ExecutionJobRow, GpuRow, NodeRow, WorkloadRow

log = logging.getLogger("proofplane.execution")

LIVE_STATES = ("submitted", "running")
BACKEND_UNAVAILABLE = "backend_unavailable"


def build_backend(settings: ExecutionSettings) -> Backend:
    """The configured engine (``PROOFPLANE_BACKEND``)."""
    if settings.backend == "slurm":
        from proofplane.backends.slurm import SlurmBackend, SlurmOptions

        return SlurmBackend(
            SlurmOptions(
                conf=settings.slurm_conf,
                bin_dir=settings.slurm_bin_dir,
                partition=settings.slurm_partition,
                output_dir=settings.slurm_output_dir,
            )
        )
    if settings.backend == "kubernetes":
        from proofplane.backends.k8s import DEFAULT_IMAGE, KubernetesBackend, RenderOptions

        return KubernetesBackend(
            RenderOptions(
                namespace_prefix=settings.k8s_namespace_prefix,
                image=settings.k8s_image or DEFAULT_IMAGE,
                pin=settings.k8s_pin,
            )
        )
    import platformdirs

    from proofplane.backends.local import Limits, LocalExecutor

    state_dir = settings.local_state_dir or str(
        Path(platformdirs.user_data_dir("proofplane")) / "executor"
    )
    return LocalExecutor(
        state_dir,
        limits=Limits(
            memory_mb=settings.local_memory_mb, cpus=settings.local_cpus, pids=settings.local_pids
        ),
    )


def _gpu_models(tx: Tx, row: WorkloadRow) -> dict[str, str]:
    assert row.placement is not None
    uuids = [d["gpu_uuid"] for d in row.placement.devices]
    for member in row.placement.members or ():
        uuids.extend(d["gpu_uuid"] for d in member["devices"])
    found = tx.session.execute(select(GpuRow.uuid, GpuRow.model).where(GpuRow.uuid.in_(uuids)))
    return {uuid: model for uuid, model in found}


def live_job(session: Any, row: WorkloadRow) -> ExecutionJobRow | None:
    return session.scalar(  # type: ignore[no-any-return]
        select(ExecutionJobRow).where(
            ExecutionJobRow.workload_id == row.id, ExecutionJobRow.state.in_(LIVE_STATES)
        )
    )


def _finish(
    tx: Tx,
    row: WorkloadRow,
    status: WorkloadStatus,
    reason: str | None,
    details: dict[str, Any],
    view: ClusterView | None = None,
) -> None:
    """A workload's run ended: terminal status, capacity released (in ``view`` too, when the
    caller places with one: its scheduler must not keep holding the capacity)."""
    had_capacity = row.placement is not None
    if had_capacity and view is not None:
        view.scheduler.release(row.id)
    row.placement = None
    row.status = status.value
    row.reason = reason
    row.reason_details = details or None
    row.updated_at = tx.now
    tx.session.flush()
    tx.record(
        f"workload.{status.value}",
        "workload",
        row.name,
        outcome=Outcome.SUCCESS if status is not WorkloadStatus.FAILED else Outcome.FAILURE,
        details={"tenant": row.tenant.name, **details},
    )
    if had_capacity:
        reschedule_pending(tx, view)


def dispatch_placed(
    tx: Tx, backend: Backend, row: WorkloadRow, view: ClusterView | None = None
) -> ExecutionJobRow | None:
    """Hand a placed workload to the engine. Returns its job row, or None when nothing was
    dispatched (not placed, no command, already has a live job, or the engine failed — the
    workload then says why)."""
    if row.status != WorkloadStatus.PLACED.value or row.placement is None or not row.command:
        return None
    if live_job(tx.session, row) is not None:
        return None
    job = JobSpec.of(workload_from_row(row), _gpu_models(tx, row))
    node = row.placement.node.name
    try:
        job_id = backend.submit(job)
    except BackendUnavailable as exc:
        tx.record(
            "workload.dispatch",
            "workload",
            row.name,
            outcome=Outcome.FAILURE,
            details={"backend": backend.name, "node": node, "error": exc.message},
        )
        evict(tx, row, view or ClusterView(tx.session), BACKEND_UNAVAILABLE, exc.message)
        return None
    except JobRejected as exc:
        tx.record(
            "workload.dispatch",
            "workload",
            row.name,
            outcome=Outcome.FAILURE,
            details={"backend": backend.name, "node": node, "error": exc.message},
        )
        _finish(
            tx,
            row,
            WorkloadStatus.FAILED,
            "job_rejected",
            {"message": exc.message, "backend": backend.name, "node": node},
            view,
        )
        return None
    _cancel_on_rollback(tx, backend, job_id)
    job_row = ExecutionJobRow(
        workload_id=row.id,
        backend=backend.name,
        job_id=job_id,
        state="submitted",
        message=None,
        devices=None,
        created_at=tx.now,
        updated_at=tx.now,
    )
    tx.session.add(job_row)
    tx.session.flush()
    tx.record(
        "workload.dispatch",
        "workload",
        row.name,
        details={"backend": backend.name, "job_id": job_id, "node": node},
    )
    return job_row


def _cancel_on_rollback(tx: Tx, backend: Backend, job_id: str) -> None:
    """The engine started a job in a transaction that may still fail: if it rolls back, no
    row remembers the job, so stop it now rather than leave it running unknown."""

    def undo(_session: Any) -> None:
        try:
            backend.cancel(job_id)
        except BackendError as exc:  # nothing else can be done from here: say so
            log.error("cannot cancel job %s after a rollback: %s", job_id, exc.message)

    sa_event.listen(tx.session, "after_rollback", undo, once=True)


def dispatch_new(tx: Tx, view: ClusterView | None = None) -> list[str]:
    """Dispatch, with the transaction's engine (``Tx.backend``), every placed workload that
    has a command and no live job: what this transaction placed, and anything an earlier flow
    placed without dispatching. Returns the names dispatched; no engine: nothing."""
    backend = tx.backend
    if backend is None:
        return []
    has_job = (
        select(ExecutionJobRow.id)
        .where(
            ExecutionJobRow.workload_id == WorkloadRow.id,
            ExecutionJobRow.state.in_(LIVE_STATES),
        )
        .exists()
    )
    query = (
        select(WorkloadRow)
        .where(WorkloadRow.status == WorkloadStatus.PLACED.value, ~has_job)
        .options(*WORKLOAD_LOAD)
        .order_by(WorkloadRow.priority.desc(), WorkloadRow.created_at, WorkloadRow.id)
    )
    out: list[str] = []
    seen: set[int] = set()
    while True:  # a rejected job frees capacity that pending work may take: dispatch that too
        rows = [r for r in tx.session.scalars(query) if r.id not in seen]
        if not rows:
            return out
        for row in rows:
            seen.add(row.id)
            if row.command and dispatch_placed(tx, backend, row, view) is not None:
                out.append(row.name)


def cancel_engine_job(tx: Tx, row: WorkloadRow) -> None:
    """``cancel`` with the transaction's engine, if it has one (evictions, cancel flow)."""
    if tx.backend is not None:
        cancel(tx, tx.backend, row)


def cancel(tx: Tx, backend: Backend, row: WorkloadRow) -> None:
    """Stop the workload's engine job (cancel flow). An unreachable engine does not block
    the cancel: the job row stays live and ``sync`` cancels it as an orphan later."""
    job = live_job(tx.session, row)
    if job is None:
        return
    try:
        backend.cancel(job.job_id)
    except (BackendUnavailable, JobRejected) as exc:
        tx.record(
            "workload.engine_cancel",
            "workload",
            row.name,
            outcome=Outcome.FAILURE,
            details={"backend": job.backend, "job_id": job.job_id, "error": exc.message},
        )
        return
    _set_job(tx, job, "cancelled", "cancelled by proofplane")
    tx.record(
        "workload.engine_cancel",
        "workload",
        row.name,
        details={"backend": job.backend, "job_id": job.job_id},
    )


# Node states in which the engine must send no new work to the node.
DRAINED_STATES = frozenset(
    {NodeState.CORDONED, NodeState.QUARANTINED, NodeState.FAILED, NodeState.DECOMMISSIONED}
)


def node_state_changed(
    tx: Tx, node: str, before: NodeState, after: NodeState, reason: str | None
) -> bool | None:
    """Tell the transaction's engine about a node's new state: drain it when it leaves
    service, resume it when it is admitted again after a drain. Returns whether the engine
    took it (False: recorded as a failure event), or None when there was nothing to tell."""
    backend = tx.backend
    if backend is None:
        return None
    if after in DRAINED_STATES:  # again from another drained state: the reason changes
        return drain(tx, backend, node, reason or f"proofplane: node is {after.value}")
    if after is NodeState.ADMITTED and before in DRAINED_STATES:
        return resume(tx, backend, node)
    return None


def drain(tx: Tx, backend: Backend, node: str, reason: str) -> bool:
    """Tell the engine to send no new work to ``node`` (quarantine, failure). A failed drain
    is recorded (outcome failure) and returned as False, never swallowed; it does not undo
    the quarantine itself, which proofplane's own placement already enforces."""
    return _node_call(tx, backend, node, "drain", reason)


def resume(tx: Tx, backend: Backend, node: str) -> bool:
    """The engine may send work to ``node`` again (quarantine released)."""
    return _node_call(tx, backend, node, "resume", None)


def _node_call(tx: Tx, backend: Backend, node: str, what: str, reason: str | None) -> bool:
    try:
        if what == "drain":
            backend.drain(node, reason or "")
        else:
            backend.resume(node)
    except (DrainFailed, BackendUnavailable) as exc:
        tx.record(
            f"node.engine_{what}",
            "node",
            node,
            outcome=Outcome.FAILURE,
            details={"backend": backend.name, "error": exc.message, "reason": reason},
        )
        return False
    tx.record(
        f"node.engine_{what}", "node", node, details={"backend": backend.name, "reason": reason}
    )
    return True


def _set_job(tx: Tx, job: ExecutionJobRow, state: str, message: str | None) -> None:
    job.state = state
    job.message = message
    job.updated_at = tx.now


@dataclass
class SyncReport:
    changes: list[dict[str, Any]] = field(default_factory=list)
    dispatched: list[str] = field(default_factory=list)
    orphans_cancelled: list[str] = field(default_factory=list)
    nodes_failed: list[str] = field(default_factory=list)
    error: str | None = None


def _device_mismatch(tx: Tx, backend: Backend, row: WorkloadRow, change: Change) -> None:
    """Slurm chooses GPU indices itself: record when its choice is not proofplane's."""
    if backend.name != "slurm" or not change.devices or row.placement is None:
        return
    from proofplane.backends.slurm import slurm_indices

    placement = workload_from_row(row).placement
    assert placement is not None
    for node_name, got in change.devices.items():
        node_row = tx.session.scalar(select(NodeRow).where(NodeRow.name == node_name))
        if node_row is None or node_name not in placement.nodes:
            continue
        want = slurm_indices(placement, node_from_row(node_row))
        if tuple(got) != want:
            tx.record(
                "workload.device_mismatch",
                "workload",
                row.name,
                outcome=Outcome.FAILURE,
                details={"node": node_name, "placed": list(want), "engine": list(got)},
            )


def _apply(tx: Tx, backend: Backend, job: ExecutionJobRow, change: Change) -> None:
    row = job.workload
    details: dict[str, Any] = {
        "backend": job.backend,
        "job_id": job.job_id,
        "message": change.message,
    }
    if change.kind is ChangeKind.RUNNING:
        devices = {k: list(v) for k, v in (change.devices or {}).items()} or None
        if devices and devices != job.devices:
            job.devices = devices
            _device_mismatch(tx, backend, row, change)
        if job.state == "submitted" and not change.message.startswith("pending"):
            _set_job(tx, job, "running", change.message)
            if row.status == WorkloadStatus.PLACED.value:
                row.status = WorkloadStatus.RUNNING.value
                row.updated_at = tx.now
                tx.record("workload.running", "workload", row.name, details=details)
        return
    _set_job(tx, job, change.kind.value, change.message)
    if change.exit_code is not None:
        details["exit_code"] = change.exit_code
    if not WorkloadStatus(row.status).holds_capacity:
        return  # proofplane already moved on (cancelled, evicted): nothing to tell it
    if change.kind is ChangeKind.SUCCEEDED:
        _finish(tx, row, WorkloadStatus.SUCCEEDED, None, details)
    elif change.kind is ChangeKind.CANCELLED:
        _finish(tx, row, WorkloadStatus.CANCELLED, "cancelled_in_engine", details)
    else:
        _finish(tx, row, WorkloadStatus.FAILED, "job_failed", details)


def _node_lost(tx: Tx, change: Change, report: SyncReport) -> None:
    from proofplane.service.nodes import change_node_state

    node = tx.session.scalar(select(NodeRow).where(NodeRow.name == change.node))
    if node is None:
        return
    current = NodeState(node.state)
    if current is NodeState.FAILED or not can_transition(current, NodeState.FAILED):
        return
    change_node_state(tx, node, NodeState.FAILED, f"engine: {change.message}")
    report.nodes_failed.append(node.name)


def sync(store: Store, backend: Backend, now: datetime | None = None) -> SyncReport:
    """One reconciliation pass (see the module docstring). Engine trouble is reported in
    ``SyncReport.error`` and changes nothing; the next pass tries again."""
    report = SyncReport()
    with store.write(SYSTEM, now) as tx:
        tx.backend = backend  # the flows this pass runs (node lost, retries) use this engine
        jobs = list(
            tx.session.scalars(
                select(ExecutionJobRow)
                .where(
                    ExecutionJobRow.state.in_(LIVE_STATES),
                    ExecutionJobRow.backend == backend.name,
                )
                .order_by(ExecutionJobRow.id)
            )
        )
        live: list[ExecutionJobRow] = []
        for job in jobs:
            if WorkloadStatus(job.workload.status).holds_capacity:
                live.append(job)
                continue
            try:  # the workload lost its placement in some flow: stop its job
                backend.cancel(job.job_id)
            except (BackendUnavailable, JobRejected) as exc:
                report.error = exc.message
                continue
            _set_job(tx, job, "cancelled", f"workload is {job.workload.status}")
            tx.record(
                "workload.engine_cancel",
                "workload",
                job.workload.name,
                details={"backend": job.backend, "job_id": job.job_id, "orphan": True},
            )
            report.orphans_cancelled.append(job.job_id)
        try:
            changes = backend.sync([j.job_id for j in live])
        except BackendUnavailable as exc:
            report.error = exc.message
            return report
        by_id = {j.job_id: j for j in live}
        for change in changes:
            report.changes.append(change.to_dict())
            if change.kind is ChangeKind.NODE_LOST:
                _node_lost(tx, change, report)
            elif change.job_id in by_id:
                _apply(tx, backend, by_id[change.job_id], change)
        # Retry what the engine could not take, then dispatch everything placed without a job.
        retry = tx.session.scalar(
            select(WorkloadRow.id).where(
                WorkloadRow.status == WorkloadStatus.PENDING.value,
                WorkloadRow.reason == BACKEND_UNAVAILABLE,
            )
        )
        if retry is not None:
            reschedule_pending(tx)
        placed = tx.session.scalars(
            select(WorkloadRow)
            .where(WorkloadRow.status == WorkloadStatus.PLACED.value)
            .options(*WORKLOAD_LOAD)
            .order_by(WorkloadRow.priority.desc(), WorkloadRow.created_at, WorkloadRow.id)
        )
        for row in list(placed):
            if row.status == WorkloadStatus.PLACED.value and dispatch_placed(tx, backend, row):
                report.dispatched.append(row.name)
    return report


def live_job_ids(store: Store, backend: Backend) -> list[str]:
    """The engine job ids proofplane believes are live on ``backend``."""
    with store.read() as session:
        return list(
            session.scalars(
                select(ExecutionJobRow.job_id)
                .where(
                    ExecutionJobRow.state.in_(LIVE_STATES),
                    ExecutionJobRow.backend == backend.name,
                )
                .order_by(ExecutionJobRow.id)
            )
        )


def stop_jobs(backend: Backend, job_ids: Iterable[str]) -> list[str]:
    """Cancel ``job_ids`` in the engine without touching the database (a demo that ends
    stops its processes; the next ``sync`` on this database reports them cancelled).
    Returns the ids the engine took; the others are logged."""
    stopped = []
    for job_id in job_ids:
        try:
            backend.cancel(job_id)
        except BackendError as exc:
            log.warning("cannot cancel job %s: %s", job_id, exc.message)
            continue
        stopped.append(job_id)
    return stopped


def jobs_of(store: Store, workload_id: int) -> list[dict[str, Any]]:
    """Every engine job of a workload, oldest first (for the API and the CLI)."""
    with store.read() as session:
        rows = session.scalars(
            select(ExecutionJobRow)
            .where(ExecutionJobRow.workload_id == workload_id)
            .order_by(ExecutionJobRow.id)
        )
        return [
            {
                "backend": r.backend,
                "job_id": r.job_id,
                "state": r.state,
                "message": r.message,
                "devices": r.devices,
                "created_at": r.created_at.isoformat(),
                "updated_at": r.updated_at.isoformat(),
            }
            for r in rows
        ]


@contextmanager
def sync_worker(store: Store, backend: Backend, interval_s: float | None) -> Iterator[Any]:
    """Run ``sync`` every ``interval_s`` seconds in a daemon thread while the context is open
    (the API server's lifespan); None or 0: no thread."""
    if not interval_s:
        yield None
        return
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(interval_s):
            try:
                report = sync(store, backend)
                if report.error:
                    log.warning("execution sync: %s", report.error)
            except Exception:  # keep the loop alive; the next pass retries
                log.exception("execution sync failed")

    thread = threading.Thread(target=loop, name="proofplane-execution-sync", daemon=True)
    thread.start()
    try:
        yield thread
    finally:
        stop.set()
        thread.join(timeout=interval_s + 5)


# --- read-side use cases (API, CLI) -------------------------------------------------------------


def workload_jobs(
    store: Store, actor: Actor, name: str, *, tenant: str | None = None
) -> dict[str, Any]:
    """The engine jobs of a workload the caller may see (hidden tenants: 404)."""
    authorize(actor, Permission.WORKLOADS_READ)
    visible = actor.visible_tenants(Permission.WORKLOADS_READ)
    with store.read() as session:
        row = workload_row(session, name, tenant=tenant, visible=visible)
        wid, wname, wtenant = row.id, row.name, row.tenant.name
    return {"workload": wname, "tenant": wtenant, "items": jobs_of(store, wid)}


def workload_logs(
    store: Store,
    actor: Actor,
    backend: Backend,
    name: str,
    *,
    tenant: str | None = None,
    stream: str = "stdout",
    tail_bytes: int | None = None,
) -> dict[str, Any]:
    """The captured output of a workload's latest job on the local executor. Other engines
    keep output themselves (Slurm: its --output files; Kubernetes: kubectl logs)."""
    jobs = workload_jobs(store, actor, name, tenant=tenant)
    latest = jobs["items"][-1] if jobs["items"] else None
    out: dict[str, Any] = {
        "workload": jobs["workload"],
        "tenant": jobs["tenant"],
        "stream": stream,
        "job_id": latest["job_id"] if latest else None,
        "backend": latest["backend"] if latest else backend.name,
        "text": "",
    }
    if latest is None:
        return out
    from proofplane.backends.local import LocalExecutor

    if latest["backend"] != "local" or not isinstance(backend, LocalExecutor):
        raise InvalidState(
            f"workload {name!r} ran on {latest['backend']}: read its output there",
            code="logs_in_engine",
            details={"backend": latest["backend"], "job_id": latest["job_id"]},
        )
    data = backend.logs(latest["job_id"], stream, tail_bytes)
    out["text"] = data.decode("utf-8", errors="replace")
    return out


def review_admission(store: Store, actor: Actor, document: dict[str, Any]) -> dict[str, Any]:
    """Decide a Kubernetes AdmissionReview against proofplane's certifications."""
    from proofplane.backends.k8s import NodeFacts, admission_review

    authorize(actor, Permission.NODES_READ)
    with store.read() as session:

        def lookup(node: str) -> NodeFacts | None:
            row = session.scalar(select(NodeRow).where(NodeRow.name == node))
            if row is None:
                return None
            facts = node_from_row(row)
            return NodeFacts(
                facts.state is NodeState.ADMITTED, dict(facts.certifications), facts.state.value
            )

        return admission_review(document, lookup)
