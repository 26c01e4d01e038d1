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

from collections.abc import Hashable, Iterable, Iterator, Mapping, Set
from dataclasses import dataclass
from types import MappingProxyType
from typing import TypeVar

from proofplane.model import IsolationLevel, Node, PlacedDevice, Placement
from proofplane.schedule.buckets import Buckets, Signature, request_class, signature
from proofplane.schedule.fit import fit, gpu_model, tenancy
from proofplane.schedule.reasons import (
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
from proofplane.schedule.usage import NO_USAGE, ClassKey, NodeInfo, Usage, decrement, node_info
from proofplane.schedule.values import Allocation, Decision, Request

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
    ) -> None:
        self.tuning = tuning or Tuning()
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
        new = signature(info, u) if info is not None and info.admitted else None
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
        best: _Best | None = None
        if compliant:
            cls = request_class(req)
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
        u = self._usage.get(name, NO_USAGE)
        if tenancy(u, req) is not None:
            return None
        info = self._info[name]
        if gpu_model(info, req) is not None:
            return None
        devices = fit(info, u, req)
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


_EMPTY: frozenset[str] = frozenset()
_NO_TENANCY: tuple[None, None] = (None, None)


def _discard(index: dict[_K, set[str]], key: _K, name: str) -> None:
    names = index.get(key)
    if names is not None:
        names.discard(name)
        if not names:
            del index[key]
