"""Defragmentation (issue 17, §3): moves that free a large MIG profile's region for a waiting
request, touching only work that may be moved.

When a MIG request (one instance of a profile, one node) fits no free instance and no idle GPU
can be repartitioned for it, free slices are often scattered: a 4g region is held by one or two
small instances while other GPUs keep free small instances of the same kind. The planner looks
for the *region* (a GPU and a valid start of the requested profile, ``hardware.skus``) whose
holders can all be moved elsewhere with the fewest (then cheapest) moves, and returns those moves.

What may be moved (the *eligibility* the caller passes as ``movable``): work that is idle (placed,
no job started) or declares itself restartable (``"restartable": true``; checkpointing is the
workload's own job). The planner adds its own rules on top, all of them hard:

* **A GPU holding work that is not movable is never touched**: no move off it, no new layout on
  it. (It may still *receive* a moved workload on one of its free instances.)
* **Never across compliance pools**: only work of the waiting request's own pool
  (``schedule.engine.pool_of``: the exact tag set) is moved, as preemption does.
* **Never to a node its tags do not allow**: every moved workload is placed again by the
  snapshot's own search with its own tags, so the compliance filters (and tenancy, co-residency,
  CPU and memory) hold for each target, each in the snapshot as it stands after the moves before.
* **Within a budget**: a plan of more than ``budget`` moves is refused.
* A moved workload holds one part of MIG instances of one profile (what MIG work is); it is
  placed again on the GPU model it is on now.

The region's new layout: the GPU keeps every instance outside the region (the work there stays
where it is) plus the requested instance at the region's start; free instances outside it are
dropped, the largest first, only when the layout would not be valid (``layout_errors``)
otherwise. When the GPU already has the requested instance there, the layout is unchanged.

Choice: the candidate regions are ordered by (moves, compute slices moved, layout change or not,
node, GPU, start) and tried in that order; the first whose movers all find a target wins, so
the plan has the fewest moves any region needs (among the first ``max_trials`` regions tried).
Every trial works on the scheduler and puts it back as it found it: the planner is pure (no I/O,
no clock) and leaves the scheduler unchanged; ``apply_plan`` then applies a plan.

The server calls it from the engine (``Scheduler.schedule(..., defrag=Defragmenter(...))``,
after repartitioning and before preemption); the MIG trace replay can call ``plan_defrag``
directly with the same scheduler.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, replace
from typing import Any

from proofplane.hardware.skus import MEMORY_SLICES, SKUS, MigProfile, Sku, layout_errors
from proofplane.model import (
    Gpu,
    GpuRequest,
    MigInstance,
    Node,
    NodeState,
    Placement,
    missing_tags,
)
from proofplane.schedule.engine import (
    Held,
    Job,
    Outcome,
    Pool,
    Repartition,
    Scheduler,
    held_for,
)
from proofplane.schedule.snapshot import ClusterSnapshot
from proofplane.schedule.values import Request, allowed_models

#: Why no plan frees a region (``DefragRefusal.code``), from the most to the least actionable.
NO_DESTINATION = "no_destination"  # regions could be freed, but their work has nowhere to go
OVER_BUDGET = "move_budget_exhausted"  # a region needs more moves than the budget has left
NON_RESTARTABLE_WORK = "non_restartable_work"  # every region holds work that may not move
OTHER_POOL = "other_compliance_pool"  # every region holds another compliance pool's work
NO_REGION = "no_region"  # no compliant MIG GPU of a SKU offering the profile
NOT_APPLICABLE = "not_applicable"  # not one MIG instance on one node

REFUSAL_MESSAGES: dict[str, str] = {
    NO_DESTINATION: "defragmentation found {regions} region(s) it could free, but the work on "
    "them fits nowhere else now",
    OVER_BUDGET: "defragmentation needs {fewest} move(s), more than the {budget} left in this "
    "hour's budget",
    NON_RESTARTABLE_WORK: "defragmentation cannot free a region: every candidate GPU holds "
    "running work that is not restartable ({regions} region(s))",
    OTHER_POOL: "defragmentation cannot free a region: every candidate GPU holds work of "
    "another compliance pool ({regions} region(s))",
    NO_REGION: "defragmentation found no compliant MIG GPU whose model offers {profile}",
    NOT_APPLICABLE: "defragmentation applies to one MIG instance on one node",
}

DEFAULT_MAX_TRIALS = 64
#: The key of ``Outcome.details`` that marks a placement defragmentation made (with no move, it
#: relaid a GPU whose work outside the region stays where it is)
DEFRAG_DETAIL = "defrag"


@dataclass(frozen=True, slots=True)
class Move:
    """One workload moved: from ``source`` to ``target`` (each a one-part placement of MIG
    instances). Recorded as an eviction and a placement with reason ``defragmentation``."""

    key: Hashable
    workload: str
    tenant: str
    source: Placement
    target: Placement

    @property
    def from_slots(self) -> tuple[tuple[str, int, int], ...]:
        """(node, GPU index, MIG start) of every instance it leaves."""
        return tuple((self.source.node, d.gpu_index, d.mig_start or 0) for d in self.source.devices)

    @property
    def to_slots(self) -> tuple[tuple[str, int, int], ...]:
        """(node, GPU index, MIG start) of every instance it takes."""
        return tuple((self.target.node, d.gpu_index, d.mig_start or 0) for d in self.target.devices)


@dataclass(frozen=True, slots=True)
class DefragPlan:
    """The moves, in order, then where the waiting request goes; ``repartition`` is the new
    layout of the freed GPU (None when its layout already has the instance)."""

    moves: tuple[Move, ...]
    placement: Placement
    repartition: Repartition | None
    regions: int  # candidate regions considered

    def describe(self) -> str:
        if not self.moves:
            return "relaid out the GPU's free instances"
        return "moved " + ", ".join(
            f"{m.tenant}/{m.workload} ({where(m.source)} → {where(m.target)})" for m in self.moves
        )


@dataclass(frozen=True, slots=True)
class DefragRefusal:
    """Why no plan: ``code`` one of the codes above; counts per region outcome."""

    code: str
    message: str
    counts: dict[str, int] = field(default_factory=dict)

    def as_details(self) -> dict[str, Any]:
        return {"refused": self.code, "message": self.message, **self.counts}


def where(p: Placement) -> str:
    """A one-part placement's instances, ``node/gpuN/profile@start``, for messages."""
    return ", ".join(f"{p.node}/gpu{d.gpu_index}/{d.mig_profile}@{d.mig_start}" for d in p.devices)


@dataclass(slots=True)
class _Region:
    cost: tuple[int, int, int, str, int, int]
    node: Node
    gpu_index: int
    start: int
    movers: tuple[Held, ...]
    stay: frozenset[int]  # starts of held instances outside the region (they stay)
    relayout: bool  # the GPU's layout lacks the instance: computed when the region is tried


def _span(sku: Sku, inst: MigInstance) -> tuple[int, int]:
    prof = sku.profile(inst.profile)
    size = prof.mem_slices if prof is not None else 1
    return inst.start, inst.start + size


def _compute(sku: Sku, profile: str | None) -> int:
    prof = sku.profile(profile) if profile is not None else None
    return prof.compute_slices if prof is not None else 0


def _mig_shape(h: Held) -> str | None:
    """The one profile ``h`` holds when it is movable MIG work (one part, MIG instances of one
    profile), else None."""
    devices = h.placement.devices
    if len(devices) == 1 and not h.placement.members:  # the common case
        d = devices[0]
        return d.mig_profile if d.mig_start is not None else None
    if h.placement.members and len(h.placement.members) > 1:
        return None
    profiles = {d.mig_profile for d in h.placement.devices}
    if len(profiles) != 1 or any(d.mig_start is None for d in h.placement.devices):
        return None
    return next(iter(profiles))


def _new_layout(
    sku: Sku, current: tuple[MigInstance, ...], held_starts: set[int], want: MigInstance
) -> tuple[MigInstance, ...] | None:
    """The GPU's layout with ``want`` in it (see the module docstring); None when no valid one
    keeps every held instance outside the region."""
    lo, hi = _span(sku, want)
    outside = [i for i in current if not (_span(sku, i)[0] < hi and lo < _span(sku, i)[1])]
    keep = [i for i in outside if i.start in held_starts]
    free = sorted(
        (i for i in outside if i.start not in held_starts),
        key=lambda i: (-_compute(sku, i.profile), i.start),
    )
    while True:
        layout = tuple(sorted([*keep, *free, want], key=lambda i: i.start))
        if not layout_errors(sku, layout):
            return layout
        if not free:
            return None
        free.pop(0)


#: A candidate region as the scan finds it: (cost, node, the movers' keys sorted by ``str``,
#: starts of the held instances outside the region); built into a ``_Region`` when tried.
_Candidate = tuple[tuple[int, int, int, str, int, int], Node, tuple[Hashable, ...], frozenset[int]]


_Spans = dict[int, tuple[tuple[MigInstance, ...], dict[int, tuple[int, str]]]]
#: per GPU model: its SKU and the requested profile, or None when it does not offer it
_Skus = dict[str, tuple[Sku, MigProfile] | None]


@dataclass(slots=True)
class _GpuRegions:
    """One MIG GPU's regions for one profile: its holders' keys, and (worked out on first
    use, kept with the node's entry) their static eligibility and each region's candidate."""

    node: Node
    gpu: Gpu
    sku: Sku
    prof: MigProfile
    holders: list[tuple[int, Hashable]]  # (MIG start or -1, key) of each device on the GPU
    # some holder is not one part of MIG instances of one profile (never movable, whatever
    # ``movable`` says), and the holders' compliance pools: None until needed
    static: tuple[bool, frozenset[Pool]] | None = None
    regions: tuple[_Candidate, ...] | None = None

    def eligibility(self, held: Mapping[Hashable, Held]) -> tuple[bool, frozenset[Pool]]:
        """(fixed, pools), every holder being held."""
        if self.static is None:
            hs = [held[k] for k in dict.fromkeys(k for _s, k in self.holders)]
            self.static = (
                any(_mig_shape(h) is None for h in hs),
                frozenset(h.pool for h in hs),
            )
        return self.static

    def candidates(
        self, held: Mapping[Hashable, Held], profile: str, spans: _Spans
    ) -> tuple[_Candidate, ...]:
        """Every region of the GPU: the holders overlapping it move, the others stay.
        ``spans``: per layout (by identity, the tuple kept alive), {start: (end, profile)}."""
        if self.regions is not None:
            return self.regions
        sku, prof, node, gpu = self.sku, self.prof, self.node, self.gpu
        layout = gpu.mig_instances
        cached = spans.get(id(layout))
        if cached is None or cached[0] is not layout:
            cached = (layout, {i.start: (_span(sku, i)[1], i.profile) for i in layout})
            spans[id(layout)] = cached
        by_start = cached[1]
        # each holder's instance: (start, end, key)
        spanned = [(s, by_start.get(s, (s + 1, ""))[0], k) for s, k in self.holders]
        slices_of: dict[Hashable, int] = {}
        no_span = (0, "")
        regions: list[_Candidate] = []
        for start in prof.starts:
            hi = start + prof.mem_slices
            if hi > MEMORY_SLICES:
                continue
            movers: dict[Hashable, None] = {}
            stay: set[int] = set()
            for s, end, k in spanned:
                if s < hi and start < end:
                    movers[k] = None
                else:
                    stay.add(s)
            slices = 0
            for k in movers:
                n = slices_of.get(k)
                if n is None:
                    n = slices_of[k] = sum(
                        _compute(sku, d.mig_profile) for d in held[k].placement.devices
                    )
                slices += n
            here = by_start.get(start, no_span)
            relayout = here[1] != profile or here[0] != hi
            regions.append(
                (
                    (len(movers), slices, int(relayout), node.name, gpu.index, start),
                    node,
                    tuple(sorted(movers, key=str)),
                    frozenset(stay),
                )
            )
        self.regions = tuple(regions)
        return self.regions


#: one node's candidates when every held workload may move (``movable=None``), for one
#: (pool, allowed GPU models): the candidates of its eligible GPUs, in GPU order, and the
#: regions refused per code, in the order the codes first came up
_NodeAnswer = tuple[tuple[_Candidate, ...], tuple[tuple[str, int], ...]]
_Answers = dict[tuple[Pool, frozenset[str] | None], _NodeAnswer]

_Entry = tuple[
    int,
    Node,
    frozenset[tuple[int, int, Hashable]],
    tuple[tuple[Hashable, Held | None], ...],
    tuple[_GpuRegions, ...],
    _Answers,
]


class RegionIndex:
    """The planner's per-node work, kept between calls (a ``Defragmenter`` keeps one): for
    each requested profile and node, the node's candidate regions (movers, moved compute,
    layout change) and its holders' static eligibility, valid while the node is the same and
    the same workloads hold the same instances on it (checked only when the snapshot's
    ``version`` of the node moved: a trial that put everything back leaves it valid). Which
    region is refused (work not movable, another pool, a GPU model not allowed, a node not
    compliant) is decided again on every call, so every call answers what a fresh scan
    would: the index only saves recomputing the regions of the nodes nothing changed on.
    ``keep=False``: a one-call index (``plan_defrag`` without one) that remembers nothing."""

    __slots__ = ("_snapshot", "_nodes", "_keep")

    def __init__(self, keep: bool = True) -> None:
        self._snapshot: object | None = None
        self._keep = keep
        # (profile, node) → (version, node, holders, their Held (or None), GPUs)
        self._nodes: dict[tuple[str, str], _Entry] = {}

    def regions(
        self, scheduler: Scheduler, node: Node, profile: str, skus: _Skus
    ) -> tuple[_GpuRegions, ...]:
        snap = scheduler.snapshot
        if not self._keep:
            return _node_gpus(scheduler, node, profile, None, skus)
        if snap is not self._snapshot:  # another scheduler's versions: start afresh
            self._snapshot = snap
            self._nodes.clear()
        version = snap.version(node.name)
        key = (profile, node.name)
        hit = self._nodes.get(key)
        if hit is not None and hit[1] is node and hit[0] == version:
            return hit[4]
        return self._entry(scheduler, node, profile, skus, hit)[4]

    def _entry(
        self, scheduler: Scheduler, node: Node, profile: str, skus: _Skus, hit: _Entry | None
    ) -> _Entry:
        """The node's entry made current (``hit``: the one kept, whose version moved)."""
        snap = scheduler.snapshot
        version = snap.version(node.name)
        key = (profile, node.name)
        holders = _holders(snap, node.name)
        held = scheduler.held
        if (
            hit is not None
            and hit[1] is node
            and hit[2] == holders
            and all(held.get(k) is h for k, h in hit[3])
        ):  # changed and changed back (a trial): the same regions
            entry: _Entry = (version, *hit[1:])
            self._nodes[key] = entry
            return entry
        found = _node_gpus(scheduler, node, profile, holders, skus)
        refs = tuple((k, held.get(k)) for k in {k for _g, _s, k in holders})
        if hit is not None and hit[1] is node:
            # the same node, other work on it: a GPU whose holders are the same workloads
            # (the same ``Held``) on the same instances keeps its regions and eligibility
            before = {g.gpu.index: g for g in hit[4]}
            was = dict(hit[3])
            for g in found:
                old = before.get(g.gpu.index)
                if (
                    old is not None
                    and old.gpu is g.gpu
                    and (old.static is not None or old.regions is not None)
                    and len(old.holders) == len(g.holders)
                    and set(old.holders) == set(g.holders)
                    and all(held.get(k) is was.get(k) for _s, k in g.holders)
                ):
                    g.static, g.regions = old.static, old.regions
        entry = (version, node, holders, refs, found, {})
        self._nodes[key] = entry
        return entry

    def all_movable(
        self,
        scheduler: Scheduler,
        node: Node,
        profile: str,
        skus: _Skus,
        want: tuple[Pool, frozenset[str] | None],
        spans: _Spans,
    ) -> _NodeAnswer:
        """``node``'s answer when every held workload may move, for a request of pool and
        allowed models ``want``: kept with the node's entry (so valid exactly as long as its
        regions are) and worked out once per (pool, models)."""
        if not self._keep:
            return _all_movable(
                _node_gpus(scheduler, node, profile, None, skus), scheduler.held, profile, want,
                spans,
            )  # fmt: skip
        snap = scheduler.snapshot
        if snap is not self._snapshot:
            self._snapshot = snap
            self._nodes.clear()
        hit = self._nodes.get((profile, node.name))
        if hit is None or hit[1] is not node or hit[0] != snap.version(node.name):
            hit = self._entry(scheduler, node, profile, skus, hit)
        answers = hit[5]
        found = answers.get(want)
        if found is None:
            found = answers[want] = _all_movable(hit[4], scheduler.held, profile, want, spans)
        return found


def _all_movable(
    gpus: tuple[_GpuRegions, ...],
    held: Mapping[Hashable, Held],
    profile: str,
    want: tuple[Pool, frozenset[str] | None],
    spans: _Spans,
) -> _NodeAnswer:
    """``_regions``' work for one node when every held workload may move (see there)."""
    pool, allowed = want
    cands: list[_Candidate] = []
    refused: dict[str, int] = {}
    for g in gpus:
        if allowed is not None and g.gpu.model not in allowed:
            continue
        stuck = any(k not in held for _s, k in g.holders)
        why = _refusal(g, held, pool, stuck)
        if why is not None:
            refused[why] = refused.get(why, 0) + len(g.prof.starts)
            continue
        cands.extend(g.candidates(held, profile, spans))
    return tuple(cands), tuple(refused.items())


def _refusal(g: _GpuRegions, held: Mapping[Hashable, Held], pool: Pool, stuck: bool) -> str | None:
    """Why GPU ``g``'s regions cannot be freed for a request of ``pool`` (None: they can):
    a holder that may not move (``stuck``, or not MIG work of one profile: ``g.static``)
    refuses it first, then holders of another pool."""
    if stuck or (g.static is not None and g.static[0]):
        return NON_RESTARTABLE_WORK
    fixed, pools = g.eligibility(held)
    if fixed:
        return NON_RESTARTABLE_WORK
    if len(pools) > 1 or (pools and pool not in pools):
        return OTHER_POOL
    return None


def _holders(snap: ClusterSnapshot, name: str) -> frozenset[tuple[int, int, Hashable]]:
    """(GPU index, MIG start or -1, held key) of every device allocated on node ``name``."""
    allocs = snap.allocations
    return frozenset(
        (d.gpu_index, d.mig_start if d.mig_start is not None else -1, akey[0])  # type: ignore[index]  # Scheduler.hold keys parts (key, i)
        for akey in snap.allocations_on(name)
        for d in allocs[akey].placement.devices
    )


def _node_gpus(
    scheduler: Scheduler,
    node: Node,
    profile: str,
    holding: frozenset[tuple[int, int, Hashable]] | None,
    skus: _Skus,
) -> tuple[_GpuRegions, ...]:
    """``node``'s MIG GPUs whose SKU offers ``profile``, each with its holders;
    ``holding``: ``_holders`` of the node (None: read them here)."""
    out: list[_GpuRegions] = []
    on_gpu: dict[int, list[tuple[int, Hashable]]] | None = None
    for gpu in node.gpus:
        if not gpu.mig_enabled:
            continue
        model = gpu.model
        if model in skus:
            found = skus[model]
        else:
            known = SKUS.get(model)
            wanted = known.profile(profile) if known is not None else None
            found = skus[model] = (
                (known, wanted) if known is not None and wanted is not None else None
            )
        if found is None:
            continue
        if on_gpu is None:  # the node's holders per GPU, once a GPU of it is a candidate
            on_gpu = {}
            if holding is None:
                snap = scheduler.snapshot
                allocs = snap.allocations
                for akey in snap.allocations_on(node.name):
                    hkey = akey[0]  # type: ignore[index]  # Scheduler.hold keys parts (key, i)
                    for d in allocs[akey].placement.devices:
                        on_gpu.setdefault(d.gpu_index, []).append(
                            (d.mig_start if d.mig_start is not None else -1, hkey)
                        )
            else:
                for gi, st, hk in holding:
                    on_gpu.setdefault(gi, []).append((st, hk))
        out.append(_GpuRegions(node, gpu, found[0], found[1], on_gpu.get(gpu.index, [])))
    return tuple(out)


def _regions(
    scheduler: Scheduler,
    job: Job,
    movable: Callable[[Hashable], bool] | None,
    counts: dict[str, int],
    index: RegionIndex | None = None,
) -> list[_Candidate]:
    """Every region that could be freed for ``job`` by moving only eligible work, with its
    movers (layouts are checked later, for the regions tried); ``counts`` gets the number of
    regions refused per rule. One pass over the nodes, with per-workload answers cached and,
    with ``index``, each node's regions kept while it is unchanged: this is the planner's hot
    loop (5,000 nodes of 8 GPUs)."""
    req = job.request
    profile = req.gpus.mig_profile
    assert profile is not None
    allowed = allowed_models(req.gpus.model)
    tags = req.tags
    pool = job.pool
    snap = scheduler.snapshot
    held = scheduler.held
    admitted = NodeState.ADMITTED
    if index is None:
        index = RegionIndex(keep=False)
    # per held key: whether it is held and ``movable`` says yes, asked once per call
    verdict: dict[Hashable, bool] = {}
    skus: _Skus = {}
    spans: _Spans = {}
    out: list[_Candidate] = []
    if movable is None:  # every held workload may move: per node answers, kept while valid
        want = (pool, allowed)
        for node in snap.nodes():
            if node.state is not admitted or (tags and missing_tags(tags, node.certifications)):
                continue
            cands, refused = index.all_movable(scheduler, node, profile, skus, want, spans)
            if cands:
                out.extend(cands)
            for code, n in refused:
                counts[code] = counts.get(code, 0) + n
        return out
    for node in snap.nodes():
        if node.state is not admitted or (tags and missing_tags(tags, node.certifications)):
            continue
        for g in index.regions(scheduler, node, profile, skus):
            if allowed is not None and g.gpu.model not in allowed:
                continue
            # a holder not movable (not held, ``movable`` says no, or not MIG work of one
            # profile) refuses the GPU; else a holder of another pool does
            stuck = False
            if not (g.static is not None and g.static[0]):
                for _s, k in g.holders:
                    v = verdict.get(k)
                    if v is None:
                        v = verdict[k] = k in held and bool(movable(k))
                    if not v:
                        stuck = True
                        break
            why = _refusal(g, held, pool, stuck)
            if why is not None:
                counts[why] = counts.get(why, 0) + len(g.prof.starts)
                continue
            out.extend(g.candidates(held, profile, spans))
    return out


def mover_request(scheduler: Scheduler, h: Held) -> Request:
    """What a moved workload asks for again: its instances' profile and count, on the GPU model
    it is on now, with its own tags (so the compliance filters hold for it), tenancy and
    co-residency, CPU and memory."""
    node = scheduler.node(h.placement.node)
    first = h.placement.devices[0]
    model = None
    if node is not None:
        model = next((g.model for g in node.gpus if g.index == first.gpu_index), None)
    return Request(
        h.name,
        h.tenant,
        dict(h.pool),
        h.isolation,
        GpuRequest(count=len(h.placement.devices), model=model, mig_profile=first.mig_profile),
        h.co_residency,
        h.cpu_milli,
        h.memory_mib,
    )


def plan_defrag(
    scheduler: Scheduler,
    job: Job,
    movable: Callable[[Hashable], bool] | None,
    budget: int,
    *,
    max_trials: int = DEFAULT_MAX_TRIALS,
    unready: Callable[[Held], AbstractSet[str]] | None = None,
    index: RegionIndex | None = None,
    prune: bool = True,
) -> DefragPlan | DefragRefusal:
    """The fewest moves that let ``job`` (pending: one MIG instance on one node) be placed, or
    why there are none. ``movable(key)``: whether the held workload ``key`` may move (idle or
    restartable). ``budget``: the most moves allowed. ``unready(held)``: nodes that may not take
    that workload now (issue 14: they have not applied its network segment), hidden while it is
    placed again. ``index``: the per-node regions kept from earlier calls on this scheduler
    (``RegionIndex``; the answer is the same without it). ``movable`` None: every held
    workload may move (the trace replays; asked of nothing, and answered per node from the
    index). ``prune`` False: run every trial, even one ``_Doomed`` shows must fail (the same
    answer, slower: the tests' reference). Leaves ``scheduler`` as it found it."""
    req = job.request
    g = req.gpus
    if g.mig_profile is None or g.nodes > 1 or g.count != 1:
        return _refuse(NOT_APPLICABLE, {})
    if budget <= 0:  # nothing may move: no need to look (the common case once it is spent)
        return _refuse(OVER_BUDGET, {}, fewest=1, budget=0)
    counts: dict[str, int] = {}
    found = _regions(scheduler, job, movable, counts, index)
    counts["regions"] = len(found)
    # in cost order, (moves, slices, relayout, node, GPU, start): no two alike, so the heap
    # pops them in the order a sort gives; most calls stop after a few dozen
    order = list(found)
    heapq.heapify(order)
    trials = 0
    doomed = _Doomed(scheduler, job)
    while order:
        cost, node, keys, stay = heapq.heappop(order)
        if cost[0] > budget:
            counts[OVER_BUDGET] = counts.get(OVER_BUDGET, 0) + 1
            continue
        if trials >= max_trials:
            break
        held = scheduler.held
        region = _Region(
            cost, node, cost[4], cost[5], tuple(held[k] for k in keys), stay, bool(cost[2])
        )
        layout = None
        if region.relayout:
            gpu = next(x for x in region.node.gpus if x.index == region.gpu_index)
            layout = _new_layout(
                SKUS[gpu.model],
                tuple(sorted(gpu.mig_instances, key=lambda i: i.start)),
                set(region.stay),
                MigInstance(g.mig_profile, region.start),
            )
            if layout is None:
                continue
        trials += 1
        if prune and doomed.fails(
            region
        ):  # a trial that cannot succeed: counted as one that failed
            counts[NO_DESTINATION] = counts.get(NO_DESTINATION, 0) + 1
            continue
        plan = _trial(scheduler, job, region, layout, len(found), unready)
        if plan is not None:
            return plan
        counts[NO_DESTINATION] = counts.get(NO_DESTINATION, 0) + 1
    if counts.get(NO_DESTINATION):
        return _refuse(NO_DESTINATION, counts, regions=counts[NO_DESTINATION])
    if counts.get(OVER_BUDGET):
        return _refuse(
            OVER_BUDGET, counts, fewest=min(r[0][0] for r in found), budget=max(budget, 0)
        )
    if counts.get(NON_RESTARTABLE_WORK):
        return _refuse(NON_RESTARTABLE_WORK, counts, regions=counts[NON_RESTARTABLE_WORK])
    if counts.get(OTHER_POOL):
        return _refuse(OTHER_POOL, counts, regions=counts[OTHER_POOL])
    return _refuse(NO_REGION, counts, profile=g.mig_profile)


_NOT_ASKED = object()


class _Doomed:
    """An exact test that a trial must fail, asked before each trial (one call's state: every
    trial puts the scheduler back as it found it).

    A trial changes one node, the region's: its movers leave it and the GPU is relaid. Every
    other node only gains work (the waiting job, the movers placed before) or is hidden (the
    nodes a mover may not take yet). Fitting a node (compliance, tenancy, co-residency, GPU
    model, CPU, memory, a free instance) never gets easier with more work on it, so a request
    (the job, then each mover) that ``snapshot.find`` places nowhere *now* can, in the trial,
    go only to the region's node; and that node cannot take it when one of these fails: its
    certifications cover the request's tags; its free CPU and memory now plus what the movers
    release hold the request's; it has enough instances of the request's profile that will
    be free: free now or held by a mover, not overlapping the region on the region's GPU, plus
    the one instance the region gets. Each is a necessary condition, so a trial this test rejects
    would have found no place: skipping it gives the same answer. All the requests that can
    only go there are checked together: each one's tags, and their CPU, memory and instances
    of each profile summed (each is placed on what the ones before it left). ``find``'s answers
    are kept per request shape (the workload's name plays no part in the search)."""

    __slots__ = ("scheduler", "job", "spots")

    def __init__(self, scheduler: Scheduler, job: Job) -> None:
        self.scheduler = scheduler
        self.job = job
        self.spots: dict[Hashable, str | None] = {}

    def _nowhere_now(self, req: Request) -> bool:
        shape = (req.tenant, tuple(sorted(req.tags.items())), req.isolation, req.gpus,
                 req.co_residency, req.cpu_milli, req.memory_mib, req.topology)  # fmt: skip
        spot = self.spots.get(shape, _NOT_ASKED)
        if spot is _NOT_ASKED:
            found = self.scheduler.snapshot.find(req)
            spot = self.spots[shape] = found.node if found is not None else None
        return spot is None

    def fails(self, region: _Region) -> bool:
        there = [self.job.request] if self._nowhere_now(self.job.request) else []
        for h in region.movers:
            req = mover_request(self.scheduler, h)
            if self._nowhere_now(req):
                there.append(req)
        return bool(there) and not self._region_takes(region, there)

    def _region_takes(self, region: _Region, reqs: list[Request]) -> bool:
        """Whether the region's node could take all of ``reqs`` once the movers left it (see
        above): each one's tags, and their CPU, memory and instances of each profile summed
        (each is placed on what the ones before it left)."""
        node = region.node
        certs = node.certifications
        if any(r.tags and missing_tags(r.tags, certs) for r in reqs):
            return False
        cpu, mem, held_slots = self.scheduler.snapshot.free_on(node.name)
        movers = region.movers
        need_cpu = sum(r.cpu_milli for r in reqs)  # none asked: no check (fit's rule)
        if need_cpu > 0 and cpu is not None and cpu + sum(h.cpu_milli for h in movers) < need_cpu:
            return False
        need_mem = sum(r.memory_mib for r in reqs)
        if need_mem > 0 and mem is not None and mem + sum(h.memory_mib for h in movers) < need_mem:
            return False
        need: dict[str | None, int] = {}
        for r in reqs:
            need[r.gpus.mig_profile] = need.get(r.gpus.mig_profile, 0) + r.gpus.count
        wanted = self.job.request.gpus.mig_profile
        free = dict.fromkeys(need, 0)
        if wanted in free:
            free[wanted] = 1  # the region's own instance
        leaving = {(d.gpu_index, d.mig_start) for h in movers for d in h.placement.devices}
        for gpu in node.gpus:
            if not gpu.mig_enabled:
                continue
            span: tuple[int, int] | None = None
            if gpu.index == region.gpu_index:
                prof = SKUS[gpu.model].profile(wanted) if wanted is not None else None
                size = prof.mem_slices if prof is not None else MEMORY_SLICES
                span = (region.start, region.start + size)
            for inst in gpu.mig_instances:
                if inst.profile not in free:
                    continue
                if span is not None:
                    lo, hi = _span(SKUS[gpu.model], inst)
                    if lo < span[1] and span[0] < hi:
                        continue  # in the region: gone with the new layout, or the job's
                slot = (gpu.index, inst.start)
                if slot not in held_slots or slot in leaving:
                    free[inst.profile] += 1
        return all(free[p] >= n for p, n in need.items())


def _refuse(code: str, counts: dict[str, int], **fields: object) -> DefragRefusal:
    return DefragRefusal(code, REFUSAL_MESSAGES[code].format(**fields), dict(counts))


def _relaid(node: Node, gpu_index: int, layout: tuple[MigInstance, ...]) -> Node:
    gpus = tuple(replace(x, mig_instances=layout) if x.index == gpu_index else x for x in node.gpus)
    return replace(node, gpus=gpus)


def _trial(
    scheduler: Scheduler,
    job: Job,
    region: _Region,
    layout: tuple[MigInstance, ...] | None,
    n_regions: int,
    unready: Callable[[Held], AbstractSet[str]] | None = None,
) -> DefragPlan | None:
    """Apply the region's moves on the scheduler, note the plan, and undo it all."""
    ranks = {h.key: scheduler.rank(h.key) for h in region.movers}
    original = scheduler.node(region.node.name)
    assert original is not None
    requests = {h.key: mover_request(scheduler, h) for h in region.movers}
    for h in region.movers:
        scheduler.release(h.key)
    moved: list[Held] = []
    placed: Placement | None = None
    try:
        if layout is not None:
            scheduler.upsert_node(_relaid(original, region.gpu_index, layout))
        # the waiting job first, so that no mover lands in the freed region; the search may
        # put it elsewhere only on capacity a mover left (still valid, and taken)
        # ``find``: the search ``place`` makes, without working out why nothing fits
        placed = scheduler.snapshot.find(job.request)
        if placed is None:
            return None
        scheduler.hold(held_for(job, placed))
        moves: list[Move] = []
        # the largest instances first: they have the fewest places to go
        order = sorted(region.movers, key=lambda h: (-len(h.placement.devices), str(h.key)))
        for h in order:
            to = _place_hiding(scheduler, requests[h.key], unready(h) if unready else frozenset())
            if to is None:
                return None
            new = replace(h, placement=to)
            scheduler.hold(new)
            moved.append(new)
            moves.append(Move(h.key, h.name, h.tenant, h.placement, to))
        repartition = None
        if layout is not None:
            gpu = next(x for x in original.gpus if x.index == region.gpu_index)
            repartition = Repartition(original.name, gpu.index, gpu.uuid, gpu.mig_instances, layout)
        return DefragPlan(tuple(moves), placed, repartition, n_regions)
    finally:
        for h in moved:
            scheduler.release(h.key)
        if placed is not None:
            scheduler.release(job.key)
        scheduler.upsert_node(original)
        for h in region.movers:
            scheduler.hold(h, rank=ranks[h.key])


def _place_hiding(scheduler: Scheduler, req: Request, hidden: AbstractSet[str]) -> Placement | None:
    """``snapshot.find(req)`` (``place``'s search and placement, without the reasons why
    nothing fits) with the admitted nodes of ``hidden`` marked cordoned for the search (as the
    engine hides nodes that wait for a network segment), then restored."""
    masked = [
        node
        for name in sorted(hidden)
        if (node := scheduler.node(name)) is not None and node.state is NodeState.ADMITTED
    ]
    for node in masked:
        scheduler.upsert_node(replace(node, state=NodeState.CORDONED))
    try:
        return scheduler.snapshot.find(req)
    finally:
        for node in masked:
            scheduler.upsert_node(node)


def apply_plan(scheduler: Scheduler, job: Job, plan: DefragPlan) -> Outcome:
    """Carry ``plan`` out on the scheduler: the new layout, every move, then the waiting job's
    placement (held at once, as ``Scheduler.schedule`` holds what it places)."""
    if plan.repartition is not None:
        node = scheduler.node(plan.repartition.node)
        assert node is not None
        scheduler.upsert_node(_relaid(node, plan.repartition.gpu_index, plan.repartition.after))
    for m in plan.moves:
        h = scheduler.held[m.key]
        rank = scheduler.rank(m.key)
        scheduler.hold(replace(h, placement=m.target), rank=rank)
    scheduler.hold(held_for(job, plan.placement))
    return Outcome(
        plan.placement,
        None,
        f"placed on {plan.placement.node} after defragmentation: {plan.describe()}",
        details={DEFRAG_DETAIL: {"moves": len(plan.moves), "regions": plan.regions}},
        repartitions=(plan.repartition,) if plan.repartition is not None else (),
        moves=plan.moves,
    )


@dataclass(slots=True)
class Defragmenter:
    """The engine's defragmentation step (``Scheduler.schedule(..., defrag=...)``):
    ``movable`` (None: every held workload may move) and ``budget`` as ``plan_defrag`` takes
    them. ``refusal`` keeps why the last
    call found no plan (for the waiting workload's explanation); ``budget`` goes down by the
    moves of each plan applied.

    A refusal is remembered for requests of the same shape (tenant, tags, isolation, GPUs,
    co-residency, CPU, memory) while the scheduler holds as many workloads as it did then: a
    queue of waiting requests alike (the pending retry) then costs one search, not one each.
    At worst a chance is missed until the next transaction; no rule depends on it."""

    movable: Callable[[Hashable], bool] | None
    budget: int
    max_trials: int = DEFAULT_MAX_TRIALS
    unready: Callable[[Held], AbstractSet[str]] | None = None
    refusal: DefragRefusal | None = None
    _refused: dict[Hashable, tuple[int, int, DefragRefusal]] = field(default_factory=dict)
    index: RegionIndex = field(default_factory=RegionIndex)  # the planner's per-node regions

    def __call__(self, scheduler: Scheduler, job: Job) -> Outcome | None:
        self.refusal = None
        req = job.request
        shape = (req.tenant, tuple(sorted(req.tags.items())), req.isolation, req.gpus,
                 req.co_residency, req.cpu_milli, req.memory_mib)  # fmt: skip
        state = (len(scheduler.held), len(scheduler.snapshot))
        seen = self._refused.get(shape)
        if seen is not None and seen[:2] == state and seen[2].code != OVER_BUDGET:
            self.refusal = seen[2]
            return None
        found = plan_defrag(
            scheduler,
            job,
            self.movable,
            self.budget,
            max_trials=self.max_trials,
            unready=self.unready,
            index=self.index,
        )
        if isinstance(found, DefragRefusal):
            self.refusal = found
            self._refused[shape] = (*state, found)
            return None
        self.budget -= len(found.moves)
        return apply_plan(scheduler, job, found)
