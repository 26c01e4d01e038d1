"""The node agent's network apply: read what the node carries, apply the diff to the desired
state the server computed, check the result, say so.

One round (:meth:`NetworkAgent.apply`):

1. **check** the desired state (:func:`check_desired`): names as proofplane makes them, MACs,
   addresses, VNIs in range, each endpoint's address inside its tenant's subnet. A state the
   agent cannot apply is not applied at all: the round reports a failed self-check that says
   why (``invalid_desired_state``), and the node keeps what it had;
2. **read** the running state: the links proofplane owns (``br<VNI>``, ``vx<VNI>``,
   ``vh<8 hex>``: the underlay and everything else on the node are never touched), the VXLAN
   FDB entries, and the nftables table ``inet proofplane``. By default through
   ``ip -j -d link show``, ``bridge -j fdb show`` and ``nft list table`` side by side (the
   kernel's dumps printed by C: on a node with hundreds of links and thousands of FDB entries
   about ten times faster than decoding them in Python); ``reader="netlink"`` reads the same
   through pyroute2;
3. **apply** :func:`proofplane.network.render.iproute2.diff` of the two: FDB removals, link
   removals, link creations (a workload's veth is created with its peer ``vw<8>`` in the
   workload's namespace ``ppw-<8>``, made here when missing, and that end is brought up with
   MTU 1450 and the overlay address through a netlink socket in that namespace), settings,
   FDB additions; then the ruleset with ``nft -f`` (one transaction: it replaces the table,
   nothing else). A small diff (the steady state: a workload placed or moved) goes through
   pyroute2 one operation at a time, each failure named; a large one (a node's first apply)
   through the rendered ``ip -batch``/``bridge -batch`` scripts, and what a batch refused is
   done through netlink after reading the node again;
4. **self-check**: read everything again; each segment present (bridge, VXLAN with the right
   VNI, VTEP and underlay device, on its bridge), each local endpoint on its bridge, the FDB
   exactly as desired, the ruleset loaded being the one rendered (its hash, and the table not
   changed since the agent loaded it), the underlay carrying the VTEP, bridged IPv4 passing
   the ``inet`` hooks (br_netfilter). ``ok`` only when all hold.

A second round with nothing changed changes nothing (the diff is empty). Whether the loaded
ruleset is still the one the agent loaded is decided by the hash of ``nft list table`` as the
agent read it right after loading; the agent keeps that (and the last applied generation) in
its state file (``state_dir``), so a one-shot agent run again does not reload either. A table
someone edited or flushed is loaded again.

``netns``: apply inside that named network namespace (``/run/netns/NAME``) instead of the
agent's own: the namespace test runs one agent per "node" namespace this way. The agent
process itself stays where it is (it talks to the server from there).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import ipaddress
import json
import os
import re
import socket
import struct
import subprocess
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

from pyroute2.netlink import (
    NLM_F_ACK,
    NLM_F_CREATE,
    NLM_F_REPLACE,
    NLM_F_REQUEST,
    NLMSG_ERROR,
)
from pyroute2.netlink.rtnl import RTM_DELLINK, RTM_GETLINK, RTM_NEWADDR, RTM_NEWLINK

from proofplane.errors import ProofplaneError
from proofplane.network.desired import Endpoint, NodeDesired, desired_from_json
from proofplane.network.render.iproute2 import (
    OVERLAY_MTU,
    VXLAN_PORT,
    Batch,
    Fdb,
    Link,
    NetworkDiff,
    RunningState,
    desired_fdb,
    desired_links,
    diff,
    owned,
    render_diff,
)
from proofplane.network.render.nftables import (
    TABLE,
    loaded_sha256,
    render_nftables,
    ruleset_sha256,
)

__all__ = [
    "NETNS_DIR",
    "BATCH_OVER",
    "METHODS",
    "NOTHING_APPLIED",
    "ApplyResult",
    "Host",
    "NetworkAgent",
    "NetworkApplyError",
    "Running",
    "check_desired",
    "read_running",
    "READERS",
    "report_body",
]

NETNS_DIR = Path("/run/netns")
#: The ``applied_sha256`` an agent reports before it has applied any desired state completely
#: (the SHA-256 of nothing), with generation 0.
NOTHING_APPLIED = hashlib.sha256(b"").hexdigest()
MAX_LISTED = 20  # entries per list in a self-check (the report stays small)
#: How a round changes the node: ``netlink`` (pyroute2, one operation at a time: precise, each
#: failure named), ``batch`` (the rendered ``ip -batch``/``bridge -batch`` scripts: a process
#: per chunk, far faster for hundreds of links), ``auto``: batches for a diff of more than
#: BATCH_OVER operations (a node's first apply), netlink otherwise (the steady state).
METHODS = ("auto", "netlink", "batch")
#: How a round reads the node (see :func:`read_running`).
READERS = ("json", "netlink")
BATCH_OVER = 64
PARALLEL_BATCHES = 4  # FDB batches (and the ruleset load) side by side, beside the workload ends
_IFNAME = re.compile(r"^[A-Za-z0-9_.:-]{1,15}$")
_MAC = re.compile(r"^[0-9a-f]{2}(:[0-9a-f]{2}){5}$")
_NETNS = re.compile(r"^ppw-[0-9a-f]{8}$")
_VNI_MAX = (1 << 24) - 1
_BR_NF = "/proc/sys/net/bridge/bridge-nf-call-iptables"
IFF_UP = 1


class NetworkApplyError(ProofplaneError):
    """The agent cannot reach the node's network at all (no such namespace, no netlink)."""

    code = "network_apply_failed"


# --------------------------------------------------------------------------- checking


def _ipv4(text: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(text), ipaddress.IPv4Address)
    except ValueError:
        return False


def _unicast_mac(text: str) -> bool:
    return _MAC.fullmatch(text) is not None and not int(text[:2], 16) & 1


def check_desired(d: NodeDesired) -> list[str]:
    """What makes ``d`` impossible to apply ([] when nothing does): each problem one line."""
    out: list[str] = []
    if not _ipv4(d.vtep):
        out.append(f"VTEP {d.vtep!r} is not an IPv4 address")
    if not _IFNAME.fullmatch(d.underlay_dev) or owned(d.underlay_dev):
        out.append(f"underlay device {d.underlay_dev!r} is not a usable interface name")
    out.extend(f"allow-listed VTEP {v!r} is not an IPv4 address" for v in d.vteps if not _ipv4(v))
    names: dict[str, str] = {}
    for s in d.segments:
        where = f"segment {s.vni}"
        if not 1 <= s.vni <= _VNI_MAX:
            out.append(f"{where}: the VNI is outside 1..{_VNI_MAX}")
            continue
        policy = d.policies.get(s.tenant)
        if policy is None:
            out.append(f"{where}: no policy for tenant {s.tenant!r}")
            continue
        subnet = ipaddress.ip_network(policy.subnet)
        for v in s.remote_vteps:
            if not _ipv4(v) or v == d.vtep:
                out.append(f"{where}: remote VTEP {v!r} is not another node's IPv4 address")
        for mac, v in s.remote:
            if not _unicast_mac(mac) or not _ipv4(v):
                out.append(f"{where}: remote endpoint {mac!r} at {v!r} is malformed")
        for e in s.local:
            if not _unicast_mac(e.mac):
                out.append(f"{where}: endpoint {e.workload!r} has no unicast MAC ({e.mac!r})")
            try:
                inside = ipaddress.ip_address(e.ip) in subnet
            except ValueError:
                inside = False
            if not inside:
                out.append(f"{where}: endpoint {e.workload!r} address {e.ip!r} is not in {subnet}")
            for name in (e.host_if, e.peer_if, e.netns):
                if name in names:
                    out.append(f"{where}: {name} of {e.workload!r} is also {names[name]!r}'s")
                names[name] = e.workload
    return out


# --------------------------------------------------------------------------- the node


class Host:
    """The node's network: the agent's own namespace (``netns`` None) or a named one.

    Netlink goes through ``pyroute2``; ``nft`` runs in the namespace (``ip netns exec``).
    Workload namespaces (``ppw-<8>``) are named namespaces beside it."""

    def __init__(self, netns: str | None = None, netns_dir: Path = NETNS_DIR) -> None:
        self.netns = netns
        self.netns_dir = netns_dir

    def exists(self) -> bool:
        return self.netns is None or (self.netns_dir / self.netns).exists()

    def netlink(self) -> Any:
        """An ``IPRoute`` socket in the node's namespace (close it)."""
        from pyroute2 import IPRoute

        if not self.exists():  # pyroute2 would create a missing one
            raise NetworkApplyError(
                f"no network namespace {self.netns!r}", details={"netns": self.netns}
            )
        return IPRoute(netns=self.netns) if self.netns else IPRoute()

    def run(self, argv: list[str], stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        """Run a tool in the node's namespace; never raises for its exit status."""
        cmd = ["ip", "netns", "exec", self.netns, *argv] if self.netns else argv
        try:
            return subprocess.run(
                cmd, input=stdin, capture_output=True, text=True, timeout=60, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return subprocess.CompletedProcess(cmd, 127, "", str(exc))

    def run_many(self, argvs: list[list[str]]) -> list[subprocess.CompletedProcess[str]]:
        """Several tools in the node's namespace at once (``ip``/``bridge`` with ``-n``,
        others through ``ip netns exec``); never raises for an exit status."""
        cmds = []
        for argv in argvs:
            if self.netns and argv[0] in ("ip", "bridge"):
                cmds.append([argv[0], "-n", self.netns, *argv[1:]])
            elif self.netns:
                cmds.append(["ip", "netns", "exec", self.netns, *argv])
            else:
                cmds.append(list(argv))
        procs: list[subprocess.Popen[str] | None] = []
        errors: list[str] = []
        for cmd in cmds:
            try:
                procs.append(
                    subprocess.Popen(
                        cmd,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE,
                        stdin=subprocess.DEVNULL,
                        text=True,
                    )
                )
                errors.append("")
            except OSError as exc:
                procs.append(None)
                errors.append(str(exc))
        out = []
        for cmd, proc, err in zip(cmds, procs, errors, strict=True):
            if proc is None:
                out.append(subprocess.CompletedProcess(cmd, 127, "", err))
                continue
            try:
                stdout, stderr = proc.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                stdout, stderr = proc.communicate()
            out.append(subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr))
        return out

    def tool(self, argv: list[str], stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        """``ip``/``bridge`` in the node's namespace (``-n``); never raises for its status."""
        cmd = [argv[0], "-n", self.netns, *argv[1:]] if self.netns else argv
        try:
            return subprocess.run(
                cmd, input=stdin, capture_output=True, text=True, timeout=120, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return subprocess.CompletedProcess(cmd, 127, "", str(exc))

    def create_namespaces(self, names: list[str]) -> str | None:
        """Create the missing named namespaces (one ``ip -batch`` for all); an error text or
        None."""
        missing = [n for n in names if not (self.netns_dir / n).exists()]
        if not missing:
            return None
        proc = subprocess.run(
            ["ip", "-batch", "-"],
            input="".join(f"netns add {n}\n" for n in missing),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        return None if proc.returncode == 0 else (proc.stderr.strip() or "ip netns add failed")

    def first_ipv4(self, dev: str) -> str | None:
        """The first IPv4 address on ``dev`` (the VTEP an agent registers), None if none."""
        ipr = self.netlink()
        try:
            found = ipr.link_lookup(ifname=dev)
            if not found:
                return None
            for a in ipr.get_addr(index=found[0], family=2):  # AF_INET
                return str(a.get("IFA_ADDRESS"))
            return None
        finally:
            ipr.close()

    def bridge_nf_call_iptables(self) -> bool | None:
        """The namespace's ``net.bridge.bridge-nf-call-iptables`` (None: no br_netfilter)."""
        from pyroute2 import netns

        if self.netns:
            netns.pushns(self.netns)
        try:
            with open(_BR_NF, encoding="ascii") as f:  # /proc/sys/net is the thread's netns
                return f.read().strip() == "1"
        except OSError:
            return None
        finally:
            if self.netns:
                netns.popns()


class WorkloadNetlink:
    """A route netlink socket inside a workload's namespace, with the few requests a workload
    end needs (link up, MTU, address, removal), encoded with pyroute2's message classes and
    sent straight on the socket: ~0.5 ms a workload, where pyroute2's ``IPRoute`` (its event
    loop per request) or an ``ip -n`` process costs several. The calling thread enters the
    namespace only to open the socket (pyroute2's ``pushns``: call it from one thread)."""

    def __init__(self, netns: str) -> None:
        from pyroute2 import netns as pr_netns

        pr_netns.pushns(netns)
        try:
            self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0)  # NETLINK_ROUTE
        finally:
            pr_netns.popns()
        self.sock.bind((0, 0))
        self.seq = 0

    def __enter__(self) -> WorkloadNetlink:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.sock.close()

    def _ask(self, msg: Any, kind: int, flags: int) -> bytes:
        self.seq += 1
        msg["header"]["type"] = kind
        msg["header"]["flags"] = NLM_F_REQUEST | flags
        msg["header"]["sequence_number"] = self.seq
        msg.encode()
        self.sock.send(msg.data)
        data: bytes = self.sock.recv(65536)
        if struct.unpack_from("=H", data, 4)[0] == NLMSG_ERROR:
            err = struct.unpack_from("=i", data, 16)[0]
            if err:
                raise OSError(-err, os.strerror(-err))
        return data

    def index(self, ifname: str) -> int:
        from pyroute2.netlink.rtnl.ifinfmsg import ifinfmsg

        m = ifinfmsg()
        m["attrs"] = [("IFLA_IFNAME", ifname)]
        data = self._ask(m, RTM_GETLINK, 0)
        return int(struct.unpack_from("=i", data, 20)[0])  # nlmsghdr, then ifinfomsg.ifi_index

    def up(self, ifname: str, mtu: int | None = None) -> None:
        from pyroute2.netlink.rtnl.ifinfmsg import ifinfmsg

        m = ifinfmsg()
        m["flags"] = m["change"] = IFF_UP
        m["attrs"] = [("IFLA_IFNAME", ifname)] + ([("IFLA_MTU", mtu)] if mtu else [])
        self._ask(m, RTM_NEWLINK, NLM_F_ACK)

    def address(self, ifname: str, ip: str, prefix: int) -> None:
        """``ip addr replace IP/PREFIX dev IFNAME``."""
        from pyroute2.netlink.rtnl.ifaddrmsg import ifaddrmsg

        m = ifaddrmsg()
        m["family"], m["prefixlen"], m["index"] = socket.AF_INET, prefix, self.index(ifname)
        m["attrs"] = [("IFA_LOCAL", ip), ("IFA_ADDRESS", ip)]
        self._ask(m, RTM_NEWADDR, NLM_F_ACK | NLM_F_CREATE | NLM_F_REPLACE)

    def delete(self, ifname: str) -> None:
        """Remove the link if it is there."""
        from pyroute2.netlink.rtnl.ifinfmsg import ifinfmsg

        m = ifinfmsg()
        m["attrs"] = [("IFLA_IFNAME", ifname)]
        try:
            self._ask(m, RTM_DELLINK, NLM_F_ACK)
        except OSError as exc:
            if exc.errno != errno.ENODEV:
                raise


def configure_end(e: Endpoint, prefix: int) -> None:
    """The workload's end of its veth, in its namespace: ``lo`` and the end up, MTU 1450, the
    overlay address (what N1's ``render_workload`` says, through netlink)."""
    with WorkloadNetlink(e.netns) as nl:
        nl.up("lo")
        nl.up(e.peer_if, OVERLAY_MTU)
        nl.address(e.peer_if, e.ip, prefix)


@dataclass(frozen=True, slots=True)
class Running:
    """What the node carries, as read: the links and FDB entries that are proofplane's
    (:class:`RunningState`, with the ruleset's hash when it is the one the agent loaded),
    plus what the self-check needs besides."""

    state: RunningState
    index: Mapping[str, int]  # every link's ifindex by name
    foreign: tuple[str, ...]  # our names on links of another kind (removed)
    bridges_nf_off: tuple[str, ...]  # our bridges that do not pass bridged IPv4 to inet
    listing: str | None  # `nft list table inet proofplane`; None: no table
    loaded_sha256: str | None  # the hash the table's comment carries


class _Raw(NamedTuple):
    """A link as either reader sees it."""

    ifindex: int
    name: str
    kind: str | None
    master: str | None
    mtu: int
    up: bool
    vni: int | None = None
    local: str | None = None
    dev: str | None = None
    learning: bool = False
    port: int | None = None
    nf_call_iptables: bool = False


def _nla(msg: Any) -> dict[str, Any]:
    """A netlink message's attribute slots by name (decoded only when read: pyroute2 decodes
    lazily, and ``msg.get`` scans the list each time)."""
    return {} if msg is None else {slot[0]: slot for slot in msg["attrs"]}


def _val(attrs: Mapping[str, Any], key: str) -> Any:
    slot = attrs.get(key)
    return None if slot is None else slot[1]


def _raw_netlink(ipr: Any) -> tuple[list[_Raw], list[tuple[str, str, str]]]:
    """Links and VXLAN FDB entries through pyroute2 (``IPRoute`` in the namespace)."""
    msgs = [(m["index"], m["flags"], _nla(m)) for m in ipr.get_links()]
    names = {i: _val(a, "IFLA_IFNAME") for i, _f, a in msgs}
    out: list[_Raw] = []
    for i, flags, a in msgs:
        name = names[i]
        info = _nla(_val(a, "IFLA_LINKINFO"))
        kind = _val(info, "IFLA_INFO_KIND")
        data = _nla(_val(info, "IFLA_INFO_DATA")) if owned(name) else {}
        master = _val(a, "IFLA_MASTER")
        out.append(
            _Raw(
                i,
                name,
                kind,
                names.get(master) if master else None,
                int(_val(a, "IFLA_MTU") or 0),
                bool(flags & 1),
                vni=_val(data, "IFLA_VXLAN_ID"),
                local=_val(data, "IFLA_VXLAN_LOCAL"),
                dev=names.get(_val(data, "IFLA_VXLAN_LINK")),
                learning=bool(_val(data, "IFLA_VXLAN_LEARNING")),
                port=_val(data, "IFLA_VXLAN_PORT"),
                nf_call_iptables=bool(_val(data, "IFLA_BR_NF_CALL_IPTABLES")),
            )
        )
    vxlans = {x.ifindex: x.name for x in out if x.kind == "vxlan" and owned(x.name)}
    fdb = []
    for n in ipr.fdb("dump"):
        dev = vxlans.get(n["ifindex"])
        if dev is not None:
            a = _nla(n)
            fdb.append((dev, _val(a, "NDA_LLADDR"), _val(a, "NDA_DST")))
    return out, fdb


def _raw_json(links_json: str, fdb_json: str) -> tuple[list[_Raw], list[tuple[str, str, str]]]:
    """The same from ``ip -j -d link show`` and ``bridge -j fdb show``."""
    out: list[_Raw] = []
    for m in json.loads(links_json or "[]"):
        name = str(m.get("ifname"))
        info = m.get("linkinfo") or {}
        data = (info.get("info_data") or {}) if owned(name) else {}
        out.append(
            _Raw(
                int(m.get("ifindex", 0)),
                name,
                info.get("info_kind"),
                m.get("master"),
                int(m.get("mtu") or 0),
                "UP" in (m.get("flags") or ()),
                vni=data.get("id"),
                local=data.get("local"),
                dev=data.get("link"),
                learning=bool(data.get("learning")),
                port=data.get("port"),
                nf_call_iptables=bool(data.get("nf_call_iptables")),
            )
        )
    vxlans = {x.name for x in out if x.kind == "vxlan" and owned(x.name)}
    fdb = [
        (str(e.get("ifname")), e.get("mac"), e.get("dst"))
        for e in json.loads(fdb_json or "[]")
        if e.get("ifname") in vxlans
    ]
    return out, fdb


def _listing_sha(listing: str) -> str:
    return hashlib.sha256(listing.encode()).hexdigest()


_KINDS = {"br": "bridge", "vx": "vxlan", "vh": "veth"}
NFT_LIST = ["nft", "list", "table", *TABLE.split()]


def read_running(
    host: Host, ipr: Any = None, trusted_listing: str | None = None, *, via: str = "json"
) -> Running:
    """Read the node's links, VXLAN FDB and the table ``inet proofplane``.

    ``via``: ``json`` (``ip -j -d link show``, ``bridge -j fdb show`` and ``nft list`` side by
    side: the kernel's dump printed by C, ~10 times faster than decoding it in Python on a
    node with hundreds of links and thousands of FDB entries), or ``netlink`` (through
    ``ipr``, an ``IPRoute`` in the namespace: pyroute2). Both read the same state.

    ``trusted_listing``: SHA-256 of the table listing as the agent read it right after it
    loaded the ruleset; the state's ``ruleset_sha256`` is the table's hash only while the
    listing is still that one (else None, and the diff loads the ruleset again)."""
    if via == "json":
        procs = host.run_many(
            [["ip", "-j", "-d", "link", "show"], ["bridge", "-j", "fdb", "show"], NFT_LIST]
        )
        for p in procs[:2]:
            if p.returncode != 0:
                raise NetworkApplyError(f"{' '.join(p.args)}: {p.stderr.strip()[:300]}")
        raw, raw_fdb = _raw_json(procs[0].stdout, procs[1].stdout)
        nft = procs[2]
    else:
        raw, raw_fdb = _raw_netlink(ipr)
        nft = host.run(NFT_LIST)
    index: dict[str, int] = {}
    links: list[Link] = []
    foreign: list[str] = []
    nf_off: list[str] = []
    for x in raw:
        index[x.name] = x.ifindex
        if not owned(x.name):
            continue
        if x.kind != _KINDS[x.name[:2]]:
            foreign.append(x.name)
            continue
        if x.kind == "vxlan":
            # learning on, or another port: not a VXLAN of ours (no VNI: the diff recreates it)
            vni = None if x.learning or x.port != VXLAN_PORT else x.vni
            links.append(Link(x.name, "vxlan", x.master, x.mtu, x.up, vni, x.local, x.dev))
        elif x.kind == "bridge":
            if not x.nf_call_iptables:
                nf_off.append(x.name)
            links.append(Link(x.name, "bridge", x.master, x.mtu, x.up))
        else:
            links.append(Link(x.name, "veth", x.master, x.mtu, x.up))
    fdb = {Fdb(dev, str(mac).lower(), str(dst)) for dev, mac, dst in raw_fdb if mac and dst}
    listing = nft.stdout if nft.returncode == 0 else None
    loaded = None if listing is None else loaded_sha256(listing)
    trusted = loaded if listing is not None and _listing_sha(listing) == trusted_listing else None
    return Running(
        state=RunningState.of(links, fdb, trusted),
        index=index,
        foreign=tuple(sorted(foreign)),
        bridges_nf_off=tuple(sorted(nf_off)),
        listing=listing,
        loaded_sha256=loaded,
    )


def _underlay(ipr: Any, dev: str, index: Mapping[str, int]) -> tuple[bool, frozenset[str]]:
    i = index.get(dev)
    if i is None:
        return False, frozenset()
    up = any(m["flags"] & 1 for m in ipr.get_links(i))
    addrs = frozenset(str(a.get("IFA_ADDRESS")) for a in ipr.get_addr(index=i))
    return up, addrs


# --------------------------------------------------------------------------- applying


def _size(plan: NetworkDiff) -> int:
    """Netlink operations a diff takes (a new link: add and set)."""
    return (
        len(plan.remove_fdb)
        + len(plan.remove_links)
        + 2 * len(plan.add_links)
        + len(plan.set_links)
        + len(plan.add_fdb)
    )


def _prefix(d: NodeDesired, tenant: str) -> int:
    return ipaddress.ip_network(d.policies[tenant].subnet).prefixlen


@dataclass
class ApplyResult:
    """One round: what changed (counts), the errors met, the self-check, the ruleset hash
    the node verifiably runs (None: not the desired one), and how long it took."""

    desired_sha256: str | None
    changes: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    self_check: dict[str, Any] = field(default_factory=dict)
    ruleset_sha256: str | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return bool(self.self_check.get("ok"))

    @property
    def changed(self) -> bool:
        return any(self.changes.values())


def report_body(generation: int, applied_sha256: str, result: ApplyResult) -> dict[str, Any]:
    """The body of ``POST /api/v1/nodes/{name}/network/report``."""
    return {
        "applied_generation": generation,
        "applied_sha256": applied_sha256,
        "ruleset_sha256": result.ruleset_sha256,
        "self_check": result.self_check,
    }


def _short(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if len(text) <= 300 else text[:300] + "…"


class _Ops:
    """The netlink operations of one round, each failure kept (with what it was doing)
    rather than raised: a failed step leaves the rest to run, and the self-check says what
    the node lacks."""

    def __init__(
        self, ipr: Any, host: Host, index: Mapping[str, int], errors: list[str] | None = None
    ) -> None:
        self.ipr = ipr
        self.host = host
        self.index = dict(index)
        self.errors: list[str] = [] if errors is None else errors

    def do(self, what: str, fn: Callable[[], Any]) -> bool:
        try:
            fn()
        except Exception as exc:  # netlink, OS, or a value pyroute2 refuses: one line each
            self.errors.append(f"{what}: {_short(exc)}")
            return False
        return True

    def lookup(self, name: str) -> int:
        i = self.index.get(name)
        if i is None:
            found = self.ipr.link_lookup(ifname=name)
            if not found:
                raise LookupError(f"no link {name}")
            i = self.index[name] = found[0]
        return i

    def delete(self, name: str) -> None:
        i = self.lookup(name)
        try:
            self.ipr.link("del", index=i)
        except Exception as exc:
            if getattr(exc, "code", None) != errno.ENODEV:  # a veth peer's removal took it
                raise
        self.index.pop(name, None)

    def add(self, link: Link, endpoint: Endpoint | None, prefix: int | None) -> None:
        if link.kind == "bridge":
            self.ipr.link(
                "add",
                ifname=link.name,
                kind="bridge",
                mtu=link.mtu,
                br_nf_call_iptables=1,
                br_nf_call_ip6tables=1,
            )
        elif link.kind == "vxlan":
            self.ipr.link(
                "add",
                ifname=link.name,
                kind="vxlan",
                mtu=link.mtu,
                vxlan_id=link.vni,
                vxlan_local=link.local,
                vxlan_link=self.lookup(str(link.dev)),
                vxlan_port=VXLAN_PORT,
                vxlan_learning=0,
            )
        else:
            assert endpoint is not None and prefix is not None
            self._add_veth(link, endpoint, prefix)
        self.index.pop(link.name, None)
        self.set(link)

    def _add_veth(self, link: Link, e: Endpoint, prefix: int) -> None:
        peer = {"ifname": e.peer_if, "net_ns_fd": e.netns, "address": e.mac, "mtu": link.mtu}
        try:
            self.ipr.link("add", ifname=link.name, kind="veth", mtu=link.mtu, peer=peer)
        except Exception as exc:
            if getattr(exc, "code", None) != errno.EEXIST:
                raise
            # the workload's end is left over in its namespace (the workload moved here from
            # another node of the same kernel, or an earlier round stopped half-way)
            with WorkloadNetlink(e.netns) as nl:
                nl.delete(e.peer_if)
            self.ipr.link("add", ifname=link.name, kind="veth", mtu=link.mtu, peer=peer)
        try:
            configure_end(e, prefix)
        except Exception:
            # the next round creates the pair again rather than leave a half-made endpoint
            with contextlib.suppress(Exception):
                self.delete(link.name)
            raise

    def set(self, link: Link) -> None:
        master = self.lookup(link.master) if link.master else 0
        self.ipr.link(
            "set",
            index=self.lookup(link.name),
            mtu=link.mtu,
            master=master,
            state="up" if link.up else "down",
        )

    def bridge_nf(self, name: str) -> None:
        """Bridged IPv4/IPv6 of this bridge through the ``inet`` hooks (br_netfilter), whatever
        the namespace's ``bridge-nf-call-iptables`` says: the tenant policy lives there."""
        self.ipr.link(
            "set",
            index=self.lookup(name),
            kind="bridge",
            br_nf_call_iptables=1,
            br_nf_call_ip6tables=1,
        )

    def fdb(self, op: str, f: Fdb) -> None:
        self.ipr.fdb(op, ifindex=self.lookup(f.dev), lladdr=f.mac, dst=f.dst)


@dataclass
class _Memory:
    """What the agent keeps between rounds (and, with a state directory, between runs)."""

    ruleset_sha256: str | None = None
    listing_sha256: str | None = None
    generation: int | None = None
    applied_sha256: str | None = None

    @staticmethod
    def load(path: Path | None) -> _Memory:
        if path is None:
            return _Memory()
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            return _Memory(
                data.get("ruleset_sha256"),
                data.get("listing_sha256"),
                data.get("generation"),
                data.get("applied_sha256"),
            )
        except (OSError, ValueError, AttributeError):
            return _Memory()

    def save(self, path: Path | None) -> None:
        if path is None:
            return
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text(json.dumps(self.__dict__, sort_keys=True), encoding="utf-8")
            os.replace(tmp, path)
        except OSError:
            pass  # the next run reloads the ruleset: correct, only not idle


class NetworkAgent:
    """Applies desired states to one node (its own namespace, or ``netns``)."""

    def __init__(
        self,
        netns: str | None = None,
        *,
        state_dir: Path | None = None,
        netns_dir: Path = NETNS_DIR,
        method: str = "auto",
        reader: str = "json",
    ) -> None:
        if method not in METHODS or reader not in READERS:
            raise ValueError(f"method {method!r}, reader {reader!r}: one of {METHODS}, {READERS}")
        self.method = method
        self.reader = reader
        self.host = Host(netns, netns_dir)
        self.state_path = (
            None if state_dir is None else state_dir / f"network-{netns or 'host'}.json"
        )
        self.memory = _Memory.load(self.state_path)

    # ------------------------------------------------------------------ memory
    @property
    def applied(self) -> tuple[int | None, str | None]:
        """(generation, sha256) of the last desired state this agent applied completely."""
        return self.memory.generation, self.memory.applied_sha256

    def remember(self, generation: int, result: ApplyResult) -> None:
        if result.ok and result.desired_sha256 is not None:
            self.memory.generation = generation
            self.memory.applied_sha256 = result.desired_sha256
            self.memory.save(self.state_path)

    # ------------------------------------------------------------------ rounds
    def apply_document(self, doc: Mapping[str, Any]) -> tuple[int | None, ApplyResult]:
        """Apply the server's JSON (``GET /nodes/{name}/network``): its generation (None when
        it has none) and the round. A document that is not a desired state is not applied:
        a failed self-check says why."""
        generation = doc.get("generation") if isinstance(doc, Mapping) else None
        if not isinstance(generation, int) or isinstance(generation, bool):
            generation = None
        try:
            if not isinstance(doc, Mapping):
                raise ProofplaneError(
                    "the desired state is not a JSON object", code="invalid_desired_state"
                )
            desired = desired_from_json(doc)
        except ProofplaneError as exc:
            return generation, self.refused(exc.code, exc.message)
        return generation, self.apply(desired)

    def refused(self, code: str, message: str) -> ApplyResult:
        """A round that applied nothing: the failed self-check carries the reason."""
        return ApplyResult(
            desired_sha256=None,
            errors=[message],
            self_check={
                "ok": False,
                "reasons": [code],
                "error": {"code": code, "message": message[:2000]},
            },
        )

    def apply(self, desired: NodeDesired) -> ApplyResult:
        """Take the node to ``desired`` and check it (see the module docstring)."""
        t0 = time.perf_counter()
        problems = check_desired(desired)
        if problems:
            result = self.refused("invalid_desired_state", "; ".join(problems[:MAX_LISTED]))
            result.desired_sha256 = None
            result.seconds = time.perf_counter() - t0
            return result
        try:
            ipr = self.host.netlink()
        except ProofplaneError as exc:
            return self.refused(exc.code, exc.message)
        except Exception as exc:  # no netlink at all (not root, no pyroute2 support)
            return self.refused("network_apply_failed", f"netlink: {_short(exc)}")
        try:
            result = self._apply(ipr, desired)
        except ProofplaneError as exc:  # the node's state could not be read
            result = self.refused(exc.code, exc.message)
        except Exception as exc:  # the agent goes on and reports; the reason is in the report
            result = self.refused("network_apply_failed", f"{type(exc).__name__}: {_short(exc)}")
        finally:
            ipr.close()
        result.seconds = time.perf_counter() - t0
        return result

    def _read(self, ipr: Any) -> Running:
        return read_running(self.host, ipr, self.memory.listing_sha256, via=self.reader)

    def _apply(self, ipr: Any, desired: NodeDesired) -> ApplyResult:
        running = self._read(ipr)
        plan = diff(desired, running.state)
        ops = _Ops(ipr, self.host, running.index)
        batch_errors: list[str] = []
        nf = self.host.bridge_nf_call_iptables()
        size = _size(plan)
        if self.method == "batch" or (self.method == "auto" and size > BATCH_OVER):
            changes = self._execute_batch(desired, running, plan, batch_errors, ops.errors)
            after = self._read(ipr)
            rest = dataclasses.replace(diff(desired, after.state), ruleset=None)
            if not rest.empty:  # what the batches could not do (a left-over veth end): netlink
                ops = _Ops(ipr, self.host, after.index, ops.errors)
                for key, n in self._execute(ops, desired, after, rest, nf).items():
                    changes[key] = changes.get(key, 0) + n
                after = self._read(ipr)
        else:
            changes = self._execute(ops, desired, running, plan, nf)
            after = running if not any(changes.values()) and not ops.errors else self._read(ipr)
        up, addrs = _underlay(ipr, desired.underlay_dev, after.index)
        check = self._self_check(desired, after, nf, up, addrs, ops.errors)
        check["method"] = "batch" if changes.get("batches") else "netlink"
        if batch_errors:  # what a batch refused and the netlink pass then did (or not: errors)
            check["recovered"] = batch_errors[:MAX_LISTED]
        expected = check["ruleset"]["expected"]
        return ApplyResult(
            desired_sha256=desired.sha256,
            changes=changes,
            errors=ops.errors,
            self_check=check,
            ruleset_sha256=expected if check["ruleset"]["ok"] else after.loaded_sha256,
        )

    def _execute(
        self, ops: _Ops, d: NodeDesired, running: Running, plan: NetworkDiff, nf: bool | None
    ) -> dict[str, int]:
        """The diff through netlink, one operation at a time."""
        endpoints = {e.host_if: e for s in d.segments for e in s.local}
        prefixes = {e.host_if: _prefix(d, s.tenant) for s in d.segments for e in s.local}
        changes = dict.fromkeys(
            (
                "remove_foreign",
                "remove_fdb",
                "remove_links",
                "add_links",
                "set_links",
                "add_fdb",
                "ruleset",
                "bridge_nf",
            ),
            0,
        )
        for name in running.foreign:
            changes["remove_foreign"] += ops.do(f"remove {name}", partial(ops.delete, name))
        for f in plan.remove_fdb:
            changes["remove_fdb"] += ops.do(
                f"fdb del {f.mac} {f.dev} {f.dst}", partial(ops.fdb, "del", f)
            )
        for x in plan.remove_links:
            changes["remove_links"] += ops.do(f"remove {x.name}", partial(ops.delete, x.name))
        veths = [x for x in plan.add_links if x.kind == "veth"]
        if veths:
            err = self.host.create_namespaces(sorted({endpoints[x.name].netns for x in veths}))
            if err:
                ops.errors.append(f"workload namespaces: {err}")
        for x in plan.add_links:
            e, p = endpoints.get(x.name), prefixes.get(x.name)
            changes["add_links"] += ops.do(f"add {x.kind} {x.name}", partial(ops.add, x, e, p))
        for x in plan.set_links:
            changes["set_links"] += ops.do(f"set {x.name}", partial(ops.set, x))
        if nf is not True:  # the namespace does not send bridged IPv4 to inet: each bridge must
            wanted = {s.bridge for s in d.segments}
            for name in (n for n in running.bridges_nf_off if n in wanted):
                changes["bridge_nf"] += ops.do(
                    f"br_netfilter on {name}", partial(ops.bridge_nf, name)
                )
        for f in plan.add_fdb:
            changes["add_fdb"] += ops.do(
                f"fdb append {f.mac} {f.dev} {f.dst}", partial(ops.fdb, "append", f)
            )
        if plan.ruleset is not None:
            changes["ruleset"] = int(self._load_ruleset(plan.ruleset, ops.errors))
        return changes

    def _execute_batch(
        self,
        d: NodeDesired,
        running: Running,
        plan: NetworkDiff,
        errors: list[str],
        ruleset_errors: list[str],
    ) -> dict[str, int]:
        """The diff as the rendered ``ip -batch``/``bridge -batch`` scripts (a node's first
        apply, a large change: one process per chunk instead of one netlink round trip per
        operation), then each new workload end configured in its namespace. ``errors``: what
        the tools refused (the caller reads the node again and does the rest through
        netlink); ``ruleset_errors``: what ``nft`` refused."""
        endpoints = {
            e.host_if: (e, d.policies[s.tenant].subnet) for s in d.segments for e in s.local
        }
        foreign = tuple(Link(n, _KINDS[n[:2]]) for n in running.foreign)  # type: ignore[arg-type]
        plan = dataclasses.replace(plan, remove_links=foreign + plan.remove_links)
        veths = [x for x in plan.add_links if x.kind == "veth"]
        if veths:
            err = self.host.create_namespaces(sorted({endpoints[x.name][0].netns for x in veths}))
            if err:
                errors.append(f"workload namespaces: {err}")
        batches = render_diff(plan)
        # links first (in order); then the FDB appends, the workload ends and the ruleset
        # side by side: they are independent of each other
        last_ip = max((i for i, x in enumerate(batches) if x.tool == "ip"), default=-1)
        for batch in batches[: last_ip + 1]:
            self._batch(batch, errors)
        with ThreadPoolExecutor(max_workers=PARALLEL_BATCHES) as pool:
            fdb = [pool.submit(self._batch, x, errors) for x in batches[last_ip + 1 :]]
            ruleset = (
                None
                if plan.ruleset is None
                else pool.submit(self._load_ruleset, plan.ruleset, ruleset_errors)
            )
            failed = self._workload_ends([endpoints[x.name] for x in veths], errors)
            for f in fdb:
                f.result()
            loaded = None if ruleset is None else ruleset.result()
        if failed:  # the next round creates these pairs again
            self.host.tool(
                ["ip", "-force", "-batch", "-"],
                stdin="".join(f"link del dev {e.host_if}\n" for e in failed),
            )
        changes = {
            "remove_foreign": len(running.foreign),
            **{k: v for k, v in plan.counts.items() if k != "ruleset"},
            "remove_links": len(plan.remove_links) - len(running.foreign),
            "ruleset": int(bool(loaded)),
            "batches": len(batches),
        }
        return changes

    def _batch(self, batch: Batch, errors: list[str]) -> None:
        proc = self.host.tool([batch.tool, "-force", "-batch", "-"], stdin=batch.text)
        if proc.returncode != 0:
            lines = (proc.stderr or proc.stdout).strip().splitlines()
            errors.extend(f"{batch.tool} -batch: {line}" for line in lines[:MAX_LISTED])

    def _workload_ends(self, ends: list[tuple[Endpoint, str]], errors: list[str]) -> list[Endpoint]:
        """Each new veth's workload end up with its address (:func:`configure_end`, in this
        thread); the endpoints that failed."""
        failed = []
        for e, subnet in ends:
            try:
                configure_end(e, ipaddress.ip_network(subnet).prefixlen)
            except Exception as exc:  # each failure named; the pair is made again next round
                errors.append(f"workload end {e.peer_if} in {e.netns}: {_short(exc)}")
                failed.append(e)
        return failed

    def _load_ruleset(self, text: str, errors: list[str]) -> bool:
        proc = self.host.run(["nft", "-f", "-"], stdin=text)
        if proc.returncode != 0:
            errors.append(f"nft -f: {(proc.stderr or proc.stdout).strip()[:1000]}")
            return False
        listing = self.host.run(["nft", "list", "table", *TABLE.split()])
        if listing.returncode == 0:
            self.memory.ruleset_sha256 = ruleset_sha256(text)
            self.memory.listing_sha256 = _listing_sha(listing.stdout)
            self.memory.save(self.state_path)
        return True

    # ------------------------------------------------------------------ checking
    def _self_check(
        self,
        d: NodeDesired,
        after: Running,
        nf: bool | None,
        underlay_up: bool,
        underlay_addrs: frozenset[str],
        errors: list[str],
    ) -> dict[str, Any]:
        have = after.state.links
        want = desired_links(d)
        missing_segments = [
            s.vni
            for s in d.segments
            if have.get(s.bridge) != want[s.bridge] or have.get(s.vxlan) != want[s.vxlan]
        ]
        eps = [e.host_if for s in d.segments for e in s.local]
        missing_eps = [n for n in eps if have.get(n) != want[n]]
        unexpected = sorted(n for n in have if n not in want)
        want_fdb = desired_fdb(d)
        fdb_missing = sorted(want_fdb - after.state.fdb)
        fdb_extra = sorted(after.state.fdb - want_fdb)
        expected = ruleset_sha256(render_nftables(d))
        trusted = after.state.ruleset_sha256
        ruleset_ok = trusted == expected
        br_nf = nf is True or (nf is not None and not after.bridges_nf_off)
        underlay_ok = underlay_up and d.vtep in underlay_addrs
        reasons = [
            r
            for r, bad in (
                ("segment_missing", missing_segments),
                ("endpoint_missing", missing_eps),
                ("unexpected_links", unexpected),
                ("fdb_missing", fdb_missing),
                ("fdb_unexpected", fdb_extra),
                ("ruleset_mismatch", not ruleset_ok),
                ("br_netfilter_off", not br_nf),
                ("underlay_missing", not underlay_ok),
                ("apply_errors", errors),
            )
            if bad
        ]
        return {
            "ok": not reasons,
            "reasons": reasons,
            "desired_sha256": d.sha256,
            "segments": {
                "expected": len(d.segments),
                "present": len(d.segments) - len(missing_segments),
                "missing": missing_segments[:MAX_LISTED],
            },
            "endpoints": {
                "expected": len(eps),
                "present": len(eps) - len(missing_eps),
                "missing": missing_eps[:MAX_LISTED],
            },
            "links": {"unexpected": unexpected[:MAX_LISTED]},
            "fdb": {
                "expected": len(want_fdb),
                "present": len(want_fdb) - len(fdb_missing),
                "missing": [[f.dev, f.mac, f.dst] for f in fdb_missing[:MAX_LISTED]],
                "unexpected": [[f.dev, f.mac, f.dst] for f in fdb_extra[:MAX_LISTED]],
            },
            "ruleset": {
                "expected": expected,
                "loaded": after.loaded_sha256,
                "unchanged_since_load": trusted is not None,
                "ok": ruleset_ok,
            },
            "br_netfilter": br_nf,
            "underlay": {
                "dev": d.underlay_dev,
                "vtep": d.vtep,
                "up": underlay_up,
                "ok": underlay_ok,
            },
            "errors": errors[:MAX_LISTED],
        }
