"""The network errors answer with the statuses issue 14 asks for (api.errors.STATUS)."""

from __future__ import annotations

from proofplane.api.errors import STATUS, is_answer, status_for
from proofplane.network.desired import SubnetExhausted
from proofplane.network.policy import CrossTenantRule, InvalidNetworkPolicy, UnknownTenant
from proofplane.network.render.partitions import PartitionsSyntaxError
from proofplane.network.segments import InvalidSegment, SegmentInUse, SegmentPoolExhausted


def test_statuses_and_codes() -> None:
    want = {
        SegmentPoolExhausted: (409, "segment_pool_exhausted"),
        SegmentInUse: (409, "segment_in_use"),
        SubnetExhausted: (409, "subnet_exhausted"),
        InvalidSegment: (422, "invalid_segment"),
        InvalidNetworkPolicy: (422, "invalid_network_policy"),
        UnknownTenant: (422, "unknown_tenant"),
        CrossTenantRule: (403, "cross_tenant_rule"),
        PartitionsSyntaxError: (422, "invalid_partitions"),
    }
    for cls, (status, code) in want.items():
        assert is_answer(cls) and status_for(cls) == status and cls.code == code, cls
        assert cls in STATUS or cls is PartitionsSyntaxError
