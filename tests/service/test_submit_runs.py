"""Submits queued in one group commit (``Store.write_grouped`` with ``apply_many``, issue 20):
each run of one actor's submits is inserted at once (one tenant read, one name check, one
insert, the events in one insert), with the rows, events and outcomes one submit after the
other gives; a name twice in a run, or a refused item, sends the run back to one at a time,
so only that one fails; another actor's submits keep their own actor in the log."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import select

from dbtest import traced_statements
from grouped import queued
from proofplane.access import SYSTEM, Actor, Role
from proofplane.errors import Conflict
from proofplane.model import GpuRequest, WorkloadStatus
from proofplane.service import workloads as workloads_svc
from proofplane.service.context import Store
from proofplane.service.workloads import WorkloadSpec, submit_workload
from proofplane.store.tables import EventRow

OPS = Actor("user:ops", frozenset({Role.ADMIN}))


def _queued(store: Store, sends: list[tuple[Actor, str]]) -> list[Any]:
    """Each (actor, name) submitted in this order into one group; their outcomes."""

    def submit(actor: Actor, name: str) -> Any:
        spec = WorkloadSpec(name=name, tenant="research-lab", gpus=GpuRequest(count=1))
        return submit_workload(store, actor, spec)

    calls = [lambda a=actor, n=name: submit(a, n) for actor, name in sends]
    return queued(store, workloads_svc._submit_in_group, calls)


def _log(store: Store, names: set[str]) -> list[tuple[str, str, str]]:
    with store.read() as session:
        return [
            (e.actor, e.action, e.target_id)
            for e in session.scalars(
                select(EventRow).where(EventRow.target_id.in_(names)).order_by(EventRow.seq)
            )
        ]


def test_one_actors_queued_submits_are_inserted_together(demo: Store) -> None:
    seen = traced_statements(demo)
    names = ["run-a", "run-b", "run-c", "run-d"]
    seen.clear()
    out = _queued(demo, [(SYSTEM, n) for n in names])
    assert [w.name for w in out] == names
    assert all(w.status is WorkloadStatus.PLACED for w in out)
    inserts = [s for s in seen if "FROM tenants" in s and "tenants.name IN" in s]  # per run
    assert len(inserts) == 1, inserts  # one tenant read for the run, not four
    log = _log(demo, set(names))
    assert sorted(log) == sorted(
        [("system", a, n) for n in names for a in ("workload.submit", "workload.place")]
    )
    for n in names:  # each workload's submission before its placement, as one by one
        mine = [a for _actor, a, t in log if t == n]
        assert mine == ["workload.submit", "workload.place"]


def test_a_name_twice_fails_only_the_second_and_actors_stay_their_own(demo: Store) -> None:
    sends = [(SYSTEM, "twice"), (SYSTEM, "other"), (SYSTEM, "twice"), (OPS, "by-ops")]
    out = _queued(demo, sends)
    assert out[0].name == "twice" and out[0].status is WorkloadStatus.PLACED
    assert out[1].name == "other"
    assert isinstance(out[2], Conflict) and "already exists" in out[2].message
    assert out[3].name == "by-ops"
    log = _log(demo, {"twice", "other", "by-ops"})
    assert ("user:ops", "workload.submit", "by-ops") in log
    assert {actor for actor, _a, t in log if t != "by-ops"} == {"system"}
    assert [a for _actor, a, t in log if t == "twice"] == ["workload.submit", "workload.place"]


def test_a_lone_submit_takes_the_one_write_path(
    demo: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    def never(*_a: Any) -> Any:
        raise AssertionError("a lone submit went through the run path")

    monkeypatch.setattr(workloads_svc, "_submit_many", never)  # before the group is made
    (workload,) = _queued(demo, [(SYSTEM, "solo")])
    assert workload.status is WorkloadStatus.PLACED
    assert _log(demo, {"solo"}) == [
        ("system", "workload.submit", "solo"),
        ("system", "workload.place", "solo"),
    ]
