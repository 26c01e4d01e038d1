"""Tenant network policies: validation (every bad input), canonical form, hash."""

from __future__ import annotations

from typing import Any

import pytest

from proofplane.network.policy import (
    DEFAULT_POLICY,
    MAX_RULES,
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

KNOWN = frozenset({"acme", "globex"})


def parse(data: Any) -> NetworkPolicy:
    return parse_policy(data, tenant="acme", known_tenants=KNOWN)


def test_default_policy_is_all_inside_the_tenant() -> None:
    assert parse(None) == DEFAULT_POLICY
    assert parse({}) == DEFAULT_POLICY  # no allow: the default allow
    assert DEFAULT_POLICY.allow == (AllowRule("any", None, "tenant"),)
    assert DEFAULT_POLICY.subnet == "10.10.0.0/24" and DEFAULT_POLICY.egress == ()
    closed = parse({"allow": []})
    assert closed.allow == () and closed != DEFAULT_POLICY


def test_a_policy_parses_to_its_canonical_form() -> None:
    p = parse(
        {
            "subnet": "10.20.0.0/16",
            "allow": [
                {"proto": "tcp", "ports": 29500, "source": "tenant"},
                {"proto": "tcp", "ports": "22", "source": "10.20.0.250/32"},
                {"proto": "tcp", "ports": "8000-8080"},
                {"proto": "udp", "ports": [53, 53], "source": {"tenant": "acme"}},
                {"proto": "icmp", "source": "fd00::/64"},
                {"proto": "tcp", "ports": 29500},  # a duplicate
            ],
            "egress": [{"proto": "any", "destination": "0.0.0.0/0"}],
        }
    )
    assert p.subnet == "10.20.0.0/16"
    assert p.allow == (
        AllowRule("icmp", None, "fd00::/64"),
        AllowRule("tcp", (22, 22), "10.20.0.250/32"),
        AllowRule("tcp", (8000, 8080), "tenant"),
        AllowRule("tcp", (29500, 29500), "tenant"),
        AllowRule("udp", (53, 53), "tenant"),  # the own tenant by name is "tenant"
    )
    assert p.egress == (EgressRule("any", None, "0.0.0.0/0"),)
    # round trip through the JSON form, and the hash does not depend on the spelling
    assert parse(policy_to_json(p)) == p
    reordered = policy_to_json(p)
    reordered["allow"].reverse()
    assert policy_sha256(parse(reordered)) == policy_sha256(p)
    assert policy_sha256(p) != policy_sha256(DEFAULT_POLICY)
    assert len(policy_sha256(p)) == 64


BAD: list[tuple[str, Any]] = [
    ("not an object", ["tcp"]),
    ("unknown key", {"allow": [], "deny": []}),
    ("subnet not a string", {"subnet": 10}),
    ("subnet garbage", {"subnet": "10.10.0/24"}),
    ("subnet host bits", {"subnet": "10.10.0.1/24"}),
    ("subnet too small", {"subnet": "10.10.0.0/31"}),
    ("subnet IPv6", {"subnet": "fd00::/64"}),
    ("allow not a list", {"allow": {"proto": "tcp"}}),
    ("rule not an object", {"allow": ["tcp 22"]}),
    ("rule unknown key", {"allow": [{"proto": "tcp", "port": 22}]}),
    ("rule without proto", {"allow": [{"ports": 22}]}),
    ("bad proto", {"allow": [{"proto": "sctp"}]}),
    ("port 0", {"allow": [{"proto": "tcp", "ports": 0}]}),
    ("port 65536", {"allow": [{"proto": "tcp", "ports": 65536}]}),
    ("port negative", {"allow": [{"proto": "udp", "ports": -1}]}),
    ("port bool", {"allow": [{"proto": "tcp", "ports": True}]}),
    ("port float", {"allow": [{"proto": "tcp", "ports": 22.0}]}),
    ("port text", {"allow": [{"proto": "tcp", "ports": "ssh"}]}),
    ("port range reversed", {"allow": [{"proto": "tcp", "ports": "90-80"}]}),
    ("port range open", {"allow": [{"proto": "tcp", "ports": "80-"}]}),
    ("port list of three", {"allow": [{"proto": "tcp", "ports": [1, 2, 3]}]}),
    ("port list of text", {"allow": [{"proto": "tcp", "ports": ["1", "2"]}]}),
    ("ports on icmp", {"allow": [{"proto": "icmp", "ports": 8}]}),
    ("ports on any", {"allow": [{"proto": "any", "ports": 22}]}),
    ("source garbage", {"allow": [{"proto": "tcp", "source": "bastion"}]}),
    ("source host bits", {"allow": [{"proto": "tcp", "source": "10.0.0.1/8"}]}),
    ("source number", {"allow": [{"proto": "tcp", "source": 10}]}),
    ("source tenant object", {"allow": [{"proto": "tcp", "source": {"name": "acme"}}]}),
    ("egress without destination", {"egress": [{"proto": "tcp"}]}),
    ("egress bad CIDR", {"egress": [{"proto": "tcp", "destination": "300.0.0.0/8"}]}),
    (
        "egress source key",
        {"egress": [{"proto": "tcp", "destination": "0.0.0.0/0", "source": "tenant"}]},
    ),  # fmt: skip
    ("too many rules", {"allow": [{"proto": "tcp", "ports": p} for p in range(1, MAX_RULES + 2)]}),
]


@pytest.mark.parametrize(("why", "data"), BAD, ids=[b[0] for b in BAD])
def test_bad_policies_are_422(why: str, data: Any) -> None:
    with pytest.raises(InvalidNetworkPolicy) as err:
        parse(data)
    assert err.value.code == "invalid_network_policy"
    assert "path" in err.value.details


def test_a_rule_naming_an_unknown_tenant_is_422() -> None:
    with pytest.raises(UnknownTenant) as err:
        parse({"allow": [{"proto": "tcp", "ports": 22, "source": {"tenant": "nobody"}}]})
    assert err.value.code == "unknown_tenant"
    assert err.value.details == {"path": "allow[0].source", "tenant": "nobody"}


def test_a_rule_opening_the_segment_to_another_tenant_is_403() -> None:
    with pytest.raises(CrossTenantRule) as err:
        parse({"allow": [{"proto": "any", "source": {"tenant": "globex"}}]})
    assert err.value.code == "cross_tenant_rule"
    assert err.value.details["other"] == "globex"
