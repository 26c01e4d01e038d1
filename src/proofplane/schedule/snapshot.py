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

The parts live beside this module: per-node accounting (``schedule.usage``: ``NodeInfo``,
``Usage``), the fit rules (``schedule.fit``: one filter each, codes from ``schedule.reasons``),
the capacity signatures and buckets (``schedule.buckets``); this module is the snapshot itself
(its indexes and their updates) and the search.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterable, Iterator, Mapping, Set
from dataclasses import dataclass
from functools import lru_cache
from types import MappingProxyType
from typing import TypeVar

from proofplane.model import IsolationLevel, Node, PlacedDevice, Placement
from proofplane.schedule.buckets import Buckets, Signature, request_class, signature
from proofplane.schedule.fit import fit, gpu_model, resources, tenancy
from proofplane.schedule.reasons import (
    FILTER_CODES,
    GPU_MODEL_UNAVAILABLE,
    INSUFFICIENT_CAPACITY,
    INSUFFICIENT_GPU_CAPACITY,
    MISSING_CERTIFICATION,
    NO_COMPLIANT_CAPACITY,
    NODE_DEDICATED_TO_OTHER_TENANT,
    NODE_NOT_ADMITTED,
    NODE_SHARED_WITH_OTHER_TENANT,
    blocking,
    template,
)
from proofplane.schedule.scoring import CPU_UNTRACKED, FULL, Scorer, Shape, State
from proofplane.schedule.topology import TopologyIndex, free_gpus
from proofplane.schedule.usage import (
    NO_USAGE,
    ClassKey,
    NodeInfo,
    Slot,
    Usage,
    decrement,
    node_info,
)
from proofplane.schedule.values import (
    MODEL_SEPARATOR,
    Allocation,
    Decision,
    Request,
    allowed_models,
)

_Best = tuple[int, str, tuple[PlacedDevice, ...]]  # (idle GPUs left, node, devices)
_K = TypeVar("_K", bound=Hashable)

_DEDICATED = IsolationLevel.DEDICATED_NODE
# A pending decision's messages, looked up once.
_NO_COMPLIANT_MESSAGE = template(NO_COMPLIANT_CAPACITY)
_INSUFFICIENT_MESSAGE = template(INSUFFICIENT_CAPACITY)


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
        scorer: Scorer | None = None,
    ) -> None:
        self.tuning = tuning or Tuning()
        self.scorer = scorer
        self._scored = ScoreIndex(scorer) if scorer is not None else None
        self._heap_tags_cache: dict[_Tags, _Tags] = {}
        self._intern: dict[ClassKey, ClassKey] = {}
        self._info: dict[str, NodeInfo] = {}
        self._usage: dict[str, Usage] = {}
        self._allocs: dict[Hashable, Allocation] = {}
        self._admitted: set[str] = set()
        self._by_cert: dict[tuple[str, str], set[str]] = {}
        self._by_model: dict[str, set[str]] = {}
        self._lacking: dict[str, set[str]] = {}  # model → known nodes without it
        self._compliant: dict[tuple[tuple[str, str], ...], set[str]] = {}
        self._sig: dict[str, Signature] = {}  # admitted nodes only
        self._buckets = Buckets()  # admitted nodes not dedicated to a tenant
        self._vacant: set[str] = set()  # admitted nodes nothing is reserved on
        self._vacant_buckets = Buckets()
        self._owner: dict[str, str] = {}  # node → tenant it is dedicated to
        self._owned: dict[str, Buckets] = {}  # tenant → buckets of nodes dedicated to it
        self._owned_names: dict[str, set[str]] = {}  # tenant → nodes dedicated to it
        self._occupied: set[str] = set()  # nodes with at least one allocation
        self._sole: dict[str, set[str]] = {}  # tenant → nodes it is the only tenant of
        self._tenancy_state: dict[str, tuple[str | None, str | None]] = {}  # (owner, sole)
        self._private: dict[str, int] = {}  # tenant → allocations refusing co-residency
        self._idle_mig: set[str] = set()  # see idle_mig_nodes
        self._changes = 0  # changes so far, any node (see ``version``)
        self._versions: dict[str, int] = {}  # node → ``_changes`` at its last change
        # issue 17 §4: admitted nodes by topology domain, with free-GPU counts per domain
        self.topology = TopologyIndex()
        # Bulk load: usage first, then every node is indexed once.
        for node in nodes:
            self._set_info(node)
        for key, alloc in (allocations or {}).items():
            self._allocs[key] = alloc
            self._usage.setdefault(alloc.placement.node, Usage()).add(key, alloc)
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
            u = self._usage[node] = Usage()
        u.add(key, allocation)
        self._reindex(node)

    def release(self, key: Hashable) -> Allocation | None:
        """Give back what ``key`` holds; returns the allocation, or None if nothing was held."""
        alloc = self._allocs.pop(key, None)
        if alloc is None:
            return None
        if not alloc.co_residency:
            decrement(self._private, alloc.tenant, 1)
        node = alloc.placement.node
        u = self._usage[node]
        u.remove(key, alloc)
        if not u.keys:
            del self._usage[node]
        self._reindex(node)
        return alloc

    def _set_info(self, node: Node) -> None:
        info = node_info(node, self._intern)
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
        self._heap_tags_cache.clear()
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
        self._changes += 1
        self._versions[name] = self._changes
        u = self._usage.get(name, NO_USAGE)
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
        new: Signature | None = None
        if info is not None and info.admitted:
            # with a scoring plugin the search never walks the capacity buckets: one constant
            # signature keeps them (and the work of keeping them) out of the way
            new = signature(info, u) if self._scored is None else _UNSIGNED
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
        if self._scored is not None:
            self._scored.changed(
                name,
                score_state(info, u, self._scored.slots_of(name, info))
                if info is not None and new is not None
                else None,
            )
        if info is not None and new is not None:
            self.topology.changed(name, info.node, lambda: free_gpus(info, u))
        else:
            self.topology.changed(name, None, 0)
        # repartitioning's candidates: admitted nodes with a MIG GPU no whole-GPU or MIG
        # allocation holds (a superset of the nodes with an idle MIG GPU)
        if (
            info is not None
            and info.admitted
            and any(
                g.mig_enabled and g.index not in u.whole and g.index not in u.busy
                for g in info.node.gpus
            )
        ):
            self._idle_mig.add(name)
        else:
            self._idle_mig.discard(name)

    def _owner_buckets(self, owner: str | None) -> Buckets:
        if owner is None:
            return self._buckets
        b = self._owned.get(owner)
        if b is None:
            b = self._owned[owner] = Buckets()
        return b

    # ------------------------------------------------------------------ deciding

    def place(self, req: Request) -> Decision:
        """Choose a node and devices for ``req``, or explain why none qualifies. Pure: the
        snapshot is not changed (``reserve`` the result to take the capacity)."""
        compliant = self._compliant_set(req.tags)
        best = self._search(req, compliant)
        if best is None:
            return self._pending(req, compliant)
        return Decision(Placement(best[1], best[2]), None, f"placed on {best[1]}")

    def find(self, req: Request) -> Placement | None:
        """``place`` without working out why nothing fits (for callers that only need where:
        the engine's MIG carving, trace replays retrying a queue): the same search, the same
        placement."""
        best = self._search(req, self._compliant_set(req.tags))
        return Placement(best[1], best[2]) if best is not None else None

    def _search(self, req: Request, compliant: Set[str]) -> _Best | None:
        best: _Best | None = None
        if compliant and self._scored is not None:
            best = self._place_scored(req, compliant)
        elif compliant:
            cls = request_class(req)
            if (
                cls is None
                or _exact_only(req)
                or (
                    (not req.co_residency or req.tenant in self._private)
                    and (req.gpus.mig_profile is not None or req.gpus.share_milli is not None)
                )
            ):
                # the signatures describe what a request allowing co-residency, of a tenant
                # holding nothing that refuses it, can take; anyone else is scanned exactly
                best = self._scan_exact(req, compliant)
            elif req.isolation is _DEDICATED:
                best = self._place_dedicated(req, cls, compliant)
            else:
                best = self._place_shared(req, cls, compliant)
        return best

    def compliant_nodes(self, tags: Mapping[str, str]) -> Set[str]:
        """Admitted nodes certified for every tag in ``tags`` (the compliance filters; a view
        the caller must not change)."""
        return self._compliant_set(tags)

    def member_fit(self, name: str, req: Request) -> tuple[PlacedDevice, ...] | None:
        """The devices ``req`` would take on compliant node ``name`` (every per-node filter:
        tenancy, GPU model, CPU, memory, capacity), or None. The caller checks compliance."""
        if name not in self._sig:
            return None
        found = self._evaluate(name, req)
        return found[1] if found is not None else None

    def version(self, name: str) -> int:
        """A number that changes whenever anything about node ``name`` changes here (its
        inventory, state or certifications, an allocation on it), and no other node has: for
        callers that keep per-node answers between decisions (``schedule.defrag.RegionIndex``).
        Versions of different snapshots are not comparable; 0 for a node never seen."""
        return self._versions.get(name, 0)

    def free_on(self, name: str) -> tuple[int | None, int | None, Set[Slot]]:
        """Node ``name``'s free CPU (milli-cores) and memory (MiB), None for a resource it does
        not track (or a node not known), and its MIG slots ``(GPU index, start)`` that some
        allocation holds (a view the caller must not change)."""
        info = self._info.get(name)
        u = self._usage.get(name, NO_USAGE)
        if info is None:
            return None, None, u.mig.keys()
        cpu = info.cpu - u.cpu if info.cpu is not None else None
        mem = info.mem - u.mem if info.mem is not None else None
        return cpu, mem, u.mig.keys()

    def idle_mig_nodes(self) -> Set[str]:
        """Admitted nodes with a MIG-enabled GPU that no whole-GPU or MIG allocation holds:
        every node the repartitioning of idle GPUs could use, kept current by every change
        (a view the caller must not change)."""
        return self._idle_mig

    def may_take(self, name: str, req: Request) -> bool:
        """Whether node ``name`` passes the per-node filters that do not look at its GPUs' free
        capacity (tenancy, GPU model, CPU, memory) for ``req``: a necessary condition of any
        placement of ``req`` there, cheap enough to ask before changing the node's layout
        (``Scheduler`` carving). The caller checks admission and compliance."""
        info = self._info.get(name)
        if info is None:
            return False
        u = self._usage.get(name, NO_USAGE)
        if tenancy(u, req) is not None or gpu_model(info, req) is not None:
            return False
        return not ((req.cpu_milli or req.memory_mib) and resources(info, u, req) is not None)

    def observe(self, req: Request) -> None:
        """Show the scorer one request before its decision (its workload mix learns from the
        stream of requests); when the mix changes, every cached score is dropped."""
        if self._scored is not None:
            self._scored.observe(shape_of(req))

    def score_key(self, name: str, req: Request) -> Hashable | None:
        """The scorer's key for placing ``req`` on node ``name`` as it stands (None without a
        scorer, or when the node's free capacity cannot take the request's shape)."""
        if self._scored is None:
            return None
        found = self._scored.score(name, shape_of(req))
        return found[0] if found is not None else None

    def _place_scored(self, req: Request, compliant: Set[str]) -> _Best | None:
        """The scorer's best node among the compliant ones that pass every filter: the
        shape's heap of scores, popped until a node passes the exact per-node filters (nodes
        that fail only for this request, e.g. tenancy or memory, are put back)."""
        index = self._scored
        assert index is not None
        shape = shape_of(req)
        if req.isolation is _DEDICATED:
            # only vacant nodes and the tenant's own may take it: score those few directly
            own = self._sole.get(req.tenant, _EMPTY)
            return self._scan_scored(req, shape, (self._vacant | own) & compliant)
        tags = self._heap_tags(tuple(sorted(req.tags.items())), compliant)
        heap = index.heap(shape, tags, self._compliant_set(dict(tags)) if tags else self._admitted)
        aside = []
        best: _Best | None = None
        version = index.version
        while heap:
            top = heap[0]
            name = top[1]
            if top[2] != version.get(name):
                heapq.heappop(heap)  # stale: the node changed since this score
                continue
            found = self._evaluate(name, req, top[3]) if name in compliant else None
            if found is None:
                aside.append(heapq.heappop(heap))
                continue
            best = (0, name, found[1])
            break
        for entry in aside:
            heapq.heappush(heap, entry)
        return best

    def _heap_tags(self, tags: _Tags, compliant: Set[str]) -> _Tags:
        """The tags whose score heaps serve a request with ``tags``: drop a tag while the
        request's compliant nodes are still at least half of the larger set (its pop then
        skips at most about one node per hit), so a few heaps serve many tag sets and each
        reservation re-scores fewer heaps."""
        hit = self._heap_tags_cache.get(tags)
        if hit is not None:
            return hit
        chosen = tags
        while chosen:
            best: tuple[int, _Tags] | None = None
            for i in range(len(chosen)):
                sub = chosen[:i] + chosen[i + 1 :]
                size = len(self._compliant_set(dict(sub)) if sub else self._admitted)
                if 2 * len(compliant) >= size and (best is None or size > best[0]):
                    best = (size, sub)
            if best is None:
                break
            chosen = best[1]
        if len(self._heap_tags_cache) > 4096:
            self._heap_tags_cache.clear()
        self._heap_tags_cache[tags] = chosen
        return chosen

    def _scan_scored(self, req: Request, shape: Shape, names: Iterable[str]) -> _Best | None:
        """The scorer's best among ``names`` that passes the exact filters."""
        index = self._scored
        assert index is not None
        ranked = []
        for name in names:
            s = index.score(name, shape)
            if s is not None:
                ranked.append((s[0], name, s[1]))
        ranked.sort()
        for _key, name, position in ranked:
            found = self._evaluate(name, req, position)
            if found is not None:
                return (0, name, found[1])
        return None

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

    def _evaluate(
        self, name: str, req: Request, position: int = -1
    ) -> tuple[int, tuple[PlacedDevice, ...]] | None:
        """The per-node filters (tenancy, GPU model, CPU, memory, capacity) and the best-fit
        score for one admitted, certified node: (idle GPUs left after placing, devices), or
        None. ``position``: the GPU a scorer chose for a share (plain GPUs) or a MIG slice (MIG
        GPUs), in node order; the fit rule's own choice when it cannot take it."""
        u = self._usage.get(name, NO_USAGE)
        if tenancy(u, req) is not None:
            return None
        info = self._info[name]
        if gpu_model(info, req) is not None:
            return None
        if (req.cpu_milli or req.memory_mib) and resources(info, u, req) is not None:
            return None
        devices = None
        if position >= 0:
            devices = fit_at(info, u, req, position)
        if devices is None:
            devices = fit(info, u, req)
        if devices is None:
            return None
        if self._scored is not None:
            return 0, devices  # the scorer ranked the nodes; no best-fit count needed
        idle = self._sig[name][0]
        if len(devices) == 1:
            return (idle - 1 if u.idle(devices[0].gpu_index) else idle), devices
        taken = {d.gpu_index for d in devices}
        return idle - sum(1 for i in taken if u.idle(i)), devices

    def _walk(
        self,
        req: Request,
        buckets: Buckets,
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
        if _exact_only(req):
            return self._pending_exact(req, compliant)
        rejections: dict[str, int] = {}

        def count(code: str, n: int) -> None:
            if n:
                rejections[code] = n

        total = len(self._info)
        n_admitted = len(self._admitted)
        n_compliant = len(compliant)
        count(NODE_NOT_ADMITTED, total - n_admitted)
        count(MISSING_CERTIFICATION, n_admitted - n_compliant)
        tenant = req.tenant
        owner = self._owner
        mine = self._owned_names.get(tenant, _EMPTY)
        others = len(owner.keys() & compliant) - (len(mine & compliant) if mine else 0)
        count(NODE_DEDICATED_TO_OTHER_TENANT, others)
        dedicated = req.isolation is _DEDICATED
        own = self._sole.get(tenant, _EMPTY)
        vacant = self._vacant
        shared = 0
        if dedicated and n_compliant:
            # occupied compliant nodes, less this tenant's own, less those dedicated to others
            shared = n_compliant - len(vacant & compliant) - len(own & compliant)
            shared -= others
            count(NODE_SHARED_WITH_OTHER_TENANT, shared)
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
            count(GPU_MODEL_UNAVAILABLE, bad)
            left -= bad
        count(INSUFFICIENT_GPU_CAPACITY, left)
        if not compliant:
            return Decision(
                None,
                NO_COMPLIANT_CAPACITY,
                _NO_COMPLIANT_MESSAGE.format(total=total, tags=dict(req.tags) or "this"),
                rejections,
            )
        return Decision(
            None,
            INSUFFICIENT_CAPACITY,
            _INSUFFICIENT_MESSAGE.format(compliant=n_compliant, blocking=blocking(rejections)),
            rejections,
        )

    def _pending_exact(self, req: Request, compliant: Set[str]) -> Decision:
        """``_pending`` by one pass over the compliant nodes, each filter in order (for requests
        the indexes do not describe: CPU or memory asked, GPU model alternatives)."""
        total = len(self._info)
        rejections: dict[str, int] = {}
        for code, n in (
            (NODE_NOT_ADMITTED, total - len(self._admitted)),
            (MISSING_CERTIFICATION, len(self._admitted) - len(compliant)),
        ):
            if n:
                rejections[code] = n
        for name in compliant:
            u = self._usage.get(name, NO_USAGE)
            info = self._info[name]
            code = (
                tenancy(u, req)
                or gpu_model(info, req)
                or resources(info, u, req)
                or INSUFFICIENT_GPU_CAPACITY
            )
            rejections[code] = rejections.get(code, 0) + 1
        if not compliant:
            return Decision(
                None,
                NO_COMPLIANT_CAPACITY,
                _NO_COMPLIANT_MESSAGE.format(total=total, tags=dict(req.tags) or "this"),
                rejections,
            )
        ordered = {c: rejections[c] for c in FILTER_CODES if c in rejections}
        return Decision(
            None,
            INSUFFICIENT_CAPACITY,
            _INSUFFICIENT_MESSAGE.format(compliant=len(compliant), blocking=blocking(ordered)),
            ordered,
        )


def _exact_only(req: Request) -> bool:
    """Requests the capacity signatures do not describe (answered by exact scans)."""
    model = req.gpus.model
    return bool(req.cpu_milli or req.memory_mib or (model and MODEL_SEPARATOR in model))


def shape_of(req: Request) -> Shape:
    """What a scorer sees of a request (``schedule.scoring.Shape``)."""
    g = req.gpus
    if g.mig_profile is not None:
        return (req.cpu_milli, g.count, 0, g.model, g.mig_profile)
    if g.share_milli is not None:
        return (req.cpu_milli, 1, g.share_milli, g.model, None)
    return (req.cpu_milli, g.count, FULL if g.count else 0, g.model, None)


def score_state(info: NodeInfo, u: Usage, slots: MigSlots) -> State:
    """What a scorer sees of a node (``schedule.scoring.State``); ``slots``: ``mig_slots(info)``."""
    whole, shares, held = u.whole, u.shares, u.mig
    if whole or shares:
        frees = tuple(0 if g.index in whole else FULL - shares.get(g.index, 0) for g in info.plain)
    else:
        frees = _all_free(len(info.plain))
    if held:
        mig = tuple(tuple(profile for profile, slot in gpu if slot not in held) for gpu in slots)
    else:
        mig = tuple(tuple(profile for profile, _slot in gpu) for gpu in slots)
    cap = info.cpu if info.cpu is not None else CPU_UNTRACKED
    cpu = cap - u.cpu if info.cpu is not None else CPU_UNTRACKED
    return (info.models, cpu, frees, mig, cap, not u.keys)


@lru_cache(maxsize=64)
def _all_free(n: int) -> tuple[int, ...]:
    return (FULL,) * n


def mig_slots(info: NodeInfo) -> MigSlots:
    """Per MIG GPU of the node, its instances as (profile, slot), sorted by profile (what
    ``score_state`` filters by the slots held)."""
    return tuple(
        tuple(sorted((ks[0][1] or "", slot) for ks, slots in groups for slot in slots))
        for _i, groups in info.mig_gpus
    )


MigSlots = tuple[tuple[tuple[str, Slot], ...], ...]


def fit_at(
    info: NodeInfo, u: Usage, req: Request, position: int
) -> tuple[PlacedDevice, ...] | None:
    """The devices of a one-device request on the GPU a scorer chose (``position`` among the
    node's plain GPUs for a share, among its MIG GPUs for a slice), or None when that GPU
    cannot take it (the caller falls back to ``fit``)."""
    g = req.gpus
    if g.mig_profile is not None:
        if g.count != 1 or position >= len(info.mig_gpus):
            return None
        return fit(info, u, req, only=info.mig_gpus[position][0])
    if g.share_milli is None or position >= len(info.plain):
        return None
    return fit(info, u, req, only=info.plain[position].index)


class ScoreIndex:
    """Per request shape (and compliance tags), a heap of ``(score key, node, version, GPU
    position)`` over the nodes that can take the shape, caught up lazily: each visit re-scores
    only the nodes changed since the shape's previous visit (stale entries are dropped when
    they surface). Node states are interned to small ids and scores memoised per shape and
    state id, so nodes in equal states cost one evaluation and a re-score of a known state is
    one dictionary lookup. A change of the scorer's workload mix drops every score."""

    def __init__(self, scorer: Scorer) -> None:
        self.scorer = scorer
        self.sid: dict[str, int] = {}  # node → id of its state
        self._slots: dict[str, tuple[NodeInfo, MigSlots]] = {}
        self.version: dict[str, int] = {}
        self._states: dict[State, int] = {}
        self._by_id: list[State] = []
        self._changes: list[str] = []
        self._base = 0  # how many changes were trimmed off the front of ``_changes``
        # (shape, tags) → (heap, [position in the change log, tick] at its last visit)
        self._heaps: dict[tuple[Shape, _Tags], tuple[list[_Entry], list[int]]] = {}
        self._memo: dict[Shape, dict[int, tuple[Hashable, int] | None]] = {}
        self._tick = 0

    def slots_of(self, name: str, info: NodeInfo) -> MigSlots:
        """``mig_slots(info)``, computed once per node inventory."""
        hit = self._slots.get(name)
        if hit is None or hit[0] is not info:
            hit = self._slots[name] = (info, mig_slots(info))
        return hit[1]

    def changed(self, name: str, state: State | None) -> None:
        self._tick += 1
        self.version[name] = self._tick
        if state is None:
            self.sid.pop(name, None)
            self._slots.pop(name, None)
        else:
            sid = self._states.get(state)
            if sid is None:
                if len(self._by_id) >= _MAX_STATES:
                    self._reset_states()
                sid = self._states[state] = len(self._by_id)
                self._by_id.append(state)
            self.sid[name] = sid
        self._changes.append(name)
        if len(self._changes) > 65536 + 4 * len(self.sid):
            # heaps behind the trimmed part catch up by node versions on their next visit
            cut = len(self._changes) // 2
            del self._changes[:cut]
            self._base += cut

    def _reset_states(self) -> None:
        """Re-intern only the current states (ids change: every score and heap is dropped)."""
        current = {name: self._by_id[sid] for name, sid in self.sid.items()}
        self._states.clear()
        self._by_id.clear()
        self._memo.clear()
        self._heaps.clear()
        for name, st in current.items():
            sid = self._states.get(st)
            if sid is None:
                sid = self._states[st] = len(self._by_id)
                self._by_id.append(st)
            self.sid[name] = sid

    def observe(self, shape: Shape) -> None:
        if self.scorer.observe(shape):
            self._heaps.clear()
            self._memo.clear()

    def score(self, name: str, shape: Shape) -> tuple[Hashable, int] | None:
        """The scorer's answer for one node (None: its state cannot take the shape)."""
        sid = self.sid.get(name)
        if sid is None:
            return None
        memo = self._memo.get(shape)
        if memo is None:
            memo = self._memo[shape] = {}
        return self._lookup(memo, sid, shape)

    def _lookup(
        self, memo: dict[int, tuple[Hashable, int] | None], sid: int, shape: Shape
    ) -> tuple[Hashable, int] | None:
        out = memo.get(sid, _MISS)
        if out is _MISS:
            st = self._by_id[sid]
            out = self.scorer.score(st, shape) if can_take(st, shape) else None
            memo[sid] = out
        return out  # type: ignore[return-value]

    def heap(
        self, shape: Shape, tags: tuple[tuple[str, str], ...], compliant: Set[str]
    ) -> list[_Entry]:
        hkey = (shape, tags)
        entry = self._heaps.get(hkey)
        end = self._base + len(self._changes)
        version = self.version
        sid_of = self.sid
        memo = self._memo.get(shape)
        if memo is None:
            memo = self._memo[shape] = {}
        lookup = self._lookup
        if entry is None:
            heap: list[_Entry] = []
            for name in compliant:
                sid = sid_of.get(name)
                if sid is None:
                    continue
                s = memo.get(sid, _MISS)
                if s is _MISS:
                    s = lookup(memo, sid, shape)
                if s is not None:
                    heap.append((s[0], name, version[name], s[1]))  # type: ignore[index]
            heapq.heapify(heap)
            if len(self._heaps) > 4096:
                self._heaps.clear()
            self._heaps[hkey] = (heap, [end, self._tick])
            return heap
        heap, pos = entry
        behind = end - pos[0]
        if behind:
            if pos[0] >= self._base and behind <= len(compliant):
                changed: Iterable[str] = set(self._changes[pos[0] - self._base :])
            else:
                # more changes than nodes (or trimmed away): the nodes changed since the
                # heap's last visit are those with a newer version
                since = pos[1]
                changed = [n for n in compliant if version.get(n, 0) > since]
            push = heapq.heappush
            for name in changed:
                if name not in compliant:
                    continue
                sid = sid_of.get(name)
                if sid is None:
                    continue
                s = memo.get(sid, _MISS)
                if s is _MISS:
                    s = lookup(memo, sid, shape)
                if s is not None:
                    push(heap, (s[0], name, version[name], s[1]))  # type: ignore[index]
            pos[0] = end
            pos[1] = self._tick
            if len(heap) > 2 * len(compliant) + 64:  # mostly stale: compact
                live = [e for e in heap if e[2] == version.get(e[1])]
                heapq.heapify(live)
                heap[:] = live
        return heap


_MISS = object()
_UNSIGNED: Signature = (0, {})
_MAX_STATES = 1 << 20


_Tags = tuple[tuple[str, str], ...]
_Entry = tuple[Hashable, str, int, int]  # (score key, node, version, GPU position)


def can_take(state: State, shape: Shape) -> bool:
    """Whether a node in ``state`` has the room for ``shape`` (CPU, GPU model, devices); the
    exact filters run again on the node that wins."""
    models, cpu, frees, mig = state[0], state[1], state[2], state[3]
    p_cpu, k, m, spec, profile = shape
    if cpu < p_cpu:
        return False
    if spec is not None:
        allowed = allowed_models(spec)
        if allowed is not None and allowed.isdisjoint(models):
            return False
    if profile is not None:
        return sum(gpu.count(profile) for gpu in mig) >= k
    if m <= 0:
        return True
    if k == 1:
        return bool(frees) and max(frees) >= m
    return sum(1 for g in frees if g >= m) >= k


_EMPTY: frozenset[str] = frozenset()
_NO_TENANCY: tuple[None, None] = (None, None)


def _discard(index: dict[_K, set[str]], key: _K, name: str) -> None:
    names = index.get(key)
    if names is not None:
        names.discard(name)
        if not names:
            del index[key]
