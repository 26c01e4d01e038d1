"""What one governed change costs (issue 12's benchmark, bench/governance.py): the SQL each step
runs, counted on the SQLite connection itself (the ORM's statements and the audit log's
DB-API ones alike), and the shape of the change routes (every dependency on the event loop,
one hop to the thread pool for the service call). A step that starts reading more, or a route
that gains a sync dependency (a thread hop each), fails here first."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from fastapi.routing import APIRoute
from sqlalchemy import event, select

from proofplane.access import SYSTEM, Actor, Role
from proofplane.api import routes_changes
from proofplane.model import Gpu, Node, NodeState
from proofplane.service import changes as svc
from proofplane.service.context import Store
from proofplane.service.nodes import get_node, issue_certification, register_node, set_node_state
from proofplane.store import migrate
from proofplane.store.repo import node_row
from proofplane.store.tables import Base, ChangeRequestRow, ChangeVoteRow, NodeRow

REQUESTER = Actor("alice", frozenset({Role.ADMIN}))
APPROVERS = (
    Actor("bob", frozenset({Role.ADMIN})),
    Actor("sec", frozenset({Role.SECURITY_OFFICER})),
)
NODES = ("gpu-a", "gpu-b", "gpu-c")

# Statements per step, the Merkle log's subtree hashes left out (how many a new leaf writes
# depends on the log's size). Every write: BEGIN IMMEDIATE, the log's edge (max seq, max hash
# id, the edge hashes), its event, COMMIT. Then, per step:
#   create: INSERT the request
#   vote:   the request, its rule, its votes; UPDATE the request, INSERT the vote
#   apply:  the request, its votes, its rule; the node's id and state, its certifications,
#           INSERT the certification, UPDATE the node, its event; whether any work is pending
#           (one indexed read, LIMIT 1: the pending work itself, with its tenants and
#           placements, only when some is; a new key evicts nothing, so the node's own work is
#           not read); the apply's event; UPDATE the request
# (before this budget: the apply also opened a read transaction to authorize the caller and
# read the node's network drift for an answer nobody used: 4 more; read the node's GPUs: 1;
# and the workloads on the node, which a new key cannot evict: 1)
BUDGET = {"create": 7, "vote": 11, "apply": 16}


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store(f"sqlite:///{tmp_path / 'cost.db'}")
    migrate.upgrade(s.engine)
    for name in NODES:
        gpus = (Gpu(0, f"GPU-{name}", "H100-80GB", 81920),)
        register_node(s, SYSTEM, Node(name, "r1", "z1", gpus=gpus))
        set_node_state(s, SYSTEM, name, NodeState.ADMITTED, "test")
    yield s
    s.dispose()


def _tracing(store: Store) -> list[str]:
    """Every statement SQLite runs from here on (new connections only: the pool is emptied)."""
    seen: list[str] = []

    @event.listens_for(store.engine, "connect")
    def trace(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.set_trace_callback(seen.append)

    store.engine.dispose()
    return seen


def _counted(
    seen: list[str], call: Callable[..., dict[str, Any]], *args: Any
) -> tuple[dict[str, Any], int]:
    seen.clear()
    out = call(*args)
    return out, sum(not s.startswith("INSERT INTO audit_hashes") for s in seen)


def test_each_step_of_a_governed_change_stays_within_its_statements(store: Store) -> None:
    seen = _tracing(store)
    for node in NODES:  # the log's size differs at each: the budget holds at any
        payload = {"node": node, "key": "hipaa", "value": "true"}
        change, n = _counted(
            seen, svc.create_change, store, REQUESTER, "certification.grant", payload
        )
        assert n <= BUDGET["create"], seen
        for approver in APPROVERS:
            _, n = _counted(seen, svc.vote, store, approver, change["id"], "approve")
            assert n <= BUDGET["vote"], seen
        applied, n = _counted(seen, svc.apply_change, store, REQUESTER, change["id"])
        assert n <= BUDGET["apply"], seen
        # nothing is pending: the workloads are only asked whether any is
        workloads = [s for s in seen if "FROM workloads" in s]
        assert len(workloads) == 1 and "LIMIT" in workloads[0], workloads
        assert "JOIN" not in workloads[0], workloads
        assert applied["state"] == "applied"
        assert get_node(store, SYSTEM, node).certifications == {"hipaa": "true"}


@contextmanager
def _orm_objects(calls: list[str]) -> Iterator[None]:
    """Collect, into ``calls``, every ORM object loaded, inserted or updated meanwhile."""

    def written(kind: str) -> Callable[..., None]:
        return lambda _mapper, _connection, target: calls.append(f"{kind} {target.__tablename__}")

    hooks = (
        ("load", lambda _target, _context: calls.append("load")),
        ("before_insert", written("insert")),
        ("before_update", written("update")),
    )
    for name, fn in hooks:
        event.listen(Base, name, fn, propagate=True)
    try:
        yield
    finally:
        for name, fn in hooks:
            event.remove(Base, name, fn)


def test_the_steps_of_a_grant_change_build_no_orm_objects(store: Store) -> None:
    """Every step holds the one write slot for its whole transaction, and the ORM's identity
    map and flush were most of that time (``bench/governance.py``'s ``in_process`` steps, the
    old code against the new, 2026-11-28: a vote 3.3-3.4 -> 1.1-1.8 ms, the grant's apply
    7.4-7.6 -> 2.1-3.3 ms): the request, its votes, the node's state and certifications are
    read and written by Core statements. This fails when one of them goes back to ORM objects
    (the ORM code below proves the hooks see them)."""
    calls: list[str] = []
    with _orm_objects(calls):
        payload = {"node": "gpu-a", "key": "hipaa", "value": "true"}
        change = svc.create_change(store, REQUESTER, "certification.grant", payload)
        for approver in APPROVERS:
            svc.vote(store, approver, change["id"], "approve")
        assert svc.apply_change(store, REQUESTER, change["id"])["state"] == "applied"
        assert svc.get_change(store, REQUESTER, change["id"])["state"] == "applied"
        assert calls == []
        with store.write(SYSTEM) as tx:  # ORM objects: the hooks do see them
            row = tx.session.scalars(select(NodeRow).where(NodeRow.name == "gpu-a")).one()
            row.region = "r2"
    assert calls == ["load", "update nodes"]


def test_a_change_record_holds_exactly_the_columns_of_a_change_request() -> None:
    """``ChangeRecord(**row)`` is built from every column a Core read returns: a column added
    without its field would fail every change step, so it fails here first."""
    columns = {c.name for c in ChangeRequestRow.__table__.c}
    assert {f.name for f in dataclasses.fields(svc.ChangeRecord)} == columns
    votes = {c.name for c in ChangeVoteRow.__table__.c} - {"id", "change_id"}
    assert {f.name for f in dataclasses.fields(svc.VoteRecord)} == votes


def test_granting_through_an_orm_row_reads_the_new_value_back(store: Store) -> None:
    """``issue_certification`` (the cluster file's path, which holds the node as an ORM row)
    writes with Core: the row's certifications, already loaded, show the new value after it
    in the same transaction, not the one the session loaded first."""
    with store.write(SYSTEM) as tx:
        row = node_row(tx.session, "gpu-a")
        issue_certification(tx, row, "hipaa", "true")
        (held,) = row.certifications  # an object the transaction still holds
        assert (held.key, held.value) == ("hipaa", "true")
        issue_certification(tx, row, "hipaa", "no")
        assert {c.key: c.value for c in row.certifications} == {"hipaa": "no"}
        assert held.value == "no"
    assert get_node(store, SYSTEM, "gpu-a").certifications == {"hipaa": "no"}


PER_CHANGE = {
    ("POST", "/api/v1/changes"),
    ("GET", "/api/v1/changes/{change_id}"),
    ("PATCH", "/api/v1/changes/{change_id}"),
    *(("POST", f"/api/v1/changes/{{change_id}}/{a}") for a in
      ("approve", "deny", "review", "apply", "cancel")),
}  # fmt: skip


def _calls(dependant: Any) -> Iterator[Callable[..., Any]]:
    for sub in dependant.dependencies:
        yield sub.call
        yield from _calls(sub)


def test_the_change_routes_hop_to_the_thread_pool_once() -> None:
    """A sync dependency or endpoint runs in the thread pool, each a hop there and back; the
    routes of one change make exactly one, for their service call (``current_actor``, for a
    caller not known yet, is the one exception: ``deps.caller``)."""
    routes = {
        (method, r.path): r
        for r in routes_changes.router.routes
        if isinstance(r, APIRoute)
        for method in r.methods
    }
    assert routes.keys() >= PER_CHANGE
    for key in PER_CHANGE:
        route = routes[key]
        assert inspect.iscoroutinefunction(route.endpoint), key
        for call in _calls(route.dependant):
            assert inspect.iscoroutinefunction(call), (key, call)
