"""Desired network state per node, derived from placements, kept up to date incrementally.

A node must carry a segment (a VXLAN VNI with its bridge; an InfiniBand PKey) exactly when a
workload of that segment runs there; no other. For each such segment it needs:

* the **remote VTEPs**: the other nodes that carry the same segment (head-end replication of
  broadcast/unknown/multicast frames goes to each of them, nowhere else);
* its **local endpoints** (a veth per workload, on the segment's bridge);
* the **remote endpoints**: a static FDB entry per remote workload MAC → its node's VTEP
  (``nolearning``: the overlay never learns a MAC from the wire, so a forged source cannot
  pull traffic);

plus the tenants' policies (rendered into the node's nftables ruleset) and the underlay
allow-list of VTEPs (the peers of all its segments: VXLAN from anyone else is dropped).

:class:`NetworkIndex` holds nodes, segments, policies and endpoints and answers
:meth:`NetworkIndex.desired` per node from per-segment views it caches. A change (a workload
placed, removed or moved, a node failed, a policy set) invalidates exactly the nodes whose
desired state changes and returns their names: those are the agents to wake. Every
:class:`NodeDesired` carries a content hash (SHA-256 of a canonical, sorted encoding): the
same state gives the same hash whatever the order of the operations that led to it.

Pure: values in, values out.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import re
from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, replace
from typing import Any

from proofplane.errors import Conflict, InvalidState, NotFound, ValidationFailed
from proofplane.model.tags import validate_name
from proofplane.network.policy import (
    DEFAULT_POLICY,
    NetworkPolicy,
    parse_policy,
    policy_sha256,
    policy_to_json,
)
from proofplane.network.segments import PKEY_MAX, PKEY_MIN, VNI_MAX, VNI_MIN, SegmentInUse

__all__ = [
    "Endpoint",
    "NetworkIndex",
    "NodeDesired",
    "NodeNet",
    "NodeSegment",
    "Segment",
    "SegmentMembers",
    "SubnetExhausted",
    "allocate_ip",
    "check_endpoint",
    "check_node",
    "check_segment",
    "check_workload_key",
    "compute_all",
    "desired_from_json",
    "desired_sha256",
    "desired_to_json",
    "endpoint_mac",
    "interface_id",
    "normalize_guid",
    "segment_digest",
]


class SubnetExhausted(Conflict):
    """409: the tenant's overlay subnet has no free host address left."""

    code = "subnet_exhausted"


# What reaches a rendered script is checked on the way in: a name or address that could carry
# a space or a newline would be a command of its own in an `ip -batch` or `nft -f` file.
_IFNAME = re.compile(r"^[A-Za-z0-9_.-]{1,15}$")
_MAC = re.compile(r"^[0-9a-f]{2}(:[0-9a-f]{2}){5}$")
# a workload's key in the desired state (the services use "tenant/workload[#member]")
_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/#:-]{0,199}$")
_OCTET = r"(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_IPV4 = re.compile(rf"^{_OCTET}(\.{_OCTET}){{3}}$")


def _invalid(what: str, value: Any, code: str) -> ValidationFailed:
    return ValidationFailed(f"invalid {what} {value!r}", code=code, details={what: value})


def check_node(node: NodeNet) -> NodeNet:
    """A node's underlay, checked: its name, an IPv4 VTEP, an interface name for the device,
    HCA GUIDs (returned in ``0x`` + 16 hex form; 422 ``invalid_name`` / ``invalid_vtep`` /
    ``invalid_underlay_dev`` / ``invalid_guid``)."""
    validate_name(node.name, "node")
    if not isinstance(node.vtep, str) or not _IPV4.fullmatch(node.vtep):
        raise _invalid("vtep", node.vtep, "invalid_vtep")
    if not isinstance(node.underlay_dev, str) or not _IFNAME.fullmatch(node.underlay_dev):
        raise _invalid("underlay_dev", node.underlay_dev, "invalid_underlay_dev")
    guids = tuple(normalize_guid(g) for g in node.hca_guids)
    return node if guids == node.hca_guids else replace(node, hca_guids=guids)


def check_workload_key(key: str) -> str:
    """A workload's key (``Endpoint.workload``, ``Segment.workload``): letters, digits and
    ``. _ / # : -``, at most 200 characters (422 ``invalid_workload_key``)."""
    if not isinstance(key, str) or not _KEY.fullmatch(key):
        raise _invalid("workload", key, "invalid_workload_key")
    return key


def check_segment(segment: Segment) -> Segment:
    """A segment, checked: tenant name (and workload key), VNI 1..2^24-1, PKey
    0x0001..0x7ffe (422 ``invalid_name`` / ``invalid_workload_key`` / ``invalid_segment``)."""
    validate_name(segment.tenant, "tenant")
    if segment.workload is not None:
        check_workload_key(segment.workload)
    for kind, value, lo, hi in (("vni", segment.vni, VNI_MIN, VNI_MAX),
                                ("pkey", segment.pkey, PKEY_MIN, PKEY_MAX)):  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise _invalid(kind, value, "invalid_segment")
    return segment


def check_endpoint(endpoint: Endpoint) -> Endpoint:
    """An endpoint's key, address and MAC, checked (422 ``invalid_workload_key`` /
    ``invalid_endpoint``); its tenant and node are its segment's and node's, checked there."""
    check_workload_key(endpoint.workload)
    if not isinstance(endpoint.ip, str) or not _IPV4.fullmatch(endpoint.ip):
        raise _invalid("ip", endpoint.ip, "invalid_endpoint")
    if not isinstance(endpoint.mac, str) or not _MAC.fullmatch(endpoint.mac):
        raise _invalid("mac", endpoint.mac, "invalid_endpoint")
    return endpoint


def interface_id(workload: str) -> str:
    """8 hex digits of SHA-256(workload): the stable part of the workload's interface names
    (Linux allows 15 characters: ``vh``/``vw`` + 8 = 10, ``ppw-`` + 8 = 12)."""
    return hashlib.sha256(workload.encode()).hexdigest()[:8]


def endpoint_mac(tenant: str, workload: str) -> str:
    """A stable, locally administered unicast MAC for the workload (bit 1 of the first octet
    set, bit 0 clear): the same workload keeps its MAC when it moves, so only the remote FDB
    entries' VTEP changes."""
    h = hashlib.sha256(f"{tenant}/{workload}".encode()).digest()
    first = (h[0] & 0xFC) | 0x02
    return ":".join(f"{b:02x}" for b in (first, *h[1:6]))


def allocate_ip(subnet: str, used: AbstractSet[str]) -> str:
    """The first host address of ``subnet`` not in ``used``; :class:`SubnetExhausted` (409)
    when every host address is taken."""
    net = ipaddress.ip_network(subnet, strict=True)
    for host in net.hosts():
        text = str(host)
        if text not in used:
            return text
    raise SubnetExhausted(
        f"the subnet {subnet} has no free address ({len(used)} in use)",
        details={"subnet": subnet, "used": len(used)},
    )


def normalize_guid(guid: str) -> str:
    """A port GUID as ``0x`` + 16 lowercase hex digits, from ``0x0002c90300a1b2c3``,
    ``0002c90300a1b2c3`` or ibstat's ``0002:c903:00a1:b2c3``; 422 ``invalid_guid`` otherwise."""
    text = str(guid).strip().lower()
    digits = text[2:] if text.startswith("0x") else text.replace(":", "")
    if not (1 <= len(digits) <= 16) or any(c not in "0123456789abcdef" for c in digits):
        raise ValidationFailed(
            f"invalid port GUID {guid!r}: 64-bit hexadecimal",
            code="invalid_guid",
            details={"guid": guid},
        )
    return f"0x{int(digits, 16):016x}"


@dataclass(frozen=True, slots=True)
class NodeNet:
    """A node's underlay: its VTEP address on the underlay device, its HCA port GUIDs."""

    name: str
    vtep: str
    underlay_dev: str = "ul0"
    hca_guids: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Segment:
    """A tenant's segment: VNI + PKey. ``workload`` is set in per-workload mode (the
    segment belongs to that one workload), None for the tenant's shared segment."""

    tenant: str
    vni: int
    pkey: int
    workload: str | None = None


@dataclass(frozen=True, slots=True, order=True)
class Endpoint:
    """A workload's interface on a segment, on the node that runs it."""

    workload: str
    tenant: str
    node: str
    vni: int
    ip: str
    mac: str

    @property
    def host_if(self) -> str:
        """The veth end on the segment's bridge in the node: ``vh`` + 8 hex."""
        return "vh" + interface_id(self.workload)

    @property
    def peer_if(self) -> str:
        """The veth end inside the workload: ``vw`` + 8 hex."""
        return "vw" + interface_id(self.workload)

    @property
    def netns(self) -> str:
        """The workload's network namespace: ``ppw-`` + 8 hex."""
        return "ppw-" + interface_id(self.workload)


@dataclass(frozen=True, slots=True)
class SegmentMembers:
    """A whole segment, shared by the node views of all its nodes: ``entries`` (mac, vtep,
    node) per endpoint, sorted; ``holders`` (vtep, node) per node carrying it, sorted;
    ``digest``: :func:`segment_digest` of both."""

    entries: tuple[tuple[str, str, str], ...]
    holders: tuple[tuple[str, str], ...]
    digest: str


def segment_digest(entries: Iterable[tuple[str, str]], vteps: Iterable[str]) -> str:
    """SHA-256 (hex) of a segment's membership: its ``(mac, vtep)`` pairs and the VTEPs that
    carry it (all of them, the node's own included), sorted, as compact JSON
    ``[[mac, vtep, mac, vtep, ...], [vtep, ...]]``."""
    return _digest(sorted(entries), sorted(vteps))


def _digest(entries: list[tuple[str, str]], vteps: list[str]) -> str:
    flat = [x for pair in entries for x in pair]
    doc = json.dumps([flat, vteps], separators=(",", ":"))
    return hashlib.sha256(doc.encode()).hexdigest()


class NodeSegment:
    """One segment as a node must carry it (see the module docstring); an immutable value.

    ``remote_vteps``: sorted VTEPs of the other nodes holding it; ``local``: endpoints on this
    node, by workload; ``remote``: ``(mac, vtep)`` per remote endpoint, sorted.

    Built by :class:`NetworkIndex`, ``remote`` and ``remote_vteps`` are read from the
    segment's shared :class:`SegmentMembers` when first asked for: a segment of E endpoints
    on N nodes holds E·N FDB entries in all, and the control plane never needs them at once
    (the hash uses the segment's digest), only a node's agent or renderer needs its own."""

    __slots__ = ("_members", "_node", "_remote", "_remote_vteps", "local", "pkey", "tenant", "vni",
                 "workload")  # fmt: skip

    vni: int
    pkey: int
    tenant: str
    workload: str | None
    local: tuple[Endpoint, ...]
    _remote: tuple[tuple[str, str], ...] | None
    _remote_vteps: tuple[str, ...] | None
    _members: SegmentMembers | None
    _node: str | None

    def __init__(
        self,
        vni: int,
        pkey: int,
        tenant: str,
        workload: str | None,
        remote_vteps: tuple[str, ...],
        local: tuple[Endpoint, ...],
        remote: tuple[tuple[str, str], ...],
    ) -> None:
        for name, value in (
            ("vni", vni), ("pkey", pkey), ("tenant", tenant), ("workload", workload),
            ("local", tuple(local)), ("_remote", tuple(remote)),
            ("_remote_vteps", tuple(remote_vteps)), ("_members", None), ("_node", None),
        ):  # fmt: skip
            object.__setattr__(self, name, value)

    @classmethod
    def of_members(
        cls,
        segment: Segment,
        node: str,
        local: tuple[Endpoint, ...],
        members: SegmentMembers,
    ) -> NodeSegment:
        """``node``'s view of a segment whose membership is ``members`` (lazy remote parts)."""
        out = cls.__new__(cls)
        put = object.__setattr__
        put(out, "vni", segment.vni)
        put(out, "pkey", segment.pkey)
        put(out, "tenant", segment.tenant)
        put(out, "workload", segment.workload)
        put(out, "local", local)
        put(out, "_remote", None)
        put(out, "_remote_vteps", None)
        put(out, "_members", members)
        put(out, "_node", node)
        return out

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"NodeSegment is immutable: cannot set {name!r}")

    @property
    def remote(self) -> tuple[tuple[str, str], ...]:
        if self._remote is None:
            assert self._members is not None
            node = self._node
            remote = tuple((m, v) for m, v, n in self._members.entries if n != node)
            object.__setattr__(self, "_remote", remote)
            return remote
        return self._remote

    @property
    def remote_vteps(self) -> tuple[str, ...]:
        if self._remote_vteps is None:
            assert self._members is not None
            node = self._node
            vteps = tuple(v for v, n in self._members.holders if n != node)
            object.__setattr__(self, "_remote_vteps", vteps)
            return vteps
        return self._remote_vteps

    def digest(self, vtep: str) -> str:
        """:func:`segment_digest` of the segment this view belongs to, the node's own endpoints
        at ``vtep`` (the remote entries and VTEPs plus the node's own determine it)."""
        if self._members is not None:
            return self._members.digest
        entries = [*self.remote, *((e.mac, vtep) for e in self.local)]
        return segment_digest(entries, [*self.remote_vteps, vtep])

    @property
    def bridge(self) -> str:
        return f"br{self.vni}"

    @property
    def vxlan(self) -> str:
        return f"vx{self.vni}"

    def _key(self) -> tuple[Any, ...]:
        return (self.vni, self.pkey, self.tenant, self.workload, self.local, self.remote_vteps,
                self.remote)  # fmt: skip

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, NodeSegment):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash((self.vni, self.pkey, self.tenant, self.workload, self.local))

    def __repr__(self) -> str:
        return (f"NodeSegment(vni={self.vni}, pkey={self.pkey}, tenant={self.tenant!r}, "
                f"workload={self.workload!r}, local={[e.workload for e in self.local]}, "
                f"remote_vteps={len(self.remote_vteps)}, remote={len(self.remote)})")  # fmt: skip


class NodeDesired:
    """Everything one node must carry; an immutable value. ``segments`` by VNI;
    ``policies``: tenant → policy for the tenants of those segments; ``vteps``: the underlay
    allow-list (the union of the segments' remote VTEPs, derived when first asked for);
    ``sha256``: :func:`desired_sha256` of the rest."""

    __slots__ = ("_vteps", "node", "policies", "segments", "sha256", "underlay_dev", "vtep")

    node: str
    vtep: str
    underlay_dev: str
    segments: tuple[NodeSegment, ...]
    policies: Mapping[str, NetworkPolicy]
    sha256: str
    _vteps: tuple[str, ...] | None

    def __init__(
        self,
        node: str,
        vtep: str,
        underlay_dev: str,
        segments: tuple[NodeSegment, ...],
        policies: Mapping[str, NetworkPolicy],
        sha256: str,
    ) -> None:
        put = object.__setattr__
        put(self, "node", node)
        put(self, "vtep", vtep)
        put(self, "underlay_dev", underlay_dev)
        put(self, "segments", tuple(segments))
        put(self, "policies", dict(policies))
        put(self, "sha256", sha256)
        put(self, "_vteps", None)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"NodeDesired is immutable: cannot set {name!r}")

    @property
    def vteps(self) -> tuple[str, ...]:
        if self._vteps is None:
            vteps = tuple(sorted({v for s in self.segments for v in s.remote_vteps}))
            object.__setattr__(self, "_vteps", vteps)
            return vteps
        return self._vteps

    def _key(self) -> tuple[Any, ...]:
        return (self.node, self.vtep, self.underlay_dev, self.segments, self.policies,
                self.sha256)  # fmt: skip

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, NodeDesired):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self.sha256)

    def __repr__(self) -> str:
        vnis = [s.vni for s in self.segments]
        return (f"NodeDesired(node={self.node!r}, vtep={self.vtep!r}, segments={vnis}, "
                f"sha256={self.sha256[:16]}…)")  # fmt: skip


def _by_workload(e: Endpoint) -> str:
    return e.workload


_SEP = (",", ":")
_DOC_TAG = "proofplane.network.desired/2"


def _segment_part(
    vni: int, pkey: int, tenant: str, workload: str | None, local: Iterable[Endpoint]
) -> str:
    """A segment's entry of the hash document without its digest and closing bracket."""
    locals_ = [[e.workload, e.tenant, e.ip, e.mac] for e in sorted(local, key=_by_workload)]
    return json.dumps([vni, pkey, tenant, workload, locals_], separators=_SEP)[:-1]


def _head(node: str, vtep: str, underlay_dev: str) -> str:
    return json.dumps([_DOC_TAG, node, vtep, underlay_dev], separators=_SEP)[:-1]


def _policy_part(tenant: str, sha: str) -> str:
    return json.dumps([tenant, sha], separators=_SEP)


def _doc(head: str, policy_parts: Iterable[str], segment_parts: Iterable[str]) -> bytes:
    """The hash document: ``json.dumps([tag, node, vtep, underlay_dev, [[tenant, policy
    sha256]...], [[vni, pkey, tenant, workload, [[workload, tenant, ip, mac]...], digest]...]],
    separators=(",", ":"))``, tenants and segments in order, assembled from pre-encoded parts
    (byte for byte the same)."""
    return f"{head},[{','.join(policy_parts)}],[{','.join(segment_parts)}]]".encode()


def _hash_doc(
    node: str,
    vtep: str,
    underlay_dev: str,
    segments: Iterable[NodeSegment],
    policy_hashes: Mapping[str, str],
) -> bytes:
    parts = [
        f'{_segment_part(s.vni, s.pkey, s.tenant, s.workload, s.local)},"{s.digest(vtep)}"]'
        for s in sorted(segments, key=lambda s: s.vni)
    ]
    pols = [_policy_part(t, policy_hashes[t]) for t in sorted(policy_hashes)]
    return _doc(_head(node, vtep, underlay_dev), pols, parts)


def desired_sha256(
    node: str,
    vtep: str,
    underlay_dev: str,
    segments: Iterable[NodeSegment],
    policies: Mapping[str, NetworkPolicy],
) -> str:
    """SHA-256 (hex) of a canonical encoding of a node's desired state: compact JSON (a list
    in a fixed order, lists sorted) of the node, its VTEP and device, each policy's
    :func:`~proofplane.network.policy.policy_sha256`, and per segment (by VNI) its ids, its
    local endpoints (sorted) and its :func:`segment_digest`. The digest covers the whole
    segment; with the node's own endpoints and VTEP it determines the remote FDB entries and
    VTEPs exactly, so equal states hash equal, whatever the order of the operations that led
    there, and the hash costs what the node carries, not what its peers carry."""
    hashes = {t: policy_sha256(p) for t, p in policies.items()}
    return hashlib.sha256(_hash_doc(node, vtep, underlay_dev, segments, hashes)).hexdigest()


def desired_to_json(d: NodeDesired) -> dict[str, Any]:
    """The JSON the API serves (``GET /api/v1/nodes/{name}/network``) and the agent reads."""
    return {
        "node": d.node,
        "vtep": d.vtep,
        "underlay_dev": d.underlay_dev,
        "segments": [
            {
                "vni": s.vni,
                "pkey": s.pkey,
                "tenant": s.tenant,
                "workload": s.workload,
                "bridge": s.bridge,
                "vxlan": s.vxlan,
                "remote_vteps": list(s.remote_vteps),
                "local": [
                    {
                        "workload": e.workload,
                        "tenant": e.tenant,
                        "ip": e.ip,
                        "mac": e.mac,
                        "host_if": e.host_if,
                        "peer_if": e.peer_if,
                        "netns": e.netns,
                    }
                    for e in s.local
                ],  # fmt: skip
                "remote": [{"mac": m, "vtep": v} for m, v in s.remote],
            }
            for s in d.segments
        ],
        "policies": {t: policy_to_json(p) for t, p in d.policies.items()},
        "vteps": list(d.vteps),
        "sha256": d.sha256,
    }


def desired_from_json(data: Mapping[str, Any]) -> NodeDesired:
    """The value back from :func:`desired_to_json`'s form; the hash is recomputed and must
    match (422 ``desired_state_mismatch`` otherwise: the agent never applies a state whose
    content is not the one the server hashed), and ``vteps`` must be the union of the
    segments' remote VTEPs."""
    try:
        node = str(data["node"])
        segments = tuple(
            NodeSegment(
                vni=int(s["vni"]),
                pkey=int(s["pkey"]),
                tenant=str(s["tenant"]),
                workload=None if s.get("workload") is None else str(s["workload"]),
                remote_vteps=tuple(str(v) for v in s["remote_vteps"]),
                local=tuple(
                    Endpoint(
                        str(e["workload"]),
                        str(e["tenant"]),
                        node,
                        int(s["vni"]),
                        str(e["ip"]),
                        str(e["mac"]),
                    )
                    for e in s["local"]
                ),  # fmt: skip
                remote=tuple((str(r["mac"]), str(r["vtep"])) for r in s["remote"]),
            )
            for s in data["segments"]
        )
        policies = {
            str(t): parse_policy(p, tenant=str(t), known_tenants=frozenset({str(t)}))
            for t, p in data["policies"].items()
        }
        vteps = tuple(str(v) for v in data["vteps"])
        vtep, underlay_dev, claimed = str(data["vtep"]), str(data["underlay_dev"]), data["sha256"]
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ValidationFailed(
            f"malformed desired network state: {exc!r}", code="invalid_desired_state"
        ) from None
    try:
        check_node(NodeNet(node, vtep, underlay_dev))
        for s in segments:
            check_segment(Segment(s.tenant, s.vni, s.pkey, s.workload))
            for e in s.local:
                if e.tenant != s.tenant:
                    raise _invalid("tenant", e.tenant, "invalid_desired_state")
                check_endpoint(e)
            for m, v in s.remote:
                check_endpoint(Endpoint("remote", s.tenant, node, s.vni, v, m))
            for v in s.remote_vteps:
                check_endpoint(Endpoint("remote", s.tenant, node, s.vni, v, "02:00:00:00:00:00"))
    except ValidationFailed as exc:
        raise ValidationFailed(
            f"malformed desired network state: {exc.message}",
            code="invalid_desired_state",
            details=exc.details,
        ) from None
    sha = desired_sha256(node, vtep, underlay_dev, segments, policies)
    out = NodeDesired(node, vtep, underlay_dev, segments, policies, sha)
    if sha != claimed or out.vteps != vteps:
        raise ValidationFailed(
            "the desired network state does not match its sha256",
            code="desired_state_mismatch",
            details={"claimed": claimed, "computed": sha},
        )
    return out


class NetworkIndex:
    """Nodes, segments, policies and endpoints, with each node's desired state derived on
    demand and cached; every mutator returns the names of the nodes whose desired state it
    changed (and only those).

    Per-segment views (its endpoints with their VTEPs, the VTEPs holding it) are cached and
    shared by the nodes of the segment, so a node's state costs what it contains."""

    def __init__(
        self,
        nodes: Iterable[NodeNet] = (),
        segments: Iterable[Segment] = (),
        policies: Mapping[str, NetworkPolicy] | None = None,
        endpoints: Iterable[Endpoint] = (),
    ) -> None:
        self._nodes: dict[str, NodeNet] = {n.name: check_node(n) for n in nodes}
        self._failed: set[str] = set()
        self._segments: dict[int, Segment] = {}
        for seg in segments:
            self._add_segment(seg)
        self._policies: dict[str, NetworkPolicy] = dict(policies or {})
        self._policy_parts: dict[str, str] = {}  # tenant -> its part of the hash doc
        self._heads: dict[str, str] = {}  # node -> the head of its hash doc
        self._endpoints: dict[str, Endpoint] = {}
        self._members: dict[int, dict[str, dict[str, Endpoint]]] = {}
        self._node_vnis: dict[str, set[int]] = {}
        self._views: dict[int, SegmentMembers] = {}
        # per (node, vni): the node's endpoints there, sorted, and their part of the hash doc
        self._frags: dict[tuple[str, int], tuple[tuple[Endpoint, ...], str]] = {}
        self._cache: dict[str, NodeDesired] = {}
        self._shas: dict[str, str] = {}
        self.place(endpoints)

    # ----------------------------------------------------------------- reading
    @property
    def nodes(self) -> Mapping[str, NodeNet]:
        return self._nodes

    @property
    def segments(self) -> Mapping[int, Segment]:
        return self._segments

    @property
    def endpoints(self) -> Mapping[str, Endpoint]:
        return self._endpoints

    @property
    def failed(self) -> AbstractSet[str]:
        return frozenset(self._failed)

    def policy(self, tenant: str) -> NetworkPolicy:
        """The tenant's policy (:data:`~proofplane.network.policy.DEFAULT_POLICY` if none)."""
        return self._policies.get(tenant, DEFAULT_POLICY)

    def nodes_of(self, vni: int) -> tuple[str, ...]:
        """The nodes that carry segment ``vni`` (have an endpoint of it), sorted."""
        return tuple(sorted(self._members.get(vni, {})))

    def segments_on(self, node: str) -> tuple[int, ...]:
        """The VNIs node ``node`` carries, sorted."""
        return tuple(sorted(self._node_vnis.get(node, ())))

    def used_ips(self, vni: int) -> frozenset[str]:
        """The overlay addresses taken on segment ``vni`` (for :func:`allocate_ip`)."""
        return frozenset(e.ip for byn in self._members.get(vni, {}).values() for e in byn.values())

    def sha256(self, node: str) -> str:
        """The sha256 of the node's desired state, without building the state (what a
        generation bump needs: a change touches many nodes, their agents fetch one each)."""
        sha = self._shas.get(node)
        if sha is None:
            net = self._net(node)
            parts = []
            tenants = set()
            for vni in sorted(self._node_vnis.get(node, ())):
                seg = self._segments[vni]
                parts.append(f'{self._frag(node, seg)[1]},"{self._view(vni).digest}"]')
                tenants.add(seg.tenant)
            head = self._heads.get(node)
            if head is None:
                head = self._heads[node] = _head(node, net.vtep, net.underlay_dev)
            doc = _doc(head, [self._ppart(t) for t in sorted(tenants)], parts)
            sha = self._shas[node] = hashlib.sha256(doc).hexdigest()
        return sha

    def desired(self, node: str) -> NodeDesired:
        """The node's desired state (cached until a change touches the node)."""
        hit = self._cache.get(node)
        if hit is not None:
            return hit
        net = self._net(node)
        segs = []
        for vni in sorted(self._node_vnis.get(node, ())):
            seg = self._segments[vni]
            local = self._frag(node, seg)[0]
            segs.append(NodeSegment.of_members(seg, node, local, self._view(vni)))
        pget = self._policies.get
        policies = {t: pget(t, DEFAULT_POLICY) for t in sorted({s.tenant for s in segs})}
        out = NodeDesired(node, net.vtep, net.underlay_dev, tuple(segs), policies,
                          self.sha256(node))  # fmt: skip
        self._cache[node] = out
        return out

    def desired_all(self) -> dict[str, NodeDesired]:
        """Every node's desired state, by name."""
        return {name: self.desired(name) for name in sorted(self._nodes)}

    # ----------------------------------------------------------------- changing
    def place(self, endpoints: Iterable[Endpoint]) -> frozenset[str]:
        """Add endpoints, or move them (same workload, another node or address): the nodes of
        their segments (before and after) are affected. All or nothing: one endpoint that does
        not fit (see :meth:`_check`) and none is placed."""
        batch = list(endpoints)
        for ep in batch:
            self._check(ep)
        affected: set[str] = set()
        touched: set[int] = set()
        for ep in batch:
            old = self._endpoints.get(ep.workload)
            if old == ep:
                continue
            if old is not None:
                self._unlink(old, affected, touched)
            self._endpoints[ep.workload] = ep
            byn = self._members.setdefault(ep.vni, {})
            if ep.node not in byn:
                self._node_vnis.setdefault(ep.node, set()).add(ep.vni)
            byn.setdefault(ep.node, {})[ep.workload] = ep
            self._frags.pop((ep.node, ep.vni), None)
            touched.add(ep.vni)
        return self._settle(touched, affected)

    def remove(self, workloads: Iterable[str]) -> frozenset[str]:
        """Remove the workloads' endpoints (ended, evicted); unknown names are ignored."""
        affected: set[str] = set()
        touched: set[int] = set()
        for w in workloads:
            ep = self._endpoints.get(w)
            if ep is not None:
                self._unlink(ep, affected, touched)
        return self._settle(touched, affected)

    def set_policy(self, tenant: str, policy: NetworkPolicy | None) -> frozenset[str]:
        """Set (None: reset to the default) a tenant's policy: the nodes carrying any of its
        segments are affected, none if the policy is unchanged."""
        before = self.policy(tenant)
        if policy is None or policy == DEFAULT_POLICY:
            self._policies.pop(tenant, None)
        else:
            self._policies[tenant] = policy
        self._policy_parts.pop(tenant, None)
        if self.policy(tenant) == before:
            return frozenset()
        affected = {
            n for vni, seg in self._segments.items() if seg.tenant == tenant
            for n in self._members.get(vni, ())
        }  # fmt: skip
        return self._invalidate(affected)

    def node_failed(self, node: str) -> frozenset[str]:
        """The node is gone: its endpoints are removed (the scheduler re-places them, then
        :meth:`place`), its own state becomes empty; the peers of its segments are affected.
        It carries nothing until :meth:`upsert_node` brings it back."""
        if node not in self._nodes:
            raise NotFound(f"node {node!r} has no network underlay", code="node_not_found",
                           details={"node": node})  # fmt: skip
        affected = {node}
        touched: set[int] = set()
        self._failed.add(node)
        for vni in list(self._node_vnis.get(node, ())):
            for ep in list(self._members[vni][node].values()):
                self._unlink(ep, affected, touched)
        return self._settle(touched, affected)

    def upsert_node(self, node: NodeNet) -> frozenset[str]:
        """Register a node's underlay, change it (a new VTEP), or bring a failed node back:
        the node and, if its VTEP or device changed, the peers of its segments."""
        old = self._nodes.get(node.name)
        self._nodes[node.name] = check_node(node)
        self._failed.discard(node.name)
        self._heads.pop(node.name, None)
        affected = {node.name}
        touched: set[int] = set()
        if old is not None and old.vtep != node.vtep:
            touched.update(self._node_vnis.get(node.name, ()))
        return self._settle(touched, affected)

    def add_segment(self, segment: Segment) -> frozenset[str]:
        """A new segment (a tenant created; a per-workload segment): no node carries it yet."""
        self._add_segment(segment)
        return frozenset()

    def remove_segment(self, vni: int) -> frozenset[str]:
        """Forget a segment with no endpoint left (409 ``segment_in_use`` otherwise)."""
        if self._members.get(vni):
            raise SegmentInUse(f"segment {vni} still has endpoints",
                               details={"vni": vni, "nodes": self.nodes_of(vni)[:20]})  # fmt: skip
        self._segments.pop(vni, None)
        return frozenset()

    # ----------------------------------------------------------------- internals
    def _add_segment(self, seg: Segment) -> None:
        check_segment(seg)
        old = self._segments.get(seg.vni)
        if old is not None and old != seg:
            raise SegmentInUse(f"VNI {seg.vni} already belongs to tenant {old.tenant!r}",
                               details={"vni": seg.vni, "tenant": old.tenant})  # fmt: skip
        self._segments[seg.vni] = seg

    def _check(self, ep: Endpoint) -> None:
        check_endpoint(ep)
        if ep.node not in self._nodes:
            raise NotFound(f"node {ep.node!r} has no network underlay", code="node_not_found",
                           details={"node": ep.node})  # fmt: skip
        if ep.node in self._failed:
            raise InvalidState(f"node {ep.node!r} has failed", details={"node": ep.node})
        seg = self._segments.get(ep.vni)
        if seg is None:
            raise NotFound(f"no segment with VNI {ep.vni}", code="segment_not_found",
                           details={"vni": ep.vni})  # fmt: skip
        if seg.tenant != ep.tenant or (seg.workload is not None and seg.workload != ep.workload):
            raise ValidationFailed(
                f"workload {ep.workload!r} of tenant {ep.tenant!r} cannot join segment "
                f"{ep.vni} of tenant {seg.tenant!r}" + (
                    f" (workload {seg.workload!r})" if seg.workload else ""),
                code="segment_mismatch",
                details={"workload": ep.workload, "tenant": ep.tenant, "vni": ep.vni},
            )  # fmt: skip

    def _unlink(self, ep: Endpoint, affected: set[str], touched: set[int]) -> None:
        """Take an endpoint out; its node is affected (it may leave the segment), and so are
        the segment's other nodes (:meth:`_settle`)."""
        affected.add(ep.node)
        touched.add(ep.vni)
        del self._endpoints[ep.workload]
        self._frags.pop((ep.node, ep.vni), None)
        byn = self._members[ep.vni]
        here = byn[ep.node]
        del here[ep.workload]
        if not here:
            del byn[ep.node]
            self._node_vnis[ep.node].discard(ep.vni)
            if not self._node_vnis[ep.node]:
                del self._node_vnis[ep.node]
            if not byn:
                del self._members[ep.vni]

    def _settle(self, touched: set[int], affected: set[str]) -> frozenset[str]:
        """After changes to the segments ``touched``: their views go, the nodes holding them
        now are affected (with those that left, already in ``affected``)."""
        for vni in touched:
            self._views.pop(vni, None)
            affected.update(self._members.get(vni, ()))
        return self._invalidate(affected)

    def _invalidate(self, affected: set[str]) -> frozenset[str]:
        for n in affected:
            self._cache.pop(n, None)
            self._shas.pop(n, None)
        return frozenset(affected)

    def _net(self, node: str) -> NodeNet:
        net = self._nodes.get(node)
        if net is None:
            raise NotFound(f"node {node!r} has no network underlay", code="node_not_found",
                           details={"node": node})  # fmt: skip
        return net

    def _frag(self, node: str, seg: Segment) -> tuple[tuple[Endpoint, ...], str]:
        """The node's endpoints on the segment, sorted, and their part of the hash doc."""
        frag = self._frags.get((node, seg.vni))
        if frag is None:
            local = tuple(sorted(self._members[seg.vni][node].values(), key=_by_workload))
            part = _segment_part(seg.vni, seg.pkey, seg.tenant, seg.workload, local)
            frag = self._frags[(node, seg.vni)] = (local, part)
        return frag

    def _ppart(self, tenant: str) -> str:
        part = self._policy_parts.get(tenant)
        if part is None:
            sha = policy_sha256(self.policy(tenant))
            part = self._policy_parts[tenant] = _policy_part(tenant, sha)
        return part

    def _view(self, vni: int) -> SegmentMembers:
        view = self._views.get(vni)
        if view is None:
            entries: list[tuple[str, str, str]] = []
            holders: list[tuple[str, str]] = []
            nodes = self._nodes
            for n, eps in self._members.get(vni, {}).items():
                vtep = nodes[n].vtep
                holders.append((vtep, n))
                entries += [(e.mac, vtep, n) for e in eps.values()]
            entries.sort()
            holders.sort()
            digest = _digest([(m, v) for m, v, _ in entries], [v for v, _ in holders])
            view = self._views[vni] = SegmentMembers(tuple(entries), tuple(holders), digest)
        return view


def compute_all(
    nodes: Iterable[NodeNet],
    segments: Iterable[Segment],
    policies: Mapping[str, NetworkPolicy],
    endpoints: Iterable[Endpoint],
) -> dict[str, NodeDesired]:
    """Every node's desired state from scratch (what :class:`NetworkIndex` keeps up to date)."""
    return NetworkIndex(nodes, segments, policies, endpoints).desired_all()
