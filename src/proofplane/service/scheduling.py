"""Turning scheduling outcomes into state: place, preempt, repartition, evict, retry pending.

Called from inside a write transaction by the services whose changes move capacity (submit,
cancel, node state, certifications, quotas). The decisions are the pure ``schedule.engine``;
this module persists each one and records its events in the same transaction.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from datetime import datetime
from typing import Any

from sqlalchemy import bindparam, func, select
from sqlalchemy import event as sa_event
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session
from sqlalchemy.pool import Pool

from proofplane.config import mig_auto_layout
from proofplane.errors import ValidationFailed
from proofplane.model import (
    GpuRequest,
    IsolationLevel,
    Node,
    Outcome,
    Placement,
    Quota,
    TopologyRequest,
    WorkloadStatus,
)
from proofplane.schedule.defrag import (
    DEFRAG_DETAIL,
    NO_REGION,
    NOT_APPLICABLE,
    Defragmenter,
    Move,
    where,
)
from proofplane.schedule.engine import Held, Job, Repartition, Scheduler, pool_of
from proofplane.schedule.engine import Outcome as Decision
from proofplane.schedule.policy import Policy, build_scheduler
from proofplane.schedule.policy import server_policy as layout_policy
from proofplane.schedule.reasons import DEFRAGMENTATION, PREEMPTED, render
from proofplane.schedule.scoring import DEFAULT_SCORER, SCORERS
from proofplane.schedule.values import Request
from proofplane.service import defrag as defrag_store
from proofplane.service import netstate
from proofplane.service.context import Tx, events_after, newest_seq
from proofplane.service.instruments import observe_decision
from proofplane.service.jobs import cancel_engine_job
from proofplane.store.repo import (
    NODE_LOAD,
    WORKLOAD_LOAD,
    devices_to_json,
    drained_gpus,
    members_to_json,
    node_from_row,
    placement_from_row,
    placement_of,
    schedulable,
    tenant_from_row,
    workload_from_row,
)
from proofplane.store.tables import EventRow, NodeRow, PlacementRow, TenantRow, WorkloadRow

log = logging.getLogger(__name__)

SCORER_ENV = "PROOFPLANE_PLACEMENT_SCORER"


def placement_scorer() -> str:
    """The scoring plugin the server places with: ``PROOFPLANE_PLACEMENT_SCORER`` (one of
    ``schedule.scoring.SCORERS``; default ``proofplane``, the fragmentation-aware scorer)."""
    name = os.environ.get(SCORER_ENV, "").strip() or DEFAULT_SCORER
    if name not in SCORERS:
        raise ValidationFailed(
            f"{SCORER_ENV}={name!r} is not a scorer (known: {', '.join(SCORERS)})",
            code="unknown_scorer",
            details={"scorer": name, "known": list(SCORERS)},
        )
    return name


def server_policy() -> Policy:
    """The plugins the server places with (issue 17): the production scorer
    (``PROOFPLANE_PLACEMENT_SCORER``) and, per ``PROOFPLANE_MIG_AUTO_LAYOUT``, MIG carving into
    free slices (``on``, the default: new instances only, nothing in use or on a GPU holding
    work destroyed) and the repartitioning of idle GPUs (``on`` and ``idle``; ``off``: the
    scheduler never changes a layout). ``schedule.policy.server_policy``: the replay's
    ``proofplane+relayout`` is the same policy with ``on``."""
    return layout_policy(placement_scorer(), mig_auto_layout())


def server_scheduler(
    nodes: Iterable[Node], held: Iterable[Held], quotas: dict[str, Quota]
) -> Scheduler:
    """The scheduler the server decides with: :func:`server_policy` built by
    ``schedule.policy.build_scheduler``, as the MIG replays build theirs."""
    return build_scheduler(server_policy(), nodes, held, quotas)


class ClusterView:
    """What placement needs to know, loaded once per transaction and kept current in it.

    ``ClusterView(session)`` loads every node and placement. ``ClusterView.cached(tx)`` reuses
    the scheduler the previous transaction left behind when nothing has been written since
    (see ``SchedulerCache``): the hot path of submitting work then reads no cluster state.
    ``ClusterView(session, from_cache=True)`` takes the cache on first use instead, caught up
    from the events since its version, this transaction's own included: for a flow that
    changes capacity itself (a cancel, a certification, a node leaving service, a drained
    GPU, a quota) before it may need to place. Every write flow takes its view this way; a
    second view in the same transaction is the first one's scheduler, caught up on what was
    written since. ``ClusterView(session)`` is for readers that want a copy of their own."""

    def __init__(self, session: Session, *, from_cache: bool = False) -> None:
        # Loaded on first use: a flow that turns out to need no placement (no pending work,
        # nothing to evict) does not pay for reading the whole cluster.
        self.session = session
        self._from_cache = from_cache
        self._scheduler: Scheduler | None = None
        self._node_rows: NodeRows | None = None
        self._readiness: netstate.Readiness | None = None
        self._readiness_loaded = False
        self._defrag: Defragmenter | None = None

    def unready(self, tenant: str, workload_id: Any) -> frozenset[str]:
        """The nodes that may not take new work of this workload's segment now (issue 14):
        read once per transaction, as it stood when the transaction began to place."""
        if not self._readiness_loaded:
            self._readiness = netstate.load_readiness(self.session)
            self._readiness_loaded = True
        if self._readiness is None:
            return frozenset()
        return self._readiness.unready(tenant, workload_id)

    def defragmenter(self, now: datetime) -> Defragmenter | None:
        """The transaction's defragmentation step (issue 17 §3; ``service.defrag``): built on
        first use with the move budget left in the rolling hour; None when it is turned off."""
        if self._defrag is None:
            if defrag_store.max_moves_per_hour() == 0:
                return None
            budget = defrag_store.budget_left(self.session, now)
            self._defrag = Defragmenter(
                defrag_store.Movable(self.session),
                budget,
                unready=lambda h: self.unready(h.tenant, h.key),
            )
        return self._defrag

    @property
    def scheduler(self) -> Scheduler:
        if self._scheduler is None:
            self._load()
        assert self._scheduler is not None
        return self._scheduler

    @property
    def node_rows(self) -> NodeRows:
        if self._node_rows is None:
            self._load()
        assert self._node_rows is not None
        return self._node_rows

    def _load(self) -> None:
        session = self.session
        if self._from_cache:
            cached = _cache_for(session).view(session)
            self._scheduler, self._node_rows = cached.scheduler, cached.node_rows
            return
        rows = list(session.scalars(select(NodeRow).options(*NODE_LOAD).order_by(NodeRow.name)))
        node_rows = NodeRows(session, {row.name: row.id for row in rows})
        for row in rows:
            node_rows[row.name] = row
        drained = drained_gpus(session)  # GPUs drained for their health get no new work
        nodes: list[Node] = [schedulable(node_from_row(row), drained) for row in rows]
        placed = session.scalars(
            select(WorkloadRow)
            .join(WorkloadRow.placement)
            .options(*WORKLOAD_LOAD)
            .order_by(PlacementRow.placed_at, PlacementRow.id)
        )
        held = [held_of(w) for w in placed if w.placement is not None]
        quotas = {t.name: tenant_from_row(t).quota for t in session.scalars(select(TenantRow))}
        self._scheduler = server_scheduler(nodes, held, quotas)
        self._node_rows = node_rows

    @classmethod
    def cached(cls, tx: Tx) -> ClusterView:
        """A view for a transaction whose only changes to capacity go through this view
        (submitting work): the cached scheduler when it is current, else a fresh load that
        becomes the cache when this transaction commits. Take it before the transaction
        writes anything: the check compares the newest event with the cache's version."""
        return _cache_for(tx.session).view(tx.session)

    @classmethod
    def cached_if_current(cls, tx: Tx) -> ClusterView | None:
        """``cached`` when the cached scheduler is current (a hit: nothing to read), else None
        and the cache left alone, for a transaction that can as well take it later, caught up
        on everything at once (a cancel: other processes' writes and its own)."""
        return _cache_for(tx.session).view_if_current(tx.session)


class NodeRows(dict[str, NodeRow]):
    """Node rows by name, loaded from the session on first use (the cached view keeps only
    names and ids between transactions)."""

    def __init__(self, session: Session, ids: dict[str, int]) -> None:
        super().__init__()
        self._session = session
        self.ids = ids

    def __missing__(self, name: str) -> NodeRow:
        # The row alone (GPUs and certifications load lazily if a caller needs them): linking
        # a placement to its node must not pay for the node's inventory.
        row = self._session.get(NodeRow, self.ids[name])
        if row is None:  # pragma: no cover - the cache is checked against the event log
            raise KeyError(name)
        self[name] = row
        return row

    def __setitem__(self, name: str, row: NodeRow) -> None:
        self.ids[name] = row.id
        super().__setitem__(name, row)


# Catching up from more events than this reads the cluster again instead.
CATCH_UP_MAX = 20_000
# ... and so does one that would read again more targets of a kind than this (the rows are
# read by ``IN`` lists), or more than this share of the nodes the cache holds: a fleet of
# 10,000 nodes writes thousands of events a minute, mostly naming the same nodes again, and a
# staleness pass on another process may change hundreds at once; reading those again costs a
# fraction of a full load (issue 20).
CATCH_UP_TARGETS_MAX = 5_000
CATCH_UP_NODE_SHARE = 0.5
# Targets of events that never change what placement sees (nodes, placements, quotas).
UNPLACED_TARGETS = frozenset(
    {
        "attestation_policy",
        "change",
        "change_rule",
        "incident",
        "key",
        "network",
        "pki_ca",
        "runbook",
        "sink",
        "token",
        "user",
    }
)


# A tenant's events that change nothing placement sees: the scheduler holds a tenant's quota
# only, and these record its network endpoints and segments (read per transaction, as
# readiness). Every placement writes one (``network.endpoints``): without this, each write of
# another process made the next catch-up read the tenant again (issue 20).
UNPLACED_TENANT_ACTIONS = frozenset(
    {
        "network.endpoints",
        "network.segment.allocate",
        "network.segment.release",
        "network.segment.exhausted",
    }
)


# The placed workloads of some names: what the scheduler holds for each, with its tenant's
# name, its placement and the placement's node joined, as columns (no ORM object: a catch-up
# after another replica's write runs this in the transaction, under the write lock), built once.
_W, _T, _P, _N = (t.__table__.c for t in (WorkloadRow, TenantRow, PlacementRow, NodeRow))
_PLACED_NAMED = (
    select(
        _W.id, _W.name, _T.name, _W.isolation, _W.priority, _W.tags, _W.co_residency,
        _W.cpu_milli, _W.memory_mib, _N.name, _P.devices, _P.members,
    )
    .join_from(WorkloadRow.__table__, TenantRow.__table__, _T.id == _W.tenant_id)
    .join(PlacementRow.__table__, _P.workload_id == _W.id)
    .join(NodeRow.__table__, _N.id == _P.node_id)
    .where(_W.name.in_(bindparam("names", expanding=True)))
    .order_by(_P.placed_at, _P.id)
)  # fmt: skip


def _held_of_columns(values: Any) -> Held:
    """``held_of`` for a row of ``_PLACED_NAMED``."""
    (wid, name, tenant, isolation, priority, tags, co_residency, cpu_milli, memory_mib,
     node, devices, members) = values  # fmt: skip
    return Held(
        wid,
        name,
        tenant,
        IsolationLevel(isolation),
        priority,
        pool_of(tags),
        placement_of(node, devices, members),
        co_residency,
        cpu_milli,
        memory_mib,
    )


class SchedulerCache:
    """The scheduler one database's last write transaction left behind, and the event
    sequence number it is current at.

    Every change to the database writes an event in the same transaction (rule 1), so the
    newest event's ``seq`` names a state: a transaction that finds the newest ``seq`` equal to
    the cache's version (it looks under the write lock) may reuse the scheduler instead of
    loading the cluster. The transaction that takes the cache owns it until it ends: on commit
    the cache is current at the new newest ``seq``; on rollback it is dropped, because the
    scheduler may hold decisions that never happened.

    A write the cache did not see (another transaction of this process, another worker
    process, an API replica on PostgreSQL) moves the newest ``seq``. The cache then catches
    up from the event stream instead of reloading the cluster: each event names its target,
    so the nodes, workloads and tenants named by the events since its version are read again
    and applied (``upsert_node``, ``release``/``hold``, ``set_quota``). An event whose target
    it cannot interpret (a cluster load, a type it does not know), more than
    ``CATCH_UP_MAX`` of them, or more nodes named than ``CATCH_UP_NODE_SHARE`` of those it
    holds, means a full load.

    Readers that only look (``/metrics``, the capacity check: :meth:`reading`) use the same
    scheduler between transactions: they catch it up the same way and hold ``lock`` while they
    look, which a transaction taking the cache waits for."""

    def __init__(self) -> None:
        self.version: int | None = None
        self.scheduler: Scheduler | None = None
        self.node_ids: dict[str, int] = {}
        self._pending: int | None = None
        # While a transaction owns the scheduler: its session, and the newest event the
        # scheduler has been brought up to within it (an earlier view of the same
        # transaction took it; a later one catches it up from there).
        self._owner: Session | None = None
        self._synced = 0
        self.hits = 0
        self.loads = 0
        self.catch_ups = 0
        #: held by a transaction while it takes the cache, and by a reader while it looks
        self.lock = threading.Lock()

    def view(self, session: Session) -> ClusterView:
        # The transaction's first statement takes the database's write lock (PostgreSQL's
        # advisory lock, store.db.write_session): take it before this thread lock, never
        # while holding it. One order for both locks everywhere (write lock, then this
        # one), so a transaction that takes the cache late (after writing: a cancel, a
        # certification) cannot deadlock with one that takes it first thing (a submit).
        session.connection()
        with self.lock:
            return self._view(session)

    def view_if_current(self, session: Session) -> ClusterView | None:
        """``view`` when the cache is current, else None (see ``ClusterView.cached_if_current``)."""
        session.connection()  # the write lock first, as in ``view``
        with self.lock:
            if self.scheduler is None or self.version != newest_seq(session):
                return None  # none, behind, or taken by a transaction (version None)
            return self._view(session)

    def _view(self, session: Session) -> ClusterView:
        newest = newest_seq(session)
        view = ClusterView(session)
        if self._owner is session and self.scheduler is not None and self.version is None:
            # This transaction took the cache for an earlier view (a group's earlier write,
            # a node change before a placement): go on with the same scheduler, caught up on
            # what the transaction wrote since, through that view or not (re-reading a
            # target is idempotent), instead of loading the cluster again.
            if self._synced == newest or self._catch_up(session, self.scheduler, self._synced):
                self._synced = newest
                return self._lend(session, view)
            self.scheduler = None  # half caught up: never reused; the load below replaces it
        if self.scheduler is not None and self.version is not None and self.version != newest:
            if self._catch_up(session, self.scheduler, self.version):
                self.version = newest
                self.catch_ups += 1
            else:
                self.scheduler, self.version = None, None
        if self.scheduler is not None and self.version == newest:
            self._lend(session, view)
        else:
            self.loads += 1
        # Owned by this transaction until it ends; nobody else may see it meanwhile.
        self.scheduler, self.version, self.node_ids = view.scheduler, None, view.node_rows.ids
        self._owner, self._synced = session, newest
        held = self.scheduler
        sa_event.listen(session, "before_commit", lambda s: self._before_commit(s, held))
        sa_event.listen(session, "after_commit", lambda _s: self._after_commit(held))
        sa_event.listen(session, "after_rollback", lambda _s: self._drop(held))
        return view

    def _lend(self, session: Session, view: ClusterView) -> ClusterView:
        """``view`` placing through the cached scheduler (a hit)."""
        assert self.scheduler is not None
        view._scheduler = self.scheduler
        view._node_rows = NodeRows(session, self.node_ids)
        self.hits += 1
        return view

    @contextmanager
    def reading(self, session: Session, *, wait_s: float = 1.0) -> Iterator[Scheduler | None]:
        """For a reader that only looks (metrics, the capacity check): the cached scheduler,
        caught up to the newest event ``session`` sees, held for the block (this process's
        transactions wait to take it until the block ends: keep it short, change nothing in
        it, copy what must outlive it). None when there is none to read: nothing loaded one
        yet (:meth:`install`), a transaction of this process still holds it after ``wait_s``,
        or catching up failed (it is dropped, as a transaction would drop it)."""
        deadline = time.monotonic() + wait_s
        while True:
            if not self.lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                yield None
                return
            if self.scheduler is None or self.version is not None:
                break
            self.lock.release()  # a transaction owns it: it ends in milliseconds
            if time.monotonic() >= deadline:
                yield None
                return
            time.sleep(0.002)
        try:
            scheduler, version = self.scheduler, self.version
            if scheduler is None or version is None:
                yield None
                return
            newest = session.scalar(select(func.max(EventRow.seq))) or 0
            if version != newest:
                if not self._catch_up(session, scheduler, version):
                    self.scheduler, self.version = None, None
                    yield None
                    return
                self.version = newest
                self.catch_ups += 1
            yield scheduler
        finally:
            self.lock.release()

    def install(self, session: Session) -> bool:
        """Load the cluster in ``session`` (a read) and make it the cache, unless a scheduler
        is cached meanwhile. The cache's version is the newest event read *before* loading, so
        whatever the load saw of later writes is read again by the next catch-up (re-reading a
        target is idempotent). Whether it was installed."""
        newest = session.scalar(select(func.max(EventRow.seq))) or 0
        view = ClusterView(session)
        scheduler, ids = view.scheduler, view.node_rows.ids
        with self.lock:
            if self.scheduler is not None:
                return False
            self.scheduler, self.version, self.node_ids = scheduler, newest, dict(ids)
            self.loads += 1
            return True

    def _catch_up(self, session: Session, scheduler: Scheduler, since: int) -> bool:
        """Apply the events after ``since`` to ``scheduler`` by reading their targets again.
        False (and nothing trustworthy left) when they cannot be applied one by one."""
        events = events_after(session, since, CATCH_UP_MAX)
        if len(events) > CATCH_UP_MAX:
            return False
        targets: dict[str, set[str]] = {"node": set(), "workload": set(), "tenant": set()}
        for _seq, target_type, target_id, action in events:
            if target_type == "tenant" and action in UNPLACED_TENANT_ACTIONS:
                continue
            if target_type in targets:
                targets[target_type].add(target_id)
            elif target_type not in UNPLACED_TARGETS:
                return False
        if any(len(names) > CATCH_UP_TARGETS_MAX for names in targets.values()):
            return False
        if len(targets["node"]) > max(1, CATCH_UP_NODE_SHARE * len(self.node_ids)):
            return False
        try:
            self._refresh_nodes(session, scheduler, targets["node"])
            self._refresh_tenants(session, scheduler, targets["tenant"])
            self._refresh_workloads(session, scheduler, targets["workload"])
        except Exception:  # half-applied: never reuse it; a full load serves the request
            log.warning("scheduler cache: catching up failed, loading the cluster", exc_info=True)
            return False
        return True

    def _refresh_nodes(self, session: Session, scheduler: Scheduler, names: set[str]) -> None:
        if not names:
            return
        rows = {
            row.name: row
            for row in session.scalars(
                select(NodeRow).where(NodeRow.name.in_(names)).options(*NODE_LOAD)
            )
        }
        drained = drained_gpus(session, names)
        for name in sorted(names):
            row = rows.get(name)
            if row is None:
                scheduler.remove_node(name)
                self.node_ids.pop(name, None)
            else:
                scheduler.upsert_node(schedulable(node_from_row(row), drained))
                self.node_ids[name] = row.id

    @staticmethod
    def _refresh_tenants(session: Session, scheduler: Scheduler, names: set[str]) -> None:
        if not names:
            return
        rows = {
            t.name: t for t in session.scalars(select(TenantRow).where(TenantRow.name.in_(names)))
        }
        for name in names:
            row = rows.get(name)
            if row is None:
                scheduler.quotas.pop(name, None)
            else:
                scheduler.set_quota(name, tenant_from_row(row).quota)

    @staticmethod
    def _refresh_workloads(session: Session, scheduler: Scheduler, names: set[str]) -> None:
        """A workload event names the workload (unique per tenant): every workload of that
        name is read again, and whatever the scheduler held under that name is released."""
        if not names:
            return
        for key in [k for k, h in scheduler.held.items() if h.name in names]:
            scheduler.release(key)
        session.flush()  # what this transaction changed through the ORM, as a query would
        for values in session.connection().execute(_PLACED_NAMED, {"names": sorted(names)}):
            scheduler.hold(_held_of_columns(values))  # joined to its placement: each holds one

    def _before_commit(self, session: Session, held: Scheduler) -> None:
        if self.scheduler is held:
            self._pending = newest_seq(session)

    def _after_commit(self, held: Scheduler) -> None:
        if self.scheduler is held:
            self._owner = None
            if self._pending is not None:
                self.version, self._pending = self._pending, None

    def _drop(self, held: Scheduler) -> None:
        if self.scheduler is held:
            self.scheduler, self.version, self._pending, self._owner = None, None, None, None


# Keyed by the engine's connection pool: the write sessions bind to option-engines (fresh
# proxies of one engine) that share it.
_CACHES: weakref.WeakKeyDictionary[Pool, SchedulerCache] = weakref.WeakKeyDictionary()


def scheduler_cache(engine: Engine) -> SchedulerCache:
    """The scheduler cache of one database engine (one per ``Store``)."""
    cache = _CACHES.get(engine.pool)
    if cache is None:
        cache = _CACHES[engine.pool] = SchedulerCache()
    return cache


def _cache_for(session: Session) -> SchedulerCache:
    bind = session.get_bind()
    return scheduler_cache(bind if isinstance(bind, Engine) else bind.engine)


def held_of(row: WorkloadRow) -> Held:
    assert row.placement is not None
    return Held(
        row.id,
        row.name,
        row.tenant.name,
        IsolationLevel(row.isolation),
        row.priority,
        pool_of(row.tags),
        placement_from_row(row.placement),
        row.co_residency,
        row.cpu_milli,
        row.memory_mib,
    )


def job_of(row: WorkloadRow) -> Job:
    wl = workload_from_row(row)
    return Job(
        row.id,
        Request(
            wl.name,
            wl.tenant,
            wl.tags,
            wl.isolation,
            wl.gpus,
            wl.co_residency,
            wl.cpu_milli,
            wl.memory_mib,
            wl.topology,
        ),
        wl.priority,
    )


def decision_details(row: WorkloadRow) -> dict[str, object]:
    """What drove a decision, as every placement event states it (NIST AU-3 'what and why')."""
    return decision_fields(
        row.tenant.name,
        row.tags,
        row.isolation,
        GpuRequest.from_row(row),
        row.co_residency,
    )


def decision_fields(
    tenant: str, tags: dict[str, str], isolation: str, g: GpuRequest, co_residency: bool = True
) -> dict[str, object]:
    """``decision_details`` from the values of a workload row not loaded as an ORM object.
    ``co_residency`` is stated when it constrained the decision (False)."""
    gpus: dict[str, object] = {
        "count": g.count,
        "model": g.model,
        "mig_profile": g.mig_profile,
        "share_milli": g.share_milli,
    }
    if g.nodes > 1:
        gpus["nodes"] = g.nodes
    out: dict[str, object] = {
        "tenant": tenant, "tags": dict(tags), "isolation": isolation, "gpus": gpus
    }  # fmt: skip
    if not co_residency:
        out["co_residency"] = False
    return out


def placement_json(p: Placement) -> dict[str, Any]:
    out: dict[str, Any] = {"node": p.node, "devices": devices_to_json(p.devices)}
    if p.members:
        out["members"] = members_to_json(p)
    return out


def _set_placement(tx: Tx, row: WorkloadRow, view: ClusterView, p: Placement) -> None:
    netstate.touch(tx, [row.id])
    row.placement = PlacementRow(
        node=view.node_rows[p.node],
        devices=devices_to_json(p.devices),
        members=members_to_json(p),
        placed_at=tx.now,
        nodes=[view.node_rows[n] for n in dict.fromkeys(p.nodes)],
    )


def _apply_repartition(
    tx: Tx, view: ClusterView, change: Repartition, row: WorkloadRow, why: str | None = None
) -> None:
    node_row = view.node_rows[change.node]
    gpu = next(g for g in node_row.gpus if g.index == change.gpu_index)
    gpu.mig_instances = [{"profile": i.profile, "start": i.start} for i in change.after]
    node_row.updated_at = tx.now
    if why is None:
        why = f"no free {row.mig_profile} instance; " + {
            "carve": "new instances carved into the GPU's free slices (no instance touched)",
            "reclaim": "idle instances of the GPU destroyed and new ones carved in their place "
            "(no instance in use touched)",
        }.get(change.step, "the GPU was idle")
    tx.record(
        "node.gpu.repartition",
        "node",
        change.node,
        details={
            "gpu_index": change.gpu_index,
            "gpu_uuid": change.gpu_uuid,
            "before": [f"{i.profile}@{i.start}" for i in change.before],
            "after": [f"{i.profile}@{i.start}" for i in change.after],
            "for_workload": f"{row.tenant.name}/{row.name}",
            "by": "scheduler",
            "step": change.step,
            "why": why,
        },
    )


def schedule(tx: Tx, row: WorkloadRow, view: ClusterView, *, preempt: bool = True) -> bool:
    """Try to place one pending workload; record the placement (with any repartitioning and
    preemption it took) or why it waits. Preempted workloads are offered capacity again."""
    outcome = decide(tx, view, job_of(row), GpuRequest.from_row(row), preempt=preempt)
    return apply_outcome(tx, row, view, outcome, preempt=preempt)


def decide(
    tx: Tx, view: ClusterView, job: Job, gpus: GpuRequest, *, preempt: bool = True
) -> Decision:
    """The scheduler's decision for ``job`` (``gpus``: its request) in ``view``, nothing
    persisted: the nodes its segment is not ready on left out, defragmentation tried where it
    applies (and said when it could not help), the decision's time observed."""
    unready = view.unready(job.request.tenant, job.key)
    defrag = defrag_for(tx, view, gpus)
    started = time.perf_counter()
    outcome = view.scheduler.schedule(job, preempt=preempt, unready=unready, defrag=defrag)
    observe_decision(outcome.placement is not None, time.perf_counter() - started)
    return with_refusal(outcome, defrag)


def defrag_for(tx: Tx, view: ClusterView, g: GpuRequest) -> Defragmenter | None:
    """The defragmentation step for a request of shape ``g`` (one MIG instance on one node),
    or None."""
    if g.mig_profile is None or g.nodes > 1 or g.count != 1:
        return None
    return view.defragmenter(tx.now)


def with_refusal(outcome: Decision, defrag: Defragmenter | None) -> Decision:
    """A waiting outcome says why defragmentation could not help it (rule 8), when it tried."""
    if outcome.placement is not None or defrag is None or defrag.refusal is None:
        return outcome
    refusal = defrag.refusal
    if refusal.code in (NOT_APPLICABLE, NO_REGION):
        return outcome
    return replace(
        outcome,
        message=f"{outcome.message}; {refusal.message}",
        details={**outcome.details, DEFRAG_DETAIL: refusal.as_details()},
    )


def _apply_moves(tx: Tx, view: ClusterView, row: WorkloadRow, outcome: Decision) -> list[Any]:
    """Defragmentation's moves (issue 17 §3), each an eviction then a placement with reason
    ``defragmentation`` (the scheduler already holds them where they go), with the freed GPU's
    new layout between the evictions and the placements, as the hardware sees it. Returns what
    the waiting workload's placement event says of them."""
    by = f"{row.tenant.name}/{row.name}"
    rows = _load(tx.session, [m.key for m in outcome.moves])
    said: list[Any] = []
    messages: dict[Any, str] = {}
    for m in outcome.moves:
        moved = rows[m.key]
        text = render(
            DEFRAGMENTATION,
            source=where(m.source),
            target=where(m.target),
            profile=row.mig_profile,
            by=by,
        )
        messages[m.key] = text
        _evict_row(tx, moved, DEFRAGMENTATION, text, extra={"for_workload": by})
    for change in outcome.repartitions:
        _apply_repartition(
            tx, view, change, row, why=f"defragmentation: a {row.mig_profile} region for {by}"
        )
    for m in outcome.moves:
        moved = rows[m.key]
        _place_moved(tx, view, moved, m, messages[m.key], by)
        said.append(
            {
                "workload": f"{m.tenant}/{m.workload}",
                "from": where(m.source),
                "to": where(m.target),
            }
        )
    return said


def _place_moved(tx: Tx, view: ClusterView, row: WorkloadRow, m: Move, text: str, by: str) -> None:
    _set_placement(tx, row, view, m.target)
    row.status = WorkloadStatus.PLACED.value
    row.reason = None
    row.reason_details = {
        "message": text,
        "moved_by": DEFRAGMENTATION,
        "for_workload": by,
        "from": where(m.source),
    }
    row.updated_at = tx.now
    tx.session.flush()
    tx.record(
        "workload.place",
        "workload",
        row.name,
        details={
            **decision_details(row),
            **placement_json(m.target),
            "reason": DEFRAGMENTATION,
            "moved_from": where(m.source),
            "for_workload": by,
        },
    )


def apply_outcome(
    tx: Tx, row: WorkloadRow, view: ClusterView, outcome: Decision, *, preempt: bool = True
) -> bool:
    """Persist one decision ``view.scheduler`` took for ``row`` (``schedule`` is this after
    the decision; the batch submit decides first and persists the simple outcomes in bulk)."""
    if outcome.placement is not None:
        defragmented = outcome.moves or DEFRAG_DETAIL in outcome.details
        moves = _apply_moves(tx, view, row, outcome) if defragmented else None
        for change in () if moves is not None else outcome.repartitions:
            _apply_repartition(tx, view, change, row)
        victims = _load(tx.session, [v.key for v in outcome.preempted])
        for held in outcome.preempted:
            victim = victims[held.key]
            _evict_row(
                tx,
                victim,
                PREEMPTED,
                render(
                    PREEMPTED,
                    by=f"{row.tenant.name}/{row.name}",
                    priority=row.priority,
                    victim_priority=victim.priority,
                    pool=dict(sorted(row.tags.items())),
                ),
                extra={"preempted_by": f"{row.tenant.name}/{row.name}"},
            )
        placement = outcome.placement
        _set_placement(tx, row, view, placement)
        row.status = WorkloadStatus.PLACED.value
        row.reason = None
        row.reason_details = None
        if moves is not None:  # what ``workloads explain`` says of it
            row.reason_details = {
                "message": outcome.message,
                DEFRAG_DETAIL: {"moves": moves},
            }
        row.updated_at = tx.now
        tx.session.flush()
        details: dict[str, Any] = {**decision_details(row), **placement_json(placement)}
        if moves is not None:
            details["reason"] = DEFRAGMENTATION
            details["moved"] = moves
        if outcome.preempted:
            details["preempted"] = [f"{v.tenant}/{v.name}" for v in outcome.preempted]
        if outcome.repartitions:
            details["repartitioned"] = [f"{c.node}/gpu{c.gpu_index}" for c in outcome.repartitions]
        details.update(outcome.details)  # a gang's topology outcome (issue 17 §4)
        tx.record("workload.place", "workload", row.name, details=details)
        # The victims wait with reason "preempted" unless capacity elsewhere takes them now
        # (they cannot preempt back: their priority is lower).
        for held in sorted(outcome.preempted, key=lambda h: -h.priority):
            schedule(tx, victims[held.key], view, preempt=preempt)
        return True
    reason, reason_details = _waiting(outcome, row.reason, row.reason_details)
    if row.reason != reason or row.reason_details != reason_details:
        row.reason = reason
        row.reason_details = reason_details
        row.updated_at = tx.now
        tx.record(
            "workload.pending",
            "workload",
            row.name,
            outcome=Outcome.FAILURE,
            details={**decision_details(row), "reason": reason, **reason_details},
        )
    return False


def _waiting(
    outcome: Decision, reason: str | None, details: dict[str, Any] | None
) -> tuple[str | None, dict[str, Any]]:
    """The reason and details a workload now waiting with ``outcome`` is stored with, given
    those it has (``reason``, ``details``)."""
    reason_details: dict[str, Any] = {
        "message": outcome.message,
        "rejections": outcome.rejections,
        **outcome.details,
    }
    if reason == PREEMPTED and details:
        # Keep saying why it left its node; the new message says why it still waits.
        for key in ("preempted_by", "from_node"):
            reason_details[key] = details.get(key)
        return PREEMPTED, reason_details
    return outcome.reason, reason_details


def _load(session: Session, ids: list[Any]) -> dict[Any, WorkloadRow]:
    if not ids:
        return {}
    rows = session.scalars(
        select(WorkloadRow).where(WorkloadRow.id.in_(ids)).options(*WORKLOAD_LOAD)
    )
    return {r.id: r for r in rows}


def _evict_row(
    tx: Tx, row: WorkloadRow, reason: str, message: str, extra: dict[str, Any] | None = None
) -> None:
    assert row.placement is not None
    cancel_engine_job(tx, row)  # an evicted workload's engine job stops with its placement
    netstate.touch(tx, [row.id])
    nodes = list(placement_from_row(row.placement).nodes)
    row.placement = None
    row.status = WorkloadStatus.PENDING.value
    row.reason = reason
    row.reason_details = {"message": message, "from_node": nodes[0], **(extra or {})}
    if len(nodes) > 1:
        row.reason_details["from_nodes"] = nodes
    row.updated_at = tx.now
    tx.session.flush()
    tx.record(
        "workload.evict",
        "workload",
        row.name,
        details={
            **decision_details(row),
            "node": nodes[0],
            "nodes": nodes,
            "reason": reason,
            "message": message,
            **(extra or {}),
        },
    )


def evict(tx: Tx, row: WorkloadRow, view: ClusterView, reason: str, message: str) -> None:
    """Take a workload's capacity away (its node failed, lost a certification…): it is pending
    again and will be placed only where its tags are still satisfied. A gang loses every
    member (all or nothing holds after placement too)."""
    view.scheduler.release(row.id)
    _evict_row(tx, row, reason, message)


def sync_node(view: ClusterView, row: NodeRow) -> None:
    """Tell the view's scheduler what a node now is (state, certifications, layouts)."""
    view.node_rows[row.name] = row
    drained = drained_gpus(view.session, {row.name})
    view.scheduler.upsert_node(schedulable(node_from_row(row), drained))


# Built once (its cache key too): building the statement cost more than running it. What a
# decision for a pending workload reads, without ORM objects: most pending work stays pending
# when capacity is offered to it, with the reason it already has, and then nothing is written
# (issue 20: with two pending workloads, loading them as ORM objects was ~7 % of a cancel's
# and submit's time together).
_WL = WorkloadRow.__table__.c
_PENDING_JOBS = (
    select(
        _WL.id,
        _WL.name,
        TenantRow.__table__.c.name,
        _WL.tags,
        _WL.isolation,
        _WL.gpu_count,
        _WL.gpu_model,
        _WL.mig_profile,
        _WL.share_milli,
        _WL.gpu_nodes,
        _WL.priority,
        _WL.co_residency,
        _WL.cpu_milli,
        _WL.memory_mib,
        _WL.topology,
        _WL.reason,
        _WL.reason_details,
    )  # fmt: skip
    .join(TenantRow.__table__, TenantRow.__table__.c.id == _WL.tenant_id)
    .where(_WL.status == WorkloadStatus.PENDING.value)
    .order_by(_WL.priority.desc(), _WL.created_at, _WL.id)
)


# Whether any work is pending at all: one indexed Core read. Most writes that free or add
# capacity (a cancel, a certification grant) find nothing pending, and the eager-loading ORM
# query above costs far more to run empty than this, under the one write slot (issue 12).
_ANY_PENDING = (
    select(WorkloadRow.__table__.c.id)
    .where(WorkloadRow.__table__.c.status == WorkloadStatus.PENDING.value)
    .limit(1)
)


def any_pending(session: Session) -> bool:
    """Whether some workload waits to be placed (one indexed row read)."""
    return session.connection().execute(_ANY_PENDING).first() is not None


def pending_jobs(session: Session) -> list[Any]:
    """The pending workloads' columns as ``reschedule_pending`` decides from them, in its
    order (highest priority first, oldest first); one read."""
    return list(session.connection().execute(_PENDING_JOBS).all())


def reschedule_pending(
    tx: Tx,
    view: ClusterView | None = None,
    *,
    jobs: list[Any] | None = None,
    before_change: Callable[[], None] | None = None,
) -> bool:
    """Offer capacity to every pending workload, highest priority first, oldest first.
    Returns whether any of them changed (placed, or waiting for another reason).

    Each is decided from its columns (``_PENDING_JOBS``); its ORM row is loaded only to
    persist a change: a placement, or a reason to wait that differs from the one stored. A
    pending workload this transaction already holds as an ORM object goes through
    ``schedule`` as it is (its status checked: a preemption chain may have placed it).

    ``jobs``: ``pending_jobs`` read by the caller since the last change (nothing read here);
    ``before_change``: called once before the first change is written (a caller's buffered
    events go first)."""
    session = tx.session
    if jobs is None:
        session.flush()  # work added in this transaction and not yet flushed counts too
        if not any_pending(session):
            return False
        jobs = pending_jobs(session)
    view = view or ClusterView(session)
    mapper = WorkloadRow.__mapper__
    changed = False
    for (
        wid, name, tenant, tags, isolation, count, model, mig_profile, share, nodes, priority,
        co_residency, cpu_milli, memory_mib, topology, reason, details,
    ) in jobs:  # fmt: skip
        held = session.identity_map.get(mapper.identity_key_from_primary_key((wid,)))
        if held is not None:
            if held.status == WorkloadStatus.PENDING.value:
                if before_change is not None and not changed:
                    before_change()
                changed = True
                schedule(tx, held, view)
            continue
        gpus = GpuRequest(
            count=count, model=model, mig_profile=mig_profile, share_milli=share, nodes=nodes
        )
        request = Request(
            name, tenant, dict(tags), IsolationLevel(isolation), gpus, co_residency,
            cpu_milli, memory_mib, TopologyRequest.from_json(topology),
        )  # fmt: skip
        outcome = decide(tx, view, Job(wid, request, priority), gpus)
        if outcome.placement is None and _waiting(outcome, reason, details) == (reason, details):
            continue  # waits as it did, for the reason it has: nothing to write
        if before_change is not None and not changed:
            before_change()
        changed = True
        apply_outcome(tx, _load(session, [wid])[wid], view, outcome)
    return changed
