"""Trace model and the arrival stream of the FGD "openb" protocol (notes §2, §3, §7.3).

Pure: everything here works on rows already read (see :mod:`proofplane.sim.loader`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from proofplane.errors import ProofplaneError
from proofplane.sim.gorand import Rng

INFLATION = 1.3  # "tune": grow (or cut) the stream to 130 % of the cluster's GPU capacity
TYPICAL_COVERAGE = 0.95  # FGD's typical-pod popularity threshold
INFORMER_DRAWS = 10  # Float64() draws of the scheduler's reflectors before the node permutation


class TraceError(ProofplaneError, ValueError):
    """A node or pod row that cannot be read."""

    code = "trace_invalid"


@dataclass(frozen=True, slots=True)
class Node:
    name: str
    cpu: int  # allocatable milli-cores
    mem: int  # MiB
    gpus: int  # devices, 1000 milli each
    model: str


@dataclass(frozen=True, slots=True)
class Pod:
    name: str
    cpu: int  # milli-cores
    mem: int  # MiB
    k: int  # number of GPUs (0 = CPU-only)
    m: int  # milli per GPU (1000 = whole GPU)
    spec: tuple[str, ...] = ()  # allowed GPU models; empty = any

    @property
    def gpu_milli(self) -> int:
        """Total GPU demand ``k·m``."""
        return self.k * self.m

    @property
    def shape(self) -> tuple[int, int, int, tuple[str, ...]]:
        """What scoring depends on: ``(cpu, k, m, spec)`` (memory is a filter only)."""
        return (self.cpu, self.k, self.m, self.spec)


@dataclass(frozen=True, slots=True)
class TypicalPod:
    cpu: int
    m: int
    k: int
    spec: tuple[str, ...]
    count: int
    weight: float  # f_t, the weights sum to 1


def _int(row: Mapping[str, str], col: str, what: str) -> int:
    raw = row.get(col)
    if raw is None:
        raise TraceError(f"{what}: missing column {col!r}")
    try:
        return int(float(raw)) if raw.strip() not in ("", "NaN", "nan") else 0
    except ValueError:
        raise TraceError(f"{what}: column {col!r} is not a number: {raw!r}") from None


def parse_nodes(rows: Iterable[Mapping[str, str]]) -> list[Node]:
    """Rows of ``sn,cpu_milli,memory_mib,gpu,model`` → nodes."""
    nodes = []
    for i, row in enumerate(rows):
        what = f"node row {i + 1}"
        name = (row.get("sn") or "").strip()
        if not name:
            raise TraceError(f"{what}: empty 'sn'")
        gpus = _int(row, "gpu", what)
        if gpus < 0:
            raise TraceError(f"{what}: negative gpu count")
        nodes.append(
            Node(
                name=name,
                cpu=_int(row, "cpu_milli", what),
                mem=_int(row, "memory_mib", what),
                gpus=gpus,
                model=(row.get("model") or "").strip(),
            )
        )
    if not nodes:
        raise TraceError("the node list is empty")
    return nodes


def parse_pods(rows: Iterable[Mapping[str, str]]) -> list[Pod]:
    """Rows of the pod CSV → pods, with the converter's rules (notes §2): GPU fields only when
    ``num_gpu != 0``, ``gpu_milli`` clamped to (0, 1000], spec tokens split on ``|``."""
    pods = []
    for i, row in enumerate(rows):
        what = f"pod row {i + 1}"
        name = (row.get("name") or "").strip()
        if not name:
            raise TraceError(f"{what}: empty 'name'")
        k = _int(row, "num_gpu", what)
        if k < 0:
            raise TraceError(f"{what}: negative num_gpu")
        m = 0
        spec: tuple[str, ...] = ()
        if k != 0:
            raw_m = _int(row, "gpu_milli", what)
            m = raw_m if 0 < raw_m <= 1000 else (1000 if raw_m > 1000 else 0)
            raw_spec = (row.get("gpu_spec") or "").strip()
            if raw_spec.lower() != "nan":
                spec = tuple(t for t in (s.strip() for s in raw_spec.split("|")) if t)
        pods.append(
            Pod(
                name=name,
                cpu=_int(row, "cpu_milli", what),
                mem=_int(row, "memory_mib", what),
                k=k,
                m=m,
                spec=spec,
            )
        )
    if not pods:
        raise TraceError("the pod list is empty")
    return pods


def typical_pods(pods: Iterable[Pod], coverage: float = TYPICAL_COVERAGE) -> list[TypicalPod]:
    """FGD's workload model: the most popular shapes ``(cpu, m, k, spec)`` of the original
    pods until their cumulative count reaches ``coverage``, weights renormalised to sum to 1.
    Ties in popularity are broken by the shape, descending."""
    pods = list(pods)
    total = len(pods)
    counts = Counter((p.cpu, p.m, p.k, p.spec) for p in pods)
    ordered = sorted(counts.items(), key=lambda kv: (kv[1], kv[0]), reverse=True)
    chosen: list[tuple[tuple[int, int, int, tuple[str, ...]], int]] = []
    cum = 0
    for shape, count in ordered:
        chosen.append((shape, count))
        cum += count
        if cum / total >= coverage:
            break
    share = cum / total
    return [
        TypicalPod(cpu=s[0], m=s[1], k=s[2], spec=s[3], count=c, weight=(c / total) / share)
        for s, c in chosen
    ]


@dataclass(frozen=True, slots=True)
class Arrivals:
    """The replay input of one seed: pods in arrival order and each node's tie-break rank."""

    pods: list[Pod]
    nodes: list[Node]  # sorted by name
    rank: list[int]  # rank[i] of nodes[i]; among equal scores the smallest rank wins
    originals: int  # how many of ``pods`` are original (the rest are inflation clones)
    total_gpu_milli: int


def build_arrivals(
    pods: list[Pod], nodes: list[Node], rng: Rng, inflation: float = INFLATION
) -> Arrivals:
    """Notes §3, in this exact order: one discarded draw, shuffle of the name-sorted pods,
    inflation to ``inflation`` × GPU capacity (clones appended, or random removals), ten
    discarded draws, then the node permutation that fixes the tie-break rank."""
    rng.int63()
    by_name = sorted(pods, key=lambda p: p.name.encode())
    stream = list(by_name)
    rng.shuffle(stream)
    capacity = sum(n.gpus for n in nodes) * 1000
    target = inflation * capacity
    total = sum(p.gpu_milli for p in stream)
    originals = len(stream)
    if total < target:
        clones = 0
        while True:
            q = by_name[rng.intn(len(by_name))]
            if total + q.m > target:  # the protocol tests the per-GPU milli, not k·m
                break
            clones += 1
            stream.append(replace(q, name=f"{q.name}-clone-{clones}"))
            total += q.gpu_milli
    elif total > target:
        while total > target:
            gone = stream.pop(rng.intn(len(stream)))
            total -= gone.gpu_milli
        originals = len(stream)
    for _ in range(INFORMER_DRAWS):
        rng.int63()
    sorted_nodes = sorted(nodes, key=lambda n: n.name.encode())
    rank = rng.perm(len(sorted_nodes))
    return Arrivals(
        pods=stream,
        nodes=sorted_nodes,
        rank=rank,
        originals=originals,
        total_gpu_milli=capacity,
    )
