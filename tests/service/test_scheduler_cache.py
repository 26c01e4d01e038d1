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


def _state(scheduler) -> tuple[object, ...]:
    """Everything placement decides from: nodes, what is held where, quotas, usage."""
    nodes = sorted((n.name, n) for n in scheduler.nodes())
    held = {
        k: (h.name, h.tenant, h.placement, h.priority, h.isolation)
        for k, h in scheduler.held.items()
    }
    used = {t: scheduler.used(t) for t in {h.tenant for h in scheduler.held.values()}}
    allocations = sorted(map(repr, scheduler.snapshot.allocations.items()))
    return nodes, held, dict(scheduler.quotas), used, allocations


def _assert_cache_is_a_fresh_load(store: Store) -> None:
    cache = _cache(store)
    assert cache.scheduler is not None
    with store.read() as session:
        assert _state(cache.scheduler) == _state(ClusterView(session).scheduler)


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
    loads, catch_ups = cache.loads, cache.catch_ups
    nxt = _submit(demo, "w-1")
    # the newest event moved: the cache caught up from the events instead of reloading
    assert cache.loads == loads and cache.catch_ups == catch_ups + 1
    assert nxt.placement is None or nxt.placement.node != placed.placement.node
    _assert_cache_is_a_fresh_load(demo)


def test_a_cancel_on_a_current_cache_reads_nothing_back(demo: Store, db_url: str) -> None:
    """A cancel takes the cache before it writes when the cache is current and releases the
    capacity in it (no catch-up reading its own workload back); when another process wrote
    first, it takes the cache after, caught up on both at once. Either way the cache is what
    a fresh load is, and the capacity is free to place on."""
    cache = _cache(demo)
    first, second = _submit(demo, "c-0", count=8), _submit(demo, "c-1", count=8)
    assert first.placement is not None and second.placement is not None
    loads, catch_ups = cache.loads, cache.catch_ups
    workloads_svc.cancel_workload(demo, SYSTEM, "c-0")
    assert (cache.loads, cache.catch_ups) == (loads, catch_ups)
    _assert_cache_is_a_fresh_load(demo)
    again = _submit(demo, "c-2", count=8)  # the freed node, decided from the cache
    assert again.placement is not None and again.placement.node == first.placement.node
    other = Store(db_url)  # another process, as far as the cache can tell
    try:
        _submit(other, "c-3")
    finally:
        other.dispose()
    workloads_svc.cancel_workload(demo, SYSTEM, "c-1")
    assert cache.loads == loads and cache.catch_ups == catch_ups + 1
    _assert_cache_is_a_fresh_load(demo)


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


def test_the_cache_catches_up_with_another_process_from_the_events(
    demo: Store, db_url: str
) -> None:
    """Another process (a second ``Store``) submits, cancels, fails and certifies nodes and
    changes quotas; each submission here then catches up from the events since the cache's
    version, never reloads the cluster, and the caught-up scheduler equals a fresh load."""
    from proofplane.model import Quota
    from proofplane.service import tenants as tenants_svc

    rnd = random.Random(11)
    cache = _cache(demo)
    _submit(demo, "own-0")
    with demo.read() as session:
        node_names = [n.name for n in ClusterView(session).scheduler.nodes()]
    other = Store(db_url)
    try:
        for i in range(25):
            op = rnd.random()
            with contextlib.suppress(ProofplaneError):  # a refused operation is fine too
                if op < 0.35:
                    _submit(other, f"o-{i}", count=rnd.choice([1, 2, 4]))
                elif op < 0.5:
                    with other.read() as session:
                        names = session.scalars(select(WorkloadRow.name)).all()
                    workloads_svc.cancel_workload(other, SYSTEM, rnd.choice(names))
                elif op < 0.7:
                    state = rnd.choice([NodeState.FAILED, NodeState.CORDONED, NodeState.ADMITTED])
                    nodes_svc.set_node_state(other, SYSTEM, rnd.choice(node_names), state, "t")
                elif op < 0.8:
                    nodes_svc.grant_certification(
                        other, SYSTEM, rnd.choice(node_names), "pci-dss", "isolated"
                    )
                elif op < 0.9:
                    nodes_svc.revoke_certification(other, SYSTEM, rnd.choice(node_names), "hipaa")
                else:
                    quota = Quota(gpus=rnd.choice([None, 2, 8]), mig_slices=None)
                    tenants_svc.set_quota(other, SYSTEM, "research-lab", quota)
            loads, catch_ups = cache.loads, cache.catch_ups
            with demo.read() as session:  # did the other process write since our last?
                moved = (session.scalar(select(func.max(EventRow.seq))) or 0) != cache.version
            _submit(demo, f"own-{i + 1}", count=rnd.choice([1, 2]))
            assert cache.loads == loads
            assert cache.catch_ups == catch_ups + (1 if moved else 0)
            _assert_cache_is_a_fresh_load(demo)
    finally:
        other.dispose()
    assert cache.catch_ups >= 20


def test_an_event_the_cache_cannot_interpret_means_a_full_load(demo: Store) -> None:
    cache = _cache(demo)
    _submit(demo, "x-0")
    with demo.write(SYSTEM) as tx:  # e.g. a cluster load: it names the cluster, not the nodes
        tx.record("cluster.load", "cluster", "demo")
    loads = cache.loads
    _submit(demo, "x-1")
    assert cache.loads == loads + 1
    _assert_cache_is_a_fresh_load(demo)
    with demo.write(SYSTEM) as tx:  # a target it knows places nothing: caught up, no load
        tx.record("user.update", "user", "someone")
    loads, catch_ups = cache.loads, cache.catch_ups
    _submit(demo, "x-2")
    assert cache.loads == loads and cache.catch_ups == catch_ups + 1


def test_too_many_events_mean_a_full_load(demo: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    from proofplane.service import scheduling

    monkeypatch.setattr(scheduling, "CATCH_UP_MAX", 2)
    cache = _cache(demo)
    _submit(demo, "y-0")
    with demo.read() as session:
        node = next(iter(ClusterView(session).scheduler.nodes())).name
    # three events the cache did not see (a node change places through the cache itself
    # now, so these are written directly, as another process's writes would arrive)
    with demo.write(SYSTEM) as tx:
        for _ in range(3):
            tx.record("node.label", "node", node)
    loads = cache.loads
    _submit(demo, "y-1")
    assert cache.loads == loads + 1
    _assert_cache_is_a_fresh_load(demo)


def test_events_naming_most_of_the_nodes_mean_a_full_load(demo: Store) -> None:
    """Many events naming a few nodes are caught up (each node read once); events naming more
    than half of the nodes the cache holds read the cluster again instead."""
    cache = _cache(demo)
    _submit(demo, "w-0")
    with demo.read() as session:
        names = sorted(n.name for n in ClusterView(session).scheduler.nodes())
    few, most = names[:2], names[: len(names) // 2 + 1]
    with demo.write(SYSTEM) as tx:
        for _ in range(50):
            for name in few:
                tx.record("node.label", "node", name)
    loads, catch_ups = cache.loads, cache.catch_ups
    _submit(demo, "w-1")
    assert (cache.loads, cache.catch_ups) == (loads, catch_ups + 1)
    with demo.write(SYSTEM) as tx:
        for name in most:
            tx.record("node.label", "node", name)
    _submit(demo, "w-2")
    assert (cache.loads, cache.catch_ups) == (loads + 1, catch_ups + 1)
    _assert_cache_is_a_fresh_load(demo)


def test_a_catch_up_that_fails_falls_back_to_a_full_load(
    demo: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    from proofplane.service.scheduling import SchedulerCache

    cache = _cache(demo)
    _submit(demo, "z-0")
    with demo.read() as session:
        node = next(iter(ClusterView(session).scheduler.nodes())).name
    with demo.write(SYSTEM) as tx:  # an event the cache did not see names the node
        tx.record("node.label", "node", node)

    def broken(*_a: object) -> None:
        raise RuntimeError("a node row that cannot be read back")

    monkeypatch.setattr(SchedulerCache, "_refresh_nodes", broken)
    loads = cache.loads
    assert _submit(demo, "z-1").placement is not None  # the request is served all the same
    assert cache.loads == loads + 1
    _assert_cache_is_a_fresh_load(demo)


def test_cancels_and_certifications_use_the_cache_not_a_cluster_load(demo: Store) -> None:
    """A cancel gives its capacity back through the cached scheduler (and pending work takes
    it there); a grant or a revoke tells it the node's new certifications and evicts through
    it: none of them loads the whole cluster, and the cache stays what a fresh load is."""
    cache = _cache(demo)
    placed = [_submit(demo, f"k-{i}", count=8) for i in range(30)]
    waiting = [w for w in placed if w.placement is None]
    assert waiting, "the demo cluster should be full enough that some wait"
    loads = cache.loads
    running = next(w for w in placed if w.placement is not None)
    workloads_svc.cancel_workload(demo, SYSTEM, running.name)
    assert cache.loads == loads and cache.scheduler is not None
    _assert_cache_is_a_fresh_load(demo)
    assert any(  # the freed GPUs went to a waiting workload, decided from the cache
        workloads_svc.get_workload(demo, SYSTEM, w.name).placement is not None for w in waiting
    )
    node = next(w for w in placed if w.placement is not None).placement.node
    nodes_svc.grant_certification(demo, SYSTEM, node, "pci-dss", "isolated")
    _assert_cache_is_a_fresh_load(demo)
    nodes_svc.revoke_certification(demo, SYSTEM, node, "pci-dss")
    _assert_cache_is_a_fresh_load(demo)
    with demo.read() as session:  # a node the cache holds with its certifications as stored
        fresh = {n.name: n for n in ClusterView(session).scheduler.nodes()}
    assert cache.scheduler is not None
    assert cache.scheduler.node(node) == fresh[node]
    assert cache.loads == loads


def test_node_changes_place_through_the_cache_not_a_cluster_load(
    demo: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node leaving service evicts its work and offers capacity to what waits through the
    cached scheduler, caught up on the change's own events; several nodes changed in one
    transaction (a staleness pass, a cluster file) share that scheduler, events between the
    changes or not. None of it reads the whole cluster, and the cache stays what a fresh
    load is (issue 20: a staleness pass under overload loaded the cluster once per node)."""
    from proofplane.service.lifecycle import change_node_state
    from proofplane.store.tables import NodeRow

    placed = [_submit(demo, f"q-{i}", count=8) for i in range(30)]
    busy = sorted({w.placement.node for w in placed if w.placement is not None})
    assert len(busy) >= 6 and any(w.placement is None for w in placed)
    full_loads: list[str] = []
    real = ClusterView._load

    def counted(self: ClusterView) -> None:
        if not self._from_cache:  # the cache's own fallback loads come through here too
            full_loads.append("load")
        real(self)

    monkeypatch.setattr(ClusterView, "_load", counted)

    def is_a_fresh_load() -> None:  # (the check's own fresh load is not counted)
        _assert_cache_is_a_fresh_load(demo)
        full_loads.clear()

    nodes_svc.set_node_state(demo, SYSTEM, busy[0], NodeState.FAILED, "power")
    assert full_loads == []
    is_a_fresh_load()
    with demo.write(SYSTEM) as tx:
        for name in busy[1:4]:
            row = tx.session.scalar(select(NodeRow).where(NodeRow.name == name))
            change_node_state(tx, row, NodeState.QUARANTINED, "stale")
    assert full_loads == []
    is_a_fresh_load()
    # events between the changes (grouped attestation rounds: each records its verdict)
    with demo.write(SYSTEM) as tx:
        for name in busy[4:6]:
            tx.record("node.attest", "node", name)
            row = tx.session.scalar(select(NodeRow).where(NodeRow.name == name))
            change_node_state(tx, row, NodeState.QUARANTINED, "failed its round")
    assert full_loads == []
    is_a_fresh_load()
    now = [workloads_svc.get_workload(demo, SYSTEM, w.name) for w in placed]
    gone = set(busy[:6])  # nothing is left placed on a node out of service
    assert all(w.placement is None or w.placement.node not in gone for w in now)
    assert any(w.placement is not None for w in now)
    # and back in service: the waiting work may take the nodes again, still from the cache
    nodes_svc.set_node_state(demo, SYSTEM, busy[0], NodeState.ADMITTED, "repaired")
    assert full_loads == []
    is_a_fresh_load()


def test_pending_work_is_read_as_columns_and_loaded_only_to_change_it(demo: Store) -> None:
    """A cancel offers its capacity to what waits deciding from the waiting workloads' columns:
    one that still does not fit, for the reason it already has, is neither loaded as an ORM
    object nor given another ``workload.pending`` event; one the capacity fits is loaded and
    placed (issue 20: every cancel loaded every waiting workload as ORM objects)."""
    from sqlalchemy import event as sa_event

    assert _submit(demo, "small", count=1).placement is not None
    placed = [_submit(demo, f"w-{i}", count=8) for i in range(30)]
    waiting = {w.name for w in placed if w.placement is None}
    assert len(waiting) >= 2, "the demo cluster should be full enough that several wait"
    loaded: list[str] = []

    def on_load(target: WorkloadRow, _context: object) -> None:
        loaded.append(target.name)

    def pending_events() -> int:
        with demo.read() as session:
            return session.scalar(
                select(func.count())
                .select_from(EventRow)
                .where(EventRow.action == "workload.pending", EventRow.target_id.in_(waiting))
            )

    sa_event.listen(WorkloadRow, "load", on_load)
    try:
        before = pending_events()
        workloads_svc.cancel_workload(demo, SYSTEM, "small")  # one GPU back: fits none of them
        assert not waiting & set(loaded), loaded
        assert pending_events() == before
        assert all(
            workloads_svc.get_workload(demo, SYSTEM, name).placement is None for name in waiting
        )
        loaded.clear()
        running = next(w for w in placed if w.placement is not None)
        workloads_svc.cancel_workload(demo, SYSTEM, running.name)  # eight GPUs back
    finally:
        sa_event.remove(WorkloadRow, "load", on_load)
    now_placed = {
        name for name in waiting
        if workloads_svc.get_workload(demo, SYSTEM, name).placement is not None
    }  # fmt: skip
    assert now_placed and now_placed <= set(loaded)  # loaded to be placed, and placed
    _assert_cache_is_a_fresh_load(demo)


def test_a_catch_up_reads_a_tenant_again_only_for_what_placement_sees(
    demo: Store, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process's placement writes a ``network.endpoints`` event naming the tenant: the
    catch-up does not read that tenant again (the scheduler holds a tenant's quota only); its
    quota change is read again, and the next decision obeys it."""
    from proofplane.model import Quota
    from proofplane.service import tenants as tenants_svc
    from proofplane.service.scheduling import SchedulerCache

    read_again: list[set[str]] = []
    real = SchedulerCache._refresh_tenants

    def counted(session: object, scheduler: object, names: set[str]) -> None:
        read_again.append(set(names))
        real(session, scheduler, names)

    monkeypatch.setattr(SchedulerCache, "_refresh_tenants", staticmethod(counted))
    cache = _cache(demo)
    _submit(demo, "own-0")
    other = Store(db_url)
    try:
        assert _submit(other, "theirs-0").placement is not None
        with demo.read() as session:
            actions = session.scalars(
                select(EventRow.action).where(EventRow.seq > cache.version)
            ).all()
        assert "network.endpoints" in actions  # the event that names the tenant
        catch_ups = cache.catch_ups
        assert _submit(demo, "own-1").placement is not None
        assert cache.catch_ups == catch_ups + 1
        assert not any(read_again), read_again
        tenants_svc.set_quota(other, SYSTEM, "research-lab", Quota(gpus=3, mig_slices=None))
        refused = _submit(demo, "own-2", count=2)  # 3 held (own-0, theirs-0, own-1) + 2 > 3
        assert {"research-lab"} in read_again
        assert refused.placement is None and refused.reason == "quota_exceeded", refused
        _assert_cache_is_a_fresh_load(demo)
    finally:
        other.dispose()
