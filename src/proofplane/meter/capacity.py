"""Capacity per compliance pool: what is held, what is free, and whether the pool survives
losing its largest node (issue 15, §10). Pure: values in, values out; the clock is a
parameter.

*Compliance pool* is the scheduler's own notion (``schedule.engine``): the set of compliance
tags a workload carries; ``{}`` is the general pool. The nodes that serve a pool are the
admitted nodes whose certifications include all its tags, so one node serves several pools
(a ``hipaa`` node also serves the general pool) and pools' capacities overlap: never add them
up across pools.

* :func:`fleet`: in one pass, what each (tenant, pool) holds (whole GPUs, GPU shares in
  thousandths, MIG compute slices: ``3g.40gb`` is 3; workloads) and each admitted node's
  capacity; ``/metrics`` and ``proofplane capacity`` both read it.
* :func:`pool_capacity`: per pool, its nodes and GPUs, the GPUs no workload holds anything on
  (*idle*: a whole GPU, or a MIG GPU the scheduler may repartition), the MIG slices configured
  and the free ones, and its largest node. Headroom is the idle GPUs and free slices.
* :func:`n_plus_one`: the failover promise, checked with the production placement core: the
  pool's largest node fails (the most GPUs; ties: the most GPUs in use, then the name), every
  workload holding capacity on it is released and offered capacity again, highest priority
  first, exactly as ``Scheduler.schedule`` decides for the service after a node failure
  (preemption inside a pool and MIG repartitioning included; a preempted workload is offered
  capacity again too). It answers whether everything found a place, and what did not, with
  the scheduler's reason. It works on the scheduler it is given and leaves it as it was:
  every workload holds what it held, at its place in placement order (which preemption
  reads), every node is the node it was; also after an exception.
* :func:`forecast`: a least-squares trend over daily peak demand, and the days until the
  trend meets the pool's capacity.

Waiting work is not re-run by the N+1 check: losing a node frees no capacity anyone else can
use, so what waited still waits; the one exception (a quota-blocked workload of a tenant whose
displaced work no longer counts against its quota) is left out.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from proofplane.meter.alerts import Finding
from proofplane.meter.anomaly import CAPACITY_N_PLUS_ONE
from proofplane.model import Node, NodeState
from proofplane.schedule.engine import Held, Job, Pool, Scheduler, pool_of
from proofplane.schedule.quota import mig_slices
from proofplane.schedule.values import FULL_GPU_MILLI

GENERAL = "general"
MAX_PREEMPTION_ROUNDS = 10_000  # a bound on victims re-offered in one check (never reached)


def pool_label(pool: Pool | Mapping[str, str]) -> str:
    """A pool as a metric label and a table key: ``k=v,k2=v2`` sorted; ``general`` for none."""
    items = sorted(pool.items() if isinstance(pool, Mapping) else pool)
    return ",".join(f"{k}={v}" for k, v in items) or GENERAL


@dataclass(frozen=True, slots=True)
class Holding:
    """What one tenant holds in one pool."""

    tenant: str
    pool: str
    workloads: int = 0
    gpus: int = 0  # whole GPUs
    share_milli: int = 0  # fractions of GPUs, in thousandths
    mig_slices: int = 0  # MIG compute slices

    @property
    def gpu_equivalents(self) -> float:
        """Whole GPUs plus shares, in GPUs (MIG slices apart: their unit is the slice)."""
        return self.gpus + self.share_milli / FULL_GPU_MILLI

    def to_json(self) -> dict[str, Any]:
        return {
            "tenant": self.tenant,
            "pool": self.pool,
            "workloads": self.workloads,
            "gpus": self.gpus,
            "share_milli": self.share_milli,
            "mig_slices": self.mig_slices,
        }


@dataclass(frozen=True, slots=True)
class NodeCapacity:
    """One admitted node's GPUs and what is free on them."""

    name: str
    certifications: frozenset[tuple[str, str]]
    gpus: int
    gpus_idle: int  # GPUs no workload holds anything on
    mig_slices: int  # compute slices of the MIG instances configured on it
    mig_slices_free: int  # of those, the ones no workload holds

    @property
    def gpus_busy(self) -> int:
        return self.gpus - self.gpus_idle


@dataclass(frozen=True, slots=True)
class PoolCapacity:
    pool: str
    tags: tuple[tuple[str, str], ...]
    nodes: int = 0
    gpus: int = 0
    gpus_idle: int = 0
    mig_slices: int = 0
    mig_slices_free: int = 0
    largest_node: str | None = None
    largest_node_gpus: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "pool": self.pool,
            "tags": dict(self.tags),
            "nodes": self.nodes,
            "gpus": self.gpus,
            "gpus_idle": self.gpus_idle,
            "mig_slices": self.mig_slices,
            "mig_slices_free": self.mig_slices_free,
            "largest_node": self.largest_node,
            "largest_node_gpus": self.largest_node_gpus,
        }


@dataclass(frozen=True, slots=True)
class Fleet:
    """What :func:`fleet` reads off nodes and holdings in one pass."""

    holdings: dict[tuple[str, str], Holding]  # (tenant, pool label) → held
    nodes: dict[str, NodeCapacity]  # admitted nodes only


# A node's facts that do not depend on what is held: its certification set, its GPUs' indexes
# and the compute slices configured on its MIG GPUs. Keyed by id(node) with the node kept
# alive and compared by identity (nodes are immutable values: the scheduler replaces a node,
# never edits one).
NodeMemo = dict[int, tuple[Node, frozenset[tuple[str, str]], frozenset[int], int]]


def _node_facts(
    node: Node, memo: NodeMemo | None
) -> tuple[frozenset[tuple[str, str]], frozenset[int], int]:
    if memo is not None:
        hit = memo.get(id(node))
        if hit is not None and hit[0] is node:
            return hit[1], hit[2], hit[3]
    slices = 0
    for gpu in node.gpus:
        if gpu.mig_enabled:
            for inst in gpu.mig_instances:
                slices += mig_slices(inst.profile)
    facts = (frozenset(node.certifications.items()), frozenset(g.index for g in node.gpus), slices)
    if memo is not None:
        memo[id(node)] = (node, *facts)
    return facts


# What one holding contributes, computed once per Held (immutable; the scheduler replaces one,
# never edits it): (tenant, pool label, whole GPUs, share milli, MIG slices, parts), a part
# being (node, GPU indexes, ((GPU index, MIG slices held on it), ...)).
_Part = tuple[str, tuple[int, ...], tuple[tuple[int, int], ...]]
_Contribution = tuple[str, str, int, int, int, tuple[_Part, ...]]
HeldMemo = dict[int, tuple[Held, _Contribution]]


def _contribution(h: Held, labels: dict[Pool, str]) -> _Contribution:
    label = labels.get(h.pool)
    if label is None:
        label = labels[h.pool] = pool_label(h.pool)
    gpus = share = slices = 0
    parts: list[_Part] = []
    for part in h.placement.parts:
        indexes: list[int] = []
        mig: dict[int, int] = {}
        for d in part.devices:
            indexes.append(d.gpu_index)
            if d.mig_profile is not None:
                n = mig_slices(d.mig_profile)
                slices += n
                mig[d.gpu_index] = mig.get(d.gpu_index, 0) + n
            elif d.share_milli is not None:
                share += d.share_milli
            else:
                gpus += 1
        parts.append((part.node, tuple(indexes), tuple(mig.items())))
    return h.tenant, label, gpus, share, slices, tuple(parts)


def fleet(
    nodes: Iterable[Node],
    held: Iterable[Held],
    *,
    labels: dict[Pool, str] | None = None,
    memo: NodeMemo | None = None,
    held_memo: HeldMemo | None = None,
) -> Fleet:
    """Holdings per (tenant, pool) and capacity per admitted node, in one pass over what is
    held and one over the nodes. ``labels``, ``memo`` and ``held_memo`` are caches the caller
    may keep between calls (pool → label; node facts; each holding's contribution, by
    identity): the answer is the same without them. A GPU the node no longer lists (drained
    for its health: placement does not see it) counts neither as capacity nor as free,
    whatever holds it."""
    labels = {} if labels is None else labels
    acc: dict[tuple[str, str], list[int]] = {}
    busy: dict[str, set[int]] = {}
    slices_held: dict[str, dict[int, int]] = {}
    seen: set[int] | None = set() if held_memo is not None else None
    for h in held:
        c: _Contribution | None = None
        if held_memo is not None:
            hit = held_memo.get(id(h))
            if hit is not None and hit[0] is h:
                c = hit[1]
            else:
                c = _contribution(h, labels)
                held_memo[id(h)] = (h, c)
            assert seen is not None
            seen.add(id(h))
        else:
            c = _contribution(h, labels)
        tenant, label, gpus, share, slices, parts = c
        row = acc.get((tenant, label))
        if row is None:
            row = acc[(tenant, label)] = [0, 0, 0, 0]
        row[0] += 1
        row[1] += gpus
        row[2] += share
        row[3] += slices
        for where, used, mig in parts:
            b = busy.get(where)
            if b is None:
                busy[where] = set(used)
            else:
                b.update(used)
            if mig:
                per_gpu = slices_held.setdefault(where, {})
                for i, n in mig:
                    per_gpu[i] = per_gpu.get(i, 0) + n
    if held_memo is not None and seen is not None and len(held_memo) > len(seen):
        for key in [k for k in held_memo if k not in seen]:  # holdings gone since
            del held_memo[key]
    caps: dict[str, NodeCapacity] = {}
    for node in nodes:
        if node.state is not NodeState.ADMITTED:
            continue
        certs, indexes, slices = _node_facts(node, memo)
        name = node.name
        b2 = busy.get(name)
        held_slices = slices_held.get(name)
        caps[name] = NodeCapacity(
            name,
            certs,
            len(indexes),
            len(indexes) - (len(indexes & b2) if b2 else 0),
            slices,
            slices - (sum(n for i, n in held_slices.items() if i in indexes) if held_slices else 0),
        )
    return Fleet({k: Holding(k[0], k[1], *v) for k, v in sorted(acc.items())}, caps)


def holdings(held: Iterable[Held]) -> dict[tuple[str, str], Holding]:
    """(tenant, pool label) → what it holds, over every part of every placement."""
    return fleet((), held).holdings


def node_capacities(nodes: Iterable[Node], held: Iterable[Held]) -> dict[str, NodeCapacity]:
    """Per admitted node: GPUs, idle GPUs, MIG slices configured and free."""
    return fleet(nodes, held).nodes


def pools_of(held: Iterable[Held], extra: Iterable[Mapping[str, str]] = ()) -> list[Pool]:
    """The pools worth reporting: the general pool, every pool a workload holds capacity in,
    and ``extra`` (the tenants' required tags), sorted by label."""
    distinct = {h.pool for h in held}
    distinct.update(pool_of(tags) for tags in extra)
    found: dict[str, Pool] = {GENERAL: frozenset()}
    for p in distinct:
        found.setdefault(pool_label(p), p)
    return [found[k] for k in sorted(found)]


def _bigger(a: NodeCapacity, b: NodeCapacity | None) -> bool:
    """Whether losing ``a`` takes more than losing ``b``: more GPUs, then more GPUs in use,
    then the lower name (a total order: the answer never depends on iteration order)."""
    if b is None:
        return True
    return (-a.gpus, -a.gpus_busy, a.name) < (-b.gpus, -b.gpus_busy, b.name)


def serves(cap: NodeCapacity, pool: Pool) -> bool:
    """Whether an admitted node serves ``pool`` (its certifications include the pool's tags)."""
    return pool <= cap.certifications


def pool_capacity(
    caps: Mapping[str, NodeCapacity], pools: Iterable[Pool]
) -> dict[str, PoolCapacity]:
    """Pool label → its capacity (see the module docstring), from :func:`fleet`'s nodes. Nodes
    are grouped by certification set first: nodes + pools × distinct certification sets."""
    by_certs: dict[frozenset[tuple[str, str]], list[int]] = {}
    biggest: dict[frozenset[tuple[str, str]], NodeCapacity] = {}
    for c in caps.values():
        t = by_certs.get(c.certifications)
        if t is None:
            t = by_certs[c.certifications] = [0, 0, 0, 0, 0]
        t[0] += 1
        t[1] += c.gpus
        t[2] += c.gpus_idle
        t[3] += c.mig_slices
        t[4] += c.mig_slices_free
        if _bigger(c, biggest.get(c.certifications)):
            biggest[c.certifications] = c
    out: dict[str, PoolCapacity] = {}
    for pool in pools:
        total = [0, 0, 0, 0, 0]
        largest: NodeCapacity | None = None
        for certs, t in by_certs.items():
            if not pool <= certs:
                continue
            for i in range(5):
                total[i] += t[i]
            if _bigger(biggest[certs], largest):
                largest = biggest[certs]
        label = pool_label(pool)
        out[label] = PoolCapacity(
            label,
            tuple(sorted(pool)),
            nodes=total[0],
            gpus=total[1],
            gpus_idle=total[2],
            mig_slices=total[3],
            mig_slices_free=total[4],
            largest_node=largest.name if largest else None,
            largest_node_gpus=largest.gpus if largest else 0,
        )
    return out


# --- N+1 -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Unplaced:
    workload: str  # tenant/name
    reason: str | None
    message: str


@dataclass(frozen=True, slots=True)
class NPlusOne:
    """The answer of :func:`n_plus_one` for one pool."""

    pool: str
    lost_node: str | None
    lost_gpus: int
    displaced: tuple[str, ...] = ()  # tenant/name of every workload on the lost node
    replaced: tuple[str, ...] = ()  # those that found a place (and preempted ones that did)
    victims: tuple[str, ...] = ()  # workloads the re-placement preempted
    unplaced: tuple[Unplaced, ...] = ()
    repartitions: int = 0  # MIG GPUs the re-placement repartitioned
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.lost_node is None or not self.unplaced

    def to_json(self) -> dict[str, Any]:
        return {
            "pool": self.pool,
            "ok": self.ok,
            "lost_node": self.lost_node,
            "lost_gpus": self.lost_gpus,
            "displaced": list(self.displaced),
            "replaced": list(self.replaced),
            "victims": list(self.victims),
            "unplaced": [
                {"workload": u.workload, "reason": u.reason, "message": u.message}
                for u in self.unplaced
            ],
            "repartitions": self.repartitions,
            "note": self.note,
        }


def largest_node(
    scheduler: Scheduler, pool: Pool, caps: Mapping[str, NodeCapacity] | None = None
) -> NodeCapacity | None:
    """The admitted node serving ``pool`` whose loss takes the most: the most GPUs, then the
    most GPUs in use, then the lowest name. ``caps``: :func:`fleet`'s nodes for the scheduler's
    present state, when the caller has them."""
    if caps is None:
        caps = fleet(scheduler.nodes(), scheduler.held.values()).nodes
    best: NodeCapacity | None = None
    for c in caps.values():
        if serves(c, pool) and _bigger(c, best):
            best = c
    return best


def displaced_by(scheduler: Scheduler, node: str) -> list[Held]:
    """Every workload holding capacity on ``node`` (a gang with one member there included),
    in placement order."""
    held = [h for h in scheduler.held.values() if node in h.placement.nodes]
    held.sort(key=lambda h: scheduler.rank(h.key) or 0)
    return held


def preemptible_by(scheduler: Scheduler, held: Iterable[Held]) -> list[Held]:
    """The workloads re-placing ``held`` could preempt: same pool, lower priority."""
    floor: dict[Pool, int] = {}
    for h in held:
        floor[h.pool] = max(floor.get(h.pool, h.priority), h.priority)
    return [h for h in scheduler.held.values() if h.pool in floor and h.priority < floor[h.pool]]


def n_plus_one(
    scheduler: Scheduler,
    pool: Pool,
    jobs: Mapping[Hashable, Job],
    caps: Mapping[str, NodeCapacity] | None = None,
) -> NPlusOne:
    """Can ``pool`` lose its largest node and still re-place everything on it? ``jobs``: the
    request of every workload the check may offer capacity to: those :func:`displaced_by` the
    :func:`largest_node`, and those they may preempt (:func:`preemptible_by`); one without a
    job counts as unplaced (reason None). ``scheduler`` is left as it was: every workload holds
    what it held at its place in placement order, every node is the node it was. ``caps``:
    as for :func:`largest_node`."""
    label = pool_label(pool)
    lost = largest_node(scheduler, pool, caps)
    if lost is None:
        return NPlusOne(label, None, 0, note="no admitted node serves this pool")
    before = {n.name: n for n in scheduler.nodes()}
    ranks = {key: scheduler.rank(key) for key in scheduler.held}
    released: dict[Hashable, tuple[Held, int | None]] = {}
    added: list[Hashable] = []
    try:
        scheduler.upsert_node(replace(before[lost.name], state=NodeState.FAILED))
        queue = displaced_by(scheduler, lost.name)
        displaced = tuple(f"{h.tenant}/{h.name}" for h in queue)
        for h in queue:
            released[h.key] = (h, scheduler.rank(h.key))
            scheduler.release(h.key)
        queue.sort(key=lambda h: -h.priority)  # stable: placement order among equals
        replaced: list[str] = []
        victims: list[str] = []
        unplaced: list[Unplaced] = []
        repartitions = 0
        rounds = 0
        while queue and rounds < MAX_PREEMPTION_ROUNDS:
            rounds += 1
            h = queue.pop(0)
            name = f"{h.tenant}/{h.name}"
            job = jobs.get(h.key)
            if job is None:
                unplaced.append(Unplaced(name, None, "its request is unknown to the check"))
                continue
            outcome = scheduler.schedule(job)
            if outcome.placement is None:
                unplaced.append(Unplaced(name, outcome.reason, outcome.message))
                continue
            added.append(job.key)
            replaced.append(name)
            repartitions += len(outcome.repartitions)
            for victim in outcome.preempted:
                victims.append(f"{victim.tenant}/{victim.name}")
                if victim.key in added:  # one the check itself placed
                    added.remove(victim.key)
                elif victim.key not in released:
                    released[victim.key] = (victim, ranks.get(victim.key))
                queue.append(victim)
            queue.sort(key=lambda v: -v.priority)
        return NPlusOne(
            label,
            lost.name,
            lost.gpus,
            displaced,
            tuple(replaced),
            tuple(victims),
            tuple(unplaced),
            repartitions,
        )
    finally:
        for key in added:
            scheduler.release(key)
        for name, node in before.items():
            if scheduler.node(name) is not node:
                scheduler.upsert_node(node)
        for h, rank in released.values():
            scheduler.hold(h, rank=rank)


def n_plus_one_finding(result: NPlusOne) -> Finding | None:
    """The alert a failed N+1 check raises (``alert.capacity_n_plus_one`` on the pool)."""
    if result.ok:
        return None
    waiting = [u.workload for u in result.unplaced]
    return Finding(
        CAPACITY_N_PLUS_ONE,
        "high",
        "pool",
        result.pool,
        f"pool {result.pool} cannot lose {result.lost_node} ({result.lost_gpus} GPUs): "
        f"{len(waiting)} workload(s) would find no compliant place",
        (("pool", result.pool),),
        {
            "lost_node": result.lost_node,
            "lost_gpus": result.lost_gpus,
            "displaced": len(result.displaced),
            "unplaced": [
                {"workload": u.workload, "reason": u.reason} for u in result.unplaced[:20]
            ],
            "unplaced_count": len(result.unplaced),
        },
    )


# --- forecast --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Forecast:
    """A straight line through daily peak demand (least squares)."""

    days: int  # days of history used
    current: float  # the last day's peak
    slope_per_week: float  # demand added per week by the trend
    projected: float  # the trend's value ``horizon_days`` after the last day
    horizon_days: int
    capacity: float
    days_to_capacity: float | None  # from the last day, while the trend rises; None: never

    def to_json(self) -> dict[str, Any]:
        return {
            "days": self.days,
            "current": round(self.current, 3),
            "slope_per_week": round(self.slope_per_week, 3),
            "projected": round(self.projected, 3),
            "horizon_days": self.horizon_days,
            "capacity": self.capacity,
            "days_to_capacity": None
            if self.days_to_capacity is None
            else round(self.days_to_capacity, 1),
        }


def forecast(daily_peaks: Sequence[float], capacity: float, horizon_days: int = 28) -> Forecast:
    """The trend of ``daily_peaks`` (oldest first, one value per day) ``horizon_days`` ahead,
    and when it reaches ``capacity``. Fewer than two days: a flat line at the one value."""
    n = len(daily_peaks)
    if n == 0:
        return Forecast(0, 0.0, 0.0, 0.0, horizon_days, capacity, None)
    ys = [float(y) for y in daily_peaks]
    if n == 1:
        slope, intercept = 0.0, ys[0]
    else:
        mx = (n - 1) / 2
        my = sum(ys) / n
        sxx = sum((x - mx) ** 2 for x in range(n))
        sxy = sum((x - mx) * (y - my) for x, y in zip(range(n), ys, strict=True))
        slope = sxy / sxx
        intercept = my - slope * mx
    last = n - 1
    at_last = intercept + slope * last
    projected = max(0.0, at_last + slope * horizon_days)
    days_to: float | None
    if at_last >= capacity:
        days_to = 0.0
    elif slope > 0:
        days_to = (capacity - at_last) / slope
    else:
        days_to = None
    return Forecast(n, ys[-1], slope * 7, projected, horizon_days, capacity, days_to)


def jobs_needed(
    scheduler: Scheduler, pools: Iterable[Pool], caps: Mapping[str, NodeCapacity] | None = None
) -> set[Hashable]:
    """The keys whose jobs :func:`n_plus_one` may need for these pools: the workloads on each
    pool's largest node, and those they could preempt."""
    if caps is None:
        caps = fleet(scheduler.nodes(), scheduler.held.values()).nodes
    keys: set[Hashable] = set()
    for pool in pools:
        lost = largest_node(scheduler, pool, caps)
        if lost is None:
            continue
        displaced = displaced_by(scheduler, lost.name)
        keys.update(h.key for h in displaced)
        keys.update(h.key for h in preemptible_by(scheduler, displaced))
    return keys


__all__ = [
    "GENERAL",
    "Forecast",
    "Holding",
    "NPlusOne",
    "NodeCapacity",
    "PoolCapacity",
    "Unplaced",
    "displaced_by",
    "fleet",
    "jobs_needed",
    "forecast",
    "holdings",
    "largest_node",
    "n_plus_one_finding",
    "n_plus_one",
    "node_capacities",
    "pool_capacity",
    "pool_label",
    "pools_of",
    "preemptible_by",
    "serves",
]
