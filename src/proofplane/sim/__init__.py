"""Trace-driven placement simulator: replays the Alibaba "openb" GPU trace with the FGD
(USENIX ATC'23) paper's protocol and reports GPU allocation ratios per policy.

Pure core (``gorand``, ``trace``, ``engine``, ``policies``, ``metrics``, ``runner``); file I/O
lives in ``loader`` only.
"""

from proofplane.sim.gorand import GoRand, PyRand, make_rng
from proofplane.sim.runner import (
    DEFAULT_POLICIES,
    DEFAULT_SEEDS,
    POLICIES,
    PolicySummary,
    SeedResult,
    make_policy,
    parse_seeds,
    run_seed,
    summarise,
)
from proofplane.sim.trace import Node, Pod, TypicalPod, build_arrivals, typical_pods

__all__ = [
    "DEFAULT_POLICIES",
    "DEFAULT_SEEDS",
    "POLICIES",
    "GoRand",
    "Node",
    "Pod",
    "PolicySummary",
    "PyRand",
    "SeedResult",
    "TypicalPod",
    "build_arrivals",
    "make_policy",
    "make_rng",
    "parse_seeds",
    "run_seed",
    "summarise",
    "typical_pods",
]
