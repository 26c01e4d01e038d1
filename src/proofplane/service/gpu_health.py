"""GPU health (issue 15): draining a GPU whose readings say it failed, and an operator's
recovery.

``drain`` runs inside the telemetry ingest's transaction when ``meter.health`` finds a fatal
reading. It records the GPU as drained (``gpu_health``: placement no longer offers it, see
``store.repo.schedulable``), writes ``gpu.drain`` (target: the node, so every scheduler cache
re-reads it), cordons the node when the finding is the node's (a GPU that fell off the bus:
the existing lifecycle, ``node.state`` admitted → cordoned, keeps the other GPUs' work), and
when the device is lost evicts the work that held it with reason ``gpu_unhealthy``: it is
re-placed at once, only where its compliance tags hold, or waits with a reason.

Recovery is an operator's action: ``recover`` (``nodes:write``) returns the GPU to service
(``gpu.recover``) and offers it to pending work; a cordoned node is uncordoned the usual way.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select

from proofplane.access import Actor, Permission, authorize
from proofplane.errors import NotFound
from proofplane.meter.health import Finding
from proofplane.model import NodeState, Outcome
from proofplane.schedule.reasons import GPU_UNHEALTHY, render
from proofplane.service import execution
from proofplane.service.context import Store, Tx
from proofplane.service.lifecycle import change_node_state, workloads_on
from proofplane.service.runbooks import with_runbook
from proofplane.service.scheduling import ClusterView, evict, reschedule_pending
from proofplane.store.repo import node_row
from proofplane.store.tables import GpuHealthRow, GpuRow, NodeRow

DRAINED = "drained"


def drain(tx: Tx, node: NodeRow, gpu_uuid: str, finding: Finding) -> dict[str, Any] | None:
    """Drain ``gpu_uuid`` of ``node`` for ``finding`` (see the module docstring); None when
    it changes nothing (the GPU is already drained, and its work already moved if lost)."""
    session = tx.session
    row = session.get(GpuHealthRow, gpu_uuid)
    newly_lost = finding.device_lost and (row is None or not row.device_lost)
    cordon = finding.scope == "node" and node.state == NodeState.ADMITTED.value
    if row is not None and not newly_lost and not cordon:
        return None
    if row is None:
        row = GpuHealthRow(
            gpu_uuid=gpu_uuid, node=node.name, state=DRAINED, cause=finding.cause,
            message=finding.message, xid=finding.xid, device_lost=finding.device_lost,
            since=tx.now,
        )  # fmt: skip
        session.add(row)
    elif newly_lost:
        row.device_lost = True
        row.cause, row.message, row.xid = finding.cause, finding.message, finding.xid
    session.flush()
    index = session.scalar(select(GpuRow.index).where(GpuRow.uuid == gpu_uuid))
    details = {
        "gpu_uuid": gpu_uuid,
        "gpu_index": index,
        "cause": finding.cause,
        "scope": finding.scope,
        "device_lost": finding.device_lost,
        "message": finding.message,
        "field": finding.field,
        "value": finding.value,
        "xid": finding.xid,
    }
    tx.record("gpu.drain", "node", node.name,
              details=with_runbook(details, "gpu.drain", "success", session))  # fmt: skip
    # the alert (M2's alert worker takes every alert.* event to Alertmanager and webhooks)
    alert = {
        "severity": "critical" if finding.device_lost or finding.scope == "node" else "high",
        "node": node.name,
        "gpu_uuid": gpu_uuid,
        "gpu_index": index,
        "xid": finding.xid,
        "kind": finding.cause,
        "action": "drain_node" if finding.scope == "node" else "drain_device",
        "device_lost": finding.device_lost,
        "message": finding.message,
    }
    alert = with_runbook(alert, "alert.gpu_health", Outcome.FAILURE, session)
    tx.record("alert.gpu_health", "node", node.name, outcome=Outcome.FAILURE, details=alert)
    evicted: list[str] = []
    view = ClusterView(session, from_cache=True)
    if cordon:
        change_node_state(tx, node, NodeState.CORDONED, f"GPU {gpu_uuid}: {finding.message}")
    if newly_lost:
        why = render(GPU_UNHEALTHY, gpu=gpu_uuid, node=node.name, why=finding.message)
        for wl in workloads_on(tx, node):
            placement = wl.placement
            held = placement is not None and any(
                d.get("gpu_uuid") == gpu_uuid
                for part in (placement.members or [{"devices": placement.devices}])
                for d in part.get("devices") or ()
            )
            if held:
                evict(tx, wl, view, GPU_UNHEALTHY, why)
                evicted.append(wl.name)
        if evicted:
            reschedule_pending(tx, view)
            execution.dispatch_new(tx, view)
    return {**details, "node": node.name, "evicted": evicted, "cordoned": cordon}


def recover(store: Store, actor: Actor, node: str, gpu_uuid: str) -> dict[str, Any]:
    """Return a drained GPU to service (an operator's action): ``gpu.recover``, and pending
    work is offered the capacity. 404 ``gpu_not_drained`` when it is not drained."""
    authorize(actor, Permission.NODES_WRITE)
    with store.write(actor) as tx:
        row = node_row(tx.session, node)
        health = tx.session.get(GpuHealthRow, gpu_uuid)
        if health is None or health.node != row.name:
            raise NotFound(
                f"GPU {gpu_uuid} of node {node!r} is not drained",
                code="gpu_not_drained",
                details={"node": node, "gpu_uuid": gpu_uuid},
            )
        out = _as_dict(health)
        tx.session.delete(health)
        tx.session.flush()
        tx.record("gpu.recover", "node", row.name, details={
            "gpu_uuid": gpu_uuid, "cause": out["cause"], "drained_since": out["since"],
        })  # fmt: skip
        view = ClusterView(tx.session, from_cache=True)
        reschedule_pending(tx, view)
        execution.dispatch_new(tx, view)
        still = row.state == NodeState.CORDONED.value
        return {**out, "state": "recovered", "node_cordoned": still}


def list_drained(store: Store, actor: Actor, node: str | None = None) -> list[dict[str, Any]]:
    """The GPUs drained for their health (of ``node``, or all), oldest first."""
    authorize(actor, Permission.NODES_READ)
    q = select(GpuHealthRow).order_by(GpuHealthRow.since, GpuHealthRow.gpu_uuid)
    if node is not None:
        q = q.where(GpuHealthRow.node == node)
    with store.read() as session:
        return [_as_dict(r) for r in session.scalars(q)]


def _as_dict(r: GpuHealthRow) -> dict[str, Any]:
    return {
        "gpu_uuid": r.gpu_uuid,
        "node": r.node,
        "state": r.state,
        "cause": r.cause,
        "message": r.message,
        "xid": r.xid,
        "device_lost": r.device_lost,
        "since": r.since.isoformat(),
    }
