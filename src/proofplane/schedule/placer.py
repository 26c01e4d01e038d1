"""Placement as one call: filter → score → choose, pure and explainable.

Each filter enforces one rule and answers with a reason code (``schedule.reasons``), so a
pending workload can say how many nodes each rule rejected (kube-scheduler's framework, in
miniature). Rule 5 of the house holds here: if no node satisfies a workload's compliance tags,
the answer is "pending", never a weaker node.

``place`` builds a ``ClusterSnapshot`` from the nodes and allocations it is given and asks it
once. Callers that decide again and again (the service's ``ClusterView``, the benchmark) keep a
snapshot and update it by deltas instead; the answers are the same.
"""

from __future__ import annotations

from collections.abc import Iterable

from proofplane.model import Node
from proofplane.schedule.reasons import COMPLIANCE_FILTERS
from proofplane.schedule.snapshot import ClusterSnapshot
from proofplane.schedule.values import FULL_GPU_MILLI, Allocation, Decision, Request

__all__ = [
    "COMPLIANCE_FILTERS",
    "FULL_GPU_MILLI",
    "Allocation",
    "Decision",
    "Request",
    "place",
]


def place(req: Request, nodes: Iterable[Node], allocations: Iterable[Allocation]) -> Decision:
    """Choose a node and devices for ``req``, or explain why none qualifies."""
    return ClusterSnapshot(nodes, dict(enumerate(allocations))).place(req)
