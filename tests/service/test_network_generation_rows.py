"""A new desired generation is written with one Core UPDATE from the nodes' columns (issue 20:
no ORM row loaded for it); a node's row that the same transaction already holds as an object
is told the values it now has, so nothing later in the transaction, or after it, reads a
stale generation from it."""

from __future__ import annotations

from sqlalchemy import select

from proofplane.access import SYSTEM
from proofplane.model import GpuRequest
from proofplane.service.context import Store
from proofplane.service.workloads import WorkloadSpec, submit_workload
from proofplane.store.tables import NodeNetworkRow, NodeRow

COLUMNS = ("desired_generation", "desired_sha256", "segment_since", "expected_ruleset_sha256",
           "drift")  # fmt: skip


def _stored(store: Store, node_id: int) -> tuple[object, ...]:
    with store.read() as session:
        row = session.get(NodeNetworkRow, node_id)
        assert row is not None
        return tuple(getattr(row, c) for c in COLUMNS)


def test_a_row_held_as_an_object_is_told_its_new_generation(demo: Store) -> None:
    with demo.write(SYSTEM) as tx:
        held = {
            name: row
            for row, name in tx.session.execute(
                select(NodeNetworkRow, NodeRow.name).join(
                    NodeRow, NodeRow.id == NodeNetworkRow.node_id
                )
            )
        }
        before = {name: row.desired_generation for name, row in held.items()}
        spec = WorkloadSpec(name="held-rows", tenant="research-lab", gpus=GpuRequest(count=1))
        with demo.joined(tx):
            placed = submit_workload(demo, SYSTEM, spec)
    assert placed.placement is not None
    node = held[placed.placement.node]
    assert node.desired_generation == before[placed.placement.node] + 1  # a new generation
    for row in held.values():  # every row as stored, the bumped one included
        assert tuple(getattr(row, c) for c in COLUMNS) == _stored(demo, row.node_id)
