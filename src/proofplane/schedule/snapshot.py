"""An in-memory cluster snapshot with incremental updates and indexes (kube-scheduler's
cache/snapshot split, in miniature).

The first engine rebuilt usage from every allocation and scanned every node for each decision.
A ``ClusterSnapshot`` keeps that state between decisions instead and updates it by deltas:
``upsert_node`` / ``remove_node`` when inventory, state or certifications change, ``reserve`` /
``release`` when a workload takes or gives back capacity. ``place`` is pure (no I/O, no clock)
and answers exactly what ``schedule.reference.reference_place`` answers for the same nodes and
allocations (same filters in the same order, the same rejection counts with every node counted
under the first filter that rejects it, the same best fit, the same devices); the tests replay
random operation sequences against that reference to hold it to this.

Indexes, each kept current by the update that can change it:

* admitted nodes, and ``(key, value)`` certification → nodes: a request's compliance filter is
  an intersection of small sets, smallest first, cached per tag set and kept current node by
  node as nodes change; its rejection counts are set sizes;
* GPU model → nodes that have it, and → known nodes that lack it (for the pending counts);
* per node usage (whole GPUs, MIG instances, shares per GPU, tenants, dedicated owner), by
  reference count so a release is an exact inverse of its reserve;
* per node *signature*: its idle GPUs and, per capacity class, how much of that class is free
  and how much of that is *warm* (on GPUs already in use). Classes are ``("w", model)`` (idle
  plain GPUs; never warm), ``("s", model)`` (most free milli on one plain GPU; warm: on one that
  already carries shares) and ``("m", profile, model)`` (free instances of a MIG profile; warm:
  on GPUs with an instance in use), ``model`` None meaning any;
* capacity buckets: class → idle GPUs → (free, warm) → node names in sorted order. Best fit
  (fewest idle GPUs left, then name) walks the buckets of the request's class from the fewest
  idle GPUs up, only through amounts that can hold the request, and stops as soon as no node
  left can beat the best found. The bound is what makes that quick: a node with ``i`` idle GPUs
  ends with exactly ``i`` when its warm amount holds the request (the fit packs onto used GPUs
  first), and with at least ``i - t`` otherwise (``t``: the idle GPUs the request can still
  take). With exact bounds the first fitting name of the best group wins; a common request
  evaluates one or two nodes;
* tenancy: nodes dedicated to a tenant sit in that tenant's own buckets, not the shared ones
  (only their owner may use them, and walks its own first); occupied nodes, nodes whose only
  tenant is a given one, and vacant admitted nodes with their own buckets (a dedicated-node
  request looks only there and at its tenant's sole nodes).

A request whose compliant set is small is answered by scanning that set (signatures first, the
exact fit only for the nodes that could win, the lowest bound first); the bucket walk has a step
budget and falls back to that scan when compliant nodes turn out to be rare in the buckets. A
request that ends pending gets its rejection counts from the indexes, looping only over the
smaller side of each intersection: the search has already shown that every compliant node
passing tenancy and model filters lacks capacity.

Node names are unique (the snapshot is keyed by them) and GPU indexes are unique per node (the
inventory check guarantees both).
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable, Iterable, Iterator, Mapping, Set
from dataclasses import dataclass
from types import MappingProxyType

from proofplane.model import (
    Gpu,
    IsolationLevel,
    MigInstance,
    Node,
    NodeState,
    PlacedDevice,
    Placement,
)
from proofplane.schedule.values import (
    COMPLIANCE_FILTERS,
    FULL_GPU_MILLI,
    Allocation,
    Decision,
    Request,
)

ClassKey = tuple[str | None, ...]
Amounts = tuple[int, int]  # (free, warm): capacity in a class, and the part not on idle GPUs
Signature = tuple[int, dict[ClassKey, Amounts]]  # (idle GPUs, amounts per capacity class)
_Best = tuple[int, str, tuple[PlacedDevice, ...]]  # (idle GPUs left, node, devices)
_Slot = tuple[int, int]  # (GPU index, MIG start)

_WHOLE, _SHARE, _MIG = "w", "s", "m"
_DEDICATED = IsolationLevel.DEDICATED_NODE


@dataclass(frozen=True, slots=True)
class Tuning:
    """When to scan the compliant set instead of walking buckets; decisions never depend on it.

    A tagged request scans its compliant set C when ``|C|² < scan_factor · |admitted|`` (a walk
    meets about |admitted|/|C| nodes per compliant one). A walk gives up after ``walk_budget +
    walk_budget_factor · |admitted| / |C|`` steps and scans C instead.
    """

    scan_factor: float = 2.0
    walk_budget: int = 64
    walk_budget_factor: float = 8.0


@dataclass(frozen=True, slots=True)
class _NodeInfo:
    """What placement needs from a node, precomputed once per upsert."""

    node: Node
    admitted: bool
    indexes: tuple[int, ...]
    plain: tuple[Gpu, ...]  # GPUs without MIG, in node order
    # profile → (GPU, instance, its (index, start) slot), in node order
    mig: dict[str, tuple[tuple[Gpu, MigInstance, _Slot], ...]]
    models: frozenset[str]
    # (index, whole-GPU class keys, share class keys) per plain GPU
    plain_keys: tuple[tuple[int, tuple[ClassKey, ...], tuple[ClassKey, ...]], ...]
    # per MIG GPU: (index, per profile on it: (MIG class keys, its (index, start) slots))
    mig_gpus: tuple[tuple[int, tuple[tuple[tuple[ClassKey, ...], tuple[_Slot, ...]], ...]], ...]


def _node_info(node: Node, intern: dict) -> _NodeInfo:
    """``intern`` shares equal key tuples between nodes (thousands of nodes, a few keys)."""

    def keys(*ks: ClassKey) -> tuple[ClassKey, ...]:
        return tuple(intern.setdefault(k, k) for k in ks)

    mig: dict[str, list[tuple[Gpu, MigInstance, _Slot]]] = {}
    mig_gpus = []
    plain: list[Gpu] = []
    plain_keys: list[tuple[int, tuple[ClassKey, ...], tuple[ClassKey, ...]]] = []
    for gpu in node.gpus:
        if gpu.mig_enabled:
            by_profile: dict[str, list[_Slot]] = {}
            for inst in gpu.mig_instances:
                slot = (gpu.index, inst.start)
                mig.setdefault(inst.profile, []).append((gpu, inst, slot))
                by_profile.setdefault(inst.profile, []).append(slot)
            mig_gpus.append(
                (
                    gpu.index,
                    tuple(
                        (keys((_MIG, p, None), (_MIG, p, gpu.model)), tuple(slots))
                        for p, slots in by_profile.items()
                    ),
                )
            )
        else:
            plain.append(gpu)
            plain_keys.append(
                (
                    gpu.index,
                    keys((_WHOLE, None), (_WHOLE, gpu.model)),
                    keys((_SHARE, None), (_SHARE, gpu.model)),
                )
            )
    return _NodeInfo(
        node=node,
        admitted=node.state is NodeState.ADMITTED,
        indexes=tuple(g.index for g in node.gpus),
        plain=tuple(plain),
        mig={p: tuple(v) for p, v in mig.items()},
        models=frozenset(g.model for g in node.gpus),
        plain_keys=tuple(plain_keys),
        mig_gpus=tuple(mig_gpus),
    )


class _Usage:
    """What the allocations on one node hold, by reference count (release undoes reserve)."""

    __slots__ = (
        "busy", "dedicated", "gpu_private", "gpu_tenants", "keys", "mig", "shares", "tenants",
        "whole",
    )  # fmt: skip

    def __init__(self) -> None:
        self.whole: dict[int, int] = {}  # GPU index → holders
        self.mig: dict[tuple[int, int], int] = {}  # (GPU index, start) → holders
        self.busy: dict[int, int] = {}  # GPU index → MIG instances in use on it
        self.shares: dict[int, int] = {}  # GPU index → milli held
        self.tenants: dict[str, int] = {}  # tenant → allocations
        self.dedicated: dict[Hashable, str] = {}  # key → tenant, for dedicated-node holders
        self.keys: dict[Hashable, None] = {}  # allocations here, in reservation order
        # GPU index → tenant → holders of a MIG instance or share on it (co-residency rule);
        # gpu_private: the same for holders that do not allow co-residency
        self.gpu_tenants: dict[int, dict[str, int]] = {}
        self.gpu_private: dict[int, dict[str, int]] = {}

    def add(self, key: Hashable, alloc: Allocation) -> None:
        self.keys[key] = None
        tenant = alloc.tenant
        self.tenants[tenant] = self.tenants.get(tenant, 0) + 1
        if alloc.isolation is _DEDICATED:
            self.dedicated[key] = tenant
        for dev in alloc.placement.devices:
            idx = dev.gpu_index
            if dev.mig_start is not None or dev.share_milli is not None:
                _count_holder(self.gpu_tenants, idx, tenant, 1)
                if not alloc.co_residency:
                    _count_holder(self.gpu_private, idx, tenant, 1)
            if dev.mig_start is not None:
                slot = (idx, dev.mig_start)
                n = self.mig.get(slot, 0)
                self.mig[slot] = n + 1
                if n == 0:
                    self.busy[idx] = self.busy.get(idx, 0) + 1
            elif dev.share_milli is not None:
                self.shares[idx] = self.shares.get(idx, 0) + dev.share_milli
            else:
                self.whole[idx] = self.whole.get(idx, 0) + 1

    def remove(self, key: Hashable, alloc: Allocation) -> None:
        del self.keys[key]
        _decrement(self.tenants, alloc.tenant, 1)
        self.dedicated.pop(key, None)
        for dev in alloc.placement.devices:
            idx = dev.gpu_index
            if dev.mig_start is not None or dev.share_milli is not None:
                _count_holder(self.gpu_tenants, idx, alloc.tenant, -1)
                if not alloc.co_residency:
                    _count_holder(self.gpu_private, idx, alloc.tenant, -1)
            if dev.mig_start is not None:
                if _decrement(self.mig, (idx, dev.mig_start), 1) == 0:
                    _decrement(self.busy, idx, 1)
            elif dev.share_milli is not None:
                _decrement(self.shares, idx, dev.share_milli)
            else:
                _decrement(self.whole, idx, 1)

    def idle(self, index: int) -> bool:
        return index not in self.whole and index not in self.busy and not self.shares.get(index)

    @property
    def dedicated_to(self) -> str | None:
        """The owner of the most recent dedicated-node reservation here, if any."""
        return next(reversed(self.dedicated.values())) if self.dedicated else None


_NO_USAGE = _Usage()  # stands in for a node nothing is reserved on; never mutated


def _count_holder(index: dict[int, dict[str, int]], gpu: int, tenant: str, by: int) -> None:
    per = index.get(gpu)
    if per is None:
        index[gpu] = {tenant: by}
        return
    left = per.get(tenant, 0) + by
    if left:
        per[tenant] = left
    else:
        del per[tenant]
        if not per:
            del index[gpu]


def _blocked_gpus(u: _Usage, req: Request) -> set[int] | None:
    """GPUs of the node the co-residency rule closes to ``req`` (``values.gpu_conflict``):
    with co-residency, those holding a slice or share of another tenant that refuses it;
    without, those holding any other tenant's. None when there are none (the common case)."""
    src = u.gpu_tenants if not req.co_residency else u.gpu_private
    if not src:
        return None
    tenant = req.tenant
    out = {i for i, ts in src.items() if any(t != tenant for t in ts)}
    return out or None


def _decrement(counts: dict, key: Hashable, by: int) -> int:
    left = counts.get(key, 0) - by  # shares: a 0-milli holder may find its GPU at 0 already
    if left:
        counts[key] = left
    else:
        counts.pop(key, None)
    return left


def _signature(info: _NodeInfo, u: _Usage) -> Signature:
    """Idle GPUs, and per class the capacity a request that allows co-residency, of a tenant
    holding nothing that refuses it, could take (GPUs with a holder refusing co-residency
    count as full); other requests are answered by exact scans (``ClusterSnapshot.place``)."""
    whole, shares, busy, mig = u.whole, u.shares, u.busy, u.mig
    private = u.gpu_private
    idle = 0
    for i in info.indexes:
        if i not in whole and i not in busy and not shares.get(i):
            idle += 1
    caps: dict[ClassKey, tuple[int, int]] = {}
    for i, whole_keys, share_keys in info.plain_keys:
        if i in whole:
            continue
        held = shares.get(i, 0)
        room = FULL_GPU_MILLI - held
        if room >= 1 and not (private and i in private):
            for k in share_keys:
                free, warm = caps.get(k, _NONE)
                if held:
                    caps[k] = (room if room > free else free, room if room > warm else warm)
                elif room > free:
                    caps[k] = (room, warm)
        if not held:
            for k in whole_keys:
                caps[k] = (caps.get(k, _NONE)[0] + 1, 0)
    for i, groups in info.mig_gpus:
        if private and i in private:
            continue
        if i in busy:  # some instance on it is held: count the free ones, all warm
            for ks, slots in groups:
                n = 0
                for slot in slots:
                    if slot not in mig:
                        n += 1
                if n:
                    for k in ks:
                        free, warm = caps.get(k, _NONE)
                        caps[k] = (free + n, warm + n)
        else:  # nothing held on it: every instance is free, none warm
            for ks, slots in groups:
                n = len(slots)
                for k in ks:
                    free, warm = caps.get(k, _NONE)
                    caps[k] = (free + n, warm)
    return idle, caps


_NONE = (0, 0)


class _Buckets:
    """Nodes by capacity class → idle GPUs → free amount → names, each list kept sorted."""

    __slots__ = ("classes",)

    def __init__(self) -> None:
        self.classes: dict[ClassKey, dict[int, dict[Amounts, list[str]]]] = {}

    def _add(self, name: str, key: ClassKey, idle: int, free: Amounts) -> None:
        by_free = self.classes.setdefault(key, {}).setdefault(idle, {})
        names = by_free.get(free)
        if names is None:
            by_free[free] = [name]
        else:
            bisect.insort(names, name)

    def _discard(self, name: str, key: ClassKey, idle: int, free: Amounts) -> None:
        levels = self.classes[key]
        by_free = levels[idle]
        names = by_free[free]
        del names[bisect.bisect_left(names, name)]
        if not names:
            del by_free[free]
            if not by_free:
                del levels[idle]
                if not levels:
                    del self.classes[key]

    def move(self, name: str, old: Signature | None, new: Signature | None) -> None:
        if old == new:
            return
        if old is not None and new is not None and old[0] == new[0]:
            idle, before, after = new[0], old[1], new[1]
            for key, free in before.items():
                if after.get(key) != free:
                    self._discard(name, key, idle, free)
            for key, free in after.items():
                if before.get(key) != free:
                    self._add(name, key, idle, free)
            return
        if old is not None:
            for key, free in old[1].items():
                self._discard(name, key, old[0], free)
        if new is not None:
            for key, free in new[1].items():
                self._add(name, key, new[0], free)


def _tenancy(u: _Usage, req: Request) -> str | None:
    """One rule: a dedicated node serves only its owner; a dedicated request shares with no one."""
    owner = u.dedicated_to
    if owner is not None and owner != req.tenant:
        return "node_dedicated_to_other_tenant"
    if req.isolation is _DEDICATED and any(t != req.tenant for t in u.tenants):
        return "node_shared_with_other_tenant"
    return None


def _gpu_model(info: _NodeInfo, req: Request) -> str | None:
    """One rule: a pinned GPU model must exist on the node."""
    model = req.gpus.model
    if model is None or model in info.models:
        return None
    return "gpu_model_unavailable"


def _fit(info: _NodeInfo, u: _Usage, req: Request) -> tuple[PlacedDevice, ...] | None:
    """The devices this node would give the request, or None when it lacks the capacity."""
    g = req.gpus
    model = g.model
    if g.mig_profile is not None:
        # Pack: prefer GPUs that already carry work, so whole GPUs stay free; then the lowest
        # GPU index and start.
        slots, busy = u.mig, u.busy
        blocked = _blocked_gpus(u, req) or _EMPTY_INTS
        if g.count == 1:  # the common case: one pass, no sort
            pick = None
            pick_key = None
            for gpu, inst, slot in info.mig.get(g.mig_profile, ()):
                if slot in slots or (model is not None and gpu.model != model):
                    continue
                if slot[0] in blocked:
                    continue
                k = (-busy.get(slot[0], 0), slot[0], slot[1])
                if pick_key is None or k < pick_key:
                    pick, pick_key = (gpu, inst), k
            if pick is None:
                return None
            gpu, inst = pick
            return (
                PlacedDevice(gpu.index, gpu.uuid, mig_profile=inst.profile, mig_start=inst.start),
            )
        free = [
            (gpu, inst)
            for gpu, inst, slot in info.mig.get(g.mig_profile, ())
            if (model is None or gpu.model == model)
            and slot not in slots
            and slot[0] not in blocked
        ]
        if len(free) < g.count:
            return None
        free.sort(key=lambda gi: (-busy.get(gi[0].index, 0), gi[0].index, gi[1].start))
        return tuple(
            PlacedDevice(gpu.index, gpu.uuid, mig_profile=inst.profile, mig_start=inst.start)
            for gpu, inst in free[: g.count]
        )
    whole, shares = u.whole, u.shares
    if g.share_milli is not None:  # the fullest GPU that still has room, then lowest index
        need = g.share_milli
        best: Gpu | None = None
        best_key = None
        closed = _blocked_gpus(u, req) or _EMPTY_INTS
        for gpu in info.plain:
            i = gpu.index
            if i in whole or (model is not None and gpu.model != model) or i in closed:
                continue
            held = shares.get(i, 0)
            if held + need > FULL_GPU_MILLI:
                continue
            k = (FULL_GPU_MILLI - held, i)
            if best_key is None or k < best_key:
                best, best_key = gpu, k
        if best is None:
            return None
        return (PlacedDevice(best.index, best.uuid, share_milli=need),)
    plain = [
        gpu
        for gpu in info.plain
        if (model is None or gpu.model == model) and gpu.index not in whole
    ]
    idle = [gpu for gpu in plain if not shares.get(gpu.index)]
    if len(idle) < g.count:
        return None
    return tuple(PlacedDevice(gpu.index, gpu.uuid) for gpu in idle[: g.count])


def _request_class(req: Request) -> tuple[ClassKey, int, int] | None:
    """(capacity class, amount needed in it, most GPUs taken), or None for a degenerate shape
    (count or share below 1), which is answered by an exact scan."""
    g = req.gpus
    if g.mig_profile is not None:
        return ((_MIG, g.mig_profile, g.model), g.count, g.count) if g.count >= 1 else None
    if g.share_milli is not None:
        return ((_SHARE, g.model), g.share_milli, 1) if g.share_milli >= 1 else None
    return ((_WHOLE, g.model), g.count, g.count) if g.count >= 1 else None


def _beats(best: _Best | None, score: int, name: str) -> bool:
    return best is None or score < best[0] or (score == best[0] and name < best[1])


class ClusterSnapshot:
    """Nodes and the capacity reserved on them, indexed for placement, updated by deltas.

    Allocations are keyed by whatever the caller uses (the service uses workload row ids).
    Allocations on nodes the snapshot does not know are kept and count once the node appears,
    as the reference counts them. ``reserve`` on a key already held replaces that allocation.
    """

    def __init__(
        self,
        nodes: Iterable[Node] = (),
        allocations: Mapping[Hashable, Allocation] | None = None,
        *,
        tuning: Tuning | None = None,
    ) -> None:
        self.tuning = tuning or Tuning()
        self._intern: dict[ClassKey, ClassKey] = {}
        self._info: dict[str, _NodeInfo] = {}
        self._usage: dict[str, _Usage] = {}
        self._allocs: dict[Hashable, Allocation] = {}
        self._admitted: set[str] = set()
        self._by_cert: dict[tuple[str, str], set[str]] = {}
        self._by_model: dict[str, set[str]] = {}
        self._lacking: dict[str, set[str]] = {}  # model → known nodes without it
        self._compliant: dict[tuple[tuple[str, str], ...], set[str]] = {}
        self._sig: dict[str, Signature] = {}  # admitted nodes only
        self._buckets = _Buckets()  # admitted nodes not dedicated to a tenant
        self._vacant: set[str] = set()  # admitted nodes nothing is reserved on
        self._vacant_buckets = _Buckets()
        self._owner: dict[str, str] = {}  # node → tenant it is dedicated to
        self._owned: dict[str, _Buckets] = {}  # tenant → buckets of nodes dedicated to it
        self._owned_names: dict[str, set[str]] = {}  # tenant → nodes dedicated to it
        self._occupied: set[str] = set()  # nodes with at least one allocation
        self._sole: dict[str, set[str]] = {}  # tenant → nodes it is the only tenant of
        self._tenancy_state: dict[str, tuple[str | None, str | None]] = {}  # (owner, sole)
        self._private: dict[str, int] = {}  # tenant → allocations refusing co-residency
        # Bulk load: usage first, then every node is indexed once.
        for node in nodes:
            self._set_info(node)
        for key, alloc in (allocations or {}).items():
            self._allocs[key] = alloc
            self._usage.setdefault(alloc.placement.node, _Usage()).add(key, alloc)
            if not alloc.co_residency:
                self._private[alloc.tenant] = self._private.get(alloc.tenant, 0) + 1
        for name in self._info.keys() | self._usage.keys():
            self._reindex(name)

    # ------------------------------------------------------------------ reading

    def __len__(self) -> int:
        return len(self._info)

    def __contains__(self, name: object) -> bool:
        return name in self._info

    def node(self, name: str) -> Node | None:
        info = self._info.get(name)
        return info.node if info is not None else None

    def nodes(self) -> Iterator[Node]:
        return (info.node for info in self._info.values())

    @property
    def allocations(self) -> Mapping[Hashable, Allocation]:
        """Every allocation held, by key, in reservation order (a read-only view)."""
        return MappingProxyType(self._allocs)

    def allocations_on(self, node: str) -> list[Hashable]:
        """Keys of the allocations on ``node``, in reservation order."""
        u = self._usage.get(node)
        return list(u.keys) if u is not None else []

    # ------------------------------------------------------------------ updates

    def upsert_node(self, node: Node) -> None:
        """Add a node or replace what is known about it (state, certifications, GPUs)."""
        self._drop_info(node.name)
        self._set_info(node)
        self._recheck_compliance(node.name)
        self._reindex(node.name)

    def remove_node(self, name: str) -> None:
        """Forget a node. Allocations on it stay reserved until released (and count again if
        the node comes back)."""
        if self._drop_info(name):
            self._recheck_compliance(name)
            self._reindex(name)

    def reserve(self, key: Hashable, allocation: Allocation) -> None:
        """Record that ``allocation`` holds its devices, under ``key``."""
        if key in self._allocs:
            self.release(key)
        self._allocs[key] = allocation
        if not allocation.co_residency:
            self._private[allocation.tenant] = self._private.get(allocation.tenant, 0) + 1
        node = allocation.placement.node
        u = self._usage.get(node)
        if u is None:
            u = self._usage[node] = _Usage()
        u.add(key, allocation)
        self._reindex(node)

    def release(self, key: Hashable) -> Allocation | None:
        """Give back what ``key`` holds; returns the allocation, or None if nothing was held."""
        alloc = self._allocs.pop(key, None)
        if alloc is None:
            return None
        if not alloc.co_residency:
            _decrement(self._private, alloc.tenant, 1)
        node = alloc.placement.node
        u = self._usage[node]
        u.remove(key, alloc)
        if not u.keys:
            del self._usage[node]
        self._reindex(node)
        return alloc

    def _set_info(self, node: Node) -> None:
        info = _node_info(node, self._intern)
        name = node.name
        self._info[name] = info
        if info.admitted:
            self._admitted.add(name)
        for pair in node.certifications.items():
            self._by_cert.setdefault(pair, set()).add(name)
        models = info.models
        for model, lacking in self._lacking.items():
            if model in models:
                self._by_model[model].add(name)
            else:
                lacking.add(name)
        for model in models:
            if model not in self._by_model:  # the first node with this model
                self._by_model[model] = {name}
                self._lacking[model] = {n for n in self._info if n != name}

    def _drop_info(self, name: str) -> bool:
        info = self._info.pop(name, None)
        if info is None:
            return False
        self._admitted.discard(name)
        for pair in info.node.certifications.items():
            _discard(self._by_cert, pair, name)
        for model in info.models:
            _discard(self._by_model, model, name)
            if model not in self._by_model:
                del self._lacking[model]
        for lacking in self._lacking.values():
            lacking.discard(name)
        return True

    def _recheck_compliance(self, name: str) -> None:
        """Keep the cached compliant sets current for one changed node (or drop the cache when
        it is large: rebuilding an entry costs one set intersection)."""
        cache = self._compliant
        if len(cache) > 64:
            cache.clear()
            return
        info = self._info.get(name)
        certs = info.node.certifications if info is not None and info.admitted else None
        for tags, members in cache.items():
            if certs is not None and all(certs.get(k) == v for k, v in tags):
                members.add(name)
            else:
                members.discard(name)

    def _reindex(self, name: str) -> None:
        """Bring every index that depends on node ``name`` up to date."""
        u = self._usage.get(name, _NO_USAGE)
        # tenancy
        owner = u.dedicated_to
        sole = next(iter(u.tenants)) if len(u.tenants) == 1 else None
        old_owner, old_sole = self._tenancy_state.get(name, _NO_TENANCY)
        if owner != old_owner:
            if old_owner is not None:
                del self._owner[name]
                _discard(self._owned_names, old_owner, name)
            if owner is not None:
                self._owner[name] = owner
                self._owned_names.setdefault(owner, set()).add(name)
        if sole != old_sole:
            if old_sole is not None:
                _discard(self._sole, old_sole, name)
            if sole is not None:
                self._sole.setdefault(sole, set()).add(name)
        if owner is None and sole is None:
            self._tenancy_state.pop(name, None)
        else:
            self._tenancy_state[name] = (owner, sole)
        if u.tenants:
            self._occupied.add(name)
        else:
            self._occupied.discard(name)
        # capacity: a node dedicated to a tenant is in that tenant's buckets, not the shared
        # ones (only its owner may use it); vacant nodes also have buckets of their own
        info = self._info.get(name)
        old = self._sig.get(name)
        new = _signature(info, u) if info is not None and info.admitted else None
        was_vacant = name in self._vacant
        vacant = new is not None and not u.tenants
        if owner == old_owner:
            self._owner_buckets(owner).move(name, old, new)
        else:
            self._owner_buckets(old_owner).move(name, old, None)
            self._owner_buckets(owner).move(name, None, new)
            if old_owner is not None and not self._owned[old_owner].classes:
                del self._owned[old_owner]
        if was_vacant or vacant:
            self._vacant_buckets.move(name, old if was_vacant else None, new if vacant else None)
        if new is None:
            self._sig.pop(name, None)
        else:
            self._sig[name] = new
        if vacant:
            self._vacant.add(name)
        elif was_vacant:
            self._vacant.discard(name)

    def _owner_buckets(self, owner: str | None) -> _Buckets:
        if owner is None:
            return self._buckets
        b = self._owned.get(owner)
        if b is None:
            b = self._owned[owner] = _Buckets()
        return b

    # ------------------------------------------------------------------ deciding

    def place(self, req: Request) -> Decision:
        """Choose a node and devices for ``req``, or explain why none qualifies. Pure: the
        snapshot is not changed (``reserve`` the result to take the capacity)."""
        compliant = self._compliant_set(req.tags)
        best: _Best | None = None
        if compliant:
            cls = _request_class(req)
            if cls is None or (
                (not req.co_residency or req.tenant in self._private)
                and (req.gpus.mig_profile is not None or req.gpus.share_milli is not None)
            ):
                # the signatures describe what a request allowing co-residency, of a tenant
                # holding nothing that refuses it, can take; anyone else is scanned exactly
                best = self._scan_exact(req, compliant)
            elif req.isolation is _DEDICATED:
                best = self._place_dedicated(req, cls, compliant)
            else:
                best = self._place_shared(req, cls, compliant)
        if best is None:
            return self._pending(req, compliant)
        return Decision(Placement(best[1], best[2]), None, f"placed on {best[1]}")

    def _compliant_set(self, tags: Mapping[str, str]) -> Set[str]:
        """Admitted nodes certified for every tag: the first two filters, as one set."""
        if not tags:
            return self._admitted
        key = tuple(sorted(tags.items()))
        hit = self._compliant.get(key)
        if hit is None:
            sets = [self._by_cert.get(pair) for pair in key]
            if any(s is None for s in sets):
                hit = set()
            else:
                ordered = sorted((s for s in sets if s is not None), key=len)
                hit = ordered[0].intersection(*ordered[1:], self._admitted)
            if len(self._compliant) >= 4096:
                self._compliant.clear()
            self._compliant[key] = hit
        return hit

    def _place_shared(
        self, req: Request, cls: tuple[ClassKey, int, int], compliant: Set[str]
    ) -> _Best | None:
        key, need, most = cls
        n_admitted = len(self._admitted)
        tagged = compliant is not self._admitted
        t = self.tuning
        if tagged and len(compliant) ** 2 < t.scan_factor * n_admitted:
            return self._scan(req, key, need, most, compliant, None)
        among = compliant if tagged else None
        # Nodes dedicated to this tenant are not in the shared buckets: walk its own first.
        owned = self._owned.get(req.tenant)
        best = None
        if owned is not None:
            best = self._walk(req, owned, key, need, most, among, None, None)[0]
        budget = None
        if tagged:
            budget = t.walk_budget + int(t.walk_budget_factor * n_admitted / len(compliant))
        best, done = self._walk(req, self._buckets, key, need, most, among, best, budget)
        return best if done else self._scan(req, key, need, most, compliant, best)

    def _place_dedicated(
        self, req: Request, cls: tuple[ClassKey, int, int], compliant: Set[str]
    ) -> _Best | None:
        """A dedicated-node request may go only where it would be the sole tenant: to vacant
        nodes, or to nodes only its own tenant uses."""
        key, need, most = cls
        own = self._sole.get(req.tenant)
        best = self._scan(req, key, need, most, own & compliant, None) if own else None
        tagged = compliant is not self._admitted
        t = self.tuning
        budget = None
        if tagged:
            budget = t.walk_budget + int(
                t.walk_budget_factor * len(self._admitted) / len(compliant)
            )
        best, done = self._walk(
            req, self._vacant_buckets, key, need, most, compliant if tagged else None, best, budget
        )
        if not done:
            best = self._scan(req, key, need, most, self._vacant & compliant, best)
        return best

    def _evaluate(self, name: str, req: Request) -> tuple[int, tuple[PlacedDevice, ...]] | None:
        """The per-node filters (tenancy, GPU model, capacity) and the best-fit score for one
        admitted, certified node: (idle GPUs left after placing, devices), or None."""
        u = self._usage.get(name, _NO_USAGE)
        if _tenancy(u, req) is not None:
            return None
        info = self._info[name]
        if _gpu_model(info, req) is not None:
            return None
        devices = _fit(info, u, req)
        if devices is None:
            return None
        idle = self._sig[name][0]
        if len(devices) == 1:
            return (idle - 1 if u.idle(devices[0].gpu_index) else idle), devices
        taken = {d.gpu_index for d in devices}
        return idle - sum(1 for i in taken if u.idle(i)), devices

    def _walk(
        self,
        req: Request,
        buckets: _Buckets,
        key: ClassKey,
        need: int,
        most: int,
        compliant: Set[str] | None,
        best: _Best | None,
        budget: int | None,
    ) -> tuple[_Best | None, bool]:
        """Best fit by walking ``buckets`` of class ``key`` from the fewest idle GPUs up.
        Returns (best, True), or (partial, False) when the step budget ran out."""
        levels = buckets.classes.get(key)
        if not levels:
            return best, True
        steps = 0
        for idle in sorted(levels):
            if best is not None and idle - most > best[0]:
                break  # no node at this level or above can end with fewer idle GPUs
            for (free, warm), names in levels[idle].items():
                if free < need:
                    continue
                bound = idle if warm >= need else idle - min(most, need - warm)
                if best is not None and (
                    bound > best[0] or (bound == best[0] and names[0] >= best[1])
                ):
                    continue
                for name in names:
                    if not _beats(best, bound, name):
                        break
                    steps += 1
                    if budget is not None and steps > budget:
                        return best, False
                    if compliant is not None and name not in compliant:
                        continue
                    found = self._evaluate(name, req)
                    if found is not None and _beats(best, found[0], name):
                        best = (found[0], name, found[1])
        return best, True

    def _scan(
        self,
        req: Request,
        key: ClassKey,
        need: int,
        most: int,
        names: Iterable[str],
        best: _Best | None,
    ) -> _Best | None:
        """Best fit among ``names`` (admitted, certified): signatures rule out nodes without
        room and order the rest by bound; exact fits only while a node could still win."""
        sig = self._sig
        owner = self._owner
        tenant = req.tenant
        candidates: list[tuple[int, str]] = []
        for name in names:
            idle, caps = sig[name]
            amounts = caps.get(key)
            if amounts is None or amounts[0] < need:
                continue
            held_by = owner.get(name)
            if held_by is not None and held_by != tenant:
                continue  # dedicated to another tenant: the tenancy filter refuses it
            free, warm = amounts
            bound = idle if warm >= need else idle - min(most, need - warm)
            candidates.append((bound, name))
        if not candidates:
            return best
        # The bounds are usually exact: try the lowest first, before sorting the rest.
        bound, name = min(candidates)
        if not _beats(best, bound, name):
            return best
        found = self._evaluate(name, req)
        if found is not None and found[0] == bound:
            return (bound, name, found[1])
        candidates.sort()
        for bound, name in candidates:
            if not _beats(best, bound, name):
                break
            found = self._evaluate(name, req)
            if found is not None and _beats(best, found[0], name):
                best = (found[0], name, found[1])
        return best

    def _scan_exact(self, req: Request, names: Iterable[str]) -> _Best | None:
        best: _Best | None = None
        for name in names:
            found = self._evaluate(name, req)
            if found is not None and _beats(best, found[0], name):
                best = (found[0], name, found[1])
        return best

    def _pending(self, req: Request, compliant: Set[str]) -> Decision:
        """Why nothing fits, per filter, each node under the first filter that rejects it.

        Called only once the search found no node, so every compliant node that passes the
        tenancy and GPU-model filters was rejected for capacity. Counted from the indexes
        (set sizes, and loops over the smaller side only): admitted nodes are either vacant
        or occupied, a node's sole tenant is its dedicated owner if it has one."""
        rejections: dict[str, int] = {}

        def count(code: str, n: int) -> None:
            if n:
                rejections[code] = n

        total = len(self._info)
        n_admitted = len(self._admitted)
        n_compliant = len(compliant)
        count("node_not_admitted", total - n_admitted)
        count("missing_certification", n_admitted - n_compliant)
        tenant = req.tenant
        owner = self._owner
        mine = self._owned_names.get(tenant, _EMPTY)
        others = len(owner.keys() & compliant) - (len(mine & compliant) if mine else 0)
        count("node_dedicated_to_other_tenant", others)
        dedicated = req.isolation is _DEDICATED
        own = self._sole.get(tenant, _EMPTY)
        vacant = self._vacant
        shared = 0
        if dedicated and n_compliant:
            # occupied compliant nodes, less this tenant's own, less those dedicated to others
            shared = n_compliant - len(vacant & compliant) - len(own & compliant)
            shared -= others
            count("node_shared_with_other_tenant", shared)
        left = n_compliant - others - shared
        model = req.gpus.model
        if model is not None and left:
            lacking = self._lacking.get(model)
            if lacking is None:  # no node has it
                bad = left
            else:
                bad = 0
                for n in lacking & compliant:
                    held_by = owner.get(n)
                    if held_by is not None and held_by != tenant:
                        continue  # counted as dedicated to another tenant
                    if dedicated and n not in vacant and n not in own:
                        continue  # counted as shared with another tenant
                    bad += 1
            count("gpu_model_unavailable", bad)
            left -= bad
        count("insufficient_gpu_capacity", left)
        if not compliant:
            return Decision(
                None,
                "no_compliant_capacity",
                f"none of {total} nodes is admitted and certified for {dict(req.tags) or 'this'}",
                rejections,
            )
        blocking = ", ".join(
            f"{code} on {n}"
            for code, n in sorted(rejections.items())
            if code not in COMPLIANCE_FILTERS
        )
        return Decision(
            None,
            "insufficient_capacity",
            f"{n_compliant} node(s) are admitted and certified, none can take it now ({blocking})",
            rejections,
        )


_EMPTY: frozenset[str] = frozenset()
_EMPTY_INTS: frozenset[int] = frozenset()
_NO_TENANCY: tuple[None, None] = (None, None)


def _discard(index: dict, key: Hashable, name: str) -> None:
    names = index.get(key)
    if names is not None:
        names.discard(name)
        if not names:
            del index[key]
