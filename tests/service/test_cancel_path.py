"""A cancel reads and changes its workload by Core statements (issue 20: the ORM's load and
flush were a fifth of a cancel), and through the ORM when its transaction already holds the
workload or its placement as objects. Either way: the same answer, rows, events and capacity."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import event as sa_event
from sqlalchemy import func, select

from proofplane.access import SYSTEM
from proofplane.errors import Conflict, InvalidState, NotFound
from proofplane.model import GpuRequest, WorkloadStatus
from proofplane.service import workloads as workloads_svc
from proofplane.service.context import Store
from proofplane.service.scheduling import ClusterView
from proofplane.store.tables import EventRow, PlacementRow, WorkloadRow, placement_nodes

TENANT = "research-lab"


def _spec(name: str, count: int = 1) -> workloads_svc.WorkloadSpec:
    return workloads_svc.WorkloadSpec(name=name, tenant=TENANT, gpus=GpuRequest(count=count))


def _rows(store: Store, name: str) -> tuple[Any, int, int]:
    """The workload's row values, its placements and their node links."""
    with store.read() as session:
        row = session.execute(
            select(
                WorkloadRow.id, WorkloadRow.status, WorkloadRow.reason, WorkloadRow.reason_details
            ).where(WorkloadRow.name == name)
        ).one()
        placements = session.scalar(
            select(func.count()).select_from(PlacementRow).where(PlacementRow.workload_id == row.id)
        )
        links = session.scalar(select(func.count()).select_from(placement_nodes))
    return row, placements, links


def _cancel_events(store: Store, name: str) -> list[dict[str, Any]]:
    with store.read() as session:
        return list(
            session.scalars(
                select(EventRow.details).where(
                    EventRow.action == "workload.cancel", EventRow.target_id == name
                )
            )
        )


def test_a_cancel_loads_no_orm_object_and_answers_as_a_read_would(demo: Store) -> None:
    placed = workloads_svc.submit_workload(demo, SYSTEM, _spec("c-1", count=2))
    assert placed.placement is not None
    _, _, links_before = _rows(demo, "c-1")
    loaded: list[str] = []

    def on_load(target: WorkloadRow, _context: object) -> None:
        loaded.append(target.name)

    sa_event.listen(WorkloadRow, "load", on_load)
    try:
        answer = workloads_svc.cancel_workload(demo, SYSTEM, "c-1", "done with it")
    finally:
        sa_event.remove(WorkloadRow, "load", on_load)
    assert "c-1" not in loaded
    assert answer == workloads_svc.get_workload(demo, SYSTEM, "c-1")
    assert answer.status is WorkloadStatus.CANCELLED and answer.placement is None
    assert answer.reason_details == {"message": "done with it"}
    row, placements, links = _rows(demo, "c-1")
    assert row.status == WorkloadStatus.CANCELLED.value and placements == 0
    assert links == links_before - 1  # the placement's node link went with it
    assert _cancel_events(demo, "c-1") == [
        {"tenant": TENANT, "from_status": "placed", "node": placed.placement.node,
         "reason": "done with it"}
    ]  # fmt: skip
    with demo.read() as session:  # its capacity is free again, as a fresh load sees it
        held = {h.name for h in ClusterView(session).scheduler.held.values()}
    assert "c-1" not in held


def test_a_cancel_in_the_transaction_that_submitted_goes_through_the_orm(demo: Store) -> None:
    """Submitted and cancelled in one transaction (as a group commit may do): the workload is
    an ORM object there, and the cancel changes it through that object, not behind it."""
    with demo.write(SYSTEM) as tx:
        view = ClusterView.cached(tx)
        row = workloads_svc.insert_workload(tx, _spec("c-2"), GpuRequest(count=1), view=view)
        assert row.placement is not None
        answer = workloads_svc._cancel_in_group(tx, ("c-2", None, TENANT, None))
        assert row.status == WorkloadStatus.CANCELLED.value and row.placement is None
    assert answer == workloads_svc.get_workload(demo, SYSTEM, "c-2")
    assert answer.status is WorkloadStatus.CANCELLED
    _, placements, _ = _rows(demo, "c-2")
    assert placements == 0
    assert len(_cancel_events(demo, "c-2")) == 1


def test_a_pending_workload_is_cancelled_and_frees_nothing(demo: Store) -> None:
    waiting = [workloads_svc.submit_workload(demo, SYSTEM, _spec(f"p-{i}", 8)) for i in range(30)]
    name = next(w.name for w in waiting if w.placement is None)
    answer = workloads_svc.cancel_workload(demo, SYSTEM, name)
    assert answer.status is WorkloadStatus.CANCELLED
    assert _cancel_events(demo, name)[0]["node"] is None
    assert answer == workloads_svc.get_workload(demo, SYSTEM, name)


def test_refused_cancels_change_nothing(demo: Store) -> None:
    workloads_svc.submit_workload(demo, SYSTEM, _spec("r-1"))
    workloads_svc.cancel_workload(demo, SYSTEM, "r-1")
    before = _rows(demo, "r-1"), _cancel_events(demo, "r-1")
    with pytest.raises(InvalidState) as again:
        workloads_svc.cancel_workload(demo, SYSTEM, "r-1")
    assert again.value.details == {"workload": "r-1", "status": "cancelled"}
    with pytest.raises(NotFound):
        workloads_svc.cancel_workload(demo, SYSTEM, "no-such-workload")
    with pytest.raises(NotFound):
        workloads_svc.cancel_workload(demo, SYSTEM, "r-1", tenant="another-tenant")
    assert (_rows(demo, "r-1"), _cancel_events(demo, "r-1")) == before


def test_a_name_two_tenants_use_needs_the_tenant(demo: Store) -> None:
    for tenant in (TENANT, "berlin-telco"):
        spec = workloads_svc.WorkloadSpec(name="same", tenant=tenant, gpus=GpuRequest(count=1))
        workloads_svc.submit_workload(demo, SYSTEM, spec)
    with pytest.raises(Conflict) as ambiguous:
        workloads_svc.cancel_workload(demo, SYSTEM, "same")
    assert ambiguous.value.code == "ambiguous_name"
    answer = workloads_svc.cancel_workload(demo, SYSTEM, "same", tenant="berlin-telco")
    assert answer.tenant == "berlin-telco" and answer.status is WorkloadStatus.CANCELLED
    other = workloads_svc.get_workload(demo, SYSTEM, "same", tenant=TENANT)
    assert other.status is not WorkloadStatus.CANCELLED
