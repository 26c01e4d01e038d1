"""A node's tenant policy as an nftables ruleset: ``table inet proofplane``, flush-and-replace.

Loading the text (``nft -f``) replaces the whole table in one transaction: it is created if
missing, deleted, and defined again, so what runs is exactly what was rendered (no rule left
over from an earlier policy) and the rest of the node's ruleset is never touched.

What it enforces (bridged IPv4/IPv6 traverses the ``inet`` hooks with br_netfilter; there the
input and output interface of a bridged packet is the bridge, one per segment):

* ``prerouting`` (priority raw): each segment's traffic gets its own conntrack zone, so two
  tenants using the same subnet never share a connection-tracking entry;
* ``input``: VXLAN (``udp dport 4789``) from a source not in the set ``@vteps`` (the VTEPs of
  this node's segment peers) is dropped; nothing from a tenant interface reaches the host;
* ``forward``: established and related traffic passes (stateful allow-lists), invalid
  tenant traffic is dropped; per segment, the tenant's allow rules (inside the segment: in and
  out on the same bridge) and egress rules (out of the segment, never into another tenant's
  interface); then every other packet from or to a tenant interface is dropped (default
  deny between segments).

The table carries ``comment "proofplane ruleset sha256:<hex>"``: :func:`ruleset_sha256` of
the text, so the agent reads back from the kernel which ruleset is loaded
(:func:`loaded_sha256` of ``nft list table inet proofplane``). Closing braces stand on their
own lines (``nft -f`` refuses ``} }``).
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
from collections.abc import Iterable

from proofplane.network.desired import NodeDesired, NodeSegment
from proofplane.network.policy import AllowRule, EgressRule, NetworkPolicy, policy_sha256

__all__ = [
    "TABLE",
    "ct_zones",
    "loaded_sha256",
    "render_nftables",
    "ruleset_sha256",
]

TABLE = "inet proofplane"
VXLAN_PORT = 4789
_COMMENT = re.compile(r'^\s*comment "proofplane ruleset sha256:([0-9a-f]{64})"\s*$', re.M)
_COMMENT_LINE = re.compile(r'^\s*comment "proofplane ruleset sha256:[0-9a-f]{64}"\s*\n', re.M)


def ruleset_sha256(text: str) -> str:
    """SHA-256 (hex) of a rendered ruleset, its own ``comment`` line left out (the line that
    carries this very hash)."""
    return hashlib.sha256(_COMMENT_LINE.sub("", text).encode()).hexdigest()


def loaded_sha256(listing: str) -> str | None:
    """The hash a loaded table carries (from ``nft list table inet proofplane``); None when
    the table or its comment is missing (someone flushed or replaced it: drift)."""
    m = _COMMENT.search(listing)
    return m.group(1) if m else None


def ct_zones(vnis: Iterable[int]) -> dict[int, int]:
    """A conntrack zone (1..65535) per VNI: ``(vni - 1) % 65535 + 1``, the next free one on a
    collision (VNIs in ascending order), so a segment keeps its zone while the node keeps its
    segments."""
    out: dict[int, int] = {}
    taken: set[int] = set()
    for vni in sorted(set(vnis)):
        zone = (vni - 1) % 65535 + 1
        while zone in taken:
            zone = zone % 65535 + 1
        taken.add(zone)
        out[vni] = zone
    return out


def _family(cidr: str) -> str:
    return "ip6" if isinstance(ipaddress.ip_network(cidr), ipaddress.IPv6Network) else "ip"


def _peer(cidr: str, direction: str) -> str:
    """``ip saddr 10.0.0.0/8`` (``direction``: saddr | daddr); a /0 matches the family."""
    net = ipaddress.ip_network(cidr)
    if net.prefixlen == 0:
        return "meta nfproto ipv6" if net.version == 6 else "meta nfproto ipv4"
    return f"{_family(cidr)} {direction} {net}"


def _service(proto: str, ports: tuple[int, int] | None) -> str:
    if proto in ("tcp", "udp"):
        if ports is None:
            return f"meta l4proto {proto}"
        lo, hi = ports
        return f"{proto} dport {lo}" if lo == hi else f"{proto} dport {lo}-{hi}"
    if proto == "icmp":
        return "meta l4proto { icmp, ipv6-icmp }"
    return ""  # any


def _join(*parts: str) -> str:
    return " ".join(p for p in parts if p)


def _allow(seg: NodeSegment, rule: AllowRule) -> str:
    source = "" if rule.source == "tenant" else _peer(rule.source, "saddr")
    inside = f'iifname "{seg.bridge}" oifname "{seg.bridge}"'
    return _join(inside, source, _service(rule.proto, rule.ports), "accept")


def _egress(seg: NodeSegment, rule: EgressRule) -> str:
    out = f'iifname "{seg.bridge}" oifname != @tenant_ifaces'
    return _join(out, _peer(rule.destination, "daddr"), _service(rule.proto, rule.ports), "accept")


def _set(name: str, kind: str, elements: list[str]) -> list[str]:
    lines = [f"\tset {name} {{", f"\t\ttype {kind}"]
    if elements:
        lines.append(f"\t\telements = {{ {', '.join(elements)} }}")
    lines.append("\t}")
    return lines


def _segment_rules(seg: NodeSegment, policy: NetworkPolicy) -> list[str]:
    who = f"tenant {seg.tenant}" + (f", workload {seg.workload}" if seg.workload else "")
    lines = [f"\t\t# segment {seg.vni}: {who}, policy sha256:{policy_sha256(policy)[:16]}"]
    lines.extend(f"\t\t{_allow(seg, r)}" for r in policy.allow)
    lines.extend(f"\t\t{_egress(seg, r)}" for r in policy.egress)
    return lines


def render_nftables(d: NodeDesired) -> str:
    """The node's ruleset (deterministic: the same desired state gives the same text)."""
    ifaces = sorted(
        {s.bridge for s in d.segments}
        | {s.vxlan for s in d.segments}
        | {e.host_if for s in d.segments for e in s.local}
    )
    zones = ct_zones(s.vni for s in d.segments)
    zone_map = ", ".join(f'"br{vni}" : {zone}' for vni, zone in sorted(zones.items()))
    body = [
        f"# proofplane: the tenant network policy of node {d.node}",
        f"# loading it replaces table {TABLE} (and nothing else)",
        f"add table {TABLE}",
        f"delete table {TABLE}",
        f"table {TABLE} {{",
        *_set("vteps", "ipv4_addr", list(d.vteps)),
        *_set("tenant_ifaces", "ifname", [f'"{name}"' for name in ifaces]),
        "\tchain prerouting {",
        "\t\ttype filter hook prerouting priority raw; policy accept;",
    ]
    if zone_map:
        body.append(f"\t\tct zone set iifname map {{ {zone_map} }}")
    body += [
        "\t}",
        "\tchain input {",
        "\t\ttype filter hook input priority filter; policy accept;",
        f"\t\tudp dport {VXLAN_PORT} ip saddr != @vteps drop",
        "\t\tiifname @tenant_ifaces drop",
        "\t}",
        "\tchain forward {",
        "\t\ttype filter hook forward priority filter; policy accept;",
        "\t\tct state established,related accept",
        "\t\tiifname @tenant_ifaces ct state invalid drop",
        "\t\toifname @tenant_ifaces ct state invalid drop",
    ]
    for seg in d.segments:
        body += _segment_rules(seg, d.policies[seg.tenant])
    body += [
        "\t\tiifname @tenant_ifaces drop",
        "\t\toifname @tenant_ifaces drop",
        "\t}",
        "}",
    ]
    text = "".join(line + "\n" for line in body)
    sha = hashlib.sha256(text.encode()).hexdigest()
    at = text.index(f"table {TABLE} {{\n") + len(f"table {TABLE} {{\n")
    return f'{text[:at]}\tcomment "proofplane ruleset sha256:{sha}"\n{text[at:]}'
