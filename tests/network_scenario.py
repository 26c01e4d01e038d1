"""A small, fixed network scenario shared by the network tests (the golden files are rendered
from it): three GPU nodes on an underlay 10.250.0.0/24, two tenants using the same overlay
subnet 10.10.0.0/24 (isolation at L2, not by routing), a third tenant in per-workload mode.

    node     gpu-a: acme w1, acme w2, globex g1
             gpu-b: acme w3, globex g2, initech i1 (its own segment)
             gpu-c: globex g3
"""

from __future__ import annotations

from proofplane.network.desired import (
    Endpoint,
    NetworkIndex,
    NodeNet,
    Segment,
    allocate_ip,
    endpoint_mac,
)
from proofplane.network.policy import NetworkPolicy, parse_policy

NODES = (
    NodeNet("gpu-a", "10.250.0.1", "ul0", ("0x0002c90300a1b2c1",)),
    NodeNet("gpu-b", "10.250.0.2", "ul0", ("0x0002c90300a1b2c2", "0x0002c90300a1b2d2")),
    NodeNet("gpu-c", "10.250.0.3", "ul0", ("0x0002c90300a1b2c3",)),
)
SEGMENTS = (
    Segment("acme", 10000, 0x0001),
    Segment("globex", 10001, 0x0002),
    Segment("initech", 10002, 0x0003, workload="i1"),
)
TENANTS = frozenset({"acme", "globex", "initech"})
PLACEMENTS = (  # (workload, tenant, node)
    ("w1", "acme", "gpu-a"),
    ("w2", "acme", "gpu-a"),
    ("g1", "globex", "gpu-a"),
    ("w3", "acme", "gpu-b"),
    ("g2", "globex", "gpu-b"),
    ("i1", "initech", "gpu-b"),
    ("g3", "globex", "gpu-c"),
)
MANAGEMENT_GUIDS = ("0x0002c90300ffff01",)


def policies() -> dict[str, NetworkPolicy]:
    acme = parse_policy(
        {
            "subnet": "10.10.0.0/24",
            "allow": [
                {"proto": "tcp", "ports": 29500, "source": "tenant"},
                {"proto": "tcp", "ports": "22", "source": "10.10.0.250/32"},
                {"proto": "udp", "ports": [4791, 4792], "source": {"tenant": "acme"}},
                {"proto": "icmp"},
            ],
            "egress": [
                {"proto": "tcp", "ports": 443, "destination": "192.0.2.0/24"},
                {"proto": "udp", "ports": 53, "destination": "2001:db8::/32"},
                {"proto": "any", "destination": "0.0.0.0/0"},
            ],
        },
        tenant="acme",
        known_tenants=TENANTS,
    )
    # globex: the default policy (all traffic inside the tenant); initech: closed inside
    initech = parse_policy({"allow": []}, tenant="initech", known_tenants=TENANTS)
    return {"acme": acme, "initech": initech}


def endpoints() -> list[Endpoint]:
    vni = {s.tenant: s.vni for s in SEGMENTS}
    used: dict[str, set[str]] = {}
    out = []
    for workload, tenant, node in PLACEMENTS:
        ip = allocate_ip("10.10.0.0/24", used.setdefault(tenant, set()))
        used[tenant].add(ip)
        mac = endpoint_mac(tenant, workload)
        out.append(Endpoint(workload, tenant, node, vni[tenant], ip, mac))
    return out


def index() -> NetworkIndex:
    return NetworkIndex(NODES, SEGMENTS, policies(), endpoints())
