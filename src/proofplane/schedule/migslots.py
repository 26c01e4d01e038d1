"""Carving MIG instances into a GPU's free space: the MIG slot choice of the placement core.

NVIDIA MIG lets a GPU instance be created in the free memory/compute slices of a GPU while
other instances on it run; creating one touches no running work. The engine's *carve* step
(``schedule.engine.Scheduler`` with a ``carver``) uses that when no existing free instance
fits a MIG request: it adds the missing instances to the free space of one node's MIG GPUs,
then places the request through the snapshot's filters and scorer as usual. Existing instances
are never changed here (that is repartitioning, ``schedule.mig``, idle GPUs only).

Where the new instance goes is a plugin (:data:`CARVERS`):

* ``first-slot-best-fit`` (the MIG papers' baseline): the node left with the fewest free
  compute slices, on it the GPU with the fewest free compute slices, the first valid start.
* ``least-fragmenting`` (proofplane): each (node, GPU, start) is costed by how much it raises
  the layout's *potential*, ``100 · stranded + Σ_p w_p · (free − c_p · fit_p)``: stranded
  compute (free slices no further instance can use) first, then the free compute that further
  ``p`` instances could not use (``fit_p``: the most further ``p`` instances the layout still
  takes), weighted by the demand mix ``w_p`` (each profile's share of the requested compute
  slices, learned from the requests). Lowest rise wins, then the tighter node, then the name.

A GPU's layouts form a state graph (:func:`geometry`): every layout reachable by adding
request profiles one instance at a time, validated by ``hardware.skus.layout_errors`` and
nothing else, with each state's moves precomputed, so a placement's cost is a table lookup.
Pure: values in, values out.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from functools import lru_cache

from proofplane.errors import ValidationFailed
from proofplane.hardware.skus import COMPUTE_SLICES, SKUS, MigProfile, Sku, get_sku, layout_errors
from proofplane.model import Gpu, MigInstance, Node

Layout = tuple[MigInstance, ...]


class UnknownCarver(ValidationFailed):
    """A carver name that is not one of :data:`CARVERS`."""

    code = "unknown_carver"


@dataclass(frozen=True)
class Geometry:
    """The layouts one GPU can hold, as a state graph. State 0 is the empty GPU.

    ``moves[s][p]`` lists ``(start, next_state)`` for every valid placement of profile ``p``
    (index into ``profiles``) on layout ``s``, by ascending start slot; ``fit[s][p]`` is the
    most further ``p`` instances layout ``s`` can take."""

    sku: Sku
    profiles: tuple[MigProfile, ...]
    layouts: tuple[Layout, ...]
    free: tuple[int, ...]  # free compute slices per state
    moves: tuple[tuple[tuple[tuple[int, int], ...], ...], ...]
    fit: tuple[tuple[int, ...], ...]
    ids: dict[Layout, int]

    def index(self, profile: str) -> int | None:
        for i, p in enumerate(self.profiles):
            if p.name == profile:
                return i
        return None

    def state_of(self, instances: Iterable[MigInstance]) -> int | None:
        """The state of a layout, None when it is not in the graph (e.g. a ``+me`` instance)."""
        return self.ids.get(tuple(sorted(instances, key=lambda i: (i.start, i.profile))))


@lru_cache(maxsize=8)
def geometry(sku_name: str) -> Geometry:
    """Enumerate the layouts of ``sku_name`` reachable by adding request profiles (every
    profile but the ``+me`` ones) one instance at a time."""
    sku = get_sku(sku_name)
    profiles = tuple(
        sorted(
            (p for p in sku.mig_profiles if not p.media_extensions),
            key=lambda p: (p.compute_slices, p.mem_slices),
        )
    )
    ids: dict[Layout, int] = {(): 0}
    layouts: list[Layout] = [()]
    moves: list[list[tuple[tuple[int, int], ...]]] = []
    i = 0
    while i < len(layouts):
        cur = layouts[i]
        row = []
        for prof in profiles:
            opts = []
            for start in prof.starts:
                cand = tuple(
                    sorted(
                        (*cur, MigInstance(prof.name, start)), key=lambda x: (x.start, x.profile)
                    )
                )
                if cand not in ids:
                    if layout_errors(sku, cand):
                        continue
                    ids[cand] = len(layouts)
                    layouts.append(cand)
                opts.append((start, ids[cand]))
            row.append(tuple(opts))
        moves.append(row)
        i += 1
    compute = {p.name: p.compute_slices for p in profiles}
    free = tuple(COMPUTE_SLICES - sum(compute[x.profile] for x in lay) for lay in layouts)
    fit_memo: dict[tuple[int, int], int] = {}

    def fit(s: int, p: int) -> int:
        key = (s, p)
        if key not in fit_memo:
            fit_memo[key] = max((1 + fit(nxt, p) for _, nxt in moves[s][p]), default=0)
        return fit_memo[key]

    return Geometry(
        sku=sku,
        profiles=profiles,
        layouts=tuple(layouts),
        free=free,
        moves=tuple(tuple(r) for r in moves),
        fit=tuple(tuple(fit(s, p) for p in range(len(profiles))) for s in range(len(layouts))),
        ids=ids,
    )


def max_fill(geo: Geometry) -> list[int]:
    """Per layout: the most compute slices further instances (of any mix of profiles) can
    still use. ``free − max_fill`` is stranded compute: no request can ever use it."""
    memo: list[int | None] = [None] * len(geo.layouts)

    def fill(s: int) -> int:
        got = memo[s]
        if got is None:
            got = 0
            for p, prof in enumerate(geo.profiles):
                for _, nxt in geo.moves[s][p]:
                    got = max(got, prof.compute_slices + fill(nxt))
            memo[s] = got
        return got

    return [fill(s) for s in range(len(geo.layouts))]


def fragmentation(geo: Geometry, weights: Sequence[float]) -> list[float]:
    """Per layout: ``Σ_p w_p · (free − c_p · fit_p)``, the free compute the expected requests
    cannot use."""
    return [
        sum(
            w * (geo.free[s] - p.compute_slices * geo.fit[s][i])
            for i, (p, w) in enumerate(zip(geo.profiles, weights, strict=True))
        )
        for s in range(len(geo.layouts))
    ]


STRANDED_WEIGHT = 100.0  # one stranded slice outweighs any fragmentation difference (|ΔF| ≤ 7)


def potentials(geo: Geometry, weights: Sequence[float]) -> list[float]:
    """The least-fragmenting carver's per-layout potential (module docstring)."""
    frag = fragmentation(geo, weights)
    fill = max_fill(geo)
    return [STRANDED_WEIGHT * (geo.free[s] - fill[s]) + frag[s] for s in range(len(geo.layouts))]


# ---------------------------------------------------------------------------------- carvers

# One GPU-level move: (cost, start, next state).
Move = tuple[float, int, int]


class Carver:
    """A MIG slot-choice plugin. ``move(geo, state, p)``: where one new ``p`` instance goes on
    a GPU in ``state`` (``None``: it does not fit). ``uses_cost``: whether node order follows
    the summed move costs (else the tightest node wins)."""

    name = "carver"
    uses_cost = False
    version = 0  # a carver whose costs change bumps it (plans memoised under it are dropped)

    def observe(self, profile: str, count: int) -> None:
        """See a MIG request (its profile and instance count) before it is placed."""

    def move(self, geo: Geometry, state: int, p: int) -> Move | None:
        raise NotImplementedError


class FirstSlotBestFit(Carver):
    """The baseline: the first valid start slot; tightest node, then tightest GPU."""

    name = "first-slot-best-fit"

    def move(self, geo: Geometry, state: int, p: int) -> Move | None:
        moves = geo.moves[state][p]
        return (0.0, moves[0][0], moves[0][1]) if moves else None


class LeastFragmenting(Carver):
    """proofplane: the start slot (and GPU, and node) whose layout potential rises least.
    The mix is the share of requested compute slices per profile, counted from the requests
    (re-derived at powers of two and then every 4,096 requests); uniform until then, or fixed
    by ``weights`` (per profile of the SKU's geometry, by profile name)."""

    name = "least-fragmenting"
    uses_cost = True

    def __init__(self, weights: dict[str, float] | None = None) -> None:
        self._fixed = weights is not None
        self._counts: dict[str, float] = dict(weights or {})
        self._weights: dict[str, float] = dict(weights or {})
        self._seen = 0
        self._tables: dict[str, tuple[list[float], list[list[Move | None]]]] = {}
        self.version = 0  # bumped whenever the costs change

    def observe(self, profile: str, count: int) -> None:
        if self._fixed:
            return
        self._counts[profile] = self._counts.get(profile, 0) + count * _slices(profile)
        self._seen += 1
        n = self._seen
        if (n & (n - 1)) == 0 and n <= 4096 or n % 4096 == 0:
            total = sum(self._counts.values())
            new = {k: v / total for k, v in self._counts.items()}
            keys = new.keys() | self._weights.keys()
            if sum(abs(new.get(k, 0.0) - self._weights.get(k, 0.0)) for k in keys) > 0.02:
                self._weights = new
                self._tables.clear()
                self.version += 1

    def _table(self, geo: Geometry) -> list[list[Move | None]]:
        hit = self._tables.get(geo.sku.name)
        if hit is None:
            w = [self._weights.get(p.name, 0.0) for p in geo.profiles]
            if not any(w):
                w = [1.0 / len(w)] * len(w)
            pot = potentials(geo, w)
            rows: list[list[Move | None]] = []
            for s in range(len(geo.layouts)):
                row: list[Move | None] = []
                for p in range(len(geo.profiles)):
                    best: Move | None = None
                    for start, nxt in geo.moves[s][p]:
                        d = round(pot[nxt] - pot[s], 9)
                        if best is None or d < best[0]:
                            best = (d, start, nxt)
                    row.append(best)
                rows.append(row)
            hit = self._tables[geo.sku.name] = (pot, rows)
        return hit[1]

    def move(self, geo: Geometry, state: int, p: int) -> Move | None:
        return self._table(geo)[state][p]


@lru_cache(maxsize=64)
def _slices(profile: str) -> int:
    head = profile.split("g", 1)[0]
    return int(head) if head.isdigit() else 1


#: The carving plugins by name; each call makes a fresh one (its own learned mix).
CARVERS: dict[str, type[Carver]] = {
    "first-slot-best-fit": FirstSlotBestFit,
    "least-fragmenting": LeastFragmenting,
}


def make_carver(name: str) -> Carver:
    if name not in CARVERS:
        raise UnknownCarver(f"unknown carver {name!r} (known: {', '.join(CARVERS)})")
    return CARVERS[name]()


# ---------------------------------------------------------------------------------- planning


@dataclass(frozen=True, slots=True)
class CarvePlan:
    """New instances for one node: ``key`` orders plans (smaller first), ``layouts`` maps each
    changed GPU index to its layout after carving."""

    key: tuple[float, int]
    layouts: tuple[tuple[int, Layout], ...]


def gpu_states(
    node: Node, held: AbstractSet[tuple[int, int]] | None = None
) -> tuple[tuple[Gpu, Geometry, int], ...]:
    """The node's MIG GPUs that can be carved: each with its SKU's geometry and layout state
    (GPUs of a SKU without MIG, or with a layout outside the graph, are left out). With
    ``held`` (the ``(GPU index, start)`` of the instances in use), the state counts only the
    instances in use: free instances may be destroyed (reclaimed) to make room."""
    out = []
    for gpu in node.gpus:
        if not gpu.mig_enabled or gpu.model not in SKUS:
            continue
        geo = geometry(gpu.model)
        if not geo.profiles:
            continue
        instances = gpu.mig_instances
        if held is not None:
            instances = tuple(i for i in instances if (gpu.index, i.start) in held)
        state = geo.state_of(instances)
        if state is not None:
            out.append((gpu, geo, state))
    return tuple(out)


def plan_carve(
    carver: Carver,
    gpus: Sequence[tuple[Gpu, Geometry, int]],
    profile: str,
    count: int,
    model: frozenset[str] | None = None,
) -> CarvePlan | None:
    """Where ``count`` new ``profile`` instances go on one node's carvable GPUs (greedy, one
    at a time: the GPU whose move costs least, then the one with the fewest free compute
    slices, then the lowest index), None when they do not all fit. ``model``: the GPU models
    the request accepts (None: any)."""
    states: list[tuple[Gpu, Geometry, int]] = [
        g for g in gpus if model is None or g[0].model in model
    ]
    cost = 0.0
    changed: dict[int, int] = {}
    for _ in range(count):
        best: tuple[float, int, int, int, int] | None = None  # cost, free, pos, start, next
        for pos, (_gpu, geo, s) in enumerate(states):
            p = geo.index(profile)
            if p is None:
                continue
            mv = carver.move(geo, s, p)
            if mv is None:
                continue
            key = (mv[0], geo.free[s], pos, mv[1], mv[2])
            if best is None or key < best:
                best = key
        if best is None:
            return None
        pos = best[2]
        gpu, geo, _s = states[pos]
        states[pos] = (gpu, geo, best[4])
        changed[pos] = best[4]
        cost += best[0]
    free_after = sum(geo.free[s] for _g, geo, s in states)
    layouts = tuple((states[pos][0].index, states[pos][1].layouts[s]) for pos, s in changed.items())
    return CarvePlan((round(cost, 9) if carver.uses_cost else 0.0, free_after), layouts)


class CarveIndex:
    """A carver with the indexes that make carving cheap (the score heaps' idea, for free
    space): per node its carvable GPUs and their state key (refreshed by :meth:`track` on
    every layout change), plans memoised per (state key, profile, count, models) so nodes
    with equal layouts cost one planning, and for the common request (one instance, any
    model) a heap per profile of ``(plan key, node, version)`` that re-plans only the nodes
    changed since that profile's last request."""

    def __init__(self, carver: Carver) -> None:
        self.carver = carver
        self._nodes: dict[str, tuple[Node, tuple[tuple[Gpu, Geometry, int], ...], Hashable]] = {}
        self._plans: dict[Hashable, CarvePlan | None] = {}
        self._cost_version = carver.version
        self._version: dict[str, int] = {}
        self._log: list[str] = []  # node names, in the order they changed
        # per request shape (profile, count, models): a heap of (plan key, node, version)
        self._heaps: dict[
            tuple[str, int, frozenset[str] | None],
            tuple[list[tuple[tuple[float, int], str, int]], list[int]],
        ] = {}

    def observe(self, profile: str, count: int) -> None:
        self.carver.observe(profile, count)
        if self.carver.version != self._cost_version:
            self._cost_version = self.carver.version
            self._plans.clear()
            self._heaps.clear()

    def track(self, node: Node, held: AbstractSet[tuple[int, int]] | None = None) -> None:
        """``node`` is new or changed (its layouts may differ; with ``held``, reclaiming:
        which of its instances are in use, see :func:`gpu_states`)."""
        gpus = gpu_states(node, held)
        self._nodes[node.name] = (node, gpus, tuple((g.model, g.index, s) for g, _geo, s in gpus))
        self._touch(node.name)

    def forget(self, name: str) -> None:
        if self._nodes.pop(name, None) is not None:
            self._touch(name)

    def _touch(self, name: str) -> None:
        self._version[name] = self._version.get(name, 0) + 1
        self._log.append(name)
        if len(self._log) > 1_000_000:  # every heap re-plans from scratch
            self._log.clear()
            self._heaps.clear()

    def tracked(self, name: str) -> Node | None:
        hit = self._nodes.get(name)
        return hit[0] if hit is not None else None

    def plan(
        self, name: str, profile: str, count: int, model: frozenset[str] | None
    ) -> CarvePlan | None:
        hit = self._nodes.get(name)
        if hit is None or not hit[1]:
            return None
        _node, gpus, state_key = hit
        memo_key = (state_key, profile, count, model)
        if memo_key in self._plans:
            return self._plans[memo_key]
        if len(self._plans) > 200_000:
            self._plans.clear()
        plan = self._plans[memo_key] = plan_carve(self.carver, gpus, profile, count, model)
        return plan

    def candidates(
        self, profile: str, count: int, model: frozenset[str] | None
    ) -> Iterator[tuple[str, CarvePlan]]:
        """Nodes that can take ``count`` new ``profile`` instances, best plan first (then the
        name), with their plans. The caller tries them in order; a node it changes is
        :meth:`track`-ed; the rest keep their place for the next request."""
        shape = (profile, count, model)
        entry = self._heaps.get(shape)
        if entry is None:
            heap = []
            for name in self._nodes:
                plan = self.plan(name, profile, count, model)
                if plan is not None:
                    heap.append((plan.key, name, self._version[name]))
            heapq.heapify(heap)
            entry = self._heaps[shape] = (heap, [len(self._log)])
        else:
            heap, pos = entry
            if pos[0] < len(self._log):
                for name in set(self._log[pos[0] :]):
                    plan = self.plan(name, profile, count, model)
                    if plan is not None:
                        heapq.heappush(heap, (plan.key, name, self._version[name]))
                pos[0] = len(self._log)
        heap = entry[0]
        aside = []
        try:
            while heap:
                top = heapq.heappop(heap)
                name = top[1]
                if top[2] != self._version.get(name):
                    continue  # stale: the node changed since
                aside.append(top)
                plan = self.plan(name, profile, count, model)
                if plan is not None:
                    yield name, plan
        finally:
            for top in aside:
                if top[2] == self._version.get(top[1]):
                    heapq.heappush(heap, top)
