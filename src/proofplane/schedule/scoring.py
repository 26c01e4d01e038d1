"""Scoring plugins of the placement core (kube-scheduler's Score extension point).

The snapshot's filters decide *where a workload may go*; a scorer decides *which* of those
nodes it goes to. Every scorer here sees a node only through its :data:`State` (what is free on
it) and a request only through its :data:`Shape`, and returns a key (smaller is better; ties go
to the smallest node name) and, for a GPU share or a MIG slice, the GPU it would use. Because a
score depends on nothing else, the snapshot (``schedule.snapshot``) can keep one heap of scores
per request shape and re-score only the nodes that changed since that shape was last placed:
that is what makes the fragmentation-aware scorer cheap enough for the server.

Plugins, selected by name (:data:`SCORERS`):

* ``first-fit``: every feasible node scores the same, so the first by name wins.
* ``best-fit``: the FGD paper's BestFit baseline: least weighted CPU + GPU left after placing.
* ``fgd``: FGD (Weng et al., ATC '23): place where the *expected fragmentation* grows least.
* ``proofplane``: the production scorer: FGD's gradient, plus the GPU capacity a node's free CPU
  can no longer feed, plus packing tie-breaks; the workload mix is learned from the requests.

**Expected fragmentation** (the quantity the last two minimise), for a node ``n`` and a mix of
typical requests ``t`` with weights ``f_t`` (``Σ f_t = 1``)::

    F(n) = Σ_t f_t · frag_t(n)
    frag_t(n) = free GPU milli on n that a request of shape t could not use:
        all of it             if t asks no GPU, cannot run on n's models, or does not fit n;
        the free milli of GPUs with less than t's per-GPU milli free   otherwise;
      and for a MIG profile t: the free compute slices of the MIG GPUs that have no free
      instance of t (in milli: slices / 7 · 1000).

A placement's score is ``trunc(100·σ((F(n) − F(n'))/1000))`` with ``n'`` the node after it.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Protocol

from proofplane.errors import ValidationFailed

FULL = 1000
CPU_UNTRACKED = 1 << 40  # the free CPU of a node that does not track CPU: never short
MIG_SLICES = 7  # compute slices of a MIG GPU (A100/H100/H200/B200)

# (cpu milli, GPUs or MIG instances, milli per GPU (1000 whole, 1..999 share, 0 CPU-only or
# MIG), GPU model spec ("A|B" alternatives, None any), MIG profile or None)
Shape = tuple[int, int, int, str | None, str | None]
# (models, free cpu, free milli per plain GPU in node order, free MIG instance profiles per MIG
# GPU in node order (sorted), cpu capacity, fresh: nothing allocated on the node)
State = tuple[frozenset[str], int, tuple[int, ...], tuple[tuple[str, ...], ...], int, bool]
MigFree = tuple[tuple[str, ...], ...]
_Row = tuple[float, int, int, int, bool, str | None]
Score = tuple[Hashable, int]  # (key, position of the GPU for a share or MIG slice, else -1)


@dataclass(frozen=True, slots=True)
class Typical:
    """One shape of the workload mix and its weight."""

    cpu: int
    k: int
    m: int
    spec: frozenset[str] | None
    mig: str | None
    weight: float


def spec_set(spec: str | None) -> frozenset[str] | None:
    if spec is None:
        return None
    return frozenset(s for s in spec.split("|") if s)


@lru_cache(maxsize=256)
def mig_slices(profile: str) -> int:
    """Compute slices of a MIG profile from its name (``3g.40gb`` → 3)."""
    head = profile.split("g", 1)[0]
    return int(head) if head.isdigit() else 1


class Scorer(Protocol):
    """A scoring plugin. ``observe`` sees every request before it is placed and returns True
    when the scores of unchanged nodes changed (the snapshot then drops its score caches);
    ``score`` must be a pure function of ``(state, shape)`` between such changes."""

    name: str

    def observe(self, shape: Shape) -> bool: ...

    def score(self, state: State, shape: Shape) -> Score: ...


def best_position(frees: tuple[int, ...], m: int) -> int:
    """GPU selection ``best``: the position of the smallest free milli ≥ m, lowest on ties."""
    best = -1
    best_free = 1 << 30
    for j, g in enumerate(frees):
        if m <= g < best_free:
            best, best_free = j, g
    return best


def _sharing(shape: Shape) -> bool:
    return shape[4] is None and shape[1] == 1 and 0 < shape[2] < FULL


class FirstFit:
    """Every feasible node scores alike: the first by name wins; shares take the fullest GPU."""

    name = "first-fit"

    def observe(self, shape: Shape) -> bool:
        return False

    def score(self, state: State, shape: Shape) -> Score:
        return 0, best_position(state[2], shape[2]) if _sharing(shape) else -1


class BestFit:
    """The FGD paper's BestFit (its §7.2): least weighted CPU + GPU left after placing,
    truncated to an integer, normalised by a 128-core, 8-GPU node."""

    name = "best-fit"
    cpu_scale = 128000
    gpu_scale = 8000

    def observe(self, shape: Shape) -> bool:
        return False

    def score(self, state: State, shape: Shape) -> Score:
        cpu, frees = state[1], state[2]
        p_cpu, k, m = shape[0], shape[1], shape[2]
        left = (cpu - p_cpu) / self.cpu_scale * 0.5 + (sum(frees) - k * m) / self.gpu_scale * 0.5
        return -int(100 * (1 - left)), best_position(frees, m) if _sharing(shape) else -1


class FirstSlotBestFit(BestFit):
    """The MIG papers' baseline (``first-slot-best-fit``): a MIG slice goes on the node left
    with the fewest free compute slices in free instances, on the GPU with the fewest such
    slices that has a free instance of the profile (the lowest position on ties); the instance
    carved when none is free is the carver's (``schedule.migslots``). Anything else: BestFit."""

    name = "first-slot-best-fit"

    def score(self, state: State, shape: Shape) -> Score:
        profile = shape[4]
        if profile is None:
            return super().score(state, shape)
        mig = state[3]
        total = 0
        best = -1
        best_free = 1 << 30
        for j, free in enumerate(mig):
            slices = sum(mig_slices(p) for p in free)
            total += slices
            if profile in free and slices < best_free:
                best, best_free = j, slices
        left = total - mig_slices(profile) * max(shape[1], 1)
        return left, best if shape[1] == 1 else -1


# FGD's fragmentation categories, in the order its simulator sums them (Q3 is not a fragment).
_Q1, _Q2, _Q3, _Q4, _XL, _XR, _NA = range(7)


class WorkloadMix:
    """The typical requests and their weights, learned from the stream of requests.

    Counts per shape, halved every ``window`` requests (so the mix follows the recent work);
    the typical set is the most frequent shapes covering ``coverage`` of the requests (FGD's
    95 %), derived at ``first`` requests, then at 8 × ``first``, then every ``every``, and
    adopted only when it moved by more than ``drift`` (L1 over the weights). Between adoptions
    every score stays valid, which is what lets the snapshot keep its heaps; an adoption
    re-scores every node the next requests look at, so it is rare by design."""

    def __init__(
        self,
        coverage: float = 0.95,
        *,
        first: int = 256,
        every: int = 8192,
        drift: float = 0.05,
        window: int = 1 << 16,
        fixed: Sequence[Typical] | None = None,
    ) -> None:
        self.coverage = coverage
        self.every = every
        self.drift = drift
        self.window = window
        self.fixed = fixed is not None
        self.typical: tuple[Typical, ...] = tuple(fixed or ())
        self.version = 0
        self._counts: Counter[tuple[int, int, int, str | None, str | None]] = Counter()
        self._seen = 0
        self._first = first
        self._next = first

    def observe(self, shape: Shape) -> bool:
        """Count one request; True when the adopted mix changed."""
        if self.fixed:
            return False
        self._counts[shape] += 1
        self._seen += 1
        if self._seen % self.window == 0:
            for key in list(self._counts):
                left = self._counts[key] // 2
                if left:
                    self._counts[key] = left
                else:
                    del self._counts[key]
        if self._seen < self._next:
            return False
        if self._seen == self._first:
            self._next = min(8 * self._first, self._seen + self.every)
        else:
            self._next = self._seen + self.every
        new = derive_typical(self._counts.items(), self.coverage)
        if self.typical and _distance(self.typical, new) <= self.drift:
            return False
        self.typical = new
        self.version += 1
        return True


def derive_typical(
    counts: Iterable[tuple[Shape, int]], coverage: float = 0.95
) -> tuple[Typical, ...]:
    """FGD's workload model from shape counts: the most popular shapes until their cumulative
    count reaches ``coverage``, weights renormalised to sum to 1 (ties by shape, descending)."""
    items = [(s, c) for s, c in counts if c > 0]
    total = sum(c for _, c in items)
    if total == 0:
        return ()
    items.sort(key=lambda sc: (sc[1], _sort_key(sc[0])), reverse=True)
    chosen: list[tuple[Shape, int]] = []
    cum = 0
    for shape, count in items:
        chosen.append((shape, count))
        cum += count
        if cum / total >= coverage:
            break
    share = cum / total
    return tuple(
        Typical(s[0], s[1], s[2], spec_set(s[3]), s[4], (c / total) / share) for s, c in chosen
    )


def _sort_key(shape: Shape) -> tuple[int, int, int, str, str]:
    return (shape[0], shape[2], shape[1], shape[3] or "", shape[4] or "")


def _distance(a: Sequence[Typical], b: Sequence[Typical]) -> float:
    def key(t: Typical) -> tuple[object, ...]:
        return (t.cpu, t.k, t.m, t.spec, t.mig)

    wa = {key(t): t.weight for t in a}
    wb = {key(t): t.weight for t in b}
    return sum(abs(wa.get(k, 0.0) - wb.get(k, 0.0)) for k in wa.keys() | wb.keys())


class Fragmentation:
    """``F`` of a node state against a mix (see the module docstring), in two parts that are
    memoised apart: the plain part, per (models, CPU level, sorted free GPU milli), summed per
    FGD category in the mix's order as FGD's simulator sums it (so the ``fgd`` plugin
    reproduces its decisions); and the MIG part, a sum over the MIG GPUs of a term that
    depends only on that GPU's free instances (memoised per free-instance tuple). A MIG
    placement changes one GPU's term, so its ΔF is one lookup, not a recomputation."""

    def __init__(self, typical: Sequence[Typical]) -> None:
        self.typical = tuple(typical)
        self.cpu_levels = sorted({t.cpu for t in self.typical})
        self._rows: dict[frozenset[str], list[_Row]] = {}
        self._memo: dict[tuple[frozenset[str], int, tuple[int, ...]], float] = {}
        self._gpu_memo: dict[tuple[str, ...], float] = {}
        # the MIG part's weights: per profile, and what plain requests (which cannot use a
        # slice at all) add
        self._mig_weight: dict[str, float] = {}
        plain = 0.0
        for t in self.typical:
            if t.mig is not None:
                self._mig_weight[t.mig] = self._mig_weight.get(t.mig, 0.0) + t.weight
            else:
                plain += t.weight
        self._plain_weight = plain

    def _rows_for(self, models: frozenset[str]) -> list[_Row]:
        rows = self._rows.get(models)
        if rows is None:
            rows = [
                (t.weight, t.cpu, t.m, t.k, t.spec is None or not t.spec.isdisjoint(models), t.mig)
                for t in self.typical
            ]
            self._rows[models] = rows
        return rows

    def value(
        self,
        models: frozenset[str],
        cpu: int,
        sorted_frees: tuple[int, ...],
        mig: MigFree = (),
    ) -> float:
        """``F`` of a node: the plain part plus every MIG GPU's term."""
        out = self.plain(models, cpu, sorted_frees)
        for gpu in mig:
            out += self.gpu(gpu)
        return out

    def plain(self, models: frozenset[str], cpu: int, sorted_frees: tuple[int, ...]) -> float:
        key = (models, bisect_right(self.cpu_levels, cpu), sorted_frees)
        hit = self._memo.get(key)
        if hit is None:
            if len(self._memo) > 500_000:
                self._memo.clear()
            hit = self._memo[key] = self.compute(models, cpu, sorted_frees)
        return hit

    def gpu(self, free: tuple[str, ...]) -> float:
        """One MIG GPU's term: its free compute (in milli) times the weight of the requests
        that cannot use it: MIG profiles with no free instance on it, and plain requests."""
        hit = self._gpu_memo.get(free)
        if hit is None:
            if not free:
                hit = 0.0
            else:
                milli = sum(mig_slices(p) for p in free) * FULL / MIG_SLICES
                stuck = self._plain_weight
                for profile, w in self._mig_weight.items():
                    if profile not in free:
                        stuck += w
                hit = stuck * milli
            self._gpu_memo[free] = hit
        return hit

    def compute(self, models: frozenset[str], cpu: int, frees: tuple[int, ...]) -> float:
        """Unmemoised plain part of ``F`` (``frees`` in any order); MIG typical requests count
        every free plain milli as fragment."""
        total = sum(frees)
        q = [0.0] * 7
        for f, t_cpu, t_m, t_k, access, t_mig in self._rows_for(models):
            cpu_ok = cpu >= t_cpu
            if t_mig is not None:
                q[_Q2] += f * total
            elif t_k == 0:
                q[_XL if cpu_ok else _XR] += f * total
            elif not access:
                q[_NA] += f * total
            else:
                fit = 0
                small = 0
                for g in frees:
                    if g >= t_m:
                        fit += 1
                    else:
                        small += g
                if fit >= t_k:
                    if cpu_ok:
                        q[_Q2] += f * small
                        q[_Q3] += f * (total - small)
                    else:
                        q[_Q4] += f * total
                else:
                    q[_Q1 if not cpu_ok else _Q2] += f * total
        return ((((q[0] + q[1]) + q[3]) + q[4]) + q[5]) + q[6]


def after_placement(frees: tuple[int, ...], k: int, m: int) -> tuple[int, ...]:
    """Sorted free list after a non-sharing request takes ``m`` from ``k`` fitting GPUs in
    ascending free order (FGD's hypothetical ``n'``)."""
    out = sorted(frees)
    if m <= 0 or k <= 0:
        return tuple(out)
    taken = 0
    for j, g in enumerate(out):
        if g >= m:
            out[j] = g - m
            taken += 1
            if taken == k:
                break
    return tuple(sorted(out))


def _sigmoid_score(delta: float) -> int:
    """``trunc(100·σ(delta/1000))``."""
    return int(100 * (1.0 / (1.0 + math.exp(-delta / 1000))))


class FGD:
    """FGD (its §7.3): the placement that grows the expected fragmentation least; a share goes
    on the lowest-position GPU with the best truncated score. The mix is the trace's typical
    pods when given (the paper's protocol), else learned from the requests."""

    name = "fgd"

    def __init__(self, mix: WorkloadMix | None = None) -> None:
        self.mix = mix or WorkloadMix()
        self.frag = Fragmentation(self.mix.typical)

    def observe(self, shape: Shape) -> bool:
        if self.mix.observe(shape):
            self.frag = Fragmentation(self.mix.typical)
            return True
        return False

    def potential(self, models: frozenset[str], cpu: int, frees: tuple[int, ...]) -> float:
        """The part of the node's potential that plain GPUs and CPU carry (``frees``
        sorted); the MIG GPUs' terms are ``Fragmentation.gpu``."""
        return self.frag.plain(models, cpu, frees)

    def score(self, state: State, shape: Shape) -> Score:
        models, cpu, frees = state[0], state[1], state[2]
        p_cpu, k, m, _spec, profile = shape
        if profile is not None:
            return self._mig(state, shape)
        potential = self.potential
        base = potential(models, cpu, tuple(sorted(frees)))
        left = cpu - p_cpu
        if k == 1 and 0 < m < FULL:
            best = -1
            dev = -1
            seen: dict[int, int] = {}
            for j, g in enumerate(frees):
                if g < m:
                    continue
                s = seen.get(g)
                if s is None:
                    after = list(frees)
                    after[j] = g - m
                    s = _sigmoid_score(base - potential(models, left, tuple(sorted(after))))
                    seen[g] = s
                if s > best:
                    best, dev = s, j
            return -best, dev
        moved = potential(models, left, after_placement(frees, k, m))
        return -_sigmoid_score(base - moved), -1

    def _mig(self, state: State, shape: Shape) -> Score:
        """A MIG slice: the GPU whose term grows least (CPU's part is the same on every GPU);
        ``k`` slices count ``k`` times the best GPU's change, placed by the fit rule."""
        models, cpu, frees, mig = state[0], state[1], state[2], state[3]
        p_cpu, k, _m, _spec, profile = shape
        assert profile is not None
        sorted_frees = tuple(sorted(frees))
        plain_delta = self.potential(models, cpu, sorted_frees) - self.potential(
            models, cpu - p_cpu, sorted_frees
        )
        gpu = self.frag.gpu
        best = -1
        dev = -1
        seen: dict[tuple[str, ...], int] = {}
        for j, free in enumerate(mig):
            if profile not in free:
                continue
            s = seen.get(free)
            if s is None:
                after = list(free)
                after.remove(profile)
                delta = gpu(free) - gpu(tuple(after))
                s = seen[free] = _sigmoid_score(plain_delta + delta * max(k, 1))
            if s > best:
                best, dev = s, j
        return -best, dev if k == 1 else -1


class Proofplane(FGD):
    """proofplane's production scorer: FGD's gradient, made CPU-aware and packing.

    1. **Starved GPU capacity.** ``F`` only asks "can the next typical request fit now?"; it
       does not see that a node whose free CPU is too small *for its free GPUs* will strand
       some of them. We add ``λ·max(0, G − C/ρ)`` to ``F``: ``ρ`` is the typical GPU
       request's CPU per GPU milli (``Σ f_t·cpu_t / Σ f_t·k_t·m_t``), ``G``/``C`` the node's
       free GPU milli and CPU: the GPU milli its CPU cannot feed.
    2. **The same coarse gradient** ``trunc(100·σ(−ΔF/1000))``: finer keys lose packing, the
       near-ties they break are better decided by a consistent node order.
    3. **Packing tie-breaks**: nodes in use before untouched ones, then (shares) the tightest
       GPU, then the name.

    The mix is learned from the requests the scorer sees (``WorkloadMix``)."""

    name = "proofplane"
    starve_weight = 1.0  # λ

    def __init__(self, mix: WorkloadMix | None = None) -> None:
        super().__init__(mix)
        self.rho = _rho(self.mix.typical)

    def observe(self, shape: Shape) -> bool:
        if super().observe(shape):
            self.rho = _rho(self.mix.typical)
            return True
        return False

    def potential(self, models: frozenset[str], cpu: int, frees: tuple[int, ...]) -> float:
        value = self.frag.plain(models, cpu, frees)
        if self.rho > 0 and cpu < CPU_UNTRACKED:
            starved = sum(frees) - cpu / self.rho
            if starved > 0:
                value += self.starve_weight * starved
        return value

    def score(self, state: State, shape: Shape) -> Score:
        models, cpu, frees, _mig, _cap, fresh = state
        p_cpu, k, m, _spec, profile = shape
        used = 1 if fresh else 0
        if profile is not None:
            key, dev = self._mig(state, shape)
            return (key, used, 0), dev
        potential = self.potential
        base = potential(models, cpu, tuple(sorted(frees)))
        left = cpu - p_cpu
        if k == 1 and 0 < m < FULL:
            best: tuple[int, int, int] | None = None
            dev = -1
            for j, g in enumerate(frees):
                if g < m:
                    continue
                after = list(frees)
                after[j] = g - m
                delta = base - potential(models, left, tuple(sorted(after)))
                key = (-_sigmoid_score(delta), used, g)
                if best is None or key < best:
                    best, dev = key, j
            if best is None:
                return (0, used, 0), -1
            return best, dev
        delta = base - potential(models, left, after_placement(frees, k, m))
        return (-_sigmoid_score(delta), used, 0), -1


def _rho(typical: Sequence[Typical]) -> float:
    rows = [t for t in typical if t.k > 0 and t.m > 0]
    gpu = sum(t.weight * t.k * t.m for t in rows)
    return sum(t.weight * t.cpu for t in rows) / gpu if gpu > 0 else 0.0


#: The scoring plugins by name; each call makes a fresh scorer (its own learned mix).
SCORERS: dict[str, Callable[[], Scorer]] = {
    "proofplane": Proofplane,
    "fgd": FGD,
    "best-fit": BestFit,
    "first-fit": FirstFit,
    "first-slot-best-fit": FirstSlotBestFit,
}
DEFAULT_SCORER = "proofplane"


class UnknownScorer(ValidationFailed):
    """A scorer name that is not one of ``SCORERS`` (422 ``unknown_scorer``)."""

    code = "unknown_scorer"


def make_scorer(name: str, mix: WorkloadMix | None = None) -> Scorer:
    """A fresh scorer by name (``mix`` fixes the workload mix of ``fgd``/``proofplane``)."""
    if name not in SCORERS:
        raise UnknownScorer(f"unknown scorer {name!r} (known: {', '.join(SCORERS)})")
    if mix is not None and name in ("fgd", "proofplane"):
        return Proofplane(mix) if name == "proofplane" else FGD(mix)
    return SCORERS[name]()
