"""Trace-driven placement simulator: replays the Alibaba "openb" GPU trace with the FGD
(USENIX ATC'23) paper's protocol and reports GPU allocation ratios per policy.

The placing is the production scheduler's (``proofplane.schedule``: ``sim.engine`` turns the
trace into a cluster and a request stream and runs ``Scheduler.schedule``); ``sim/`` keeps the
protocol (``gorand``, ``trace``), the metrics and the runner. File I/O lives in ``loader`` only.
"""

from proofplane.sim.gorand import GoRand, PyRand, make_rng
from proofplane.sim.runner import (
    DEFAULT_POLICIES,
    DEFAULT_SEEDS,
    POLICIES,
    PolicySummary,
    SeedResult,
    check_policy,
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
    "check_policy",
    "make_rng",
    "parse_seeds",
    "run_seed",
    "summarise",
    "typical_pods",
]
