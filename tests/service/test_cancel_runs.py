"""Cancels queued in one group commit (``Store.write_grouped`` with ``apply_many``, issue 20):
each run of one actor's cancels is applied at once (one workload read, one placement delete,
the rows in one executemany, the events in one insert), with the rows, events, answers and
capacity one cancel after the other gives; a refused cancel (not found, already ended, named
twice) sends the run back to one at a time, so only that one fails; when pending work may take
the capacity, each cancel offers it in its turn."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import func, select

from dbtest import traced_statements
from grouped import queued
from proofplane.access import SYSTEM, Actor, Role
from proofplane.errors import ProofplaneError
from proofplane.model import GpuRequest, WorkloadStatus
from proofplane.service import workloads as workloads_svc
from proofplane.service.context import Store
from proofplane.service.scheduling import ClusterView
from proofplane.service.workloads import WorkloadSpec, cancel_workload, submit_workload
from proofplane.store.tables import EventRow, PlacementRow, WorkloadRow

OPS = Actor("user:ops", frozenset({Role.ADMIN}))
TENANT = "research-lab"


def _submit(store: Store, name: str, count: int = 1) -> Any:
    return submit_workload(
        store, SYSTEM, WorkloadSpec(name=name, tenant=TENANT, gpus=GpuRequest(count=count))
    )


def _queued(store: Store, sends: list[tuple[Actor, str, str | None]]) -> list[Any]:
    """Each (actor, name, reason) cancelled in this order into one group; their outcomes."""
    calls = [
        lambda a=actor, n=name, r=reason: cancel_workload(store, a, n, r)
        for actor, name, reason in sends
    ]
    return queued(store, workloads_svc._cancel_in_group, calls)


def _log(store: Store, names: set[str]) -> list[tuple[str, str, str, Any]]:
    with store.read() as session:
        return [
            (e.actor, e.action, e.target_id, e.details)
            for e in session.scalars(
                select(EventRow).where(EventRow.target_id.in_(names)).order_by(EventRow.seq)
            )
        ]


def _held(store: Store) -> set[str]:
    """The workloads holding capacity, as a fresh load of the cluster sees them."""
    with store.read() as session:
        return {h.name for h in ClusterView(session).scheduler.held.values()}


def _cached_held(store: Store) -> set[str]:
    """The same, as the process's cached scheduler sees them (caught up if behind)."""
    with store.write(SYSTEM) as tx:
        return {h.name for h in ClusterView.cached(tx).scheduler.held.values()}


def test_one_actors_queued_cancels_are_applied_together(demo: Store) -> None:
    names = ["k-a", "k-b", "k-c", "k-d"]
    placed = {n: _submit(demo, n) for n in names}
    assert all(w.placement is not None for w in placed.values())
    seen = traced_statements(demo)
    seen.clear()
    out = _queued(demo, [(SYSTEM, n, f"done with {n}" if n != "k-c" else None) for n in names])
    assert [w.name for w in out] == names
    assert all(w.status is WorkloadStatus.CANCELLED and w.placement is None for w in out)
    assert out[0].reason_details == {"message": "done with k-a"}
    assert out[2].reason_details == {"message": "cancelled by system"}
    reads = [s for s in seen if "FROM workloads" in s and "workloads.name IN" in s]
    assert len(reads) == 1, reads  # one read for the run, not four
    # the demo's two pending workloads stay pending (no GPU they need is freed): the pending
    # work read once for the run and decided again after each release, not read per cancel
    pending_reads = [s for s in seen if "workloads.status = " in s and "reason_details" in s]
    assert len(pending_reads) == 1, pending_reads
    for w in out:  # each answer is what a read gives afterwards
        assert w == workloads_svc.get_workload(demo, SYSTEM, w.name)
    log = _log(demo, set(names))
    cancels = [(actor, t, d) for actor, a, t, d in log if a == "workload.cancel"]
    assert cancels == [
        ("system", n, {"tenant": TENANT, "from_status": "placed",
                       "node": placed[n].placement.node,
                       "reason": f"done with {n}" if n != "k-c" else None})
        for n in names
    ]  # fmt: skip
    with demo.read() as session:
        left = session.scalar(
            select(func.count())
            .select_from(PlacementRow)
            .join(WorkloadRow, WorkloadRow.id == PlacementRow.workload_id)
            .where(WorkloadRow.name.in_(names))
        )
    assert left == 0
    assert not set(names) & _held(demo)
    assert not set(names) & _cached_held(demo)  # the cached scheduler released them too


def test_refused_cancels_fail_alone_and_actors_stay_their_own(demo: Store) -> None:
    for n in ("r-a", "r-b", "r-c", "r-gone"):
        _submit(demo, n)
    cancel_workload(demo, SYSTEM, "r-gone")
    sends: list[tuple[Actor, str, str | None]] = [
        (SYSTEM, "r-a", None),
        (SYSTEM, "no-such", None),
        (SYSTEM, "r-gone", None),
        (SYSTEM, "r-b", None),
        (SYSTEM, "r-a", None),
        (OPS, "r-c", None),
    ]
    out = _queued(demo, sends)
    assert out[0].status is WorkloadStatus.CANCELLED
    assert isinstance(out[1], ProofplaneError) and out[1].code == "not_found"
    assert isinstance(out[2], ProofplaneError) and out[2].code == "invalid_state"
    assert out[3].status is WorkloadStatus.CANCELLED
    assert isinstance(out[4], ProofplaneError) and out[4].code == "invalid_state"
    assert out[5].status is WorkloadStatus.CANCELLED
    log = [(actor, a, t) for actor, a, t, _d in _log(demo, {"r-a", "r-b", "r-c", "r-gone"})]
    assert [e for e in log if e[1] == "workload.cancel"] == [
        ("system", "workload.cancel", "r-gone"),
        ("system", "workload.cancel", "r-a"),
        ("system", "workload.cancel", "r-b"),
        ("user:ops", "workload.cancel", "r-c"),
    ]
    assert not {"r-a", "r-b", "r-c"} & _held(demo)


def test_pending_work_takes_the_capacity_after_the_first_release(demo: Store) -> None:
    """With work pending, each cancel of the run offers its capacity in its turn, as one by one:
    the first release places the waiting workload, and its placement comes right after it."""
    placed = [_submit(demo, f"full-{i}", 8) for i in range(30)]
    waiting = next(w.name for w in placed if w.placement is None)
    nodes: dict[str, list[str]] = {}
    for w in placed:
        if w.placement is not None:
            nodes.setdefault(w.placement.node, []).append(w.name)
    first, second = (ns[0] for ns in list(nodes.values())[:2])
    out = _queued(demo, [(SYSTEM, first, None), (SYSTEM, second, None)])
    assert [w.status for w in out] == [WorkloadStatus.CANCELLED] * 2
    log = [(a, t) for _actor, a, t, _d in _log(demo, {first, second, waiting})]
    at = log.index(("workload.cancel", first))
    assert log[at + 1] == ("workload.place", waiting)  # before the second cancel
    assert log.index(("workload.cancel", second)) > at + 1
    assert workloads_svc.get_workload(demo, SYSTEM, waiting).status is WorkloadStatus.PLACED
    assert _held(demo) == _cached_held(demo)


def test_a_lone_cancel_takes_the_one_write_path(
    demo: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    def never(*_a: Any) -> Any:
        raise AssertionError("a lone cancel went through the run path")

    _submit(demo, "solo")
    monkeypatch.setattr(workloads_svc, "_cancel_many", never)  # before the group is made
    (workload,) = _queued(demo, [(SYSTEM, "solo", None)])
    assert workload.status is WorkloadStatus.CANCELLED


def test_a_run_fails_without_its_many_path(demo: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """The run path is the one taken: replaced by one that refuses, every cancel of the run
    falls back to one at a time (and still lands)."""
    calls: list[int] = []

    def counted(tx: Any, items: list[Any]) -> Any:
        calls.append(len(items))
        raise workloads_svc.InvalidState("refused for the test")

    for n in ("m-a", "m-b"):
        _submit(demo, n)
    monkeypatch.setattr(workloads_svc, "_cancel_many", counted)
    out = _queued(demo, [(SYSTEM, "m-a", None), (SYSTEM, "m-b", None)])
    assert calls == [2]
    assert [w.status for w in out] == [WorkloadStatus.CANCELLED] * 2


def test_one_users_credentials_share_a_run_each_with_its_own_tenants(demo: Store) -> None:
    """Two tokens of one user are one actor in the log: their cancels are applied as one run
    (one workload read), and each still sees only its own credential's tenants."""
    admin = Actor("user:ops", frozenset({Role.ADMIN}), token_id="tok-a")
    scoped = Actor(
        "user:ops", frozenset({Role.DEVELOPER}), frozenset({"berlin-telco"}), token_id="tok-b"
    )
    for n in ("u-a", "u-b", "u-c"):
        _submit(demo, n)  # in research-lab, which the scoped token does not cover
    seen = traced_statements(demo)
    seen.clear()
    out = _queued(demo, [(admin, "u-a", None), (scoped, "u-b", None), (admin, "u-c", None)])
    assert out[0].status is WorkloadStatus.CANCELLED
    assert isinstance(out[1], ProofplaneError) and out[1].code == "not_found"
    assert out[2].status is WorkloadStatus.CANCELLED
    reads = [s for s in seen if "FROM workloads" in s and "workloads.name IN" in s]
    assert len(reads) == 1, reads  # the run was tried at once, not one by one
    assert workloads_svc.get_workload(demo, SYSTEM, "u-b").status is WorkloadStatus.PLACED
    log = [(actor, a, t) for actor, a, t, _d in _log(demo, {"u-a", "u-b", "u-c"})]
    assert [e for e in log if e[1] == "workload.cancel"] == [
        ("user:ops", "workload.cancel", "u-a"),
        ("user:ops", "workload.cancel", "u-c"),
    ]
