"""Cluster files' network facts (issue 14): a node's own underlay, the demo's simulated one
from a range, tenants' manual segments and network profile, and what is refused."""

from __future__ import annotations

import pytest

from proofplane.errors import ValidationFailed
from proofplane.hardware.cluster_file import parse_cluster, simulated_guid

FILE = """
cluster: lab
network: {simulated_underlay: 10.250.0.0/29}
tenants:
  - name: a
    vni: 20000
    pkey: 0x20
    profile:
      segment: per-workload
      network_policy: {allow: [{proto: tcp, ports: 22}]}
  - name: b
nodes:
  - {name: n1, region: r, zone: z, network: {vtep: 10.250.0.1, underlay_dev: eth1,
     hca_guids: ["0x0002c90300a1b2c3"]}}
  - {name: n2, region: r, zone: z}
  - {name: n3, region: r, zone: z}
"""


def test_underlay_given_and_simulated() -> None:
    spec = parse_cluster(FILE)
    u1, u2, u3 = (ns.underlay for ns in spec.nodes)
    assert u1 is not None and (u1.vtep, u1.underlay_dev, u1.simulated) == ("10.250.0.1", "eth1",
                                                                           False)  # fmt: skip
    # the range's addresses, skipping the one n1 holds
    assert u2 is not None and (u2.vtep, u2.simulated) == ("10.250.0.2", True)
    assert u3 is not None and u3.vtep == "10.250.0.3"
    assert u3.hca_guids == (simulated_guid("n3"),) and simulated_guid("n3") != simulated_guid("n2")
    a, b = spec.tenants
    assert a.profile.segment == "per-workload" and a.profile.network_policy is not None
    assert spec.segments == {"a": (20000, 0x20)}
    assert b.profile.segment == "per-tenant"


def test_no_network_section_no_underlay() -> None:
    spec = parse_cluster("nodes: [{name: n1, region: r, zone: z}]")
    assert spec.nodes[0].underlay is None


@pytest.mark.parametrize(
    "text",
    [
        "network: {simulated_underlay: 10.250.0.0/30}\nnodes: [{name: a, region: r, zone: z}, "
        "{name: b, region: r, zone: z}, {name: c, region: r, zone: z}]",
        "network: {simulated_underlay: not-a-cidr}\nnodes: [{name: a, region: r, zone: z}]",
        "network: {simulated_underlay: 10.250.0.1/24}\nnodes: [{name: a, region: r, zone: z}]",
        "network: {other: 1}",
        "tenants: [{name: a, profile: {segment: per-node}}]",
        "nodes: [{name: a, region: r, zone: z, network: {underlay_dev: eth0}}]",
    ],
)
def test_refused(text: str) -> None:
    with pytest.raises(ValidationFailed) as exc:
        parse_cluster(text)
    assert exc.value.code == "invalid_cluster_file"
