"""A tenant's network policy: its overlay subnet, the allow-list inside its segments, egress.

The model is default deny: between segments (another tenant, another per-workload segment)
nothing passes, ever; to the node itself nothing passes; inside a tenant's own segment only
what an :class:`AllowRule` admits. A tenant without a policy gets :data:`DEFAULT_POLICY`:
``allow: [{"proto": "any", "source": "tenant"}]``, all traffic between the tenant's own
workloads (what a training job expects), still nothing from or to anyone else. A policy with
``"allow": []`` closes the segment inside as well.

The JSON form (the tenant profile's ``network_policy``, the ``network.policy`` change)::

    {"subnet": "10.10.0.0/24",
     "allow":  [{"proto": "tcp", "ports": 29500, "source": "tenant"},       # NCCL bootstrap
                {"proto": "tcp", "ports": "22", "source": "10.10.0.250/32"}],  # a bastion
     "egress": [{"proto": "tcp", "ports": [443, 443], "destination": "192.0.2.0/24"}]}

``ports``: a number, ``"LO-HI"``, ``[LO, HI]`` (1..65535) or absent (all; the only choice for
``icmp`` and ``any``). ``source``: ``"tenant"`` (any workload of the tenant), a CIDR (inside
the segment: bridged traffic from that range), or ``{"tenant": NAME}``: the tenant's own name
is the same as ``"tenant"``; an unknown name is ``unknown_tenant`` (422); another tenant's
name is ``cross_tenant_rule`` (403): a policy can never open a segment to another tenant.

Rules are a set: :func:`parse_policy` removes duplicates and sorts them, so two spellings of
the same policy have the same :func:`policy_sha256`.
"""

from __future__ import annotations

import hashlib
import ipaddress
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

from proofplane.audit.canonical import canonical_json
from proofplane.errors import ProofplaneError, ValidationFailed

__all__ = [
    "DEFAULT_ALLOW",
    "DEFAULT_POLICY",
    "DEFAULT_SUBNET",
    "MAX_RULES",
    "PROTOS",
    "AllowRule",
    "CrossTenantRule",
    "EgressRule",
    "InvalidNetworkPolicy",
    "NetworkPolicy",
    "UnknownTenant",
    "parse_policy",
    "policy_sha256",
    "policy_to_json",
]

PROTOS = ("tcp", "udp", "icmp", "any")
TENANT = "tenant"
DEFAULT_SUBNET = "10.10.0.0/24"
MAX_RULES = 256  # per list: a policy is an allow-list, not a firewall


class InvalidNetworkPolicy(ValidationFailed):
    """422: the policy is malformed (a port, protocol, CIDR or key that is not allowed)."""

    code = "invalid_network_policy"


class UnknownTenant(ValidationFailed):
    """422: a rule names a tenant that does not exist."""

    code = "unknown_tenant"


class CrossTenantRule(ProofplaneError):
    """403: a rule would open the tenant's segment to another tenant."""

    code = "cross_tenant_rule"


Ports = tuple[int, int] | None


@dataclass(frozen=True, slots=True, order=True)
class AllowRule:
    """Admit ``proto`` (to ``ports``, inclusive; None: all) into the tenant's segment from
    ``source``: ``"tenant"`` (any of its workloads) or a CIDR (``ipaddress`` form)."""

    proto: str
    ports: Ports = None
    source: str = TENANT


@dataclass(frozen=True, slots=True, order=True)
class EgressRule:
    """Let the tenant's workloads reach ``destination`` (a CIDR) with ``proto``/``ports``."""

    proto: str
    ports: Ports = None
    destination: str = "0.0.0.0/0"


DEFAULT_ALLOW = (AllowRule("any", None, TENANT),)


@dataclass(frozen=True, slots=True)
class NetworkPolicy:
    """A tenant's policy, canonical (rules deduplicated and sorted, CIDRs normalised)."""

    subnet: str = DEFAULT_SUBNET
    allow: tuple[AllowRule, ...] = DEFAULT_ALLOW
    egress: tuple[EgressRule, ...] = ()


DEFAULT_POLICY = NetworkPolicy()


def _fail(message: str, path: str, value: Any = None) -> InvalidNetworkPolicy:
    return InvalidNetworkPolicy(
        f"invalid network policy: {path}: {message}", details={"path": path, "value": value}
    )


def _ports(value: Any, proto: str, path: str) -> Ports:
    if value is None:
        return None
    if proto in ("icmp", "any"):
        raise _fail(f"ports apply to tcp and udp only, not {proto}", path, value)
    lo: Any
    hi: Any
    if isinstance(value, bool):
        raise _fail("a port is a number 1..65535", path, value)
    if isinstance(value, int):
        lo = hi = value
    elif isinstance(value, str):
        lo_s, sep, hi_s = value.partition("-")
        if not lo_s.strip().isdigit() or (sep and not hi_s.strip().isdigit()):
            raise _fail("write a port as N or LO-HI", path, value)
        lo = int(lo_s)
        hi = int(hi_s) if sep else lo
    elif isinstance(value, list | tuple) and len(value) == 2:
        lo, hi = value
        if any(isinstance(p, bool) or not isinstance(p, int) for p in (lo, hi)):
            raise _fail("a port range is [LO, HI] of numbers", path, value)
    else:
        raise _fail("a port is N, 'LO-HI' or [LO, HI]", path, value)
    if not (1 <= lo <= hi <= 65535):
        raise _fail("ports are 1..65535 with LO <= HI", path, value)
    return (lo, hi)


def _proto(value: Any, path: str) -> str:
    if value not in PROTOS:
        raise _fail(f"proto is one of {', '.join(PROTOS)}", path, value)
    return str(value)


def _cidr(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise _fail("a CIDR is a string such as 10.0.0.0/8", path, value)
    try:
        return str(ipaddress.ip_network(value, strict=True))
    except ValueError as exc:
        raise _fail(f"not a network address: {exc}", path, value) from None


def _source(value: Any, path: str, tenant: str, known: AbstractSet[str]) -> str:
    if value == TENANT:
        return TENANT
    if isinstance(value, Mapping):
        if set(value) != {TENANT} or not isinstance(value[TENANT], str):
            raise _fail('a tenant source is {"tenant": NAME}', path, value)
        other = value[TENANT]
        if other == tenant:
            return TENANT
        if other not in known:
            raise UnknownTenant(
                f"invalid network policy: {path}: unknown tenant {other!r}",
                details={"path": path, "tenant": other},
            )
        raise CrossTenantRule(
            f"a rule of tenant {tenant!r} may not open its segment to tenant {other!r} "
            f"({path}): tenants never share a segment",
            details={"path": path, "tenant": tenant, "other": other},
        )
    return _cidr(value, path)


def _keys(item: Any, allowed: set[str], required: set[str], path: str) -> Mapping[str, Any]:
    if not isinstance(item, Mapping):
        raise _fail("a rule is an object", path, item)
    unknown = set(item) - allowed
    if unknown:
        raise _fail(f"unknown keys {sorted(map(str, unknown))}", path, sorted(map(str, unknown)))
    missing = required - set(item)
    if missing:
        raise _fail(f"missing {sorted(missing)}", path, None)
    return item


def _list(value: Any, path: str) -> list[Any]:
    if not isinstance(value, list | tuple):
        raise _fail("a list of rules", path, None)
    if len(value) > MAX_RULES:
        raise _fail(f"at most {MAX_RULES} rules", path, len(value))
    return list(value)


def parse_policy(
    data: Mapping[str, Any] | None, *, tenant: str, known_tenants: AbstractSet[str]
) -> NetworkPolicy:
    """The policy of ``tenant`` from its JSON form, validated and made canonical (None: the
    default policy). ``known_tenants``: the names that exist (for ``{"tenant": NAME}``).

    Raises :class:`InvalidNetworkPolicy` (422), :class:`UnknownTenant` (422) or
    :class:`CrossTenantRule` (403)."""
    if data is None:
        return DEFAULT_POLICY
    if not isinstance(data, Mapping):
        raise _fail("a policy is an object", "policy", None)
    unknown = set(data) - {"subnet", "allow", "egress"}
    if unknown:
        raise _fail(
            f"unknown keys {sorted(map(str, unknown))}", "policy", sorted(map(str, unknown))
        )
    subnet = data.get("subnet", DEFAULT_SUBNET)
    if not isinstance(subnet, str):
        raise _fail("a subnet is a string such as 10.10.0.0/24", "subnet", subnet)
    try:
        net = ipaddress.ip_network(subnet, strict=True)
    except ValueError as exc:
        raise _fail(f"not a network address: {exc}", "subnet", subnet) from None
    if not isinstance(net, ipaddress.IPv4Network) or net.prefixlen > 30:
        raise _fail("the overlay subnet is an IPv4 network of /30 or larger", "subnet", subnet)

    allow: set[AllowRule] = set()
    for i, item in enumerate(_list(data.get("allow", list(DEFAULT_ALLOW_JSON)), "allow")):
        path = f"allow[{i}]"
        rule = _keys(item, {"proto", "ports", "source"}, {"proto"}, path)
        proto = _proto(rule["proto"], f"{path}.proto")
        allow.add(
            AllowRule(
                proto,
                _ports(rule.get("ports"), proto, f"{path}.ports"),
                _source(rule.get("source", TENANT), f"{path}.source", tenant, known_tenants),
            )
        )
    egress: set[EgressRule] = set()
    for i, item in enumerate(_list(data.get("egress", []), "egress")):
        path = f"egress[{i}]"
        rule = _keys(item, {"proto", "ports", "destination"}, {"proto", "destination"}, path)
        proto = _proto(rule["proto"], f"{path}.proto")
        egress.add(
            EgressRule(
                proto,
                _ports(rule.get("ports"), proto, f"{path}.ports"),
                _cidr(rule["destination"], f"{path}.destination"),
            )
        )
    return NetworkPolicy(str(net), tuple(sorted(allow, key=_key)), tuple(sorted(egress, key=_key)))


def _key(rule: AllowRule | EgressRule) -> tuple[str, tuple[int, int], str]:
    peer = rule.source if isinstance(rule, AllowRule) else rule.destination
    return (rule.proto, rule.ports or (0, 0), peer)


def _ports_json(ports: Ports) -> list[int] | None:
    return None if ports is None else [ports[0], ports[1]]


def policy_to_json(policy: NetworkPolicy) -> dict[str, Any]:
    """The JSON form (what :func:`parse_policy` reads back to the same value)."""
    return {
        "subnet": policy.subnet,
        "allow": [
            {"proto": r.proto, "ports": _ports_json(r.ports), "source": r.source}
            for r in policy.allow
        ],
        "egress": [
            {"proto": r.proto, "ports": _ports_json(r.ports), "destination": r.destination}
            for r in policy.egress
        ],
    }


DEFAULT_ALLOW_JSON: tuple[dict[str, Any], ...] = (
    {"proto": "any", "ports": None, "source": TENANT},
)


def policy_sha256(policy: NetworkPolicy) -> str:
    """SHA-256 (hex) of the policy's canonical JSON (RFC 8785): its identity in the desired
    state, the segmentation map and the ``network.policy`` change."""
    return hashlib.sha256(canonical_json(policy_to_json(policy))).hexdigest()
