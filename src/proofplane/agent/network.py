"""The node agent's network apply: read what the node carries, apply the diff to the desired
state the server computed, check the result, say so.

One round (:meth:`NetworkAgent.apply`):

1. **check** the desired state (:func:`check_desired`): names as proofplane makes them, MACs,
   addresses, VNIs in range, each endpoint's address inside its tenant's subnet. A state the
   agent cannot apply is not applied at all: the round reports a failed self-check that says
   why (``invalid_desired_state``), and the node keeps what it had;
2. **read** the running state through netlink (``pyroute2``): the links proofplane owns
   (``br<VNI>``, ``vx<VNI>``, ``vh<8 hex>``: the underlay and everything else on the node are
   never touched), the VXLAN FDB entries, and the nftables table ``inet proofplane``;
3. **apply** :func:`proofplane.network.render.iproute2.diff` of the two: FDB removals, link
   removals, link creations (a workload's veth is created with its peer ``vw<8>`` in the
   workload's namespace ``ppw-<8>``, made here when missing, and that end is given the
   workload's MAC, MTU 1450 and overlay address), settings, FDB additions, through netlink;
   then the ruleset with ``nft -f`` (one transaction: it replaces the table, nothing else);
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
import errno
import hashlib
import ipaddress
import json
import os
import re
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from proofplane.errors import ProofplaneError
from proofplane.network.desired import Endpoint, NodeDesired, desired_from_json
from proofplane.network.render.iproute2 import (
    OVERLAY_MTU,
    VXLAN_PORT,
    Fdb,
    Link,
    NetworkDiff,
    RunningState,
    desired_fdb,
    desired_links,
    diff,
    owned,
)
from proofplane.network.render.nftables import (
    TABLE,
    loaded_sha256,
    render_nftables,
    ruleset_sha256,
)

__all__ = [
    "NETNS_DIR",
    "NOTHING_APPLIED",
    "ApplyResult",
    "Host",
    "NetworkAgent",
    "NetworkApplyError",
    "Running",
    "check_desired",
    "read_running",
    "report_body",
]

NETNS_DIR = Path("/run/netns")
#: The ``applied_sha256`` an agent reports before it has applied any desired state completely
#: (the SHA-256 of nothing), with generation 0.
NOTHING_APPLIED = hashlib.sha256(b"").hexdigest()
MAX_LISTED = 20  # entries per list in a self-check (the report stays small)
_IFNAME = re.compile(r"^[A-Za-z0-9_.:-]{1,15}$")
_MAC = re.compile(r"^[0-9a-f]{2}(:[0-9a-f]{2}){5}$")
_NETNS = re.compile(r"^ppw-[0-9a-f]{8}$")
_VNI_MAX = (1 << 24) - 1
_BR_NF = "/proc/sys/net/bridge/bridge-nf-call-iptables"


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

    @contextlib.contextmanager
    def inside(self, name: str) -> Iterator[Any]:
        """An ``IPRoute`` socket in the named namespace ``name`` (a workload's): the calling
        thread enters it only to open the socket (much cheaper than a helper process)."""
        from pyroute2 import IPRoute, netns

        netns.pushns(name)
        try:
            ipr = IPRoute()
        finally:
            netns.popns()
        try:
            yield ipr
        finally:
            ipr.close()

    def run(self, argv: list[str], stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        """Run a tool in the node's namespace; never raises for its exit status."""
        cmd = ["ip", "netns", "exec", self.netns, *argv] if self.netns else argv
        try:
            return subprocess.run(
                cmd, input=stdin, capture_output=True, text=True, timeout=60, check=False
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


def _attr(msg: Any, *path: str) -> Any:
    cur = msg
    for name in path:
        if cur is None:
            return None
        cur = cur.get(name)
    return cur


def _listing_sha(listing: str) -> str:
    return hashlib.sha256(listing.encode()).hexdigest()


def read_running(host: Host, ipr: Any, trusted_listing: str | None = None) -> Running:
    """Read the node's state through ``ipr`` (an ``IPRoute`` in its namespace) and ``nft``.

    ``trusted_listing``: SHA-256 of the table listing as the agent read it right after it
    loaded the ruleset; the state's ``ruleset_sha256`` is the table's hash only while the
    listing is still that one (else None, and the diff loads the ruleset again)."""
    msgs = list(ipr.get_links())
    names = {m["index"]: m.get("IFLA_IFNAME") for m in msgs}
    index: dict[str, int] = {}
    links: list[Link] = []
    foreign: list[str] = []
    nf_off: list[str] = []
    for m in msgs:
        name = m.get("IFLA_IFNAME")
        index[name] = m["index"]
        if not owned(name):
            continue
        kind = _attr(m, "IFLA_LINKINFO", "IFLA_INFO_KIND")
        want = {"br": "bridge", "vx": "vxlan", "vh": "veth"}[name[:2]]
        if kind != want:
            foreign.append(name)
            continue
        master = names.get(m.get("IFLA_MASTER")) if m.get("IFLA_MASTER") else None
        common = {"master": master, "mtu": int(m.get("IFLA_MTU") or 0), "up": bool(m["flags"] & 1)}
        if kind == "vxlan":
            data = _attr(m, "IFLA_LINKINFO", "IFLA_INFO_DATA")
            vni = _attr(data, "IFLA_VXLAN_ID")
            # learning on, or another port: not a VXLAN of ours (no VNI: the diff recreates it)
            if _attr(data, "IFLA_VXLAN_LEARNING") or _attr(data, "IFLA_VXLAN_PORT") != VXLAN_PORT:
                vni = None
            links.append(
                Link(
                    name,
                    "vxlan",
                    vni=vni,
                    local=_attr(data, "IFLA_VXLAN_LOCAL"),
                    dev=names.get(_attr(data, "IFLA_VXLAN_LINK")),
                    **common,
                )
            )
        elif kind == "bridge":
            data = _attr(m, "IFLA_LINKINFO", "IFLA_INFO_DATA")
            if not _attr(data, "IFLA_BR_NF_CALL_IPTABLES"):
                nf_off.append(name)
            links.append(Link(name, "bridge", **common))
        else:
            links.append(Link(name, "veth", **common))
    ours = {x.name for x in links if x.kind == "vxlan"}
    fdb: set[Fdb] = set()
    for n in ipr.fdb("dump"):
        dev, dst, mac = names.get(n.get("ifindex")), n.get("NDA_DST"), n.get("NDA_LLADDR")
        if dev in ours and dst and mac:
            fdb.add(Fdb(dev, str(mac).lower(), str(dst)))
    proc = host.run(["nft", "list", "table", *TABLE.split()])
    listing = proc.stdout if proc.returncode == 0 else None
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

    def __init__(self, ipr: Any, host: Host, index: Mapping[str, int]) -> None:
        self.ipr = ipr
        self.host = host
        self.index = dict(index)
        self.errors: list[str] = []

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
            self.ipr.link("add", ifname=link.name, kind="bridge", mtu=link.mtu,
                          br_nf_call_iptables=1, br_nf_call_ip6tables=1)  # fmt: skip
        elif link.kind == "vxlan":
            self.ipr.link(
                "add", ifname=link.name, kind="vxlan", mtu=link.mtu, vxlan_id=link.vni,
                vxlan_local=link.local, vxlan_link=self.lookup(str(link.dev)),
                vxlan_port=VXLAN_PORT, vxlan_learning=0,
            )  # fmt: skip
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
            with self.host.inside(e.netns) as w:
                for i in w.link_lookup(ifname=e.peer_if):
                    w.link("del", index=i)
            self.ipr.link("add", ifname=link.name, kind="veth", mtu=link.mtu, peer=peer)
        try:
            with self.host.inside(e.netns) as w:
                lo = w.link_lookup(ifname="lo")
                if lo:
                    w.link("set", index=lo[0], state="up")
                i = w.link_lookup(ifname=e.peer_if)[0]
                w.link("set", index=i, mtu=OVERLAY_MTU, address=e.mac, state="up")
                w.addr("replace", index=i, address=e.ip, prefixlen=prefix)
        except Exception:
            # the next round creates the pair again rather than leave a half-made endpoint
            with contextlib.suppress(Exception):
                self.delete(link.name)
            raise

    def set(self, link: Link) -> None:
        master = self.lookup(link.master) if link.master else 0
        self.ipr.link("set", index=self.lookup(link.name), mtu=link.mtu, master=master,
                      state="up" if link.up else "down")  # fmt: skip

    def bridge_nf(self, name: str) -> None:
        """Bridged IPv4/IPv6 of this bridge through the ``inet`` hooks (br_netfilter), whatever
        the namespace's ``bridge-nf-call-iptables`` says: the tenant policy lives there."""
        self.ipr.link("set", index=self.lookup(name), kind="bridge", br_nf_call_iptables=1,
                      br_nf_call_ip6tables=1)  # fmt: skip

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
    ) -> None:
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
                raise ProofplaneError("the desired state is not a JSON object",
                                      code="invalid_desired_state")  # fmt: skip
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
        finally:
            ipr.close()
        result.seconds = time.perf_counter() - t0
        return result

    def _apply(self, ipr: Any, desired: NodeDesired) -> ApplyResult:
        running = read_running(self.host, ipr, self.memory.listing_sha256)
        plan = diff(desired, running.state)
        ops = _Ops(ipr, self.host, running.index)
        changes = self._execute(ops, desired, running, plan)
        after = read_running(self.host, ipr, self.memory.listing_sha256)
        up, addrs = _underlay(ipr, desired.underlay_dev, after.index)
        check = self._self_check(desired, after, up, addrs, ops.errors)
        expected = check["ruleset"]["expected"]
        return ApplyResult(
            desired_sha256=desired.sha256,
            changes=changes,
            errors=ops.errors,
            self_check=check,
            ruleset_sha256=expected if check["ruleset"]["ok"] else after.loaded_sha256,
        )

    def _execute(
        self, ops: _Ops, d: NodeDesired, running: Running, plan: NetworkDiff
    ) -> dict[str, int]:
        endpoints = {e.host_if: e for s in d.segments for e in s.local}
        prefixes = {
            s.vxlan: ipaddress.ip_network(d.policies[s.tenant].subnet).prefixlen for s in d.segments
        }
        seg_of = {e.host_if: s.vxlan for s in d.segments for e in s.local}
        changes = dict.fromkeys(
            ("remove_foreign", "remove_fdb", "remove_links", "add_links", "set_links",
             "add_fdb", "ruleset", "bridge_nf"), 0)  # fmt: skip
        for name in running.foreign:
            changes["remove_foreign"] += ops.do(f"remove {name}", lambda n=name: ops.delete(n))
        for f in plan.remove_fdb:
            changes["remove_fdb"] += ops.do(f"fdb del {f.mac} {f.dev} {f.dst}",
                                            lambda f=f: ops.fdb("del", f))  # fmt: skip
        for x in plan.remove_links:
            changes["remove_links"] += ops.do(f"remove {x.name}", lambda n=x.name: ops.delete(n))
        veths = [x for x in plan.add_links if x.kind == "veth"]
        if veths:
            err = self.host.create_namespaces(sorted({endpoints[x.name].netns for x in veths}))
            if err:
                ops.errors.append(f"workload namespaces: {err}")
        for x in plan.add_links:
            e = endpoints.get(x.name)
            prefix = prefixes[seg_of[x.name]] if e is not None else None
            changes["add_links"] += ops.do(f"add {x.kind} {x.name}",
                                           lambda x=x, e=e, p=prefix: ops.add(x, e, p))  # fmt: skip
        for x in plan.set_links:
            changes["set_links"] += ops.do(f"set {x.name}", lambda x=x: ops.set(x))
        for name in running.bridges_nf_off:
            if name in {s.bridge for s in d.segments}:
                changes["bridge_nf"] += ops.do(
                    f"br_netfilter on {name}", lambda n=name: ops.bridge_nf(n)
                )
        for f in plan.add_fdb:
            changes["add_fdb"] += ops.do(f"fdb append {f.mac} {f.dev} {f.dst}",
                                         lambda f=f: ops.fdb("append", f))  # fmt: skip
        if plan.ruleset is not None:
            changes["ruleset"] = int(self._load_ruleset(plan.ruleset, ops.errors))
        return changes

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
        nf = self.host.bridge_nf_call_iptables()
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
            "segments": {"expected": len(d.segments),
                         "present": len(d.segments) - len(missing_segments),
                         "missing": missing_segments[:MAX_LISTED]},
            "endpoints": {"expected": len(eps), "present": len(eps) - len(missing_eps),
                          "missing": missing_eps[:MAX_LISTED]},
            "links": {"unexpected": unexpected[:MAX_LISTED]},
            "fdb": {"expected": len(want_fdb), "present": len(want_fdb) - len(fdb_missing),
                    "missing": [[f.dev, f.mac, f.dst] for f in fdb_missing[:MAX_LISTED]],
                    "unexpected": [[f.dev, f.mac, f.dst] for f in fdb_extra[:MAX_LISTED]]},
            "ruleset": {"expected": expected, "loaded": after.loaded_sha256,
                        "unchanged_since_load": trusted is not None, "ok": ruleset_ok},
            "br_netfilter": br_nf,
            "underlay": {"dev": d.underlay_dev, "vtep": d.vtep, "up": underlay_up,
                         "ok": underlay_ok},
            "errors": errors[:MAX_LISTED],
        }  # fmt: skip
