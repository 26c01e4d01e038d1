"""MIG mode of the trace replay (``proofplane sim openb --mig``).

Every GPU of the cluster becomes an H100-80GB in MIG mode (7 compute and 8 memory slices, the
profiles, start slots and validity rules of :mod:`proofplane.hardware.skus`). A request asks for
``count`` instances of one MIG profile on one node: GPU-sharing pods of the openb trace map to
the smallest profile that covers their share (see :func:`profile_for_share`), whole-GPU pods
ask for ``k`` ``7g.80gb`` instances (a full GPU each), CPU-only pods ask for no GPU. Otherwise
the protocol of the openb replay holds: arrival order and 130 % inflation of notes §3, no
departures, CPU and memory feasibility, failed requests dropped, ties to the node's rank.

**Placed by the production core.** Every request goes through
``schedule.engine.Scheduler.schedule`` (the snapshot, its filters and a scoring plugin of
``schedule.scoring``) with a MIG carver of ``schedule.migslots``: a request that fits no free
MIG instance gets new instances carved into the free space of one node's GPUs (running
instances untouched), chosen by the carver, then placed by the snapshot. Policies
(:data:`POLICY_PLUGINS`): ``first-slot-best-fit`` (scorer and carver ``first-slot-best-fit``:
tightest node and GPU, first valid start slot), ``proofplane`` (the production scorer and the
``least-fragmenting`` carver) and, with departures (``sim.dynamic``), ``proofplane+relayout``
(the server's default, ``schedule.policy.server_policy`` with ``PROOFPLANE_MIG_AUTO_LAYOUT=on``:
carving without reclaim, and the engine's on-demand repartitioning of idle GPUs) and
``proofplane+repartition`` (more than the server does: carving that also reclaims idle
instances beside running work, and the repartitioning of idle GPUs). ``sim/`` keeps the streams, the
cluster as values and the counting; no slot or node choice is made here.

Pure: requests and nodes come in as values; nothing here reads files or the clock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from itertools import accumulate
from typing import Any

from proofplane.errors import ProofplaneError
from proofplane.hardware.skus import COMPUTE_SLICES
from proofplane.model import (
    GpuRequest,
    IsolationLevel,
    MigInstance,
    Placement,
)
from proofplane.model import Node as ClusterNode
from proofplane.schedule.engine import Job, Outcome, Scheduler
from proofplane.schedule.migslots import Geometry, LeastFragmenting
from proofplane.schedule.migslots import geometry as sku_geometry
from proofplane.schedule.policy import (
    CARVE,
    RECLAIM,
    Policy,
    build_scheduler,
    server_policy,
)
from proofplane.schedule.scoring import DEFAULT_SCORER
from proofplane.schedule.values import Request
from proofplane.sim import engine
from proofplane.sim.gorand import Rng, make_rng
from proofplane.sim.trace import INFLATION, Node, Pod, build_arrivals

# The code that places in this mode (the replay output names it).
ENGINE = "proofplane.schedule"
SKU_NAME = "H100-80GB"
WHOLE_GPU = "7g.80gb"
TENANT = "openb"
# policy -> its plugins (``schedule.policy.Policy``): scoring plugin, MIG carver, whether carving
# reclaims (destroys idle instances beside running ones), whether the engine re-lays idle GPUs
POLICY_PLUGINS: dict[str, Policy] = {
    "proofplane": Policy("proofplane", "least-fragmenting"),
    "first-slot-best-fit": Policy("first-slot-best-fit", "first-slot-best-fit"),
    # the server with PROOFPLANE_MIG_AUTO_LAYOUT=reclaim
    "proofplane+repartition": server_policy(DEFAULT_SCORER, RECLAIM),
    "first-slot-best-fit+repartition": Policy(
        "first-slot-best-fit", "first-slot-best-fit", reclaim=True, repartition=True
    ),
    # the server's default (PROOFPLANE_MIG_AUTO_LAYOUT=on): carve without reclaim, re-lay
    # idle GPUs
    "proofplane+relayout": server_policy(DEFAULT_SCORER, CARVE),
}
MIG_POLICIES = ("proofplane", "first-slot-best-fit")  # without departures (static)
MIXES = ("openb", "synthetic")

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


def geometry() -> Geometry:
    """The MIG layouts of :data:`SKU_NAME` (``schedule.migslots.geometry``)."""
    return sku_geometry(SKU_NAME)


def profile_index(geo: Geometry, profile: str) -> int:
    i = geo.index(profile)
    if i is None:
        known = ", ".join(p.name for p in geo.profiles)
        raise MigSimError(f"unknown MIG profile {profile!r} (known: {known})")
    return i


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
    limit: int | None = None,
) -> MigStream:
    """A seeded small-slice-heavy stream: requests drawn i.i.d. from ``mix`` (per mille) until
    the next one would push the requested compute slices past ``inflation`` × the cluster's
    compute slices; each asks for ``SYNTHETIC_CPU_PER_SLICE`` milli-cores per compute slice and
    ``SYNTHETIC_MEM_PER_SLICE`` MiB per memory slice. Then the node tie-break permutation.
    ``limit``: exactly that many requests instead (the dynamic replay's stream)."""
    geo = geometry()
    if sum(w for _, w in mix) != 1000:
        raise MigSimError("the synthetic mix must sum to 1000 per mille")
    profs = [geo.profiles[profile_index(geo, name)] for name, _ in mix]
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
        if (limit is None and total + prof.compute_slices > target) or (
            limit is not None and len(requests) >= limit
        ):
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
            i = profile_index(g, r.profile)
            slices[i] += max(r.count, 1) * g.profiles[i].compute_slices
    total = sum(slices)
    if total == 0:
        return [1 / len(slices)] * len(slices)
    return [c / total for c in slices]


# --------------------------------------------------------------------------------------------
# The cluster and the requests as the production scheduler's values.


def cluster_node(node: Node, rank: int) -> ClusterNode:
    """A trace node as ``sim openb`` makes it (``sim.engine.cluster_node``: admitted, its CPU
    and memory, named by its tie-break rank) with its GPUs H100-80GB in MIG mode and no
    instances yet."""
    plain = engine.cluster_node(node, rank)
    gpus = tuple(replace(g, model=SKU_NAME, memory_mb=81_559, mig_enabled=True) for g in plain.gpus)
    return replace(plain, gpus=gpus)


def mig_request(req: MigRequest) -> Request:
    """A MIG request as a placement request (a CPU-only one asks for no GPU)."""
    if req.profile is None:
        gpus = GpuRequest(count=0)
        isolation = IsolationLevel.SHARED
    else:
        gpus = GpuRequest(count=req.count, mig_profile=req.profile)
        isolation = IsolationLevel.MIG
    return Request(req.name, TENANT, {}, isolation, gpus, cpu_milli=req.cpu, memory_mib=req.mem)


def make_scheduler(
    stream: MigStream, policy: str, weights: Sequence[float] | None = None
) -> tuple[Scheduler, bool]:
    """The production scheduler for ``policy`` over ``stream``'s nodes, built as the server
    builds its own (``schedule.policy.build_scheduler``), and whether it may repartition idle
    GPUs. ``weights`` (one per profile of :func:`geometry`) fixes the least-fragmenting
    carver's mix (default: learned from the requests, as in the server)."""
    if policy not in POLICY_PLUGINS:
        raise MigSimError(f"unknown MIG policy {policy!r} (known: {', '.join(POLICY_PLUGINS)})")
    plugins = POLICY_PLUGINS[policy]
    carver = None
    if weights is not None and plugins.carver == "least-fragmenting":
        geo = geometry()
        if len(weights) != len(geo.profiles):
            raise MigSimError(f"need {len(geo.profiles)} weights, one per profile")
        carver = LeastFragmenting({p.name: w for p, w in zip(geo.profiles, weights, strict=True)})
    nodes = [cluster_node(n, r) for n, r in zip(stream.nodes, stream.rank, strict=True)]
    return build_scheduler(plugins, nodes, carver=carver), plugins.repartition


def check_requests(requests: Iterable[MigRequest]) -> None:
    geo = geometry()
    for r in requests:
        if r.profile is not None:
            profile_index(geo, r.profile)
            if r.count < 1:
                raise MigSimError(f"request {r.name!r}: count must be >= 1")


def instances_changed(out: Outcome) -> tuple[int, int]:
    """(instances carved, repartitions) an outcome made: carving adds instances in free space;
    a repartition re-lays an idle GPU."""
    carved = sum(len(r.after) - len(r.before) for r in out.repartitions if r.carved)
    return carved, sum(1 for r in out.repartitions if not r.carved)


def layouts_of(sched: Scheduler) -> dict[str, tuple[tuple[MigInstance, ...], ...]]:
    """Per node name, its GPUs' MIG layouts now."""
    return {n.name: tuple(g.mig_instances for g in n.gpus) for n in sched.nodes()}


# --------------------------------------------------------------------------------------------
# The replay without departures.


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
    carved: int = 0  # MIG instances created
    repartitions: int = 0
    placements: list[Placement | None] = field(default_factory=list)  # per request
    scheduler: Scheduler | None = None

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


def replay_mig(
    stream: MigStream,
    policy: str,
    weights: Sequence[float] | None = None,
    record_placements: bool = False,
) -> MigResult:
    """Replay ``stream`` (no departures, failed requests dropped) through the production
    scheduler under ``policy``."""
    check_requests(stream.requests)
    sched, repartition = make_scheduler(stream, policy, weights)
    geo = geometry()
    res = MigResult(
        policy=policy, capacity_slices=sum(n.gpus for n in stream.nodes) * COMPUTE_SLICES
    )
    res.scheduler = sched
    for prof in geo.profiles:
        res.by_profile[prof.name] = [0, 0]
    for i, req in enumerate(stream.requests):
        need = 0
        if req.profile is None:
            res.cpu_only += 1
        else:
            need = geo.profiles[profile_index(geo, req.profile)].compute_slices * req.count
            res.requests += 1
            res.slices_requested += need
            res.by_profile[req.profile][0] += 1
        out = sched.schedule(Job(i, mig_request(req)), preempt=False, repartition=repartition)
        if record_placements:
            res.placements.append(out.placement)
        if out.placement is None:
            continue
        carved, reparts = instances_changed(out)
        res.carved += carved
        res.repartitions += reparts
        if req.profile is None:
            res.cpu_only_accepted += 1
        else:
            res.accepted += 1
            res.slices_placed += need
            res.by_profile[req.profile][1] += 1
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
        if policy not in POLICY_PLUGINS:
            known = ", ".join(POLICY_PLUGINS)
            raise MigSimError(f"unknown MIG policy {policy!r} (known: {known})")
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
