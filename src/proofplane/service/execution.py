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
* ``jobs.cancel(tx, backend, row)`` — in the cancel flow, before the placement is cleared, and
  on every eviction (node failure, lost certification, preemption: ``scheduling._evict_row``);
  :mod:`proofplane.service.jobs` keeps the job rows, below scheduling.
* ``node_state_changed(tx, node, before, after, reason)`` — drain the node in the engine when
  it leaves service (cordoned, quarantined, failed, decommissioned), resume it when it is
  admitted again; a failed drain is an event with outcome failure.
* ``reconcile.sync(store, backend)`` — the reconciliation pass (a background worker runs it,
  :mod:`proofplane.service.reconcile`): orphaned jobs cancelled, the engine's status changes
  applied, lost nodes failed, ``backend_unavailable`` retried, placed work dispatched.

Layers, bottom up: ``jobs`` < ``scheduling`` < ``execution`` < ``lifecycle`` (node state
changes) < ``attestation``, ``nodes``, ``reconcile``; no module imports one above it.

Workloads without a command are reservations (the simulator's and the scheduler tests'
workloads): they are never dispatched.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from sqlalchemy import bindparam, func, select
from sqlalchemy import event as sa_event

from proofplane.access import Actor, Permission, authorize
from proofplane.backends.base import (
    Backend,
    BackendError,
    BackendUnavailable,
    DrainFailed,
    JobRejected,
    JobSpec,
)
from proofplane.config import ExecutionSettings
from proofplane.errors import InvalidState
from proofplane.model import NodeState, Outcome, WorkloadStatus
from proofplane.service import netstate
from proofplane.service.context import Store, Tx
from proofplane.service.jobs import LIVE_STATES, live_job
from proofplane.service.scheduling import ClusterView, evict, reschedule_pending
from proofplane.store.repo import WORKLOAD_LOAD, node_from_row, workload_from_row, workload_row
from proofplane.store.tables import ExecutionJobRow, GpuRow, NodeRow, WorkloadRow

log = logging.getLogger("proofplane.execution")

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

    from proofplane.backends.local import Limits, LocalExecutor, Sandbox

    state_dir = settings.local_state_dir or str(
        Path(platformdirs.user_data_dir("proofplane")) / "executor"
    )
    return LocalExecutor(
        state_dir,
        limits=Limits(
            memory_mb=settings.local_memory_mb, cpus=settings.local_cpus, pids=settings.local_pids
        ),
        sandbox=Sandbox(enabled=settings.local_sandbox, user=settings.local_job_user),
    )


def _gpu_models(tx: Tx, row: WorkloadRow) -> dict[str, str]:
    assert row.placement is not None
    uuids = [d["gpu_uuid"] for d in row.placement.devices]
    for member in row.placement.members or ():
        uuids.extend(d["gpu_uuid"] for d in member["devices"])
    found = tx.session.execute(select(GpuRow.uuid, GpuRow.model).where(GpuRow.uuid.in_(uuids)))
    return {uuid: model for uuid, model in found}


def finish(
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
    netstate.touch(tx, [row.id])  # its endpoints (and a per-workload segment) end with it
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
        view = view or ClusterView(tx.session, from_cache=True)
        evict(tx, row, view, BACKEND_UNAVAILABLE, exc.message)
        return None
    except JobRejected as exc:
        tx.record(
            "workload.dispatch",
            "workload",
            row.name,
            outcome=Outcome.FAILURE,
            details={"backend": backend.name, "node": node, "error": exc.message},
        )
        finish(
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


@functools.cache
def _to_dispatch(postgres: bool) -> Any:
    """The ids of placed workloads with a command and no live job, highest priority first
    (built once per dialect, its cache key too: building it cost more than running it). Only
    workloads with a command run anywhere: placements without one (the engine is somebody
    else's, or nothing runs) are never read here, however many a fleet holds. A Core read of
    ids: the rows, as ORM objects with what dispatching needs, are loaded only when there is
    something to dispatch (issue 20: every submit and cancel with an engine runs this, and the
    ORM query's own cost was most of a replica's dispatch time when it found nothing)."""
    has_job = (
        select(ExecutionJobRow.id)
        .where(
            ExecutionJobRow.workload_id == WorkloadRow.id,
            ExecutionJobRow.state.in_(LIVE_STATES),
        )
        .exists()
    )
    length = func.jsonb_array_length if postgres else func.json_array_length
    return (
        select(WorkloadRow.id)
        .where(
            WorkloadRow.status == WorkloadStatus.PLACED.value,
            length(WorkloadRow.command) > 0,
            ~has_job,
        )
        .order_by(WorkloadRow.priority.desc(), WorkloadRow.created_at, WorkloadRow.id)
    )


_DISPATCH_ROWS = (
    select(WorkloadRow)
    .where(WorkloadRow.id.in_(bindparam("ids", expanding=True)))
    .options(*WORKLOAD_LOAD)
)


def dispatch_new(tx: Tx, view: ClusterView | None = None) -> list[str]:
    """Dispatch, with the transaction's engine (``Tx.backend``), every placed workload that
    has a command and no live job: what this transaction placed, and anything an earlier flow
    placed without dispatching. Returns the names dispatched; no engine: nothing."""
    backend = tx.backend
    if backend is None:
        return []
    query = _to_dispatch(tx.session.get_bind().dialect.name == "postgresql")
    out: list[str] = []
    seen: set[int] = set()
    session = tx.session
    while True:  # a rejected job frees capacity that pending work may take: dispatch that too
        session.flush()  # what this transaction placed is what the read below sees
        ids = [i for i in session.connection().execute(query).scalars() if i not in seen]
        if not ids:
            return out
        seen.update(ids)  # each looked at once, even one gone by the time it is loaded
        loaded = {r.id: r for r in session.scalars(_DISPATCH_ROWS, {"ids": ids})}
        for row in (loaded[i] for i in ids if i in loaded):  # in the order of the read above
            if row.command and dispatch_placed(tx, backend, row, view) is not None:
                out.append(row.name)


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
