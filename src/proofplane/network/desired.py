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
from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

from proofplane.errors import Conflict, InvalidState, NotFound, ValidationFailed
from proofplane.network.policy import (
    DEFAULT_POLICY,
    NetworkPolicy,
    parse_policy,
    policy_sha256,
    policy_to_json,
)
from proofplane.network.segments import SegmentInUse

__all__ = [
    "Endpoint",
    "NetworkIndex",
    "NodeDesired",
    "NodeNet",
    "NodeSegment",
    "Segment",
    "SubnetExhausted",
    "allocate_ip",
    "compute_all",
    "desired_from_json",
    "desired_sha256",
    "desired_to_json",
    "endpoint_mac",
    "interface_id",
    "normalize_guid",
]


class SubnetExhausted(Conflict):
    """409: the tenant's overlay subnet has no free host address left."""

    code = "subnet_exhausted"


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
class NodeSegment:
    """One segment as a node must carry it (see the module docstring).

    ``remote_vteps``: sorted VTEPs of the other nodes holding it; ``local``: endpoints on this
    node, by workload; ``remote``: ``(mac, vtep)`` per remote endpoint, sorted."""

    vni: int
    pkey: int
    tenant: str
    workload: str | None
    remote_vteps: tuple[str, ...]
    local: tuple[Endpoint, ...]
    remote: tuple[tuple[str, str], ...]

    @property
    def bridge(self) -> str:
        return f"br{self.vni}"

    @property
    def vxlan(self) -> str:
        return f"vx{self.vni}"


@dataclass(frozen=True, slots=True)
class NodeDesired:
    """Everything one node must carry. ``segments`` by VNI; ``policies``: tenant → policy
    for the tenants of those segments; ``vteps``: the underlay allow-list (the union of the
    segments' remote VTEPs); ``sha256``: :func:`desired_sha256` of the rest."""

    node: str
    vtep: str
    underlay_dev: str
    segments: tuple[NodeSegment, ...]
    policies: Mapping[str, NetworkPolicy]
    vteps: tuple[str, ...]
    sha256: str


def _hash_doc(
    node: str,
    vtep: str,
    underlay_dev: str,
    segments: Iterable[NodeSegment],
    policy_hashes: Mapping[str, str],
    vteps: Iterable[str],
) -> bytes:
    doc = {
        "node": node,
        "vtep": vtep,
        "underlay_dev": underlay_dev,
        "segments": [
            [
                s.vni,
                s.pkey,
                s.tenant,
                s.workload,
                sorted(s.remote_vteps),
                sorted([e.workload, e.tenant, e.ip, e.mac] for e in s.local),
                sorted([m, v] for m, v in s.remote),
            ]
            for s in sorted(segments, key=lambda s: s.vni)
        ],  # fmt: skip
        "policies": dict(policy_hashes),
        "vteps": sorted(vteps),
        "v": 1,
    }
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def desired_sha256(
    node: str,
    vtep: str,
    underlay_dev: str,
    segments: Iterable[NodeSegment],
    policies: Mapping[str, NetworkPolicy],
    vteps: Iterable[str],
) -> str:
    """SHA-256 (hex) of a canonical encoding of a node's desired state: every list sorted,
    each policy by its :func:`~proofplane.network.policy.policy_sha256`, compact JSON with
    sorted keys. Order-independent: equal states hash equal."""
    hashes = {t: policy_sha256(p) for t, p in policies.items()}
    return hashlib.sha256(_hash_doc(node, vtep, underlay_dev, segments, hashes, vteps)).hexdigest()


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
    content is not the one the server hashed)."""
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
    sha = desired_sha256(node, vtep, underlay_dev, segments, policies, vteps)
    if sha != claimed:
        raise ValidationFailed(
            "the desired network state does not match its sha256",
            code="desired_state_mismatch",
            details={"claimed": claimed, "computed": sha},
        )
    return NodeDesired(node, vtep, underlay_dev, segments, policies, vteps, sha)


# (mac, vtep, node) per endpoint of a segment, sorted; (vtep, node) per node holding it, sorted
_SegView = tuple[list[tuple[str, str, str]], list[tuple[str, str]]]


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
        self._nodes: dict[str, NodeNet] = {n.name: n for n in nodes}
        self._failed: set[str] = set()
        self._segments: dict[int, Segment] = {}
        for seg in segments:
            self._add_segment(seg)
        self._policies: dict[str, NetworkPolicy] = dict(policies or {})
        self._policy_sha: dict[str, str] = {}
        self._endpoints: dict[str, Endpoint] = {}
        self._members: dict[int, dict[str, dict[str, Endpoint]]] = {}
        self._node_vnis: dict[str, set[int]] = {}
        self._views: dict[int, _SegView] = {}
        self._cache: dict[str, NodeDesired] = {}
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

    def desired(self, node: str) -> NodeDesired:
        """The node's desired state (cached until a change touches the node)."""
        hit = self._cache.get(node)
        if hit is not None:
            return hit
        net = self._nodes.get(node)
        if net is None:
            raise NotFound(f"node {node!r} has no network underlay", code="node_not_found",
                           details={"node": node})  # fmt: skip
        segs = []
        for vni in sorted(self._node_vnis.get(node, ())):
            seg = self._segments[vni]
            entries, holders = self._view(vni)
            segs.append(
                NodeSegment(
                    vni=vni,
                    pkey=seg.pkey,
                    tenant=seg.tenant,
                    workload=seg.workload,
                    remote_vteps=tuple(v for v, n in holders if n != node),
                    local=tuple(sorted(self._members[vni][node].values())),
                    remote=tuple((m, v) for m, v, n in entries if n != node),
                )
            )
        vteps = tuple(sorted({v for s in segs for v in s.remote_vteps}))
        tenants = sorted({s.tenant for s in segs})
        policies = {t: self.policy(t) for t in tenants}
        hashes = {t: self._psha(t) for t in tenants}
        doc = _hash_doc(node, net.vtep, net.underlay_dev, segs, hashes, vteps)
        out = NodeDesired(node, net.vtep, net.underlay_dev, tuple(segs), policies, vteps,
                          hashlib.sha256(doc).hexdigest())  # fmt: skip
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
        for ep in batch:
            old = self._endpoints.get(ep.workload)
            if old == ep:
                continue
            if old is not None:
                self._unlink(old, affected)
            self._endpoints[ep.workload] = ep
            byn = self._members.setdefault(ep.vni, {})
            if ep.node not in byn:
                self._node_vnis.setdefault(ep.node, set()).add(ep.vni)
            byn.setdefault(ep.node, {})[ep.workload] = ep
            self._touch(ep.vni, affected)
        return self._invalidate(affected)

    def remove(self, workloads: Iterable[str]) -> frozenset[str]:
        """Remove the workloads' endpoints (ended, evicted); unknown names are ignored."""
        affected: set[str] = set()
        for w in workloads:
            ep = self._endpoints.get(w)
            if ep is not None:
                self._unlink(ep, affected)
        return self._invalidate(affected)

    def set_policy(self, tenant: str, policy: NetworkPolicy | None) -> frozenset[str]:
        """Set (None: reset to the default) a tenant's policy: the nodes carrying any of its
        segments are affected, none if the policy is unchanged."""
        before = self.policy(tenant)
        if policy is None or policy == DEFAULT_POLICY:
            self._policies.pop(tenant, None)
        else:
            self._policies[tenant] = policy
        self._policy_sha.pop(tenant, None)
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
        self._failed.add(node)
        for vni in list(self._node_vnis.get(node, ())):
            for ep in list(self._members[vni][node].values()):
                self._unlink(ep, affected)
        return self._invalidate(affected)

    def upsert_node(self, node: NodeNet) -> frozenset[str]:
        """Register a node's underlay, change it (a new VTEP), or bring a failed node back:
        the node and, if its VTEP or device changed, the peers of its segments."""
        old = self._nodes.get(node.name)
        self._nodes[node.name] = node
        self._failed.discard(node.name)
        affected = {node.name}
        if old is not None and old.vtep != node.vtep:
            for vni in self._node_vnis.get(node.name, ()):
                self._touch(vni, affected)
        return self._invalidate(affected)

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
        old = self._segments.get(seg.vni)
        if old is not None and old != seg:
            raise SegmentInUse(f"VNI {seg.vni} already belongs to tenant {old.tenant!r}",
                               details={"vni": seg.vni, "tenant": old.tenant})  # fmt: skip
        self._segments[seg.vni] = seg

    def _check(self, ep: Endpoint) -> None:
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

    def _unlink(self, ep: Endpoint, affected: set[str]) -> None:
        self._touch(ep.vni, affected)  # before: the nodes that hold it now
        del self._endpoints[ep.workload]
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

    def _touch(self, vni: int, affected: set[str]) -> None:
        self._views.pop(vni, None)
        affected.update(self._members.get(vni, ()))

    def _invalidate(self, affected: set[str]) -> frozenset[str]:
        for n in affected:
            self._cache.pop(n, None)
        return frozenset(affected)

    def _psha(self, tenant: str) -> str:
        sha = self._policy_sha.get(tenant)
        if sha is None:
            sha = self._policy_sha[tenant] = policy_sha256(self.policy(tenant))
        return sha

    def _view(self, vni: int) -> _SegView:
        view = self._views.get(vni)
        if view is None:
            byn = self._members.get(vni, {})
            entries: list[tuple[str, str, str]] = []
            holders: list[tuple[str, str]] = []
            for n, eps in byn.items():
                vtep = self._nodes[n].vtep
                holders.append((vtep, n))
                entries.extend((e.mac, vtep, n) for e in eps.values())
            entries.sort()
            holders.sort()
            view = self._views[vni] = (entries, holders)
        return view


def compute_all(
    nodes: Iterable[NodeNet],
    segments: Iterable[Segment],
    policies: Mapping[str, NetworkPolicy],
    endpoints: Iterable[Endpoint],
) -> dict[str, NodeDesired]:
    """Every node's desired state from scratch (what :class:`NetworkIndex` keeps up to date)."""
    return NetworkIndex(nodes, segments, policies, endpoints).desired_all()
