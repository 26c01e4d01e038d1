"""The replay loop (notes §4–§6, §8), run by the production placement core.

One pod at a time, no departures, failed pods dropped, exactly as the protocol says; but the
placing is not the simulator's: every pod becomes a ``schedule.values.Request`` and goes
through ``schedule.engine.Scheduler.schedule`` (the snapshot, the filters and the scoring
plugin the server runs), and the placement it returns is held in that scheduler. ``sim/``
keeps only what is the protocol's: the nodes and pods as a cluster and a request stream, the
tie-break rank (as the node names: ``"r%04d-" % rank + name``, the smallest name wins a tie in
the snapshot as the smallest rank does in the protocol) and the ``(arrived, used)`` log.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from proofplane.model import Gpu, GpuRequest, IsolationLevel, Node, NodeState, Placement
from proofplane.schedule.engine import Job, Scheduler
from proofplane.schedule.scoring import Scorer, Typical, WorkloadMix, make_scorer
from proofplane.schedule.values import MODEL_SEPARATOR, Request
from proofplane.sim.trace import Arrivals, Pod, TypicalPod
from proofplane.sim.trace import Node as TraceNode

ENGINE = "proofplane.schedule"  # what the replay output names as the code that placed
TENANT = "openb"


def cluster_node(node: TraceNode, rank: int) -> Node:
    """A trace node as an admitted cluster node: its GPUs as plain (non-MIG) GPUs of its
    model, its CPU and memory as capacities, named by its tie-break rank."""
    name = f"r{rank:04d}-{node.name}"
    return Node(
        name=name,
        region="openb",
        zone="openb",
        state=NodeState.ADMITTED,
        gpus=tuple(Gpu(i, f"{name}/{i}", node.model, 0) for i in range(node.gpus)),
        cpu_milli=node.cpu,
        memory_mib=node.mem,
    )


def pod_request(pod: Pod) -> Request:
    """A trace pod as a placement request: ``k`` whole GPUs, or a share of one GPU
    (``k == 1, m < 1000``), or no GPU; its ``gpu_spec`` as the GPU model filter."""
    model = MODEL_SEPARATOR.join(pod.spec) if pod.spec else None
    if pod.k == 1 and 0 < pod.m < 1000:
        gpus = GpuRequest(count=1, model=model, share_milli=pod.m)
        isolation = IsolationLevel.SHARED
    else:
        gpus = GpuRequest(count=pod.k if pod.m > 0 else 0, model=model)
        isolation = IsolationLevel.EXCLUSIVE_GPU
    return Request(pod.name, TENANT, {}, isolation, gpus, cpu_milli=pod.cpu, memory_mib=pod.mem)


def protocol_mix(typical: list[TypicalPod]) -> WorkloadMix:
    """The protocol's typical pods (notes §7.3) as a fixed workload mix, in their order."""
    return WorkloadMix(
        fixed=[
            Typical(
                t.cpu,
                t.k,
                t.m,
                frozenset(t.spec) if t.spec else None,
                None,
                t.weight,
            )
            for t in typical
        ]
    )


def scorer_for(policy: str, typical: list[TypicalPod]) -> Scorer:
    """The scoring plugin a policy name selects. ``fgd`` uses the protocol's typical pods (the
    paper's setting); ``proofplane`` learns its mix from the stream, as the server does."""
    if policy == "fgd":
        return make_scorer(policy, protocol_mix(typical))
    return make_scorer(policy)


@dataclass
class ReplayResult:
    arrived: list[int] = field(default_factory=list)  # cumulative arrived GPU milli per event
    used: list[int] = field(default_factory=list)  # allocated GPU milli after each event
    placed: int = 0
    failed: int = 0
    placements: list[Placement | None] = field(default_factory=list)  # per pod, in order
    scheduler: Scheduler | None = None


def replay(arrivals: Arrivals, scorer: Scorer) -> ReplayResult:
    """Run one seed's arrival stream through the production scheduler with ``scorer``."""
    nodes = [cluster_node(n, r) for n, r in zip(arrivals.nodes, arrivals.rank, strict=True)]
    sched = Scheduler(nodes, scorer=scorer)
    result = ReplayResult(scheduler=sched)
    arrived = 0
    used = 0
    for i, pod in enumerate(arrivals.pods):
        demand = pod.k * pod.m
        arrived += demand
        out = sched.schedule(Job(i, pod_request(pod)), preempt=False, repartition=False)
        if out.placement is None:
            result.failed += 1
        else:
            result.placed += 1
            used += demand
        result.placements.append(out.placement)
        result.arrived.append(arrived)
        result.used.append(used)
    return result
