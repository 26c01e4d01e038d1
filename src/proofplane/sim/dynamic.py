"""MIG under arrivals and departures (``proofplane sim openb --mig --dynamic``).

Requests arrive in trace time order and run for their own duration once placed: the openb
pods with their ``creation_time``/``deletion_time`` (pods still running when the trace ends
leave at the end of the replay; CPU-only pods are left out), or the synthetic small-slice mix
with seeded exponential lifetimes. Arrival times are divided by one compression factor, found
by bisection, so the *offered load* ``Σ slices·duration / (capacity · horizon)`` (durations cut
at the horizon, the last arrival) is the asked share of the cluster's MIG compute.

Every decision is the production scheduler's (``schedule.engine.Scheduler.schedule`` with the
policy's scorer and carver, ``sim.mig.POLICY_PLUGINS``); this module only keeps time:

* **FIFO with backfill.** A request that does not fit waits in a FIFO queue. The queue is
  retried in order at scheduling *ticks* (every ``tick`` seconds of trace time, default 5 s,
  when something departed since the last one); any waiting request that fits is placed, not
  only the head (backfill, no reservation). A request shape (profile, count, CPU, memory)
  that failed is not tried again until the next tick, and a new arrival of such a shape joins
  the queue directly (between departures capacity almost only shrinks; what a repartition's
  spare instances open up waits for the next tick).
* **Patience.** A request still waiting ``patience`` seconds (default 600) after it arrived
  is rejected; so is one still waiting at the horizon (the last arrival), when everything
  still running leaves.
* **Departures** release the workload's capacity in the scheduler (``Scheduler.release``);
  its MIG instance stays (the production lifecycle: instances change only by carving and by
  repartitioning idle GPUs).
* **Defragmentation.** When a request becomes the waiting head of the queue, and when the
  head still waits after a tick's retry, the ``…+defrag`` policies (:data:`DEFRAG_POLICIES`)
  schedule the head once more with the engine's own defragmenter
  (``schedule.defrag.Defragmenter``, as the server runs it: ``Scheduler.schedule(…,
  defrag=…)``), which may move held work off a region to place it. Every replayed workload
  counts as restartable (the most defragmentation could do; in the server only idle work and
  work that says ``"restartable": true`` moves), and the moves are capped at
  :data:`DEFRAG_MOVE_SHARE` of the instances placed so far (the issue's limit, standing in
  for the server's per-hour budget). A moved workload keeps its departure time (the
  checkpoint-restart cost is the workload's and not modelled). A ``defrag`` callable
  (none by default) may instead return moves ``(key, placement)``; the replay applies each
  and counts it, then retries the queue. The engine's planner looks at every compliant GPU
  (tens of milliseconds to a few hundred on the openb cluster), so a head is tried when it
  becomes the head and then at most every :data:`DEFRAG_RETRY` seconds of trace time.

Nothing here reads files or the clock; ``clock`` only times the run.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from proofplane.hardware.skus import COMPUTE_SLICES
from proofplane.model import Placement
from proofplane.schedule.defrag import DEFRAG_DETAIL, Defragmenter
from proofplane.schedule.engine import Held, Job, Scheduler
from proofplane.schedule.scoring import mig_slices
from proofplane.sim import mig
from proofplane.sim.gorand import Rng, make_rng
from proofplane.sim.mig import MigRequest, MigSimError
from proofplane.sim.trace import Node, Pod

POLICIES = (
    "first-slot-best-fit",
    "proofplane",
    "proofplane+relayout",
    "proofplane+repartition",
    "first-slot-best-fit+repartition",
    "proofplane+repartition+defrag",
)
# a defragmenting policy: the scheduler plugins of the policy it extends (sim.mig)
DEFRAG_POLICIES = {"proofplane+repartition+defrag": "proofplane+repartition"}
DEFRAG_MOVE_SHARE = 0.02  # moves allowed: this share of the instances placed so far
DEFRAG_RETRY = 60.0  # seconds of trace time before the same waiting head is tried again
LOADS = (1.0, 1.3, 1.6)
PATIENCE = 600.0  # seconds of trace time
TICK = 5.0
SYNTHETIC_MEAN_LIFETIME = 3600.0  # seconds
SYNTHETIC_SIZE = 2.0  # synthetic requests: this many times load x capacity / mean slices
OPENB_COPIES = 6
MIXES = ("openb", "synthetic")


@dataclass(frozen=True, slots=True)
class Timed:
    request: MigRequest
    arrival: float  # seconds of trace time (compressed)
    duration: float  # seconds it runs once placed (to the end at most)


@dataclass(frozen=True)
class DynamicStream:
    items: list[Timed]  # by arrival
    nodes: list[Node]
    rank: list[int]
    load: float
    compression: float  # trace seconds per replay second (synthetic: of the unit-rate draw)
    end: float  # the horizon: the last arrival; everything still running leaves then

    def as_stream(self) -> mig.MigStream:
        return mig.MigStream([t.request for t in self.items], self.nodes, self.rank)


@dataclass(frozen=True, slots=True)
class Move:
    """A defragmentation move: the workload held under ``key`` goes to ``placement``."""

    key: Hashable
    placement: Placement


# defrag(scheduler, head request key, now) -> moves to apply
DefragHook = Callable[[Scheduler, Hashable, float], Sequence[Move]]


def request_slices(req: MigRequest) -> int:
    if req.profile is None:
        return 0
    geo = mig.geometry()
    return geo.profiles[mig.profile_index(geo, req.profile)].compute_slices * req.count


def offered_load(
    arrivals: Sequence[float], durations: Sequence[float], slices: Sequence[int], capacity: int
) -> float:
    """``Σ slices·min(duration, H) / (capacity · H)``, ``H`` the horizon (from the first
    arrival to the last): the compute the requests ask for per unit of time, each lifetime
    counted at most once the horizon (a trace's months-long pods would otherwise make it)."""
    if not arrivals:
        return 0.0
    t0 = arrivals[0]
    end = arrivals[-1] - t0
    if end <= 0:
        return math.inf
    used = sum(s * min(d, end) for d, s in zip(durations, slices, strict=True))
    return used / (capacity * end)


def compress(
    requests: Sequence[MigRequest],
    arrivals: Sequence[float],
    durations: Sequence[float],
    nodes: list[Node],
    rank: list[int],
    load: float,
) -> DynamicStream:
    """Divide ``arrivals`` (sorted) by the factor that makes the offered load ``load``."""
    if load <= 0:
        raise MigSimError("the offered load must be > 0")
    capacity = sum(n.gpus for n in nodes) * COMPUTE_SLICES
    slices = [request_slices(r) for r in requests]

    def at(f: float) -> float:
        return offered_load([a / f for a in arrivals], durations, slices, capacity)

    lo, hi = 1e-6, 1e9
    if at(hi) < load:
        raise MigSimError(
            f"the stream cannot offer {load:.0%} of the cluster's MIG compute "
            f"(at most {at(hi):.0%} with every arrival at once): use more requests"
        )
    for _ in range(200):
        midf = math.sqrt(lo * hi)
        if at(midf) < load:
            lo = midf
        else:
            hi = midf
        if hi / lo < 1 + 1e-9:
            break
    f = hi
    t0 = arrivals[0] / f if arrivals else 0.0
    shifted = [a / f - t0 for a in arrivals]
    end = shifted[-1] if shifted else 0.0
    items = [
        Timed(r, a, min(d, end - a)) for r, a, d in zip(requests, shifted, durations, strict=True)
    ]
    return DynamicStream(items, nodes, rank, load, round(f, 6), end)


def openb_dynamic(
    pods: list[Pod],
    times: dict[str, tuple[int, int]],
    nodes: list[Node],
    seed: int,
    load: float,
    rng: str = "go",
    copies: int = 6,
) -> DynamicStream:
    """The openb pods with GPUs, in creation order (then name), each as its MIG request
    (``sim.mig.request_for_pod``) with its own lifetime; node ranks from ``seed``. The trace
    offers little load on its own (its 7,064 GPU pods span 149 days, median lifetime 9 min):
    it is played ``copies`` times back to back (copy ``k`` shifted by ``k`` trace spans), then
    compressed to the load."""
    geo = mig.geometry()
    base = []
    for p in pods:
        if p.k == 0 or p.m == 0:
            continue
        if p.name not in times:
            raise MigSimError(f"pod {p.name!r} has no creation/deletion time")
        c, d = times[p.name]
        base.append((c, p.name, mig.request_for_pod(p, geo), float(d - c)))
    if copies < 1:
        raise MigSimError("copies must be >= 1")
    span = max((r[0] for r in base), default=0) + 1
    rows = [
        (c + k * span, name, replace(req, name=f"{name}~{k}") if k else req, d)
        for k in range(copies)
        for c, name, req, d in base
    ]
    rows.sort(key=lambda r: (r[0], r[1]))
    sorted_nodes = sorted(nodes, key=lambda n: n.name.encode())
    rank = make_rng(rng, seed).perm(len(sorted_nodes))
    return compress(
        [r[2] for r in rows],
        [float(r[0]) for r in rows],
        [r[3] for r in rows],
        sorted_nodes,
        rank,
        load,
    )


def _exp(r: Rng, mean: float) -> float:
    u = (r.int63() + 0.5) / float(1 << 63)
    return -math.log(u) * mean


def synthetic_dynamic(
    nodes: list[Node],
    seed: int,
    load: float,
    rng: str = "go",
    n: int | None = None,
    mean_lifetime: float = SYNTHETIC_MEAN_LIFETIME,
) -> DynamicStream:
    """``n`` requests of ``sim.mig.SYNTHETIC_MIX`` (the same draw as the static mix), with
    seeded exponential inter-arrival times and lifetimes (mean ``mean_lifetime`` seconds).
    ``n`` defaults to ``2 · load · capacity / mean slices per request`` (the stream then
    spans about 1.6 mean lifetimes)."""
    if n is None:
        geo = mig.geometry()
        mean = (
            sum(
                geo.profiles[mig.profile_index(geo, p)].compute_slices * w
                for p, w in mig.SYNTHETIC_MIX
            )
            / 1000
        )
        capacity = sum(x.gpus for x in nodes) * COMPUTE_SLICES
        n = math.ceil(SYNTHETIC_SIZE * load * capacity / mean)
    base = mig.synthetic_stream(nodes, seed, rng, limit=n)
    r = make_rng(rng, seed + 1_000_003)
    t = 0.0
    arrivals = []
    durations = []
    for _ in base.requests:
        t += _exp(r, 1.0)
        arrivals.append(t)
        durations.append(_exp(r, mean_lifetime))
    return compress(base.requests, arrivals, durations, base.nodes, base.rank, load)


def make_dynamic(
    mix: str,
    pods: list[Pod],
    times: dict[str, tuple[int, int]],
    nodes: list[Node],
    seed: int,
    load: float,
    rng: str = "go",
    n: int | None = None,
) -> DynamicStream:
    """``mix``'s stream at ``load`` for ``seed`` (``n``: synthetic requests, or openb copies)."""
    if mix == "openb":
        return openb_dynamic(pods, times, nodes, seed, load, rng, n or OPENB_COPIES)
    if mix == "synthetic":
        return synthetic_dynamic(nodes, seed, load, rng, n)
    raise MigSimError(f"unknown mix {mix!r} (known: {', '.join(MIXES)})")


# --------------------------------------------------------------------------------------------
# The replay.

_DEPART, _EXPIRE, _TICK, _ARRIVE = 0, 1, 2, 3


class _Clock:
    """A replay's trace time: arrivals, departures, patience expiries and scheduling ticks in
    one heap (ties in time: departures first, then expiries, ticks, arrivals), the FIFO queue
    of waiting requests, and the tick rule: a tick ``tick`` seconds after a departure while
    something waits, which retries the queue only if something left since the last one.
    Shared by :func:`replay_dynamic` and :func:`replay_pooled`, so both keep one clock."""

    def __init__(self, stream: DynamicStream, tick: float, patience: float) -> None:
        self.end = stream.end
        self.tick = tick
        self.patience = patience
        self.events = [
            (t.arrival, _ARRIVE, i)
            for i, t in enumerate(stream.items)
            if t.request.profile is not None
        ]
        heapq.heapify(self.events)
        self.queue: dict[int, None] = {}  # waiting requests, FIFO
        self.dirty = False  # something departed since the last tick
        self._tick_pending = False

    def due(self) -> Iterator[tuple[float, int, int]]:
        """The events in time order up to the horizon: there what still runs leaves and what
        still waits is not served; the last arrivals still see what runs until the end."""
        while self.events:
            now, kind, i = heapq.heappop(self.events)
            if now > self.end:
                return
            if now == self.end and kind != _ARRIVE:
                continue
            yield now, kind, i

    def runs(self, i: int, now: float, duration: float) -> float:
        """Request ``i`` placed at ``now``: schedule its departure; the seconds it runs (to
        the horizon at most)."""
        run = max(min(duration, self.end - now) if now < self.end else 0.0, 0.0)
        heapq.heappush(self.events, (now + run, _DEPART, i))
        return run

    def departed(self, now: float) -> None:
        self.dirty = True
        if self.queue:
            self._schedule_tick(now)

    def expired(self, i: int) -> bool:
        """Request ``i``'s patience ran out: whether it was still waiting (now rejected)."""
        if i in self.queue:
            del self.queue[i]
            return True
        return False

    def ticked(self) -> bool:
        """A tick: whether the queue is to be retried (something left since the last)."""
        self._tick_pending = False
        if self.dirty:
            self.dirty = False
            return True
        return False

    def waits(self, i: int, now: float) -> None:
        """Request ``i`` did not fit on arrival: it joins the queue until its patience."""
        self.queue[i] = None
        heapq.heappush(self.events, (now + self.patience, _EXPIRE, i))
        if self.dirty:
            self._schedule_tick(now)

    def _schedule_tick(self, now: float) -> None:
        if not self._tick_pending:
            heapq.heappush(self.events, (now + self.tick, _TICK, -1))
            self._tick_pending = True


@dataclass
class DynamicResult:
    policy: str
    requests: int = 0
    accepted: int = 0
    rejected: int = 0  # waited past patience
    waiting_at_end: int = 0  # still waiting at the horizon (censored: neither)
    # why each rejection: "capacity" (less free compute in the cluster than asked),
    # "fragmentation" (enough in total, but no GPU has that much free), "layout" (some GPU
    # has the compute free, but not as a placeable instance: slot, memory slices, idle
    # instances of other profiles, or CPU/memory of its node)
    rejected_why: dict[str, int] = field(
        default_factory=lambda: {"capacity": 0, "fragmentation": 0, "layout": 0}
    )
    compute_hours: float = 0.0  # GPU-hours served (a MIG instance counts slices / 7)
    waits: list[float] = field(default_factory=list)  # per accepted request, seconds
    placed_instances: int = 0
    carved: int = 0
    repartitions: int = 0
    moves: int = 0
    defrag_plans: int = 0  # the defragmenter placed the head (with moves or a new layout)
    defrag_refused: dict[str, int] = field(default_factory=dict)  # per refusal code
    free_at_rejection: list[int] = field(default_factory=list)  # free slices, per rejection
    capacity_slices: int = 0
    placements: list[Placement | None] = field(default_factory=list)  # per request (if asked)
    seconds: float = 0.0
    scheduler: Scheduler | None = None  # as the replay left it (the GPUs' layouts at the end)

    def summary(self) -> dict[str, Any]:
        waits = sorted(self.waits)
        p95 = waits[min(len(waits) - 1, math.ceil(0.95 * len(waits)) - 1)] if waits else 0.0
        inst = self.placed_instances
        decided = self.requests - self.waiting_at_end
        why = self.rejected_why
        return {
            "requests": self.requests,
            "accepted": self.accepted,
            "rejected": self.rejected,
            "waiting_at_end": self.waiting_at_end,
            "accepted_ratio": round(self.accepted / decided, 4) if decided else 0.0,
            "gpu_compute_hours": round(self.compute_hours, 1),
            "wait_mean_s": round(sum(waits) / len(waits), 2) if waits else 0.0,
            "wait_p95_s": round(p95, 2),
            "instances_placed": inst,
            "instances_carved": self.carved,
            "repartitions": self.repartitions,
            "repartitions_pct_of_instances": _pct(self.repartitions, inst, 3),
            "moves": self.moves,
            "defrag_plans": self.defrag_plans,
            "defrag_refused": dict(sorted(self.defrag_refused.items())),
            "moves_pct_of_instances": _pct(self.moves, inst, 3),
            "rejected_why": dict(why),
            "rejected_why_pct": {k: _pct(v, self.rejected, 2) for k, v in why.items()},
            "free_compute_at_rejection_pct_mean": self._free_pct(),
            "seconds": self.seconds,
        }

    def _free_pct(self) -> float:
        free = self.free_at_rejection
        if not free or not self.capacity_slices:
            return 0.0
        return round(100 * sum(free) / (len(free) * self.capacity_slices), 3)


def _pct(part: int, whole: int, digits: int) -> float:
    return round(100 * part / whole, digits) if whole else 0.0


def replay_dynamic(
    stream: DynamicStream,
    policy: str,
    *,
    patience: float = PATIENCE,
    tick: float = TICK,
    defrag: DefragHook | None = None,
    record_placements: bool = False,
    clock: Callable[[], float] | None = None,
    move_share: float = DEFRAG_MOVE_SHARE,
) -> DynamicResult:
    """Replay ``stream`` with departures under ``policy`` (one of :data:`POLICIES`);
    ``move_share``: the ``…+defrag`` policies' cap on moves, a share of the instances placed."""
    if patience < 0 or tick <= 0:
        raise MigSimError("patience must be >= 0 and tick > 0")
    if not 0 <= move_share <= 1:
        raise MigSimError("move_share must be between 0 and 1")
    t_start = clock() if clock else 0.0
    requests = [t.request for t in stream.items]
    mig.check_requests(requests)
    sched, repartition = mig.make_scheduler(stream.as_stream(), DEFRAG_POLICIES.get(policy, policy))
    # one defragmenter for the replay: it remembers refusals while the cluster is unchanged
    defragmenter = Defragmenter(movable=None, budget=0) if policy in DEFRAG_POLICIES else None
    capacity = sum(n.gpus for n in stream.nodes) * COMPUTE_SLICES
    res = DynamicResult(policy=policy, capacity_slices=capacity, scheduler=sched)
    res.requests = sum(1 for r in requests if r.profile is not None)
    if record_placements:
        res.placements = [None] * len(requests)
    slices = [request_slices(r) for r in requests]
    jobs = [mig.mig_request(r) for r in requests]
    shapes = [(r.profile, r.count, r.cpu, r.mem) for r in requests]
    clk = _Clock(stream, tick, patience)
    queue = clk.queue  # waiting requests, FIFO
    failed: set[tuple[Any, ...]] = set()  # shapes that did not fit since the last tick
    held = 0  # compute slices held
    # per GPU the compute slices in use, and how many GPUs have at least k slices not in use
    gpu_used: dict[tuple[str, int], int] = {}
    at_least = [0] * (COMPUTE_SLICES + 1)
    for node in sched.nodes():
        for g in node.gpus:
            gpu_used[(node.name, g.index)] = 0
    for k in range(COMPUTE_SLICES + 1):
        at_least[k] = len(gpu_used)

    def account(placement: Placement, sign: int) -> None:
        for d in placement.devices:
            if d.mig_profile is None:
                continue
            key = (placement.node, d.gpu_index)
            before = COMPUTE_SLICES - gpu_used[key]
            gpu_used[key] += sign * mig_slices(d.mig_profile)
            after = COMPUTE_SLICES - gpu_used[key]
            for k in range(min(before, after) + 1, max(before, after) + 1):
                at_least[k] += 1 if after > before else -1

    defrag_tried: dict[int, float] = {}  # per waiting head, when it was last defragmented for

    def attempt(i: int, now: float, defragment: bool = False) -> bool:
        nonlocal held
        if shapes[i] in failed and not defragment:
            return False
        dfr = None
        if defragment and defragmenter is not None:
            dfr = defragmenter
            dfr.budget = int(move_share * res.placed_instances) - res.moves
            dfr.refusal = None  # set only if the engine reaches the defragmentation step
        out = sched.schedule(
            Job(i, jobs[i]), preempt=False, repartition=repartition, defrag=dfr, explain=False
        )
        if dfr is not None:
            if dfr.refusal is not None:
                code = dfr.refusal.code
                res.defrag_refused[code] = res.defrag_refused.get(code, 0) + 1
            elif DEFRAG_DETAIL in out.details:
                res.defrag_plans += 1
        if out.placement is None:
            failed.add(shapes[i])
            return False
        for move in out.moves:  # work the defragmenter moved to make room
            account(move.source, -1)
            account(move.target, 1)
            res.moves += 1
            if record_placements and isinstance(move.key, int):
                res.placements[move.key] = move.target
        carved, reparts = mig.instances_changed(out)
        res.carved += carved
        res.repartitions += reparts
        res.accepted += 1
        res.placed_instances += requests[i].count
        res.waits.append(now - stream.items[i].arrival)
        held += slices[i]
        account(out.placement, 1)
        run = clk.runs(i, now, stream.items[i].duration)
        res.compute_hours += slices[i] / COMPUTE_SLICES * run / 3600
        if record_placements:
            res.placements[i] = out.placement
        return True

    def reject(i: int) -> None:
        res.rejected += 1
        free = capacity - held
        res.free_at_rejection.append(free)
        per = slices[i] // max(requests[i].count, 1)
        if free < slices[i]:
            res.rejected_why["capacity"] += 1
        elif at_least[per] == 0:
            res.rejected_why["fragmentation"] += 1
        else:
            res.rejected_why["layout"] += 1

    def retry(now: float) -> None:
        for i in list(queue):
            if attempt(i, now):
                del queue[i]
        defrag_step(now)

    def defrag_step(now: float) -> None:
        """The head waits: let the defragmenter propose moves, apply them, retry."""
        head = next(iter(queue), None)
        last = defrag_tried.get(head) if head is not None else None
        if (
            defragmenter is not None
            and head is not None
            and (last is None or now - last >= DEFRAG_RETRY)
        ):
            defrag_tried[head] = now
            moved = res.moves
            if attempt(head, now, defragment=True):
                del queue[head]
            if res.moves > moved:  # held work moved: what failed before may fit now
                failed.clear()
                for i in list(queue):
                    if attempt(i, now):
                        del queue[i]
        if defrag is not None and queue:
            head = next(iter(queue))
            moves = defrag(sched, head, now)
            for mv in moves:
                h = sched.held.get(mv.key)
                if h is None:
                    raise MigSimError(f"defrag moved {mv.key!r}, which holds nothing")
                sched.hold(replace(h, placement=mv.placement), rank=sched.rank(mv.key))
                account(h.placement, -1)
                account(mv.placement, 1)
                res.moves += 1
            if moves:
                failed.clear()
                for i in list(queue):
                    if attempt(i, now):
                        del queue[i]

    for now, kind, i in clk.due():
        if kind == _DEPART:
            h: Held | None = sched.release(i)
            if h is not None:
                held -= slices[i]
                account(h.placement, -1)
                clk.departed(now)
        elif kind == _EXPIRE:
            if clk.expired(i):
                reject(i)
        elif kind == _TICK:
            if clk.ticked():
                failed.clear()
                retry(now)
        elif not attempt(i, now):
            clk.waits(i, now)
            if len(queue) == 1:
                defrag_step(now)  # it is the head, and it waits
    res.waiting_at_end = len(queue)  # still waiting at the horizon
    res.seconds = round((clock() - t_start) if clock else 0.0, 3)
    return res


# --------------------------------------------------------------------------------------------
# The fragmentation-free reference.

REFERENCE = "fragmentation-free"


def replay_pooled(
    stream: DynamicStream,
    *,
    patience: float = PATIENCE,
    tick: float = TICK,
    clock: Callable[[], float] | None = None,
) -> DynamicResult:
    """The same stream, queue, ticks, patience and horizon as :func:`replay_dynamic`, on a
    cluster that cannot fragment: its MIG compute is one pool of slices, and a request fits
    whenever the pool has its slices free (no GPU boundaries, start slots, memory slices,
    layouts, CPU or memory). No scheduler decides here; it is the reference a placement
    policy's gain is measured against: what is left to win once fragmentation is gone."""
    if patience < 0 or tick <= 0:
        raise MigSimError("patience must be >= 0 and tick > 0")
    t_start = clock() if clock else 0.0
    requests = [t.request for t in stream.items]
    mig.check_requests(requests)
    capacity = sum(n.gpus for n in stream.nodes) * COMPUTE_SLICES
    res = DynamicResult(policy=REFERENCE, capacity_slices=capacity)
    res.requests = sum(1 for r in requests if r.profile is not None)
    slices = [request_slices(r) for r in requests]
    clk = _Clock(stream, tick, patience)
    queue = clk.queue  # waiting requests, FIFO
    failed: set[int] = set()  # sizes (slices) that did not fit since the last tick
    held = 0

    def attempt(i: int, now: float) -> bool:
        nonlocal held
        need = slices[i]
        if need in failed or capacity - held < need:
            failed.add(need)
            return False
        held += need
        res.accepted += 1
        res.placed_instances += requests[i].count
        res.waits.append(now - stream.items[i].arrival)
        run = clk.runs(i, now, stream.items[i].duration)
        res.compute_hours += need / COMPUTE_SLICES * run / 3600
        return True

    for now, kind, i in clk.due():
        if kind == _DEPART:
            held -= slices[i]
            clk.departed(now)
        elif kind == _EXPIRE:
            if clk.expired(i):
                res.rejected += 1
                res.rejected_why["capacity"] += 1
                res.free_at_rejection.append(capacity - held)
        elif kind == _TICK:
            if clk.ticked():
                failed.clear()
                for j in list(queue):
                    if attempt(j, now):
                        del queue[j]
        elif not attempt(i, now):
            clk.waits(i, now)
    res.waiting_at_end = len(queue)
    res.seconds = round((clock() - t_start) if clock else 0.0, 3)
    return res


# --------------------------------------------------------------------------------------------
# Runs and the report.

BASELINE = "first-slot-best-fit"


def run_dynamic(
    pods: list[Pod],
    times: dict[str, tuple[int, int]],
    nodes: list[Node],
    mixes: Sequence[str],
    policies: Sequence[str],
    loads: Sequence[float],
    seeds: Sequence[int],
    *,
    rng: str = "go",
    patience: float = PATIENCE,
    n: int | None = None,
    clock: Callable[[], float] | None = None,
    reference: bool = True,
) -> list[dict[str, Any]]:
    """One record per (mix, load, seed, policy): the stream is built once per (mix, load,
    seed) and replayed under every policy, then (``reference``) on the fragmentation-free
    pool (:func:`replay_pooled`, policy :data:`REFERENCE`)."""
    for p in policies:
        if p not in mig.POLICY_PLUGINS and p not in DEFRAG_POLICIES:
            known = ", ".join([*mig.POLICY_PLUGINS, *DEFRAG_POLICIES])
            raise MigSimError(f"unknown MIG policy {p!r} (known: {known})")
    out = []
    for mix in mixes:
        for load in loads:
            for seed in seeds:
                stream = make_dynamic(mix, pods, times, nodes, seed, load, rng, n)
                for policy in [*policies, *([REFERENCE] if reference else [])]:
                    r = (
                        replay_pooled(stream, patience=patience, clock=clock)
                        if policy == REFERENCE
                        else replay_dynamic(stream, policy, patience=patience, clock=clock)
                    )
                    out.append(
                        {
                            "mix": mix,
                            "load": load,
                            "seed": seed,
                            "policy": policy,
                            "compression": stream.compression,
                            "horizon_s": round(stream.end, 1),
                            **r.summary(),
                        }
                    )
    return out


def dynamic_report(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per mix and load: per policy the seeds' records and mean accepted requests, and each
    policy's accepted requests relative to :data:`BASELINE` (mean over seeds)."""
    doc: dict[str, Any] = {}
    for r in records:
        cell = doc.setdefault(r["mix"], {}).setdefault(f"{round(r['load'] * 100)}%", {})
        cell.setdefault("policies", {}).setdefault(r["policy"], []).append(r)
    for mix in doc.values():
        for cell in mix.values():
            means = {}
            for policy, rs in cell["policies"].items():
                means[policy] = sum(x["accepted"] for x in rs) / len(rs)
            cell["accepted_mean"] = {p: round(v, 1) for p, v in means.items()}
            base = means.get(BASELINE)
            if base:
                cell["accepted_vs_baseline"] = {p: round(v / base, 4) for p, v in means.items()}
    return doc


def definitions() -> dict[str, str]:
    """What the report's numbers mean (also in the README)."""
    return {
        "offered_load": "sum(slices x min(duration, H)) / (MIG compute slices x H), H the "
        "horizon (first to last arrival); arrivals compressed by one factor to reach it",
        "accepted_ratio": "accepted / (GPU requests - still waiting at the horizon)",
        "gpu_compute_hours": "sum over placed instances of compute slices / 7 x hours run",
        "wait": "seconds from arrival to placement, accepted requests",
        "rejected_why": "at each rejection: capacity (free compute in the cluster < asked), "
        "fragmentation (enough in total, no GPU with that much free), layout (a GPU has it "
        "free but not as a placeable instance: start slots, memory slices, idle instances "
        "of other profiles, or its node's CPU/memory)",
        "free_compute_at_rejection_pct_mean": "mean free (not in use) compute at rejections, "
        "% of the cluster's",
        "repartitions": "GPUs whose idle instances were destroyed to make room (running "
        "instances never touched); instances_carved: instances created in free space",
        REFERENCE: "not a policy: the same stream, queue, ticks and patience on a cluster "
        "that cannot fragment (its MIG compute one pool of slices; a request fits whenever the "
        "pool has its slices free); its GPU-compute-hours are what any placement could serve "
        "with no fragmentation at all. Not a bound on accepted requests: the pool also admits "
        "large requests that a fragmented cluster turns away, and their capacity then "
        "refuses later small ones",
        "moves": "defragmentation moves applied (the +defrag policy only: the engine's "
        "defragmenter, every workload counted restartable, at most 2 % of the instances placed "
        "so far); defrag_plans: times it placed the waiting head, defrag_refused: times it "
        "found no plan, per reason (schedule.defrag's codes)",
    }
