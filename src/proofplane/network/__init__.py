"""Network segmentation per tenant (pure): segment pools, policies, per-node desired state.

* :mod:`~proofplane.network.segments`: VNI and PKey pools with a cool-down;
* :mod:`~proofplane.network.policy`: a tenant's network policy, validated and canonical;
* :mod:`~proofplane.network.desired`: each node's desired state from placements, incremental;
* :mod:`~proofplane.network.render`: iproute2/bridge batches with a diff against the running
  state, the nftables ruleset, OpenSM ``partitions.conf`` (and its parser).

No I/O here: the services persist, the agent applies (``proofplane.agent.network``).
"""

from proofplane.network.desired import (
    Endpoint,
    NetworkIndex,
    NodeDesired,
    NodeNet,
    NodeSegment,
    Segment,
    SubnetExhausted,
    allocate_ip,
    compute_all,
    desired_from_json,
    desired_to_json,
    endpoint_mac,
)
from proofplane.network.policy import (
    DEFAULT_POLICY,
    AllowRule,
    CrossTenantRule,
    EgressRule,
    InvalidNetworkPolicy,
    NetworkPolicy,
    UnknownTenant,
    parse_policy,
    policy_sha256,
    policy_to_json,
)
from proofplane.network.segments import (
    InvalidSegment,
    SegmentInUse,
    SegmentPoolExhausted,
    check_manual,
    next_free,
    parse_pool,
)

__all__ = [
    "DEFAULT_POLICY",
    "AllowRule",
    "CrossTenantRule",
    "EgressRule",
    "Endpoint",
    "InvalidNetworkPolicy",
    "InvalidSegment",
    "NetworkIndex",
    "NetworkPolicy",
    "NodeDesired",
    "NodeNet",
    "NodeSegment",
    "Segment",
    "SegmentInUse",
    "SegmentPoolExhausted",
    "SubnetExhausted",
    "UnknownTenant",
    "allocate_ip",
    "check_manual",
    "compute_all",
    "desired_from_json",
    "desired_to_json",
    "endpoint_mac",
    "next_free",
    "parse_policy",
    "parse_pool",
    "policy_sha256",
    "policy_to_json",
]
