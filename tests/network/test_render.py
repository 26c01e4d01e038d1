"""Renderers: golden files (regenerated and compared), idempotent diffs, batches, nft -c.

The golden files under tests/network/golden/ are rendered from tests/network_scenario.py.
After an intended change of a renderer, rewrite them and review the diff::

    PROOFPLANE_UPDATE_GOLDEN=1 .venv/bin/pytest tests/network/test_render.py
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
from pathlib import Path

import network_scenario as sc
from ci import unavailable
from proofplane.network.desired import Endpoint, NodeDesired, endpoint_mac
from proofplane.network.render.iproute2 import (
    OVERLAY_MTU,
    Batch,
    Fdb,
    Link,
    RunningState,
    applied_state,
    desired_fdb,
    desired_links,
    diff,
    owned,
    render_diff,
    render_iproute2,
    render_workload,
)
from proofplane.network.render.nftables import (
    ct_zones,
    loaded_sha256,
    render_nftables,
    ruleset_sha256,
)
from proofplane.network.render.partitions import partitions_for, render_partitions

GOLDEN = Path(__file__).parent / "golden"
NODES = ("gpu-a", "gpu-b", "gpu-c")


def _batches_text(batches: tuple[Batch, ...]) -> str:
    out = []
    for i, b in enumerate(batches, start=1):
        out.append(f"# {i}/{len(batches)}: {b.tool} -batch -\n{b.text}")
    return "".join(out)


def _failover() -> tuple[NodeDesired, NodeDesired]:
    """gpu-b before and after: gpu-c fails and its globex workload g3 moves to gpu-a."""
    ix = sc.index()
    before = ix.desired("gpu-b")
    g3 = ix.endpoints["g3"]
    ix.node_failed("gpu-c")
    ix.place([dataclasses.replace(g3, node="gpu-a")])
    return before, ix.desired("gpu-b")


def rendered() -> dict[str, str]:
    ix = sc.index()
    out: dict[str, str] = {}
    for node in NODES:
        d = ix.desired(node)
        ip, bridge = render_iproute2(d)
        out[f"{node}.ip.txt"] = ip
        out[f"{node}.bridge.txt"] = bridge
        out[f"{node}.nft.txt"] = render_nftables(d)
    out["partitions.conf.txt"] = render_partitions(
        partitions_for(ix, management_guids=sc.MANAGEMENT_GUIDS)
    )
    before, after = _failover()
    running = applied_state(before)
    # some drift besides: a stray veth of ours, a foreign link, a bridge's MTU changed
    links = dict(running.links)
    links["vh0000beef"] = Link("vh0000beef", "veth", master="br10001")
    links["eth9"] = Link("eth9", "veth")
    links["br10001"] = dataclasses.replace(links["br10001"], mtu=1500)
    drifted = dataclasses.replace(running, links=links)
    out["gpu-b.failover.diff.txt"] = _batches_text(render_diff(diff(after, drifted), chunk=3))
    g1 = sc.index().endpoints["g1"]
    out["workload-g1.ip.txt"] = render_workload(g1, "10.10.0.0/24")
    return out


def test_golden_files() -> None:
    files = rendered()
    if os.environ.get("PROOFPLANE_UPDATE_GOLDEN"):
        GOLDEN.mkdir(exist_ok=True)
        for name, text in files.items():
            (GOLDEN / name).write_text(text)
    for name, text in files.items():
        path = GOLDEN / name
        assert path.exists(), f"{path} is missing: PROOFPLANE_UPDATE_GOLDEN=1 writes it"
        assert path.read_text() == text, f"{name} differs from its golden file"
    assert sorted(p.name for p in GOLDEN.glob("*.txt")) == sorted(files)


def test_rendering_is_deterministic_and_order_free() -> None:
    assert rendered() == rendered()
    # a state built in another order renders the same text
    from proofplane.network.desired import NetworkIndex

    other = NetworkIndex(
        reversed(sc.NODES), reversed(sc.SEGMENTS), sc.policies(), reversed(sc.endpoints())
    )
    for node in NODES:
        a, b = sc.index().desired(node), other.desired(node)
        assert render_iproute2(a) == render_iproute2(b)
        assert render_nftables(a) == render_nftables(b)


def test_iproute2_content() -> None:
    d = sc.index().desired("gpu-a")
    ip, bridge = render_iproute2(d)
    lines = ip.splitlines()
    assert "link add name br10000 mtu 1450 type bridge" in lines
    assert (
        "link add name vx10000 mtu 1450 type vxlan id 10000 local 10.250.0.1 dev ul0 "
        "dstport 4789 nolearning" in lines
    )
    w1 = next(e for s in d.segments for e in s.local if e.workload == "w1")
    assert (
        f"link add name {w1.host_if} mtu 1450 type veth peer name {w1.peer_if} mtu 1450 "
        f"address {w1.mac} netns {w1.netns}" in lines
    )
    assert f"link set dev {w1.host_if} master br10000 up" in lines
    # every bridge is created before its ports are attached
    assert lines.index("link add name br10000 mtu 1450 type bridge") < lines.index(
        "link set dev vx10000 master br10000 up"
    )
    b = bridge.splitlines()
    assert "fdb append 00:00:00:00:00:00 dev vx10000 dst 10.250.0.2" in b
    assert f"fdb append {endpoint_mac('acme', 'w3')} dev vx10000 dst 10.250.0.2" in b
    assert not any("10.250.0.1" in line for line in b)  # never its own VTEP
    assert OVERLAY_MTU == 1450


def test_diff_of_the_applied_state_is_empty() -> None:
    ix = sc.index()
    for node in NODES:
        d = ix.desired(node)
        running = applied_state(d)
        assert diff(d, running).empty
        assert render_diff(diff(d, running)) == ()
        # links the agent reads back carry no peer/address/netns: still nothing to do
        bare = {n: dataclasses.replace(x, peer=None, address=None, netns=None)
                for n, x in running.links.items()}  # fmt: skip
        foreign = Link("ul0", "veth", mtu=1500)
        again = RunningState({**bare, "ul0": foreign}, running.fdb, running.ruleset_sha256)
        assert diff(d, again).empty


def test_diff_from_nothing_and_to_nothing() -> None:
    d = sc.index().desired("gpu-b")
    full = diff(d, RunningState())
    assert set(full.add_links) == set(desired_links(d).values())
    assert set(full.add_fdb) == desired_fdb(d) and full.ruleset == render_nftables(d)
    assert not full.remove_links and not full.remove_fdb and not full.set_links
    # the node loses all its work: everything of ours goes, ports before bridges
    empty = sc.index()
    for n in NODES:
        empty.node_failed(n)
    gone = diff(empty.desired("gpu-b"), applied_state(d))
    assert {x.name for x in gone.remove_links} == set(desired_links(d))
    kinds = [x.kind for x in gone.remove_links]
    assert kinds == sorted(kinds, key=["veth", "vxlan", "bridge"].index)
    assert gone.remove_fdb == ()  # their vxlans go with them
    assert gone.add_links == () and gone.add_fdb == ()


def test_failover_diff_touches_only_what_moved() -> None:
    before, after = _failover()
    delta = diff(after, applied_state(before))
    g3 = endpoint_mac("globex", "g3")
    assert set(delta.remove_fdb) == {
        Fdb("vx10001", "00:00:00:00:00:00", "10.250.0.3"),
        Fdb("vx10001", g3, "10.250.0.3"),
    }
    assert delta.add_fdb == (Fdb("vx10001", g3, "10.250.0.1"),)
    assert not delta.add_links and not delta.remove_links and not delta.set_links
    assert delta.ruleset is not None  # the VTEP allow-list lost gpu-c
    assert "10.250.0.3" not in delta.ruleset
    assert delta.counts == {"remove_fdb": 2, "remove_links": 0, "add_links": 0,
                            "set_links": 0, "add_fdb": 1, "ruleset": 1}  # fmt: skip
    batches = render_diff(delta)
    assert [b.tool for b in batches] == ["bridge", "bridge"]  # removals first
    assert batches[0].lines[0].startswith("fdb del ")


def test_a_recreated_link_takes_its_fdb_and_ports_along() -> None:
    d = sc.index().desired("gpu-a")
    running = applied_state(d)
    links = dict(running.links)
    links["vx10000"] = dataclasses.replace(links["vx10000"], local="10.250.0.99")  # identity
    links["br10001"] = Link("br10001", "vxlan", vni=5)  # wrong kind: recreated
    delta = diff(d, dataclasses.replace(running, links=links))
    assert {x.name for x in delta.remove_links} == {"vx10000", "br10001"}
    assert {x.name for x in delta.add_links} == {"vx10000", "br10001"}
    # all of vx10000's FDB again (deleting the link dropped it), none removed
    assert {f for f in delta.add_fdb} == {f for f in desired_fdb(d) if f.dev == "vx10000"}
    assert delta.remove_fdb == ()
    # the ports of the recreated bridge br10001 are attached again
    assert {x.name for x in delta.set_links} == {
        x.name for x in desired_links(d).values() if x.master == "br10001" and x.name != "vx10000"
    }
    lines = [line for b in render_diff(delta) for line in b.lines]
    assert lines.index("link del dev vx10000") < lines.index(
        "link add name vx10000 mtu 1450 type vxlan id 10000 local 10.250.0.1 dev ul0 "
        "dstport 4789 nolearning"
    )


def test_settings_are_fixed_in_place() -> None:
    d = sc.index().desired("gpu-a")
    running = applied_state(d)
    w1 = next(e for s in d.segments for e in s.local if e.workload == "w1")
    links = dict(running.links)
    links[w1.host_if] = dataclasses.replace(links[w1.host_if], master=None, up=False, mtu=1500)
    links["br10000"] = dataclasses.replace(links["br10000"], master="br10001")
    delta = diff(d, dataclasses.replace(running, links=links))
    assert not delta.add_links and not delta.remove_links
    lines = [line for b in render_diff(delta) for line in b.lines]
    assert lines == [
        "link set dev br10000 mtu 1450 nomaster up",
        f"link set dev {w1.host_if} mtu 1450 master br10000 up",
    ]


def test_only_our_links_are_ever_removed() -> None:
    for name in ("br10000", "vx16000000", "vh0123abcd"):
        assert owned(name)
    for name in ("ul0", "eth0", "lo", "docker0", "br-lan", "vxlan0", "vh0123ABCD", "vhx", "br"):
        assert not owned(name)
    d = sc.index().desired("gpu-c")
    foreign = [Link(n, "bridge") for n in ("docker0", "br-lan")]
    applied = applied_state(d)
    stray = Fdb("vxlan0", "02:00:00:00:00:09", "1.2.3.4")
    running = RunningState.of(
        [*applied.links.values(), *foreign], [*applied.fdb, stray], applied.ruleset_sha256
    )
    assert diff(d, running).empty


def test_batches_are_chunked_in_order() -> None:
    ix = sc.index()
    d = ix.desired("gpu-b")
    delta = diff(d, RunningState())
    whole = [line for b in render_diff(delta, chunk=1 << 20) for line in b.lines]
    for chunk in (1, 2, 5, 7):
        batches = render_diff(delta, chunk=chunk)
        assert all(0 < len(b.lines) <= chunk for b in batches)
        assert [line for b in batches for line in b.lines] == whole
        tools = [b.tool for b in batches]
        assert tools == sorted(tools, key=["ip", "bridge"].index)  # links, then FDB
    ip, bridge = render_iproute2(d)
    assert ip.splitlines() + bridge.splitlines() == whole


def test_workload_side() -> None:
    ep = Endpoint("w1", "acme", "gpu-a", 10000, "10.10.0.7", endpoint_mac("acme", "w1"))
    text = render_workload(ep, "10.10.0.0/24")
    assert f"addr replace 10.10.0.7/24 dev {ep.peer_if}" in text.splitlines()
    assert f"mtu 1450 address {ep.mac} up" in text


# ------------------------------------------------------------------------------ nftables
def test_nftables_content() -> None:
    d = sc.index().desired("gpu-b")
    text = render_nftables(d)
    assert text.count("table inet proofplane {") == 1
    assert "add table inet proofplane\ndelete table inet proofplane\n" in text  # replace
    assert "\t\tudp dport 4789 ip saddr != @vteps drop\n" in text
    assert "elements = { 10.250.0.1, 10.250.0.3 }" in text
    assert "\t\tct state established,related accept\n" in text
    assert '\t\tiifname "br10000" oifname "br10000" tcp dport 29500 accept\n' in text
    bastion = 'iifname "br10000" oifname "br10000" ip saddr 10.10.0.250/32 tcp dport 22 accept'
    assert f"\t\t{bastion}\n" in text
    assert '\t\tiifname "br10001" oifname "br10001" accept\n' in text  # globex: default
    assert '"br10002" oifname' not in text  # initech: closed inside
    egress = 'iifname "br10000" oifname != @tenant_ifaces ip daddr 192.0.2.0/24 tcp dport 443'
    assert f"\t\t{egress} accept\n" in text
    tail = "\t\tiifname @tenant_ifaces drop\n\t\toifname @tenant_ifaces drop\n\t}\n}"
    assert text.rstrip().endswith(tail)
    assert "} }" not in text and "fwd" not in text
    for line in text.splitlines():  # closing braces alone on their lines
        assert "}" not in line or line.strip() == "}" or "{" in line


def test_ruleset_hash_is_embedded_and_read_back() -> None:
    d = sc.index().desired("gpu-a")
    text = render_nftables(d)
    sha = ruleset_sha256(text)
    assert f'comment "proofplane ruleset sha256:{sha}"' in text
    listing = text.replace("\t", "    ")  # as `nft list table` might indent it
    assert loaded_sha256(listing) == sha
    assert loaded_sha256("table inet proofplane {\n}\n") is None
    other = render_nftables(sc.index().desired("gpu-c"))
    assert ruleset_sha256(other) != sha


def test_an_empty_node_ruleset_drops_all_vxlan() -> None:
    ix = sc.index()
    ix.node_failed("gpu-c")
    text = render_nftables(ix.desired("gpu-c"))
    assert "elements" not in text and "ct zone set" not in text
    assert "udp dport 4789 ip saddr != @vteps drop" in text


def test_ct_zones() -> None:
    assert ct_zones([10000, 10001]) == {10000: 10000, 10001: 10001}
    # 65536 + 10000 collides with 10000 mod 65535 + 1 ... resolved by probing
    zones = ct_zones([10000, 10000 + 65535, 65535, 65536])
    assert len(set(zones.values())) == 4 and all(1 <= z <= 65535 for z in zones.values())
    assert zones[10000] == 10000 and zones[10000 + 65535] == 10001


def test_golden_rulesets_pass_nft_check(tmp_path: Path) -> None:
    nft = shutil.which("nft")
    if nft is None:
        unavailable("nft is not installed (apt-get install -y nftables)")
    for path in sorted(GOLDEN.glob("*.nft.txt")):
        run = subprocess.run([nft, "-c", "-f", str(path)], capture_output=True, text=True,
                             timeout=30)  # fmt: skip
        if run.returncode != 0 and "Operation not permitted" in run.stderr:
            unavailable("nft -c needs CAP_NET_ADMIN")
        assert run.returncode == 0, f"{path.name}: {run.stderr}"
    # and a ruleset with a syntax error is refused (the check checks)
    bad = tmp_path / "bad.nft"
    bad.write_text("table inet proofplane {\n\tchain fwd {\n\t}\n}\n")
    assert subprocess.run([nft, "-c", "-f", str(bad)], capture_output=True).returncode != 0


def test_the_expected_ruleset_hash_is_the_rendered_rulesets_whatever_came_before() -> None:
    """The services' ruleset hash (memoised by the desired state's SHA-256) is the hash of the
    ruleset rendered for that state: for every node of the scenario, before and after a
    failover, asked once or again, in either order."""
    from proofplane.service.render_support import expected_ruleset_sha256

    before, after = _failover()
    states = [sc.index().desired(node) for node in NODES] + [after]  # ``before`` is gpu-b's
    assert len({d.sha256 for d in states}) == len(states)  # distinct states, distinct keys
    for d in states + states[::-1]:
        assert expected_ruleset_sha256(d) == ruleset_sha256(render_nftables(d))
    assert expected_ruleset_sha256(before) != expected_ruleset_sha256(after)
