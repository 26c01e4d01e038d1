"""The scheduler cache between write transactions (``service.scheduling.SchedulerCache``).

Submitting work reuses the scheduler the previous transaction left behind only while no other
write happened since; a rollback drops it; another process writing to the same database (a
second ``Store``) invalidates it. Each test checks that decisions made from the cache are the
decisions a fresh load makes."""

from __future__ import annotations

import contextlib
import random

import pytest
from sqlalchemy import func, select

from proofplane.access import SYSTEM
from proofplane.errors import ProofplaneError
from proofplane.model import GpuRequest, NodeState
from proofplane.service import nodes as nodes_svc
from proofplane.service import workloads as workloads_svc
from proofplane.service.context import Store
from proofplane.service.scheduling import ClusterView, scheduler_cache
from proofplane.store.tables import EventRow, WorkloadRow


def _cache(store: Store):
    return scheduler_cache(store.engine)


def _submit(store: Store, name: str, tenant: str = "research-lab", count: int = 1):
    spec = workloads_svc.WorkloadSpec(name=name, tenant=tenant, gpus=GpuRequest(count=count))
    return workloads_svc.submit_workload(store, SYSTEM, spec)


def _held_fresh(store: Store) -> dict[int, object]:
    with store.read() as session:
        return {k: h.placement for k, h in ClusterView(session).scheduler.held.items()}


def _held_cached(store: Store) -> dict[int, object]:
    cache = _cache(store)
    assert cache.scheduler is not None
    return {k: h.placement for k, h in cache.scheduler.held.items()}


def test_consecutive_submissions_reuse_the_scheduler(demo: Store) -> None:
    cache = _cache(demo)
    _submit(demo, "c-0")
    loads, hits = cache.loads, cache.hits
    for i in range(1, 6):
        _submit(demo, f"c-{i}")
    assert cache.loads == loads and cache.hits == hits + 5
    assert _held_cached(demo) == _held_fresh(demo)


def test_a_rolled_back_transaction_drops_the_cache(demo: Store) -> None:
    cache = _cache(demo)
    _submit(demo, "r-0")
    before = _held_fresh(demo)
    spec = workloads_svc.WorkloadSpec(name="r-1", tenant="research-lab", gpus=GpuRequest(count=1))
    with pytest.raises(RuntimeError), demo.write(SYSTEM) as tx:
        row = workloads_svc.insert_workload(tx, spec, spec.gpus)
        assert row.placement is not None  # the cached scheduler now holds r-1's devices
        raise RuntimeError("crash before commit")
    assert cache.scheduler is None and cache.version is None
    assert _held_fresh(demo) == before
    loads = cache.loads
    again = _submit(demo, "r-1")  # the same devices are free again: a fresh load sees that
    assert cache.loads == loads + 1 and again.placement is not None
    assert _held_cached(demo) == _held_fresh(demo)


def test_a_refused_submission_leaves_a_usable_cache(demo: Store) -> None:
    cache = _cache(demo)
    _submit(demo, "dup")
    with pytest.raises(ProofplaneError):
        _submit(demo, "dup")  # conflict: refused before any scheduling
    _submit(demo, "after")
    assert _held_cached(demo) == _held_fresh(demo)
    assert cache.scheduler is not None


def test_another_writer_invalidates_the_cache(demo: Store, db_url: str) -> None:
    cache = _cache(demo)
    placed = _submit(demo, "w-0")
    assert placed.placement is not None
    other = Store(db_url)  # another process, as far as the cache can tell
    try:
        nodes_svc.set_node_state(other, SYSTEM, placed.placement.node, NodeState.FAILED, "psu")
    finally:
        other.dispose()
    loads = cache.loads
    nxt = _submit(demo, "w-1")
    assert cache.loads == loads + 1  # the newest event moved: the cache was not trusted
    assert nxt.placement is None or nxt.placement.node != placed.placement.node
    assert _held_cached(demo) == _held_fresh(demo)


def test_random_mix_of_operations_matches_a_fresh_load(demo: Store) -> None:
    rnd = random.Random(7)
    checked = 0
    with demo.read() as session:
        node_names = [n.name for n in ClusterView(session).scheduler.nodes()]
    for i in range(30):
        op = rnd.random()
        if op < 0.7:
            _submit(demo, f"m-{i}", count=rnd.choice([1, 1, 2, 4]))
        elif op < 0.85:
            with demo.read() as session:
                names = session.scalars(
                    select(WorkloadRow.name).where(WorkloadRow.name.like("m-%"))
                ).all()
            if names:
                with contextlib.suppress(ProofplaneError):  # already cancelled
                    workloads_svc.cancel_workload(demo, SYSTEM, rnd.choice(names))
        else:
            node = rnd.choice(node_names)
            state = rnd.choice([NodeState.CORDONED, NodeState.ADMITTED])
            with contextlib.suppress(ProofplaneError):  # not every transition is allowed
                nodes_svc.set_node_state(demo, SYSTEM, node, state, "test")
        cache = _cache(demo)
        with demo.read() as session:
            newest = session.scalar(select(func.max(EventRow.seq)))
        if cache.scheduler is not None and cache.version == newest:  # it would be reused
            checked += 1
            assert _held_cached(demo) == _held_fresh(demo)
    assert checked >= 10
