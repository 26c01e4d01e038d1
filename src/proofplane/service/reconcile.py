"""The reconciliation pass between proofplane and the engine (``sync``; the server runs it in
the background: ``proofplane.workers.reconcile``).

One pass, in one write transaction: cancel engine jobs whose workload lost its placement
(evictions from any flow), apply the engine's status changes, mark nodes the engine lost as
failed (through the node lifecycle, so their work is re-placed only on compliant nodes),
retry ``backend_unavailable`` workloads, and dispatch placed workloads that have no job yet (a
crash between placement and dispatch loses nothing). Engine trouble is reported in
``SyncReport.error`` and changes nothing; the next pass tries again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import select

from proofplane.access import SYSTEM
from proofplane.backends.base import Backend, BackendUnavailable, Change, ChangeKind, JobRejected
from proofplane.model import NodeState, Outcome, WorkloadStatus, can_transition
from proofplane.service.context import Store, Tx
from proofplane.service.execution import BACKEND_UNAVAILABLE, dispatch_placed, finish
from proofplane.service.jobs import LIVE_STATES, set_job
from proofplane.service.lifecycle import change_node_state
from proofplane.service.runbooks import with_runbook
from proofplane.service.scheduling import reschedule_pending
from proofplane.store.repo import WORKLOAD_LOAD, node_from_row, workload_from_row
from proofplane.store.tables import ExecutionJobRow, NodeRow, WorkloadRow


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
                details=with_runbook(
                    {"node": node_name, "placed": list(want), "engine": list(got)},
                    "workload.device_mismatch",
                    "failure",
                    tx.session,
                ),  # fmt: skip
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
            set_job(tx, job, "running", change.message)
            if row.status == WorkloadStatus.PLACED.value:
                row.status = WorkloadStatus.RUNNING.value
                row.updated_at = tx.now
                tx.record("workload.running", "workload", row.name, details=details)
        return
    set_job(tx, job, change.kind.value, change.message)
    if change.exit_code is not None:
        details["exit_code"] = change.exit_code
    if not WorkloadStatus(row.status).holds_capacity:
        return  # proofplane already moved on (cancelled, evicted): nothing to tell it
    if change.kind is ChangeKind.SUCCEEDED:
        finish(tx, row, WorkloadStatus.SUCCEEDED, None, details)
    elif change.kind is ChangeKind.CANCELLED:
        finish(tx, row, WorkloadStatus.CANCELLED, "cancelled_in_engine", details)
    else:
        finish(tx, row, WorkloadStatus.FAILED, "job_failed", details)


def _node_lost(tx: Tx, change: Change, report: SyncReport) -> None:
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
            set_job(tx, job, "cancelled", f"workload is {job.workload.status}")
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
