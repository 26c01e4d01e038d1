"""MIG mode of the trace replay (``proofplane sim openb --mig``).

Every GPU of the cluster becomes an H100-80GB in MIG mode (7 compute and 8 memory slices, the
profiles, start slots and validity rules of :mod:`proofplane.hardware.skus`). A request asks for
``count`` instances of one MIG profile on one node: GPU-sharing pods of the openb trace map to
the smallest profile that covers their share (see :func:`profile_for_share`), whole-GPU pods
ask for ``k`` ``7g.80gb`` instances (a full GPU each), CPU-only pods ask for no GPU. Otherwise
the protocol of the openb replay holds: arrival order and 130 % inflation of notes §3, no
departures, CPU and memory feasibility, failed requests dropped, ties to the node's rank.

Placing an instance picks a node, a GPU and a start slot. Two policies:

* ``first-slot-best-fit`` (baseline): the node with the best BestFit score (notes §7.2 with
  compute slices instead of milli-GPU), on it the fitting GPU with the fewest free compute
  slices, on that GPU the first valid start slot.
* ``proofplane``: fragmentation-aware. A layout's *potential* is, first, its stranded
  compute (free compute slices no further instance can ever use, e.g. the seventh slice beside
  ``3g@0`` and ``3g@4``: the memory is gone) and, second, its fragmentation: for a profile
  ``p``, the free compute that ``p`` instances could not use, ``free − c_p · fit_p`` with
  ``fit_p`` the most further ``p`` instances the layout can still take, weighted by the demand
  mix (each profile's share of the requested compute slices). Every (node, GPU, start slot) is
  scored by how much the placement raises the potential; the smallest rise wins, then the
  tighter node (BestFit score), then the node rank; on the node, ties go to the tighter GPU,
  then the lower index and slot. That keeps ``4g`` (start 0 only) and ``3g`` regions open
  while small slices fill gaps, and puts at most one memory-hungry instance (``3g``,
  ``1g.20gb``) on a GPU when it can.

Pure: requests and nodes come in as values; nothing here reads files or the clock.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import accumulate
from typing import Any

from proofplane.errors import ProofplaneError
from proofplane.hardware.skus import COMPUTE_SLICES, MigProfile, Sku, get_sku, layout_errors
from proofplane.model.node import MigInstance
from proofplane.sim.gorand import Rng, make_rng
from proofplane.sim.trace import INFLATION, Node, Pod, build_arrivals

# The code that places in this mode: the simulator's own MIG model, not ``proofplane.schedule``
# (which places on existing instances and repartitions idle GPUs only); see the README.
ENGINE = "proofplane.sim.mig"
SKU_NAME = "H100-80GB"
WHOLE_GPU = "7g.80gb"
MIG_POLICIES = ("proofplane", "first-slot-best-fit")
MIXES = ("openb", "synthetic")
# BestFit normalisation (notes §7.2): 128 cores, and 8 GPUs x 7 compute slices.
CPU_NORM = 128_000
SLICE_NORM = 8 * COMPUTE_SLICES

# The synthetic small-slice-heavy mix: share of requests per profile (per mille), and the host
# CPU (milli) per compute slice and memory (MiB) per memory slice every request asks for.
SYNTHETIC_MIX: tuple[tuple[str, int], ...] = (
    ("1g.10gb", 400),
    ("1g.20gb", 100),
    ("2g.20gb", 200),
    ("3g.40gb", 150),
    ("4g.40gb", 100),
    ("7g.80gb", 50),
)
SYNTHETIC_CPU_PER_SLICE = 1000
SYNTHETIC_MEM_PER_SLICE = 4096


class MigSimError(ProofplaneError, ValueError):
    """A MIG-mode input that cannot be replayed (unknown policy, mix or profile)."""

    code = "mig_sim_invalid"


# --------------------------------------------------------------------------------------------
# Geometry: every layout of one GPU reachable with the request profiles, and its moves.


@dataclass(frozen=True)
class Geometry:
    """The layouts one GPU can hold, as a state graph. State 0 is the empty GPU.

    ``moves[s][p]`` lists ``(start, next_state)`` for every valid placement of profile ``p``
    (index into ``profiles``) on layout ``s``, by ascending start slot; ``fit[s][p]`` is the
    most further ``p`` instances layout ``s`` can take. Validity is decided by
    :func:`proofplane.hardware.skus.layout_errors`, nothing else."""

    sku: Sku
    profiles: tuple[MigProfile, ...]
    layouts: tuple[tuple[MigInstance, ...], ...]
    free: tuple[int, ...]  # free compute slices per state
    moves: tuple[tuple[tuple[tuple[int, int], ...], ...], ...]
    fit: tuple[tuple[int, ...], ...]

    def index(self, profile: str) -> int:
        for i, p in enumerate(self.profiles):
            if p.name == profile:
                return i
        known = ", ".join(p.name for p in self.profiles)
        raise MigSimError(f"unknown MIG profile {profile!r} (known: {known})")

    def state_of(self, instances: Iterable[MigInstance]) -> int:
        key = tuple(sorted(instances, key=lambda i: (i.start, i.profile)))
        return self.layouts.index(key)


@lru_cache(maxsize=4)
def geometry(sku_name: str = SKU_NAME) -> Geometry:
    """Enumerate the layouts of ``sku_name`` reachable by adding request profiles (every
    profile but the ``+me`` ones) one instance at a time."""
    sku = get_sku(sku_name)
    profiles = tuple(
        sorted(
            (p for p in sku.mig_profiles if not p.media_extensions),
            key=lambda p: (p.compute_slices, p.mem_slices),
        )
    )
    ids: dict[tuple[MigInstance, ...], int] = {(): 0}
    layouts: list[tuple[MigInstance, ...]] = [()]
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
    )


def profile_for_share(milli: int, geo: Geometry | None = None) -> str:
    """The smallest profile (fewest compute, then memory slices) whose compute *and* memory
    fractions both cover a share of ``milli``/1000 of a GPU; ``7g.80gb`` for shares a smaller
    profile cannot cover. For H100-80GB: ≤125 → 1g.10gb, ≤142 → 1g.20gb, ≤250 → 2g.20gb,
    ≤428 → 3g.40gb, ≤500 → 4g.40gb, else 7g.80gb."""
    g = geo or geometry()
    mem_total = 8
    for p in g.profiles:
        if milli * COMPUTE_SLICES <= p.compute_slices * 1000 and milli * mem_total <= (
            p.mem_slices * 1000
        ):
            return p.name
    return g.profiles[-1].name


# --------------------------------------------------------------------------------------------
# Requests and streams.


@dataclass(frozen=True, slots=True)
class MigRequest:
    """``count`` instances of ``profile`` on one node (``None``: a CPU-only request)."""

    name: str
    cpu: int  # milli-cores
    mem: int  # MiB
    profile: str | None
    count: int = 1


@dataclass(frozen=True, slots=True)
class MigStream:
    requests: list[MigRequest]
    nodes: list[Node]  # sorted by name
    rank: list[int]  # rank[i] of nodes[i]; the smallest rank wins ties


def request_for_pod(pod: Pod, geo: Geometry | None = None) -> MigRequest:
    """An openb pod as a MIG request: sharing pods get the covering profile, whole-GPU pods
    ``k`` full GPUs (``7g.80gb``), CPU-only pods no GPU. ``gpu_spec`` is dropped: every GPU is
    an H100-80GB in this mode."""
    if pod.k == 0 or pod.m == 0:
        return MigRequest(pod.name, pod.cpu, pod.mem, None, 0)
    if pod.m >= 1000:
        return MigRequest(pod.name, pod.cpu, pod.mem, WHOLE_GPU, pod.k)
    return MigRequest(pod.name, pod.cpu, pod.mem, profile_for_share(pod.m, geo), pod.k)


def openb_stream(pods: list[Pod], nodes: list[Node], seed: int, rng: str = "go") -> MigStream:
    """The openb arrival stream of ``seed`` (notes §3, inflation on the pods' own GPU milli),
    each pod mapped to a MIG request."""
    arrivals = build_arrivals(pods, nodes, make_rng(rng, seed))
    geo = geometry()
    return MigStream(
        requests=[request_for_pod(p, geo) for p in arrivals.pods],
        nodes=arrivals.nodes,
        rank=arrivals.rank,
    )


def synthetic_stream(
    nodes: list[Node],
    seed: int,
    rng: str = "go",
    mix: Sequence[tuple[str, int]] = SYNTHETIC_MIX,
    inflation: float = INFLATION,
) -> MigStream:
    """A seeded small-slice-heavy stream: requests drawn i.i.d. from ``mix`` (per mille) until
    the next one would push the requested compute slices past ``inflation`` × the cluster's
    compute slices; each asks for ``SYNTHETIC_CPU_PER_SLICE`` milli-cores per compute slice and
    ``SYNTHETIC_MEM_PER_SLICE`` MiB per memory slice. Then the node tie-break permutation."""
    geo = geometry()
    if sum(w for _, w in mix) != 1000:
        raise MigSimError("the synthetic mix must sum to 1000 per mille")
    profs = [geo.profiles[geo.index(name)] for name, _ in mix]
    cum = list(accumulate(w for _, w in mix))
    r: Rng = make_rng(rng, seed)
    capacity = sum(n.gpus for n in nodes) * COMPUTE_SLICES
    target = inflation * capacity
    total = 0
    requests: list[MigRequest] = []
    while True:
        x = r.intn(1000)
        pick = 0
        while x >= cum[pick]:
            pick += 1
        prof = profs[pick]
        if total + prof.compute_slices > target:
            break
        total += prof.compute_slices
        requests.append(
            MigRequest(
                name=f"syn-{len(requests):06d}",
                cpu=SYNTHETIC_CPU_PER_SLICE * prof.compute_slices,
                mem=SYNTHETIC_MEM_PER_SLICE * prof.mem_slices,
                profile=prof.name,
                count=1,
            )
        )
    sorted_nodes = sorted(nodes, key=lambda n: n.name.encode())
    return MigStream(requests=requests, nodes=sorted_nodes, rank=r.perm(len(sorted_nodes)))


def demand_weights(requests: Iterable[MigRequest], geo: Geometry | None = None) -> list[float]:
    """Share of the requested compute slices per profile (a request of ``count`` instances
    counts ``count`` times): how much of the expected demand each profile is. Uniform when
    there are no GPU requests."""
    g = geo or geometry()
    slices = [0] * len(g.profiles)
    for r in requests:
        if r.profile is not None:
            i = g.index(r.profile)
            slices[i] += max(r.count, 1) * g.profiles[i].compute_slices
    total = sum(slices)
    if total == 0:
        return [1 / len(slices)] * len(slices)
    return [c / total for c in slices]


def fragmentation(geo: Geometry, weights: Sequence[float]) -> list[float]:
    """Per layout: ``Σ_p w_p · (free − c_p · fit_p)``, the free compute the expected requests
    cannot use."""
    out = []
    for s in range(len(geo.layouts)):
        out.append(
            sum(
                w * (geo.free[s] - p.compute_slices * geo.fit[s][i])
                for i, (p, w) in enumerate(zip(geo.profiles, weights, strict=True))
            )
        )
    return out


# --------------------------------------------------------------------------------------------
# Slot choice on one GPU.


def first_slot(geo: Geometry, state: int, p: int) -> tuple[int, int] | None:
    """Baseline: the first valid start slot, ``(start, next_state)``; None when none."""
    moves = geo.moves[state][p]
    return moves[0] if moves else None


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


STRANDED_WEIGHT = 100.0  # one stranded slice outweighs any fragmentation difference (|ΔF| ≤ 7)


def placement_costs(geo: Geometry, weights: Sequence[float]) -> list[float]:
    """proofplane's per-layout potential: ``STRANDED_WEIGHT · stranded + fragmentation``. A
    move's cost is the increase of the potential; a move that strands nothing and keeps the
    larger profiles placeable costs least."""
    frag = fragmentation(geo, weights)
    fill = max_fill(geo)
    return [STRANDED_WEIGHT * (geo.free[s] - fill[s]) + frag[s] for s in range(len(geo.layouts))]


def least_fragmenting_slot(
    geo: Geometry, potential: Sequence[float], state: int, p: int
) -> tuple[float, int, int] | None:
    """proofplane: the start slot whose resulting layout has the lowest ``potential`` (see
    :func:`placement_costs`), ``(increase, start, next_state)``; the lower slot on ties; None
    when none fits."""
    best: tuple[float, int, int] | None = None
    base = potential[state]
    for start, nxt in geo.moves[state][p]:
        d = round(potential[nxt] - base, 9)
        if best is None or d < best[0]:
            best = (d, start, nxt)
    return best


# --------------------------------------------------------------------------------------------
# The replay.


@dataclass
class MigResult:
    policy: str
    requests: int = 0  # GPU requests arrived
    accepted: int = 0  # GPU requests placed
    cpu_only: int = 0
    cpu_only_accepted: int = 0
    slices_requested: int = 0  # compute slices of the arrived GPU requests
    slices_placed: int = 0
    by_profile: dict[str, list[int]] = field(default_factory=dict)  # name -> [arrived, placed]
    capacity_slices: int = 0
    layouts: list[list[tuple[MigInstance, ...]]] = field(default_factory=list)  # per node, GPU
    free_cpu: list[int] = field(default_factory=list)
    free_mem: list[int] = field(default_factory=list)
    placements: list[tuple[str, int, tuple[tuple[int, int], ...]] | None] = field(
        default_factory=list
    )  # per request: (node, node index, ((gpu, start), ...)) or None

    @property
    def accepted_pct(self) -> float:
        return round(100 * self.accepted / self.requests, 4) if self.requests else 0.0

    @property
    def slice_utilisation_pct(self) -> float:
        return (
            round(100 * self.slices_placed / self.capacity_slices, 4)
            if self.capacity_slices
            else 0.0
        )


def _bestfit(free_cpu: int, free_slices: int, cpu: int, slices: int) -> int:
    """BestFit score (notes §7.2, compute slices for milli-GPU); larger is tighter."""
    left = (free_cpu - cpu) / CPU_NORM * 0.5 + (free_slices - slices) / SLICE_NORM * 0.5
    return int(100 * (1 - left))


def replay_mig(
    stream: MigStream,
    policy: str,
    weights: Sequence[float] | None = None,
    record_placements: bool = False,
) -> MigResult:
    """Replay ``stream`` under ``policy`` (one of :data:`MIG_POLICIES`). ``weights`` is the
    demand mix proofplane's fragmentation measure expects (default: the stream's own mix).

    Speed, as in :mod:`proofplane.sim.engine`: a node's cost for a request depends only on the
    node's state and the request's shape ``(cpu, profile, count)``; every shape keeps a heap of
    ``(cost, rank, node, version)`` and re-scores only the nodes changed since its last visit.
    Nothing is released, so a node that fails CPU or MIG room once is gone for that shape;
    memory is checked when popping."""
    if policy not in MIG_POLICIES:
        raise MigSimError(f"unknown MIG policy {policy!r} (known: {', '.join(MIG_POLICIES)})")
    geo = geometry()
    nprof = len(geo.profiles)
    prof_idx = {p.name: i for i, p in enumerate(geo.profiles)}
    for r in stream.requests:
        if r.profile is not None and r.profile not in prof_idx:
            geo.index(r.profile)  # raises MigSimError
        if r.profile is not None and r.count < 1:
            raise MigSimError(f"request {r.name!r}: count must be >= 1")
    w = list(weights) if weights is not None else demand_weights(stream.requests, geo)
    if len(w) != nprof:
        raise MigSimError(f"need {nprof} weights, one per profile, got {len(w)}")
    potential = placement_costs(geo, w)
    smart = policy == "proofplane"
    free_of = geo.free
    fit_of = geo.fit
    compute = [p.compute_slices for p in geo.profiles]
    # Per state and profile: the GPU-level move each policy makes, (increase, start, next).
    move_of: list[list[tuple[float, int, int] | None]] = []
    for s in range(len(geo.layouts)):
        row: list[tuple[float, int, int] | None] = []
        for p in range(nprof):
            if smart:
                row.append(least_fragmenting_slot(geo, potential, s, p))
            else:
                m = first_slot(geo, s, p)
                row.append(None if m is None else (0.0, m[0], m[1]))
        move_of.append(row)

    nodes = stream.nodes
    n = len(nodes)
    rank = stream.rank
    cpu = [x.cpu for x in nodes]
    mem = [x.mem for x in nodes]
    gpus: list[list[int]] = [[0] * x.gpus for x in nodes]
    free_slices = [x.gpus * COMPUTE_SLICES for x in nodes]
    room = [[0] * nprof for _ in range(n)]  # room[j][p]: further p instances node j can take
    delta = [[0.0] * nprof for _ in range(n)]  # proofplane: least fragmentation increase

    def refresh(j: int) -> None:
        states = gpus[j]
        rj, dj = room[j], delta[j]
        for p in range(nprof):
            rj[p] = sum(fit_of[s][p] for s in states)
            if smart:
                dj[p] = min((m[0] for s in states if (m := move_of[s][p]) is not None), default=0.0)

    for j in range(n):
        refresh(j)

    version = [0] * n
    changes: list[int] = []
    heaps: dict[
        tuple[int, int, int], tuple[list[tuple[tuple[float, int], int, int, int]], list[int]]
    ] = {}

    def cost(j: int, shape: tuple[int, int, int]) -> tuple[float, int] | None:
        c, p, k = shape
        if cpu[j] < c:
            return None
        if p < 0:
            return (0.0, -_bestfit(cpu[j], free_slices[j], c, 0))
        if room[j][p] < k:
            return None
        bf = -_bestfit(cpu[j], free_slices[j], c, compute[p] * k)
        return (delta[j][p] * k if smart else 0.0, bf)

    res = MigResult(policy=policy, capacity_slices=sum(free_slices))
    for prof in geo.profiles:
        res.by_profile[prof.name] = [0, 0]
    for req in stream.requests:
        p = prof_idx[req.profile] if req.profile is not None else -1
        k = req.count if p >= 0 else 0
        need = compute[p] * k if p >= 0 else 0
        if p < 0:
            res.cpu_only += 1
        else:
            res.requests += 1
            res.slices_requested += need
            res.by_profile[geo.profiles[p].name][0] += 1
        shape = (req.cpu, p, k)
        entry = heaps.get(shape)
        if entry is None:
            heap = []
            for j in range(n):
                cj = cost(j, shape)
                if cj is not None:
                    heap.append((cj, rank[j], j, version[j]))
            heapq.heapify(heap)
            entry = (heap, [len(changes)])
            heaps[shape] = entry
        else:
            heap, pos = entry
            if pos[0] < len(changes):
                for j in set(changes[pos[0] :]):
                    cj = cost(j, shape)
                    if cj is not None:
                        heapq.heappush(heap, (cj, rank[j], j, version[j]))
                pos[0] = len(changes)
        heap = entry[0]
        chosen = -1
        aside = []
        while heap:
            top = heap[0]
            j = top[2]
            if top[3] != version[j]:
                heapq.heappop(heap)
            elif mem[j] < req.mem:
                aside.append(heapq.heappop(heap))
            else:
                chosen = j
                break
        for e in aside:
            heapq.heappush(heap, e)
        if chosen < 0:
            if record_placements:
                res.placements.append(None)
            continue
        j = chosen
        placed: list[tuple[int, int]] = []
        if p >= 0:
            states = gpus[j]
            for _ in range(k):
                best: tuple[float, int, int, int, int] | None = None
                for g, s in enumerate(states):
                    mv = move_of[s][p]
                    if mv is not None:
                        key = (mv[0], free_of[s], g, mv[1], mv[2])
                        if best is None or key < best:
                            best = key
                assert best is not None  # room[j][p] >= k
                states[best[2]] = best[4]
                placed.append((best[2], best[3]))
            free_slices[j] -= need
            res.accepted += 1
            res.slices_placed += need
            res.by_profile[geo.profiles[p].name][1] += 1
            refresh(j)
        else:
            res.cpu_only_accepted += 1
        cpu[j] -= req.cpu
        mem[j] -= req.mem
        version[j] += 1
        changes.append(j)
        if record_placements:
            res.placements.append((nodes[j].name, j, tuple(placed)))
    res.layouts = [[geo.layouts[s] for s in states] for states in gpus]
    res.free_cpu = cpu
    res.free_mem = mem
    return res


# --------------------------------------------------------------------------------------------
# Runs over seeds and the summary.


@dataclass
class MigSeedResult:
    mix: str
    policy: str
    seed: int
    requests: int
    accepted: int
    accepted_pct: float
    cpu_only: int
    cpu_only_accepted: int
    slice_utilisation_pct: float
    by_profile: dict[str, list[int]]
    seconds: float


def make_stream(
    mix: str, pods: list[Pod], nodes: list[Node], seed: int, rng: str = "go"
) -> MigStream:
    """The stream of ``mix`` (``openb``: the trace's pods mapped to MIG requests;
    ``synthetic``: :data:`SYNTHETIC_MIX`) for ``seed``."""
    if mix == "openb":
        return openb_stream(pods, nodes, seed, rng)
    if mix == "synthetic":
        return synthetic_stream(nodes, seed, rng)
    raise MigSimError(f"unknown mix {mix!r} (known: {', '.join(MIXES)})")


def run_mig_seed(
    pods: list[Pod],
    nodes: list[Node],
    mix: str,
    policies: Sequence[str],
    seed: int,
    rng: str = "go",
    clock: Callable[[], float] | None = None,
) -> list[MigSeedResult]:
    """Build ``mix``'s stream for ``seed`` once and replay it under every policy. ``clock``
    (e.g. ``time.perf_counter``) times each replay; None: no timings."""
    for policy in policies:
        if policy not in MIG_POLICIES:
            raise MigSimError(f"unknown MIG policy {policy!r} (known: {', '.join(MIG_POLICIES)})")
    stream = make_stream(mix, pods, nodes, seed, rng)
    out = []
    for policy in policies:
        t0 = clock() if clock else 0.0
        r = replay_mig(stream, policy)
        t1 = clock() if clock else 0.0
        out.append(
            MigSeedResult(
                mix=mix,
                policy=policy,
                seed=seed,
                requests=r.requests,
                accepted=r.accepted,
                accepted_pct=r.accepted_pct,
                cpu_only=r.cpu_only,
                cpu_only_accepted=r.cpu_only_accepted,
                slice_utilisation_pct=r.slice_utilisation_pct,
                by_profile=r.by_profile,
                seconds=round(t1 - t0, 3),
            )
        )
    return out


def composition(mix: str) -> dict[str, Any]:
    """How ``mix``'s requests are made, for reports."""
    if mix == "openb":
        return {
            "source": "openb pod list, arrival order and 130 % inflation of the FGD protocol",
            "sharing_pods": "smallest profile covering gpu_milli in compute and memory: "
            "<=125 1g.10gb, <=142 1g.20gb, <=250 2g.20gb, <=428 3g.40gb, <=500 4g.40gb, "
            "else 7g.80gb",
            "whole_gpu_pods": "k x 7g.80gb (k full GPUs on one node)",
            "cpu_only_pods": "replayed for CPU/memory, not counted as requests",
            "gpu_spec": "ignored (every GPU is an H100-80GB)",
        }
    if mix == "synthetic":
        return {
            "per_mille": dict(SYNTHETIC_MIX),
            "cpu_milli_per_compute_slice": SYNTHETIC_CPU_PER_SLICE,
            "memory_mib_per_memory_slice": SYNTHETIC_MEM_PER_SLICE,
            "arrivals": "i.i.d. draws with the seed's Go math/rand until the next request would "
            "pass 130 % of the cluster's compute slices; node ranks from the same RNG",
        }
    raise MigSimError(f"unknown mix {mix!r} (known: {', '.join(MIXES)})")


BASELINE = "first-slot-best-fit"


def summarise_mig(results: Iterable[MigSeedResult]) -> dict[str, dict[str, Any]]:
    """Per mix: per policy ``accepted`` (per seed), ``accepted_mean``, ``accepted_pct_mean``,
    ``per_seed`` details; and, when both policies ran, the ratio proofplane / first-slot
    best-fit of the mean accepted requests (and per seed), plus the baseline's unused compute
    (the most any placement could add at this load is about that share)."""
    by_mix: dict[str, dict[str, list[MigSeedResult]]] = {}
    for r in results:
        by_mix.setdefault(r.mix, {}).setdefault(r.policy, []).append(r)
    out: dict[str, dict[str, Any]] = {}
    for mix, pols in by_mix.items():
        doc: dict[str, Any] = {"composition": composition(mix)}
        policies: dict[str, Any] = {}
        for name, rs in pols.items():
            rs = sorted(rs, key=lambda x: x.seed)
            policies[name] = {
                "accepted": {str(x.seed): x.accepted for x in rs},
                "accepted_mean": round(sum(x.accepted for x in rs) / len(rs), 2),
                "requests_mean": round(sum(x.requests for x in rs) / len(rs), 2),
                "accepted_pct_mean": round(sum(x.accepted_pct for x in rs) / len(rs), 4),
                "slice_utilisation_pct_mean": round(
                    sum(x.slice_utilisation_pct for x in rs) / len(rs), 4
                ),
                "per_seed": {
                    str(x.seed): {
                        "requests": x.requests,
                        "accepted": x.accepted,
                        "accepted_pct": x.accepted_pct,
                        "cpu_only": x.cpu_only,
                        "cpu_only_accepted": x.cpu_only_accepted,
                        "slice_utilisation_pct": x.slice_utilisation_pct,
                        "by_profile": x.by_profile,
                        "seconds": x.seconds,
                    }
                    for x in rs
                },
            }
        doc["policies"] = policies
        pp, bf = pols.get("proofplane"), pols.get(BASELINE)
        if pp and bf:
            a = {x.seed: x.accepted for x in pp}
            b = {x.seed: x.accepted for x in bf}
            mean_a = sum(a.values()) / len(a)
            mean_b = sum(b.values()) / len(b)
            doc["ratio_proofplane_vs_first_slot_best_fit"] = (
                round(mean_a / mean_b, 4) if mean_b else None
            )
            doc["ratio_per_seed"] = {
                str(s): round(a[s] / b[s], 4) for s in sorted(a) if s in b and b[s]
            }
            doc["baseline_unused_slices_pct_mean"] = round(
                100 - sum(x.slice_utilisation_pct for x in bf) / len(bf), 4
            )
        out[mix] = doc
    return out
