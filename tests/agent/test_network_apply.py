"""The agent's network apply (proofplane.agent.network) on real kernel networking, in network
namespaces: two "nodes" on a veth underlay, the desired state of each applied by the agent
code; self-check, idempotence, drift repaired, a tampered ruleset loaded again, bad input
refused with a reason and nothing applied, and the overlay carrying same-tenant traffic.

The checks of a desired state (check_desired) need no privileges and always run; the rest
need root and the kernel's netns/veth/bridge/vxlan (skipped locally without, failed in CI).
"""

from __future__ import annotations

import dataclasses
import secrets
from pathlib import Path
from typing import Any

import pytest

import netns
from proofplane.agent.network import (
    NOTHING_APPLIED,
    Host,
    NetworkAgent,
    check_desired,
    read_running,
    report_body,
)
from proofplane.network.desired import (
    Endpoint,
    NetworkIndex,
    NodeDesired,
    NodeNet,
    NodeSegment,
    Segment,
    desired_to_json,
    endpoint_mac,
)
from proofplane.network.policy import parse_policy

TENANTS = frozenset({"acme", "globex"})


def scenario(tag: str) -> NetworkIndex:
    """acme: a1 on gpu-1, a2 on gpu-2 (ICMP and tcp 29500 inside the tenant only); globex: g1
    on gpu-1 and g2 on gpu-2 (the default policy), both tenants in 10.10.0.0/24."""
    nodes = [NodeNet("gpu-1", "10.250.0.1"), NodeNet("gpu-2", "10.250.0.2")]
    segments = [Segment("acme", 10100, 1), Segment("globex", 10101, 2)]
    acme = parse_policy(
        {"subnet": "10.10.0.0/24", "allow": [{"proto": "icmp"}, {"proto": "tcp", "ports": 29500}]},
        tenant="acme",
        known_tenants=TENANTS,
    )
    eps = []
    for w, tenant, node, vni, ip in (
        ("a1", "acme", "gpu-1", 10100, "10.10.0.1"),
        ("a2", "acme", "gpu-2", 10100, "10.10.0.2"),
        ("g1", "globex", "gpu-1", 10101, "10.10.0.1"),
        ("g2", "globex", "gpu-2", 10101, "10.10.0.2"),
    ):
        key = f"{tenant}/{w}-{tag}"
        eps.append(Endpoint(key, tenant, node, vni, ip, endpoint_mac(tenant, key)))
    return NetworkIndex(nodes, segments, {"acme": acme}, eps)


def endpoint(index: NetworkIndex, name: str) -> Endpoint:
    return next(e for k, e in index.endpoints.items() if k.split("/")[1].startswith(name + "-"))


# --------------------------------------------------------------------------- no privileges


def test_check_desired_accepts_a_computed_state() -> None:
    index = scenario("t")
    assert check_desired(index.desired("gpu-1")) == []
    assert check_desired(index.desired("gpu-2")) == []


def _segment(seg: NodeSegment, **change: Any) -> NodeSegment:
    fields = ("vni", "pkey", "tenant", "workload", "remote_vteps", "local", "remote")
    return NodeSegment(**{f: change.get(f, getattr(seg, f)) for f in fields})


def _desired(d: NodeDesired, **change: Any) -> NodeDesired:
    fields = ("node", "vtep", "underlay_dev", "segments", "policies", "sha256")
    return NodeDesired(**{f: change.get(f, getattr(d, f)) for f in fields})


def _first_segment(d: NodeDesired, **change: Any) -> NodeDesired:
    return _desired(d, segments=(_segment(d.segments[0], **change), *d.segments[1:]))


def _with_endpoint(d: NodeDesired, **change: str) -> NodeDesired:
    seg = d.segments[0]
    return _first_segment(d, local=(dataclasses.replace(seg.local[0], **change), *seg.local[1:]))


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"mac": "03:00:00:00:00:01"}, "no unicast MAC"),
        ({"mac": "not-a-mac"}, "no unicast MAC"),
        ({"ip": "10.99.0.1"}, "not in 10.10.0.0/24"),
        ({"ip": "10.10.0.x"}, "not in 10.10.0.0/24"),
    ],
)
def test_check_desired_refuses_bad_endpoints(change: dict[str, str], says: str) -> None:
    d = _with_endpoint(scenario("t").desired("gpu-1"), **change)
    problems = check_desired(d)
    assert len(problems) == 1 and says in problems[0]


def test_check_desired_refuses_bad_node_facts() -> None:
    d = scenario("t").desired("gpu-1")
    assert "not an IPv4 address" in check_desired(_desired(d, vtep="fd00::1"))[0]
    assert "usable interface" in check_desired(_desired(d, underlay_dev="br10100"))[0]
    assert "usable interface" in check_desired(_desired(d, underlay_dev="a/b"))[0]
    bad = _first_segment(d, remote_vteps=("10.250.0.1",))  # its own VTEP
    assert "another node" in check_desired(bad)[0]
    assert "outside" in check_desired(_first_segment(d, vni=1 << 24))[0]


def test_a_document_that_is_not_a_desired_state_is_refused_with_a_reason() -> None:
    agent = NetworkAgent("ppno-such-namespace")
    doc = {**desired_to_json(scenario("t").desired("gpu-1")), "generation": 4}
    doc["vteps"] = ["10.250.0.9"]  # no longer what the server hashed
    gen, result = agent.apply_document(doc)
    assert gen == 4 and not result.ok and result.desired_sha256 is None
    assert result.self_check["reasons"] == ["desired_state_mismatch"]
    for junk in ({"generation": 1}, {"node": "x", "segments": "no"}, []):
        _gen, result = agent.apply_document(junk)  # type: ignore[arg-type]
        assert not result.ok and result.self_check["reasons"] == ["invalid_desired_state"]
    body = report_body(0, NOTHING_APPLIED, result)
    assert body["applied_sha256"] == NOTHING_APPLIED and body["self_check"]["ok"] is False


def test_a_missing_namespace_is_a_failed_self_check(tmp_path: Path) -> None:
    result = NetworkAgent(f"ppno-{secrets.token_hex(3)}").apply(scenario("t").desired("gpu-1"))
    assert not result.ok and result.self_check["reasons"] == ["network_apply_failed"]


# --------------------------------------------------------------------------- in namespaces


@pytest.fixture
def lab():
    netns.require()
    with netns.lab() as made:
        yield made


def _adopt_workloads(lab: netns.Lab, index: NetworkIndex) -> None:
    for e in index.endpoints.values():
        lab.adopt(e.netns)


@pytest.mark.parametrize("method", ["netlink", "batch"])
def test_apply_self_check_idempotence_and_drift(
    lab: netns.Lab, tmp_path: Path, method: str
) -> None:
    index = scenario(lab.tag)
    _adopt_workloads(lab, index)
    n1, n2 = lab.underlay(2)
    d1, d2 = index.desired("gpu-1"), index.desired("gpu-2")
    agent1 = NetworkAgent(n1.netns, state_dir=tmp_path, method=method)
    agent2 = NetworkAgent(n2.netns, state_dir=tmp_path, method=method)

    first = agent1.apply(d1)
    assert first.ok, first.self_check
    assert first.self_check["method"] == method
    assert first.changes["add_links"] == 2 + 2 + 2  # 2 bridges, 2 vxlans, 2 workload veths
    assert first.changes["add_fdb"] == 2 * 2  # per segment: BUM to gpu-2, the remote MAC
    assert first.changes["ruleset"] == 1
    assert first.self_check["segments"] == {"expected": 2, "present": 2, "missing": []}
    assert first.ruleset_sha256 == first.self_check["ruleset"]["expected"]
    assert agent2.apply(d2).ok

    again = agent1.apply(d1)
    assert again.ok and not again.changed, again.changes
    # a new agent run (one-shot) with the same state directory: nothing to do either
    fresh = NetworkAgent(n1.netns, state_dir=tmp_path, method=method).apply(d1)
    assert fresh.ok and not fresh.changed, fresh.changes

    # drift: a port off its bridge, a lost FDB entry, a flushed ruleset: repaired
    vx = d1.segments[0].vxlan
    netns.run(["ip", "-n", n1.netns, "link", "set", vx, "nomaster"])
    netns.run(
        [
            "bridge",
            "-n",
            n1.netns,
            "fdb",
            "del",
            "00:00:00:00:00:00",
            "dev",
            vx,
            "dst",
            "10.250.0.2",
        ]
    )
    netns.run(
        netns.in_ns(n1.netns, "nft", "add", "rule", "inet", "proofplane", "forward", "accept")
    )
    fixed = agent1.apply(d1)
    assert fixed.ok, fixed.self_check
    assert (fixed.changes["set_links"], fixed.changes["add_fdb"], fixed.changes["ruleset"]) == (
        1,
        1,
        1,
    )

    # the overlay carries acme and globex, each in 10.10.0.0/24, each to its own peer
    a1, a2, g2 = endpoint(index, "a1"), endpoint(index, "a2"), endpoint(index, "g2")
    assert netns.reached(netns.ping(a1.netns, a2.ip))
    lab.listen(a2.netns, 29500)
    assert netns.reached(netns.connect(a1.netns, a2.ip, 29500))
    # globex's g2 has the very address a2 has: it sees nothing of a1's probe
    cap = lab.capture(g2.netns, g2.peer_if, f"ether src {a1.mac}")
    seen = lab.capture(a2.netns, a2.peer_if, f"ether src {a1.mac}")  # the capture works
    assert netns.reached(netns.ping(a1.netns, a2.ip))
    assert cap.stop() == []
    assert any("ICMP echo request" in line for line in seen.stop())


def test_both_readers_read_the_same_state(lab: netns.Lab, tmp_path: Path) -> None:
    index = scenario(lab.tag)
    _adopt_workloads(lab, index)
    (n1,) = lab.underlay(1)
    d1 = index.desired("gpu-1")
    assert NetworkAgent(n1.netns, state_dir=tmp_path, reader="netlink").apply(d1).ok
    netns.run(["ip", "-n", n1.netns, "link", "set", d1.segments[0].bridge, "down"])
    netns.run(["ip", "-n", n1.netns, "link", "add", "vx77", "type", "bridge"])  # not a VXLAN
    host = Host(n1.netns)
    ipr = host.netlink()
    try:
        by_json = read_running(host, ipr, via="json")
        by_netlink = read_running(host, ipr, via="netlink")
    finally:
        ipr.close()
    assert by_json == by_netlink
    assert by_json.foreign == ("vx77",)
    assert len(by_json.state.links) == 6 and len(by_json.state.fdb) == 4
    assert not by_json.state.links[d1.segments[0].bridge].up
    # the next round removes the stranger and brings the bridge up again
    result = NetworkAgent(n1.netns, state_dir=tmp_path).apply(d1)
    assert result.ok and result.changes["remove_foreign"] == 1 and result.changes["set_links"] == 1


def test_a_self_check_that_finds_drift_says_what(lab: netns.Lab, tmp_path: Path) -> None:
    index = scenario(lab.tag)
    _adopt_workloads(lab, index)
    (n1,) = lab.underlay(1)
    d1 = index.desired("gpu-1")
    netns.run(["ip", "-n", n1.netns, "addr", "flush", "dev", "ul0"])  # the VTEP is gone
    result = NetworkAgent(n1.netns, state_dir=tmp_path).apply(d1)
    assert not result.ok and result.self_check["reasons"] == ["underlay_missing"]
    assert result.self_check["segments"]["present"] == 2  # the rest was applied

    # an underlay device that does not exist: the VXLANs cannot be made, and it says so
    bad = _desired(d1, underlay_dev="nosuchdev0")
    result = NetworkAgent(n1.netns, state_dir=tmp_path).apply(bad)
    assert not result.ok
    assert {"segment_missing", "apply_errors", "underlay_missing"} <= set(
        result.self_check["reasons"]
    )
    assert any("nosuchdev0" in e for e in result.self_check["errors"])


@pytest.mark.parametrize("method", ["netlink", "batch"])
def test_workloads_leaving_and_moving(lab: netns.Lab, tmp_path: Path, method: str) -> None:
    index = scenario(lab.tag)
    _adopt_workloads(lab, index)
    n1, n2 = lab.underlay(2)
    agent1 = NetworkAgent(n1.netns, state_dir=tmp_path, method=method)
    agent2 = NetworkAgent(n2.netns, state_dir=tmp_path, method=method)
    assert agent1.apply(index.desired("gpu-1")).ok and agent2.apply(index.desired("gpu-2")).ok

    # g1 ends: gpu-1 drops globex's segment entirely, gpu-2 its FDB entries towards gpu-1
    g1 = endpoint(index, "g1")
    index.remove([g1.workload])
    r1 = agent1.apply(index.desired("gpu-1"))
    assert r1.ok, r1.self_check
    assert r1.changes["remove_links"] == 3  # g1's veth, vx10101, br10101
    r2 = agent2.apply(index.desired("gpu-2"))
    assert r2.ok and r2.changes["remove_fdb"] == 2, r2.changes

    # a2 moves to gpu-1 while its old veth end is still in its namespace (gpu-2 has not
    # applied yet): the agent on gpu-1 takes the workload's end over
    a1, a2 = endpoint(index, "a1"), endpoint(index, "a2")
    index.place([dataclasses.replace(a2, node="gpu-1")])
    r1 = agent1.apply(index.desired("gpu-1"))
    assert r1.ok, r1.self_check
    assert agent2.apply(index.desired("gpu-2")).ok
    assert netns.reached(netns.ping(a1.netns, a2.ip))
