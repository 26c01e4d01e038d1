"""Engine job rows: which job of a workload is live, its state, and stopping it.

The lowest layer of execution: scheduling's eviction stops an evicted workload's job through
``cancel_engine_job`` without knowing anything else of the engine, and
:mod:`proofplane.service.execution` (dispatch) and :mod:`proofplane.service.reconcile` (the sync
pass) keep job rows through ``set_job``.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select

from proofplane.backends.base import Backend, BackendUnavailable, JobRejected
from proofplane.model import Outcome
from proofplane.service.context import Tx
from proofplane.store.tables import ExecutionJobRow, WorkloadRow

#: job states in which the engine may still run the job
LIVE_STATES = ("submitted", "running")


def live_job(session: Any, row: WorkloadRow) -> ExecutionJobRow | None:
    """The workload's job the engine may still be running, if any."""
    return session.scalar(  # type: ignore[no-any-return]
        select(ExecutionJobRow).where(
            ExecutionJobRow.workload_id == row.id, ExecutionJobRow.state.in_(LIVE_STATES)
        )
    )


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
    set_job(tx, job, "cancelled", "cancelled by proofplane")
    tx.record(
        "workload.engine_cancel",
        "workload",
        row.name,
        details={"backend": job.backend, "job_id": job.job_id},
    )


def set_job(tx: Tx, job: ExecutionJobRow, state: str, message: str | None) -> None:
    """Record the engine's word on a job (``state`` one of the job states)."""
    job.state = state
    job.message = message
    job.updated_at = tx.now
