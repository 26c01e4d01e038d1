"""A node's lifecycle transition and everything that follows from it, in one transaction.

Every flow that moves a node (an operator, attestation, the cluster file, the engine losing
the node in the sync pass) goes through :func:`change_node_state`, so eviction, compliant
re-placement and the engine's drain happen the same way whoever asked.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import bindparam, select

from proofplane.errors import InvalidState
from proofplane.model import KEEPS_WORK, NodeState, can_transition
from proofplane.schedule.reasons import node_left_service
from proofplane.service import execution
from proofplane.service.context import Tx
from proofplane.service.runbooks import with_runbook
from proofplane.service.scheduling import ClusterView, evict, reschedule_pending
from proofplane.store.repo import WORKLOAD_LOAD
from proofplane.store.tables import NodeRow, PlacementRow, WorkloadRow

#: states in which a node's agent certificates are revoked at once
REVOKING_STATES = frozenset({NodeState.QUARANTINED, NodeState.FAILED, NodeState.DECOMMISSIONED})


def change_node_state(tx: Tx, row: NodeRow, state: NodeState, reason: str | None) -> None:
    """Move the node to ``state`` inside ``tx`` and carry out what follows: the event, the
    engine told (drain or resume), its work evicted when the node leaves service and
    re-placed only where its tags hold, pending work offered the capacity, new placements
    dispatched. ``no_change`` / ``invalid_transition`` when the move is not allowed.

    Placement, when it is needed (work to evict, work pending), starts from the process's
    cached scheduler caught up from the events, this change's own included: the changed node
    is read again, not the cluster (issue 20: a staleness pass quarantining hundreds of nodes
    under an overload loaded the whole cluster once for each, under the write lock). The next
    change of the same transaction (such a pass, a cluster file) gets the same scheduler,
    caught up on what was written since (``SchedulerCache``)."""
    current = NodeState(row.state)
    if current == state:
        raise InvalidState(
            f"node {row.name!r} is already {state.value}",
            code="no_change",
            details={"node": row.name, "state": state.value},
        )
    if not can_transition(current, state):
        raise InvalidState(
            f"node {row.name!r} cannot go from {current.value} to {state.value}",
            code="invalid_transition",
            details={"node": row.name, "from": current.value, "to": state.value},
        )
    row.state = state.value
    row.state_reason = reason
    row.updated_at = tx.now
    tx.session.flush()
    tx.record(
        "node.state",
        "node",
        row.name,
        details=_with_runbook(tx, {"from": current.value, "to": state.value, "reason": reason}),
    )
    execution.node_state_changed(tx, row.name, current, state, reason)
    if state in REVOKING_STATES:
        # its channel certificates stop working now, not when they expire (issue 13)
        from proofplane.service.pki import revoke_node

        revoke_node(tx, row.name, f"node {state.value}: {reason or 'no reason given'}")
    view = ClusterView(tx.session, from_cache=True)
    if state not in KEEPS_WORK:
        code, why = node_left_service(row.name, state, reason)
        for wl in workloads_on(tx, row):
            evict(tx, wl, view, code, why)
    reschedule_pending(tx, view)
    execution.dispatch_new(tx, view)


def workloads_on(tx: Tx, node: NodeRow | int) -> list[WorkloadRow]:
    """Workloads holding capacity on the node (its row or id), gang members included."""
    node_id = node if isinstance(node, int) else node.id
    return list(tx.session.scalars(_ON_NODE, {"node": node_id}))


# Built once (its cache key too): building the statement cost more than running it.
_ON_NODE = (
    select(WorkloadRow)
    .join(WorkloadRow.placement)
    .where(PlacementRow.nodes.any(NodeRow.id == bindparam("node")))
    .options(*WORKLOAD_LOAD)
    .order_by(WorkloadRow.name)
)


def _with_runbook(tx: Tx, details: dict[str, Any]) -> dict[str, Any]:
    """A node that failed or was quarantined names the runbook that answers it."""
    if details["to"] in (NodeState.FAILED.value, NodeState.QUARANTINED.value):
        return with_runbook(details, "node.state", "success", tx.session)
    return details
