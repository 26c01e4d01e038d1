"""Every reason code placement can answer with, and what it means (rule 8: every "no" explains
itself with a code a program can match and a message a human can act on).

kube-scheduler's framework has each plugin declare its status codes beside its Filter. Here the
codes live in this one table, each entry naming the filter (or the step) that says it, so the
filters (``schedule.fit``, ``schedule.snapshot``), the scanning reference
(``schedule.reference``), the engine (``schedule.engine``), the explainer
(``schedule.explain``) and the services that persist decisions all cite the same constants
and render the same messages. No other module spells a reason code out
(``tests/schedule/test_schedule_reasons.py`` holds the code base to that).

Three kinds of codes:

* ``filter``: a per-node rejection. A pending workload's ``rejections`` (and the explainer's
  ``filters``) count the nodes under the first filter that rejected each, in the pipeline's
  order: ``node_not_admitted``, ``missing_certification``, ``network_not_applied``, tenancy
  (``node_dedicated_to_other_tenant``, ``node_shared_with_other_tenant``),
  ``gpu_model_unavailable``, ``insufficient_cpu``, ``insufficient_memory``,
  ``insufficient_gpu_capacity``; plus ``gang_node_taken`` (a node an
  earlier member of the same gang took) and the quota PreFilter's ``quota_exceeded`` (every
  node alike).
* ``pending``: why a workload waits after a decision (``Workload.reason``), with the message
  in ``reason_details["message"]``: ``no_compliant_capacity``, ``insufficient_capacity``,
  ``quota_exceeded``, ``topology_unsatisfiable`` (a gang that requires one topology domain).
* ``evicted`` / ``ended``: why a workload lost its placement (``preempted``,
  ``certification_revoked``, ``node_<state>``, ``backend_unavailable``) or ended
  (``cancelled``); ``defragmentation``: moved, and placed again at once (issue 17 §3).

The codes and messages are an interface: users' scripts match them. Change neither.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

from proofplane.model import NodeState

Kind = Literal["filter", "pending", "evicted", "ended"]

# --- per-node filters, in the pipeline's order --------------------------------------------------
NODE_NOT_ADMITTED = "node_not_admitted"
MISSING_CERTIFICATION = "missing_certification"
NETWORK_NOT_APPLIED = "network_not_applied"
NODE_DEDICATED_TO_OTHER_TENANT = "node_dedicated_to_other_tenant"
NODE_SHARED_WITH_OTHER_TENANT = "node_shared_with_other_tenant"
GPU_MODEL_UNAVAILABLE = "gpu_model_unavailable"
INSUFFICIENT_CPU = "insufficient_cpu"
INSUFFICIENT_MEMORY = "insufficient_memory"
INSUFFICIENT_GPU_CAPACITY = "insufficient_gpu_capacity"
GANG_NODE_TAKEN = "gang_node_taken"
# --- why a workload waits -----------------------------------------------------------------------
QUOTA_EXCEEDED = "quota_exceeded"  # also the quota PreFilter's per-node code
NO_COMPLIANT_CAPACITY = "no_compliant_capacity"
INSUFFICIENT_CAPACITY = "insufficient_capacity"
TOPOLOGY_UNSATISFIABLE = "topology_unsatisfiable"  # issue 17 §4
# --- why a workload lost its placement, or ended ------------------------------------------------
PREEMPTED = "preempted"
CERTIFICATION_REVOKED = "certification_revoked"
NODE_QUARANTINED = "node_quarantined"
NODE_FAILED = "node_failed"
NODE_DECOMMISSIONED = "node_decommissioned"
BACKEND_UNAVAILABLE = "backend_unavailable"
GPU_UNHEALTHY = "gpu_unhealthy"  # issue 15: the GPU it held was lost (XID, ECC)
IDLE_RECLAIMED = "idle_reclaimed"  # issue 15: its tenant's idle policy took the capacity back
DEFRAGMENTATION = "defragmentation"  # issue 17 §3: moved to free a MIG region (and re-placed)
CANCELLED = "cancelled"


@dataclass(frozen=True, slots=True)
class Reason:
    """One reason code. ``filter``: the filter whose per-node rejections carry it (None: not a
    node rejection). ``template``: the message that goes with it as a workload's reason
    (``str.format`` fields; None where the message is someone else's words, as the execution
    engine's error for ``backend_unavailable``)."""

    code: str
    kind: Kind
    meaning: str
    filter: str | None = None
    template: str | None = None

    def message(self, **fields: object) -> str:
        """The message for this reason, with ``fields`` filled into its template."""
        if self.template is None:
            raise ValueError(f"reason {self.code!r} has no message template")
        return self.template.format(**fields)


_ENTRIES = (
    Reason(
        NODE_NOT_ADMITTED,
        "filter",
        "the node is not admitted (registered, cordoned, quarantined, failed or decommissioned)",
        filter="admitted",
    ),
    Reason(
        MISSING_CERTIFICATION,
        "filter",
        "the node is not certified for every compliance tag the workload carries",
        filter="certified",
    ),
    Reason(
        NETWORK_NOT_APPLIED,
        "filter",
        "the node's agent has not yet applied the network segment of the workload (issue 14: a "
        "node under network management takes new work of a segment only once it applied it)",
        filter="network",
    ),
    Reason(
        NODE_DEDICATED_TO_OTHER_TENANT,
        "filter",
        "the node is dedicated to another tenant's workload",
        filter="tenancy",
    ),
    Reason(
        NODE_SHARED_WITH_OTHER_TENANT,
        "filter",
        "the workload needs a dedicated node and another tenant already uses this one",
        filter="tenancy",
    ),
    Reason(
        GPU_MODEL_UNAVAILABLE,
        "filter",
        "the node has no GPU of the model the workload asks for",
        filter="gpu_model",
    ),
    Reason(
        INSUFFICIENT_CPU,
        "filter",
        "the node has not enough free CPU (milli-cores) for the workload's cpu_milli now",
        filter="cpu",
    ),
    Reason(
        INSUFFICIENT_MEMORY,
        "filter",
        "the node has not enough free memory (MiB) for the workload's memory_mib now",
        filter="memory",
    ),
    Reason(
        INSUFFICIENT_GPU_CAPACITY,
        "filter",
        "the node has not enough free GPUs, MIG instances or GPU share for the workload now",
        filter="capacity",
    ),
    Reason(
        GANG_NODE_TAKEN,
        "filter",
        "an earlier member of the same gang took the node (a gang's members need distinct nodes)",
        filter="gang",
    ),
    Reason(
        QUOTA_EXCEEDED,
        "pending",
        "the tenant's holdings plus the workload would exceed its quota (every node alike)",
        filter="quota",
        template="tenant {tenant!r} quota would be exceeded ({what})",
    ),
    Reason(
        NO_COMPLIANT_CAPACITY,
        "pending",
        "no node is admitted and certified for the workload's compliance tags: it waits rather "
        "than run on a weaker node",
        template="none of {total} nodes is admitted and certified for {tags}",
    ),
    Reason(
        INSUFFICIENT_CAPACITY,
        "pending",
        "compliant nodes exist but none can take the workload now (the rejection counts say "
        "which filter refused how many)",
        template="{compliant} node(s) are admitted and certified, none can take it now "
        "({blocking})",
    ),
    Reason(
        TOPOLOGY_UNSATISFIABLE,
        "pending",
        "the gang requires all its members in one topology domain (rack, NVLink domain, …) and "
        "no domain has enough compliant nodes free now, though the cluster as a whole might",
        template="a gang of {nodes} nodes requires one {level}; it would fit across several, but "
        "no {level} has {nodes} compliant nodes free now (at most {most})",
    ),
    Reason(
        PREEMPTED,
        "evicted",
        "a higher-priority workload of the same compliance pool took its capacity",
        template="preempted by {by} (priority {priority} > {victim_priority}, same compliance "
        "pool {pool})",
    ),
    Reason(
        CERTIFICATION_REVOKED,
        "evicted",
        "its node no longer holds a certification the workload's tags require",
        template="node {node} no longer certified for {lost}",
    ),
    Reason(
        NODE_QUARANTINED,
        "evicted",
        "its node was quarantined (for instance, a failed attestation)",
        template="node {node} is {state}",
    ),
    Reason(
        NODE_FAILED,
        "evicted",
        "its node failed",
        template="node {node} is {state}",
    ),
    Reason(
        NODE_DECOMMISSIONED,
        "evicted",
        "its node was decommissioned",
        template="node {node} is {state}",
    ),
    Reason(
        BACKEND_UNAVAILABLE,
        "evicted",
        "the execution engine could not be reached to start it; a later sync retries",
    ),
    Reason(
        GPU_UNHEALTHY,
        "evicted",
        "a GPU it held failed (a fatal XID error, an uncorrectable ECC error): the GPU is "
        "drained and the workload is re-placed only where its tags hold",
        template="GPU {gpu} on node {node} failed: {why}",
    ),
    Reason(
        IDLE_RECLAIMED,
        "evicted",
        "it held its devices idle (utilisation below its tenant's threshold over the whole "
        "window) and its tenant's idle policy reclaims idle preemptible work",
        template="idle: peak utilisation {peak:.3f} < {threshold:g} over {minutes:g} min "
        "(tenant {tenant!r} idle policy: reclaim)",
    ),
    Reason(
        DEFRAGMENTATION,
        "evicted",
        "defragmentation moved it (it was idle, or declares itself restartable) to free a MIG "
        "region for a waiting workload of its compliance pool; it was placed again at once, "
        "on a node its tags allow",
        template="moved from {source} to {target} by defragmentation, to free a {profile} "
        "region for {by}",
    ),
    Reason(
        CANCELLED,
        "ended",
        "it was cancelled",
        template="cancelled by {actor}",
    ),
)

#: Every reason code, with its entry.
REASONS: Mapping[str, Reason] = MappingProxyType({r.code: r for r in _ENTRIES})

#: The codes per-node filters reject with, in the pipeline's order.
FILTER_CODES: tuple[str, ...] = tuple(r.code for r in _ENTRIES if r.filter is not None)

#: Filters whose rejections mean "this node may never host this workload" (as opposed to "not
#: enough free capacity right now").
COMPLIANCE_FILTERS: frozenset[str] = frozenset({NODE_NOT_ADMITTED, MISSING_CERTIFICATION})

#: The reason a workload is evicted with when its node moves to a state that keeps no work.
EVICTED_BY_NODE_STATE: Mapping[NodeState, str] = MappingProxyType(
    {
        NodeState.QUARANTINED: NODE_QUARANTINED,
        NodeState.FAILED: NODE_FAILED,
        NodeState.DECOMMISSIONED: NODE_DECOMMISSIONED,
    }
)

#: One item of a ``quota_exceeded`` message (``what``), per quota dimension exceeded.
QUOTA_ITEM = "{kind}: {used:g} used + {requested:g} asked > {limit}"

#: A gang's message when not every member finds a node; ``message`` is the member's decision's.
GANG_TEMPLATE = (
    "a gang of {nodes} nodes x {per_node} GPUs: only {placed} node(s) can take a member ({message})"
)

#: Added to a pending message when nodes that would take the workload wait for its network.
NETWORK_NOTE = "{message}; {nodes} more node(s) wait for their agent to apply its network segment"

#: Added to a capacity message when the workload's tenant refuses GPU co-residency.
CO_RESIDENCY_NOTE = (
    "{message}; its tenant refuses GPU co-residency, so GPUs holding another tenant's MIG "
    "slices or shares are closed to it"
)


def template(code: str) -> str:
    """The message template of reason ``code`` (for a caller that formats it on a hot path)."""
    text = REASONS[code].template
    if text is None:
        raise ValueError(f"reason {code!r} has no message template")
    return text


def render(code: str, **fields: object) -> str:
    """The message of reason ``code`` with ``fields`` filled into its template."""
    return REASONS[code].message(**fields)


def blocking(rejections: Mapping[str, int]) -> str:
    """The capacity rejections of an ``insufficient_capacity`` message: ``code on n``, by code,
    compliance filters left out (they are not what blocks a compliant workload)."""
    return ", ".join(
        f"{code} on {n}" for code, n in sorted(rejections.items()) if code not in COMPLIANCE_FILTERS
    )


def node_left_service(node: str, state: NodeState, why: str | None) -> tuple[str, str]:
    """(reason, message) for work evicted because ``node`` moved to ``state``."""
    code = EVICTED_BY_NODE_STATE[state]
    text = render(code, node=node, state=state.value)
    return code, text + (f": {why}" if why else "")
