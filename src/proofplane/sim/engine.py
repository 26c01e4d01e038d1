"""The replay loop (notes §4–§6, §8): one pod at a time, no departures, failed pods dropped.

Speed: a policy's score depends only on the node's own state and the pod's shape
``(cpu, k, m, spec)``, and only the chosen node changes per placement. So every shape keeps a
heap of ``(cost, rank, node, version)`` over its feasible nodes; when a pod of that shape
arrives, only the nodes changed since the shape's last visit are re-scored (stale heap entries
are dropped lazily), and the heap top is the argmax with the smallest-rank tie-break. The
feasibility filters other than memory are monotone (nothing is ever released), so a node that
fails them once is gone for that shape; memory is checked at pop time. Scores are also memoised
per (node state, shape), which makes nodes in identical states cost one evaluation.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Protocol

from proofplane.sim.trace import Arrivals, Node, TypicalPod

Shape = tuple[int, int, int, tuple[str, ...]]  # (cpu, k, m, spec)
# (model, free cpu, free milli per device, free memory, (cpu, memory, GPUs) capacity)
NodeState = tuple[str, int, tuple[int, ...], int, tuple[int, int, int]]


class Policy(Protocol):
    """A placement policy. ``cost`` is compared with ``<``: the smallest cost wins, ties go to
    the node with the smallest rank. ``device`` is the device index for a sharing pod (``k == 1
    and m < 1000``), ignored otherwise (whole-GPU pods take the first ``k`` idle devices).

    ``evaluate`` is only called for feasible nodes and must be a pure function of the node
    state and the pod shape (the engine caches it); ``prepare`` runs once per replay."""

    name: str

    def prepare(self, nodes: list[Node], typical: list[TypicalPod]) -> None: ...

    def evaluate(self, state: NodeState, shape: Shape) -> tuple[Hashable, int]: ...


def feasible(state: NodeState, shape: Shape) -> bool:
    """Notes §6 without the memory check: CPU room, GPU model, device room."""
    model, cpu, gpus = state[0], state[1], state[2]
    p_cpu, k, m, spec = shape
    if cpu < p_cpu:
        return False
    if m > 0:
        if not gpus:
            return False
        if spec and model not in spec:
            return False
        if k == 1:
            return max(gpus) >= m
        return sum(g // m for g in gpus) >= k
    return True


def take_devices(gpus: tuple[int, ...], k: int, m: int) -> list[int]:
    """Device indices a non-sharing GPU pod takes: greedily in index order (for ``m = 1000``,
    the first ``k`` idle GPUs)."""
    out: list[int] = []
    for j, g in enumerate(gpus):
        fits = g // m
        while fits > 0 and len(out) < k:
            out.append(j)
            fits -= 1
        if len(out) == k:
            break
    return out


@dataclass
class ReplayResult:
    arrived: list[int] = field(default_factory=list)  # cumulative arrived GPU milli per event
    used: list[int] = field(default_factory=list)  # allocated GPU milli after each event
    placed: int = 0
    failed: int = 0
    evaluations: int = 0
    final: list[NodeState] = field(default_factory=list)  # node states at the end
    final_mem: list[int] = field(default_factory=list)  # free memory at the end


def replay(arrivals: Arrivals, policy: Policy, typical: list[TypicalPod]) -> ReplayResult:
    """Run one seed's arrival stream through ``policy``; record ``(arrived, used)`` per pod."""
    nodes = arrivals.nodes
    policy.prepare(nodes, typical)
    rank = arrivals.rank
    n_nodes = len(nodes)
    mem = [n.mem for n in nodes]
    gpus: list[list[int]] = [[1000] * n.gpus for n in nodes]
    states: list[NodeState] = [
        (n.model, n.cpu, tuple(g), n.mem, (n.cpu, n.mem, n.gpus))
        for n, g in zip(nodes, gpus, strict=True)
    ]
    version = [0] * n_nodes
    changes: list[int] = []  # node index per placement, in order
    heaps: dict[Shape, tuple[list[tuple[Hashable, int, int, int]], list[int]]] = {}
    memo: dict[tuple[NodeState, Shape], tuple[Hashable, int] | None] = {}
    evaluate: Callable[[NodeState, Shape], tuple[Hashable, int]] = policy.evaluate
    result = ReplayResult()
    arrived_log = result.arrived
    used_log = result.used
    arrived = 0
    used = 0
    evals = 0

    def score(i: int, shape: Shape) -> tuple[Hashable, int] | None:
        nonlocal evals
        st = states[i]
        key = (st, shape)
        hit = memo.get(key, memo)
        if hit is not memo:
            return hit  # type: ignore[return-value]
        out = evaluate(st, shape) if feasible(st, shape) else None
        evals += 1
        memo[key] = out
        return out

    for pod in arrivals.pods:
        shape = pod.shape
        demand = pod.k * pod.m
        arrived += demand
        entry = heaps.get(shape)
        if entry is None:
            heap: list[tuple[Hashable, int, int, int]] = []
            for i in range(n_nodes):
                s = score(i, shape)
                if s is not None:
                    heap.append((s[0], rank[i], i, version[i]))
            heapq.heapify(heap)
            entry = (heap, [len(changes)])
            heaps[shape] = entry
        else:
            heap, pos = entry
            if pos[0] < len(changes):
                for i in set(changes[pos[0] :]):
                    s = score(i, shape)
                    if s is not None:
                        heapq.heappush(heap, (s[0], rank[i], i, version[i]))
                pos[0] = len(changes)
        heap = entry[0]
        chosen = -1
        aside = []
        while heap:
            top = heap[0]
            i = top[2]
            if top[3] != version[i]:
                heapq.heappop(heap)
                continue
            if mem[i] < pod.mem:
                aside.append(heapq.heappop(heap))
                continue
            chosen = i
            break
        for e in aside:
            heapq.heappush(heap, e)
        if chosen < 0:
            result.failed += 1
        else:
            model, cpu, devs, free_mem, cap = states[chosen]
            g = gpus[chosen]
            if demand:
                if pod.k == 1 and pod.m < 1000:
                    s = score(chosen, shape)
                    assert s is not None
                    g[s[1]] -= pod.m
                else:
                    for j in take_devices(devs, pod.k, pod.m):
                        g[j] -= pod.m
            mem[chosen] = free_mem - pod.mem
            states[chosen] = (model, cpu - pod.cpu, tuple(g), free_mem - pod.mem, cap)
            version[chosen] += 1
            changes.append(chosen)
            used += demand
            result.placed += 1
        arrived_log.append(arrived)
        used_log.append(used)
    result.evaluations = evals
    result.final = states
    result.final_mem = mem
    return result
