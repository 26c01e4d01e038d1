"""One replay per (trace, policy, seed) and the summary over seeds: the API the CLI and the
benchmark share. Pure apart from the clock: pods and nodes come in already loaded."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from proofplane.schedule.scoring import SCORERS
from proofplane.sim.engine import ENGINE, replay, scorer_for
from proofplane.sim.gorand import make_rng
from proofplane.sim.metrics import MAX_RATIO, discretise
from proofplane.sim.trace import Node, Pod, build_arrivals, typical_pods

# The policies are the production scheduler's scoring plugins (``schedule.scoring``).
POLICIES: tuple[str, ...] = tuple(SCORERS)
DEFAULT_POLICIES = ("proofplane", "fgd", "best-fit", "first-fit")
DEFAULT_SEEDS = tuple(range(42, 52))
RNG_KINDS = ("go", "python")


def check_policy(name: str) -> str:
    """``name`` if it is a scoring plugin of the production scheduler; ValueError otherwise."""
    if name not in SCORERS:
        known = ", ".join(POLICIES)
        raise ValueError(f"unknown policy {name!r} (known: {known})")
    return name


def parse_seeds(text: str) -> list[int]:
    """``"42-51"``, ``"42"`` or ``"42,45,50-51"`` → seeds; ValueError when malformed."""
    seeds: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            raise ValueError(f"bad seed range {text!r}")
        lo, sep, hi = part.partition("-")
        try:
            a = int(lo)
            b = int(hi) if sep else a
        except ValueError:
            raise ValueError(f"bad seed range {text!r}: expected e.g. 42-51") from None
        if a < 0 or b < a:
            raise ValueError(f"bad seed range {text!r}: need 0 <= first <= last")
        seeds.extend(range(a, b + 1))
    if len(seeds) > 10_000:
        raise ValueError(f"bad seed range {text!r}: too many seeds")
    return seeds


@dataclass
class SeedResult:
    policy: str
    seed: int
    series: list[float | None]
    at_130: float | None
    pods: int
    placed: int
    failed: int
    seconds: float
    engine: str = ENGINE  # the code that placed: the production scheduler
    scorer: str = ""


def run_seed(
    pods: list[Pod],
    nodes: list[Node],
    policy: str,
    seed: int,
    rng: str = "go",
) -> SeedResult:
    """Build the seed's arrival stream (notes §3) and replay it under ``policy``."""
    start = time.perf_counter()
    typical = typical_pods(pods)
    arrivals = build_arrivals(pods, nodes, make_rng(rng, seed))
    result = replay(arrivals, scorer_for(check_policy(policy), typical))
    total_gpus = arrivals.total_gpu_milli // 1000
    series = discretise(result.arrived, result.used, total_gpus)
    return SeedResult(
        policy=policy,
        seed=seed,
        series=series,
        at_130=series[MAX_RATIO] if len(series) > MAX_RATIO else None,
        pods=len(arrivals.pods),
        placed=result.placed,
        failed=result.failed,
        seconds=time.perf_counter() - start,
        scorer=policy,
    )


@dataclass
class PolicySummary:
    policy: str
    mean_at_130: float | None
    per_seed: dict[int, float | None] = field(default_factory=dict)
    series: dict[int, list[float | None]] = field(default_factory=dict)
    seconds: dict[int, float] = field(default_factory=dict)


def summarise(results: Sequence[SeedResult]) -> dict[str, PolicySummary]:
    """Group seed results by policy (first-seen order); ``mean_at_130`` over the seeds."""
    out: dict[str, PolicySummary] = {}
    for r in results:
        s = out.setdefault(r.policy, PolicySummary(policy=r.policy, mean_at_130=None))
        s.per_seed[r.seed] = r.at_130
        s.series[r.seed] = r.series
        s.seconds[r.seed] = round(r.seconds, 3)
    for s in out.values():
        vals = [v for v in s.per_seed.values() if v is not None]
        s.mean_at_130 = round(sum(vals) / len(vals), 4) if vals else None
    return out
