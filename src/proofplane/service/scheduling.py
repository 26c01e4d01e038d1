"""Turning placement decisions into state: reserve, evict, retry pending work.

Called from inside a write transaction by the services whose changes move capacity (submit,
cancel, node state, certifications). The decision itself is the pure ``schedule.placer``.
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from proofplane.model import IsolationLevel, Node, Outcome, WorkloadStatus
from proofplane.schedule.placer import Allocation, Request, place
from proofplane.service.context import Tx
from proofplane.store.repo import (
    NODE_LOAD,
    WORKLOAD_LOAD,
    devices_to_json,
    node_from_row,
    placement_from_row,
    workload_from_row,
)
from proofplane.store.tables import NodeRow, PlacementRow, WorkloadRow


class ClusterView:
    """What placement needs to know, loaded once per transaction and kept current in it."""

    def __init__(self, session: Session) -> None:
        rows = session.scalars(select(NodeRow).options(*NODE_LOAD).order_by(NodeRow.name))
        self.node_ids: dict[str, int] = {}
        self.nodes: list[Node] = []
        for row in rows:
            self.node_ids[row.name] = row.id
            self.nodes.append(node_from_row(row))
        placed = session.scalars(
            select(WorkloadRow).join(WorkloadRow.placement).options(*WORKLOAD_LOAD)
        )
        self.allocations: dict[int, Allocation] = {
            w.id: _allocation(w) for w in placed if w.placement is not None
        }


def _allocation(row: WorkloadRow) -> Allocation:
    assert row.placement is not None
    return Allocation(
        f"{row.tenant.name}/{row.name}",
        row.tenant.name,
        IsolationLevel(row.isolation),
        placement_from_row(row.placement),
    )


def decision_details(row: WorkloadRow) -> dict[str, object]:
    """What drove a decision, as every placement event states it (NIST AU-3 'what and why')."""
    return {
        "tenant": row.tenant.name,
        "tags": dict(row.tags),
        "isolation": row.isolation,
        "gpus": {
            "count": row.gpu_count,
            "model": row.gpu_model,
            "mig_profile": row.mig_profile,
            "share_milli": row.share_milli,
        },
    }


def schedule(tx: Tx, row: WorkloadRow, view: ClusterView) -> bool:
    """Try to place one pending workload; record the placement or why it waits."""
    wl = workload_from_row(row)
    decision = place(
        Request(f"{wl.tenant}/{wl.name}", wl.tenant, wl.tags, wl.isolation, wl.gpus),
        view.nodes,
        view.allocations.values(),
    )
    if decision.placement is not None:
        placement = decision.placement
        row.placement = PlacementRow(
            node_id=view.node_ids[placement.node],
            devices=devices_to_json(placement.devices),
            placed_at=tx.now,
        )
        row.status = WorkloadStatus.PLACED.value
        row.reason = None
        row.reason_details = None
        row.updated_at = tx.now
        tx.session.flush()
        view.allocations[row.id] = _allocation(row)
        tx.record(
            "workload.place",
            "workload",
            row.name,
            details={
                **decision_details(row),
                "node": placement.node,
                "devices": devices_to_json(placement.devices),
            },
        )
        return True
    details = {"message": decision.message, "rejections": decision.rejections}
    if row.reason != decision.reason or row.reason_details != details:
        row.reason = decision.reason
        row.reason_details = details
        row.updated_at = tx.now
        tx.record(
            "workload.pending",
            "workload",
            row.name,
            outcome=Outcome.FAILURE,
            details={**decision_details(row), "reason": decision.reason, **details},
        )
    return False


def evict(tx: Tx, row: WorkloadRow, view: ClusterView, reason: str, message: str) -> None:
    """Take a workload's capacity away (its node failed, lost a certification…): it is pending
    again and will be placed only where its tags are still satisfied."""
    assert row.placement is not None
    node = row.placement.node.name
    row.placement = None
    row.status = WorkloadStatus.PENDING.value
    row.reason = reason
    row.reason_details = {"message": message, "from_node": node}
    row.updated_at = tx.now
    tx.session.flush()
    view.allocations.pop(row.id, None)
    tx.record(
        "workload.evict",
        "workload",
        row.name,
        details={**decision_details(row), "node": node, "reason": reason, "message": message},
    )


def reschedule_pending(tx: Tx, view: ClusterView | None = None) -> None:
    """Offer capacity to every pending workload, highest priority first, oldest first."""
    view = view or ClusterView(tx.session)
    pending = tx.session.scalars(
        select(WorkloadRow)
        .where(WorkloadRow.status == WorkloadStatus.PENDING.value)
        .options(*WORKLOAD_LOAD)
        .order_by(WorkloadRow.priority.desc(), WorkloadRow.created_at, WorkloadRow.id)
    )
    for row in list(pending):
        schedule(tx, row, view)
