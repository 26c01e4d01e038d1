"""A node's overlay as ``ip -batch`` / ``bridge -batch`` scripts, and the diff that gets a
running node there.

Per segment (VNI ``N``) the node carries::

    brN   a Linux bridge, MTU 1450 (one bridge per VNI: this kernel has no VLAN filtering)
    vxN   VXLAN id N, local <VTEP>, dev <underlay>, dstport 4789, nolearning, MTU 1450;
          a port of brN
    vh<8> per local workload: the host end of a veth pair (a port of brN, MTU 1450); its peer
          vw<8> carries the workload's MAC, MTU 1450, and is created in the workload's
          network namespace ppw-<8> (which must exist first: the executor or the agent makes it)

and in ``vxN``'s FDB: ``00:00:00:00:00:00 dst R`` per remote VTEP R (head-end replication of
broadcast, unknown unicast and multicast) and ``MAC dst R`` per remote workload (static:
``nolearning`` means the overlay never learns from the wire). MTU 1450: VXLAN adds 50 bytes to
a 1500-byte underlay.

:class:`RunningState` is what a node has (the agent reads it through pyroute2; only links
named as we name them count — ``br<digits>``, ``vx<digits>``, ``vh<8 hex>`` — so the underlay
and anything else on the node are never touched). :func:`diff` says what to remove and add;
the diff of a state already applied is empty (idempotent). :func:`render_diff` turns a diff
into batches: FDB removals, link removals, link additions and changes, FDB additions, in that
order, each cut into chunks (``ip -batch`` grows superlinearly past a few hundred links, and
a chunk that fails stops only its own lines).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from proofplane.network.desired import Endpoint, NodeDesired
from proofplane.network.render.nftables import render_nftables, ruleset_sha256

__all__ = [
    "OVERLAY_MTU",
    "UNDERLAY_MTU",
    "VXLAN_OVERHEAD",
    "VXLAN_PORT",
    "ZERO_MAC",
    "Batch",
    "Fdb",
    "Link",
    "NetworkDiff",
    "RunningState",
    "applied_state",
    "desired_fdb",
    "desired_links",
    "diff",
    "owned",
    "render_diff",
    "render_iproute2",
    "render_workload",
]

UNDERLAY_MTU = 1500
VXLAN_OVERHEAD = 50  # outer Ethernet 14 + IPv4 20 + UDP 8 + VXLAN 8
OVERLAY_MTU = UNDERLAY_MTU - VXLAN_OVERHEAD
VXLAN_PORT = 4789  # IANA
ZERO_MAC = "00:00:00:00:00:00"
DEFAULT_CHUNK = 500  # lines per `ip -batch` / `bridge -batch` run

_OWNED = re.compile(r"^(br\d{1,8}|vx\d{1,8}|vh[0-9a-f]{8})$")
_KIND_ORDER = {"bridge": 0, "vxlan": 1, "veth": 2}


def owned(name: str) -> bool:
    """Whether a link name is one proofplane manages (and so may remove)."""
    return _OWNED.fullmatch(name) is not None


@dataclass(frozen=True, slots=True)
class Link:
    """A link in the node's namespace.

    Identity (a difference means delete and create again): ``name``, ``kind``, and for a
    vxlan ``vni``, ``local``, ``dev``. Settable in place: ``master``, ``mtu``, ``up``. How to
    create a veth's other end (``peer``, ``address``, ``netns``) is not compared: from the
    node's namespace the agent cannot read it (deleting the host end deletes both)."""

    name: str
    kind: Literal["bridge", "vxlan", "veth"]
    master: str | None = None
    mtu: int = OVERLAY_MTU
    up: bool = True
    vni: int | None = None
    local: str | None = None
    dev: str | None = None
    peer: str | None = field(default=None, compare=False)
    address: str | None = field(default=None, compare=False)
    netns: str | None = field(default=None, compare=False)

    @property
    def identity(self) -> tuple[str, str, int | None, str | None, str | None]:
        return (self.name, self.kind, self.vni, self.local, self.dev)

    @property
    def settings(self) -> tuple[str | None, int, bool]:
        return (self.master, self.mtu, self.up)


@dataclass(frozen=True, slots=True, order=True)
class Fdb:
    """A VXLAN FDB entry: frames for ``mac`` (all zeros: BUM) on ``dev`` go to VTEP ``dst``."""

    dev: str
    mac: str
    dst: str


@dataclass(frozen=True, slots=True)
class RunningState:
    """What a node carries now: links by name (others than :func:`owned` ones are ignored),
    the VXLAN FDB entries that have a ``dst`` (bridge-learned entries are not ours), and the
    SHA-256 of the nftables ruleset it loaded (None: none)."""

    links: Mapping[str, Link] = field(default_factory=dict)
    fdb: frozenset[Fdb] = frozenset()
    ruleset_sha256: str | None = None

    @staticmethod
    def of(links: Iterable[Link], fdb: Iterable[Fdb], ruleset_sha256: str | None) -> RunningState:
        return RunningState({x.name: x for x in links}, frozenset(fdb), ruleset_sha256)


@dataclass(frozen=True, slots=True)
class NetworkDiff:
    """What to change, in the order it is applied: ``remove_fdb``, ``remove_links``,
    ``add_links``, ``set_links`` (the wanted settings of links that stay), ``add_fdb``, then
    ``ruleset`` (the nftables text to load; None: the loaded one is current)."""

    remove_fdb: tuple[Fdb, ...] = ()
    remove_links: tuple[Link, ...] = ()
    add_links: tuple[Link, ...] = ()
    set_links: tuple[Link, ...] = ()
    add_fdb: tuple[Fdb, ...] = ()
    ruleset: str | None = None

    @property
    def empty(self) -> bool:
        return not (
            self.remove_fdb
            or self.remove_links
            or self.add_links
            or self.set_links
            or self.add_fdb
            or self.ruleset is not None
        )

    @property
    def counts(self) -> dict[str, int]:
        return {
            "remove_fdb": len(self.remove_fdb),
            "remove_links": len(self.remove_links),
            "add_links": len(self.add_links),
            "set_links": len(self.set_links),
            "add_fdb": len(self.add_fdb),
            "ruleset": int(self.ruleset is not None),
        }


@dataclass(frozen=True, slots=True)
class Batch:
    """One run of ``ip -batch -`` or ``bridge -batch -`` with these lines on stdin."""

    tool: Literal["ip", "bridge"]
    lines: tuple[str, ...]

    @property
    def text(self) -> str:
        return "".join(line + "\n" for line in self.lines)


def desired_links(d: NodeDesired) -> dict[str, Link]:
    """The links the node must carry, by name."""
    out: dict[str, Link] = {}
    for s in d.segments:
        out[s.bridge] = Link(s.bridge, "bridge")
        out[s.vxlan] = Link(
            s.vxlan, "vxlan", master=s.bridge, vni=s.vni, local=d.vtep, dev=d.underlay_dev
        )
        for e in s.local:
            out[e.host_if] = Link(
                e.host_if, "veth", master=s.bridge, peer=e.peer_if, address=e.mac, netns=e.netns
            )
    return out


def desired_fdb(d: NodeDesired) -> frozenset[Fdb]:
    """The VXLAN FDB entries the node must carry."""
    out: set[Fdb] = set()
    for s in d.segments:
        out.update(Fdb(s.vxlan, ZERO_MAC, v) for v in s.remote_vteps)
        out.update(Fdb(s.vxlan, mac, v) for mac, v in s.remote)
    return frozenset(out)


def applied_state(d: NodeDesired) -> RunningState:
    """The running state of a node that applied ``d`` (and its ruleset) completely."""
    return RunningState(desired_links(d), desired_fdb(d), ruleset_sha256(render_nftables(d)))


def _link_key(link: Link) -> tuple[int, str]:
    return (_KIND_ORDER[link.kind], link.name)


def diff(d: NodeDesired, running: RunningState) -> NetworkDiff:
    """What takes ``running`` to ``d``: links that are missing or whose identity differs are
    (re)created, links of ours that are not wanted are removed, links whose settings differ
    are set; FDB entries likewise (those of a link being recreated are all added again, none
    removed); the ruleset when its SHA-256 differs."""
    want = desired_links(d)
    have = {name: link for name, link in running.links.items() if owned(name)}
    remove = [x for name, x in have.items() if name not in want]
    add: list[Link] = []
    change: list[Link] = []
    recreated: set[str] = set()
    for name, link in want.items():
        cur = have.get(name)
        if cur is None:
            add.append(link)
            recreated.add(name)
        elif cur.identity != link.identity:
            remove.append(cur)
            add.append(link)
            recreated.add(name)
        elif cur.settings != link.settings:
            change.append(link)
    # a bridge created again lost its ports: the ports that stay are enslaved again
    for link in want.values():
        if link.master in recreated and link.name not in recreated and link not in change:
            change.append(link)
    gone = {x.name for x in remove}
    want_fdb = desired_fdb(d)
    remove_fdb = sorted(f for f in running.fdb - want_fdb if f.dev not in gone and owned(f.dev))
    add_fdb = sorted(f for f in want_fdb if f.dev in recreated or f not in running.fdb)
    ruleset = render_nftables(d)
    return NetworkDiff(
        remove_fdb=tuple(remove_fdb),
        # ports first, bridges last
        remove_links=tuple(sorted(remove, key=_link_key, reverse=True)),
        add_links=tuple(sorted(add, key=_link_key)),
        set_links=tuple(sorted(change, key=_link_key)),
        add_fdb=tuple(add_fdb),
        ruleset=None if ruleset_sha256(ruleset) == running.ruleset_sha256 else ruleset,
    )


def _add_line(link: Link) -> str:
    if link.kind == "bridge":
        return f"link add name {link.name} mtu {link.mtu} type bridge"
    if link.kind == "vxlan":
        return (
            f"link add name {link.name} mtu {link.mtu} type vxlan id {link.vni} "
            f"local {link.local} dev {link.dev} dstport {VXLAN_PORT} nolearning"
        )
    peer = f"peer name {link.peer} mtu {link.mtu}"
    if link.address:
        peer += f" address {link.address}"
    if link.netns:
        peer += f" netns {link.netns}"
    return f"link add name {link.name} mtu {link.mtu} type veth {peer}"


def _set_line(link: Link, *, fresh: bool) -> str:
    # a link just created has its MTU and no master to undo; one that stays may have either
    mtu = "" if fresh else f" mtu {link.mtu}"
    master = f" master {link.master}" if link.master else "" if fresh else " nomaster"
    state = " up" if link.up else " down"
    return f"link set dev {link.name}{mtu}{master}{state}"


def _chunks(tool: Literal["ip", "bridge"], lines: list[str], chunk: int) -> list[Batch]:
    step = max(1, chunk)
    return [Batch(tool, tuple(lines[i : i + step])) for i in range(0, len(lines), step)]


def render_diff(diff: NetworkDiff, *, chunk: int = DEFAULT_CHUNK) -> tuple[Batch, ...]:
    """The diff's link and FDB changes as batches, in order: ``bridge`` FDB deletions,
    ``ip`` link deletions, ``ip`` link creations and settings (a segment's bridge before its
    ports, every link set up), ``bridge`` FDB appends; at most ``chunk`` lines each. (The
    ruleset, ``diff.ruleset``, is loaded apart with ``nft -f``.)"""
    fdb_del = [f"fdb del {f.mac} dev {f.dev} dst {f.dst}" for f in diff.remove_fdb]
    link_del = [f"link del dev {x.name}" for x in diff.remove_links]
    link_add: list[str] = []
    for x in diff.add_links:
        link_add.append(_add_line(x))
        link_add.append(_set_line(x, fresh=True))
    link_add.extend(_set_line(x, fresh=False) for x in diff.set_links)
    fdb_add = [f"fdb append {f.mac} dev {f.dev} dst {f.dst}" for f in diff.add_fdb]
    return (
        *_chunks("bridge", fdb_del, chunk),
        *_chunks("ip", link_del, chunk),
        *_chunks("ip", link_add, chunk),
        *_chunks("bridge", fdb_add, chunk),
    )


def render_iproute2(d: NodeDesired) -> tuple[str, str]:
    """The whole desired state as two scripts (``ip -batch``, ``bridge -batch``) for a node
    that carries none of it yet: the diff against an empty running state, unchunked."""
    batches = render_diff(diff(d, RunningState()), chunk=1 << 30)
    ip = "".join(b.text for b in batches if b.tool == "ip")
    bridge = "".join(b.text for b in batches if b.tool == "bridge")
    return ip, bridge


def render_workload(endpoint: Endpoint, subnet: str) -> str:
    """The lines for ``ip -n <endpoint.netns> -batch -``: the workload's end of the veth up
    with its overlay address (``replace``: running it again changes nothing)."""
    prefix = subnet.rsplit("/", 1)[1]
    return (
        "link set dev lo up\n"
        f"link set dev {endpoint.peer_if} mtu {OVERLAY_MTU} address {endpoint.mac} up\n"
        f"addr replace {endpoint.ip}/{prefix} dev {endpoint.peer_if}\n"
    )
