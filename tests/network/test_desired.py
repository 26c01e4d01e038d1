"""Per-node desired state: content, the affected nodes of each change, incremental == full."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import network_scenario as sc
from proofplane.errors import InvalidState, NotFound, ValidationFailed
from proofplane.network.desired import (
    Endpoint,
    NetworkIndex,
    NodeDesired,
    NodeNet,
    Segment,
    SubnetExhausted,
    allocate_ip,
    compute_all,
    desired_from_json,
    desired_to_json,
    endpoint_mac,
    interface_id,
    normalize_guid,
)
from proofplane.network.policy import DEFAULT_POLICY, parse_policy
from proofplane.network.segments import SegmentInUse


def test_desired_state_of_the_scenario() -> None:
    ix = sc.index()
    a, b, c = (ix.desired(n) for n in ("gpu-a", "gpu-b", "gpu-c"))
    assert [s.vni for s in a.segments] == [10000, 10001]  # acme, globex
    assert [s.vni for s in b.segments] == [10000, 10001, 10002]  # + initech's own segment
    assert [s.vni for s in c.segments] == [10001]
    acme_a = a.segments[0]
    assert (acme_a.tenant, acme_a.pkey, acme_a.bridge, acme_a.vxlan) == (
        "acme", 1, "br10000", "vx10000")  # fmt: skip
    assert acme_a.remote_vteps == ("10.250.0.2",)  # only gpu-b also carries acme
    assert [e.workload for e in acme_a.local] == ["w1", "w2"]
    assert acme_a.remote == ((endpoint_mac("acme", "w3"), "10.250.0.2"),)
    globex_c = c.segments[0]
    assert globex_c.remote_vteps == ("10.250.0.1", "10.250.0.2")
    assert len(globex_c.remote) == 2 and not globex_c.local[1:]
    initech = b.segments[2]
    assert (initech.workload, initech.remote_vteps, initech.remote) == ("i1", (), ())
    # the underlay allow-list: the peers of the node's segments, nobody else
    assert a.vteps == ("10.250.0.2", "10.250.0.3") and c.vteps == ("10.250.0.1", "10.250.0.2")
    assert set(b.policies) == {"acme", "globex", "initech"}
    assert b.policies["globex"] == DEFAULT_POLICY and b.policies["initech"].allow == ()
    # the same tenant subnet on both tenants: same addresses, different segments
    assert {e.ip for s in a.segments for e in s.local} == {"10.10.0.1", "10.10.0.2"}


def test_a_node_without_work_carries_nothing() -> None:
    ix = NetworkIndex([NodeNet("idle", "10.250.0.9")], sc.SEGMENTS)
    d = ix.desired("idle")
    assert d.segments == () and d.vteps == () and dict(d.policies) == {}
    with pytest.raises(NotFound) as err:
        ix.desired("ghost")
    assert err.value.code == "node_not_found"


def test_the_hash_is_order_independent_and_content_bound() -> None:
    eps = sc.endpoints()
    one = NetworkIndex(sc.NODES, sc.SEGMENTS, sc.policies(), eps).desired_all()
    two = NetworkIndex(
        reversed(sc.NODES), reversed(sc.SEGMENTS), dict(reversed(sc.policies().items())),
        reversed(eps),
    ).desired_all()  # fmt: skip
    assert {n: d.sha256 for n, d in one.items()} == {n: d.sha256 for n, d in two.items()}
    assert one == two
    # every node's hash differs (they differ in content) and each is 64 hex
    assert len({d.sha256 for d in one.values()}) == 3
    ix = sc.index()
    before = ix.desired("gpu-a").sha256
    ix.set_policy("globex", parse_policy({"allow": []}, tenant="globex", known_tenants=sc.TENANTS))
    assert ix.desired("gpu-a").sha256 != before


def test_json_round_trip_and_tamper_evidence() -> None:
    d = sc.index().desired("gpu-b")
    data = desired_to_json(d)
    assert desired_from_json(data) == d
    assert data["segments"][0]["bridge"] == "br10000"
    assert data["segments"][0]["local"][0]["host_if"].startswith("vh")
    data["segments"][0]["remote"].append({"mac": "02:00:00:00:00:01", "vtep": "10.250.0.66"})
    with pytest.raises(ValidationFailed) as err:
        desired_from_json(data)
    assert err.value.code == "desired_state_mismatch"
    with pytest.raises(ValidationFailed) as err:
        desired_from_json({"node": "x"})
    assert err.value.code == "invalid_desired_state"


def test_affected_nodes_of_each_change() -> None:
    ix = sc.index()
    # a new acme workload on gpu-c: gpu-c gains the segment, gpu-a and gpu-b gain a remote
    ep = Endpoint("w4", "acme", "gpu-c", 10000, "10.10.0.9", endpoint_mac("acme", "w4"))
    assert ix.place([ep]) == {"gpu-a", "gpu-b", "gpu-c"}
    assert ix.place([ep]) == set()  # the same again: nothing changes
    # initech's own segment: only gpu-b carries it
    i2 = Endpoint("i1", "initech", "gpu-b", 10002, "10.10.0.2", endpoint_mac("initech", "i1"))
    assert ix.place([i2]) == {"gpu-b"}  # a new address, same node
    # moving i1 to gpu-c: the old node and the new one
    assert ix.place([dataclasses.replace(i2, node="gpu-c")]) == {"gpu-b", "gpu-c"}
    assert 10002 not in ix.segments_on("gpu-b")
    assert ix.remove(["i1"]) == {"gpu-c"}
    assert ix.remove(["i1", "nobody"]) == set()
    # a policy: the nodes of the tenant's segments, only when it changes
    closed = parse_policy({"allow": []}, tenant="globex", known_tenants=sc.TENANTS)
    assert ix.set_policy("globex", closed) == {"gpu-a", "gpu-b", "gpu-c"}
    assert ix.set_policy("globex", closed) == set()
    assert ix.set_policy("acme", sc.policies()["acme"]) == set()
    assert ix.set_policy("globex", None) == {"gpu-a", "gpu-b", "gpu-c"}
    assert ix.policy("globex") == DEFAULT_POLICY
    # a node fails: it and the peers of its segments
    assert ix.node_failed("gpu-c") == {"gpu-a", "gpu-b", "gpu-c"}
    assert ix.desired("gpu-c").segments == ()
    assert "10.250.0.3" not in ix.desired("gpu-a").vteps
    with pytest.raises(InvalidState):
        ix.place([dataclasses.replace(ep, node="gpu-c")])
    # back, with a new VTEP: only itself (it carries nothing)
    assert ix.upsert_node(NodeNet("gpu-c", "10.250.0.33")) == {"gpu-c"}
    # a VTEP change of a node with work: its peers too
    assert ix.upsert_node(NodeNet("gpu-b", "10.250.0.22")) == {"gpu-a", "gpu-b"}
    assert "10.250.0.22" in ix.desired("gpu-a").vteps


def test_place_refuses_what_does_not_fit() -> None:
    ix = sc.index()
    good = Endpoint("x1", "acme", "gpu-a", 10000, "10.10.0.7", endpoint_mac("acme", "x1"))
    with pytest.raises(NotFound) as err:
        ix.place([dataclasses.replace(good, node="ghost")])
    assert err.value.code == "node_not_found"
    with pytest.raises(NotFound) as err:
        ix.place([dataclasses.replace(good, vni=4242)])
    assert err.value.code == "segment_not_found"
    with pytest.raises(ValidationFailed) as err:  # globex's segment
        ix.place([dataclasses.replace(good, vni=10001)])
    assert err.value.code == "segment_mismatch"
    with pytest.raises(ValidationFailed) as err:  # initech's per-workload segment, not i1
        ix.place([dataclasses.replace(good, tenant="initech", vni=10002)])
    assert err.value.code == "segment_mismatch"
    with pytest.raises(SegmentInUse):
        ix.remove_segment(10000)
    with pytest.raises(SegmentInUse):
        ix.add_segment(Segment("globex", 10000, 9))
    assert ix.add_segment(Segment("hooli", 10003, 4)) == set()
    assert ix.remove_segment(10003) == set() and 10003 not in ix.segments


def test_endpoint_helpers() -> None:
    mac = endpoint_mac("acme", "w1")
    first = int(mac.split(":")[0], 16)
    assert first & 0x02 and not first & 0x01  # locally administered, unicast
    assert mac == endpoint_mac("acme", "w1") != endpoint_mac("globex", "w1")
    ep = sc.endpoints()[0]
    assert ep.host_if == "vh" + interface_id("w1") and ep.peer_if == "vw" + interface_id("w1")
    assert ep.netns == "ppw-" + interface_id("w1")
    long = "w" * 63
    for name in (f"vh{interface_id(long)}", f"vw{interface_id(long)}", f"br{16_777_215}"):
        assert len(name) <= 15
    assert allocate_ip("10.10.0.0/24", set()) == "10.10.0.1"
    assert allocate_ip("10.10.0.0/24", {"10.10.0.1", "10.10.0.3"}) == "10.10.0.2"
    assert allocate_ip("10.10.0.0/30", {"10.10.0.1"}) == "10.10.0.2"
    with pytest.raises(SubnetExhausted) as err:
        allocate_ip("10.10.0.0/30", {"10.10.0.1", "10.10.0.2"})
    assert err.value.code == "subnet_exhausted"
    assert normalize_guid("0002:c903:00a1:b2c3") == "0x0002c90300a1b2c3"
    assert normalize_guid("0x2C90300A1B2C3") == "0x0002c90300a1b2c3"
    for bad in ("", "0x", "xyz", "0x1" + "0" * 16):
        with pytest.raises(ValidationFailed):
            normalize_guid(bad)


# ------------------------------------------------------------------ incremental == full
NODE_NAMES = ("n1", "n2", "n3", "n4", "n5")
TENANTS = ("t1", "t2", "t3")
WORKLOADS = tuple(f"w{i}" for i in range(9)) + ("solo",)
SEGS = (Segment("t1", 100, 1), Segment("t2", 101, 2), Segment("t3", 102, 3),
        Segment("t3", 103, 4, workload="solo"))  # fmt: skip
POLICIES = (
    None,
    parse_policy({"allow": []}, tenant="t1", known_tenants=frozenset(TENANTS)),
    parse_policy(
        {"allow": [{"proto": "tcp", "ports": 22}]}, tenant="t1", known_tenants=frozenset(TENANTS)
    ),  # fmt: skip
)


def _endpoint(workload: str, node: str, ip_last: int) -> Endpoint:
    tenant = "t3" if workload == "solo" else TENANTS[int(workload[1:]) % 3]
    vni = 103 if workload == "solo" else {"t1": 100, "t2": 101, "t3": 102}[tenant]
    mac = endpoint_mac(tenant, workload)
    return Endpoint(workload, tenant, node, vni, f"10.10.0.{ip_last}", mac)


ops = st.one_of(
    st.tuples(st.just("place"), st.lists(st.tuples(st.sampled_from(WORKLOADS),
              st.sampled_from(NODE_NAMES), st.integers(1, 3)), min_size=1, max_size=4)),
    st.tuples(st.just("remove"), st.lists(st.sampled_from(WORKLOADS), max_size=3)),
    st.tuples(st.just("fail"), st.sampled_from(NODE_NAMES)),
    st.tuples(st.just("node"), st.sampled_from(NODE_NAMES), st.integers(1, 3)),
    st.tuples(st.just("policy"), st.sampled_from(TENANTS), st.sampled_from(range(len(POLICIES)))),
)  # fmt: skip


@settings(max_examples=150, deadline=None)
@given(st.lists(ops, max_size=25))
def test_incremental_equals_full_recompute(steps: list[tuple]) -> None:  # type: ignore[type-arg]
    nodes = {n: NodeNet(n, f"10.250.0.{i + 1}") for i, n in enumerate(NODE_NAMES)}
    failed: set[str] = set()
    endpoints: dict[str, Endpoint] = {}
    policies: dict = {}  # type: ignore[type-arg]
    ix = NetworkIndex(nodes.values(), SEGS)

    def full() -> dict[str, NodeDesired]:
        return compute_all(nodes.values(), SEGS, policies, endpoints.values())

    before = full()
    for step in steps:
        ix.desired_all()  # fill the cache: a stale entry would show below
        kind = step[0]
        if kind == "place":
            eps = [_endpoint(w, n, ip) for w, n, ip in step[1]]
            if any(e.node in failed for e in eps):
                with pytest.raises(InvalidState):
                    ix.place(eps)
                eps, affected = [], frozenset()  # all or nothing
            else:
                affected = ix.place(eps)
            for e in eps:
                endpoints[e.workload] = e
        elif kind == "remove":
            affected = ix.remove(step[1])
            for w in step[1]:
                endpoints.pop(w, None)
        elif kind == "fail":
            affected = ix.node_failed(step[1])
            failed.add(step[1])
            endpoints = {w: e for w, e in endpoints.items() if e.node != step[1]}
        elif kind == "node":
            name, vtep = step[1], step[2]
            nodes[name] = NodeNet(name, f"10.250.{vtep}.{NODE_NAMES.index(name) + 1}")
            affected = ix.upsert_node(nodes[name])
            failed.discard(name)
        else:
            policy = POLICIES[step[2]]
            affected = ix.set_policy(step[1], policy)
            if policy is None:
                policies.pop(step[1], None)
            else:
                policies[step[1]] = policy
        after = full()
        # the hashes alone first (a generation bump asks only for them), then the states
        assert {n: ix.sha256(n) for n in nodes} == {n: d.sha256 for n, d in after.items()}
        assert ix.desired_all() == after, steps
        # every node whose state changed was reported
        changed = {n for n in after if after[n].sha256 != before[n].sha256}
        assert changed <= affected, (step, changed, affected)
        before = after


def test_what_reaches_a_script_is_checked() -> None:
    """A name or address with a space or newline would be a command of its own in a batch."""
    ix = sc.index()
    bad_nodes = [
        (NodeNet("gpu-d", "10.250.0.4", "ul0\nlink del dev eth0"), "invalid_underlay_dev"),
        (NodeNet("gpu-d", "10.250.0.4", "a-very-long-ifname"), "invalid_underlay_dev"),
        (NodeNet("gpu-d", "fd00::4"), "invalid_vtep"),
        (NodeNet("gpu-d", "10.250.0.256"), "invalid_vtep"),
        (NodeNet("gpu-d", "10.250.0.4 "), "invalid_vtep"),
        (NodeNet("GPU D", "10.250.0.4"), "invalid_name"),
        (NodeNet("gpu-d", "10.250.0.4", hca_guids=("0xnothex",)), "invalid_guid"),
    ]
    for node, code in bad_nodes:
        with pytest.raises(ValidationFailed) as err:
            ix.upsert_node(node)
        assert err.value.code == code, node
    assert "gpu-d" not in ix.nodes
    ix.upsert_node(NodeNet("gpu-d", "10.250.0.4", hca_guids=("0002:c903:00a1:b2c4",)))
    assert ix.nodes["gpu-d"].hca_guids == ("0x0002c90300a1b2c4",)  # normalised
    bad_segments = [
        Segment("acme corp", 10010, 9),
        Segment("acme", 10011, 10, workload="w\n1"),
        Segment("acme", 10011, 10, workload="acme/w1; drop"),
        Segment("acme", 0, 11),
        Segment("acme", 1 << 24, 12),
        Segment("acme", 10012, 0x7FFF),
        Segment("acme", 10013, 0),
    ]
    for seg in bad_segments:
        with pytest.raises(ValidationFailed) as err:
            ix.add_segment(seg)
        assert err.value.code in ("invalid_name", "invalid_segment", "invalid_workload_key"), seg
    good = Endpoint("x1", "acme", "gpu-a", 10000, "10.10.0.7", endpoint_mac("acme", "x1"))
    for bad in (
        dataclasses.replace(good, ip="10.10.0.7/24"),
        dataclasses.replace(good, ip="10.10.0.7\nlink del dev ul0"),
        dataclasses.replace(good, mac="02:00:00:00:00"),
        dataclasses.replace(good, mac="02:00:00:00:00:0G"),
        dataclasses.replace(good, workload="x 1"),
        dataclasses.replace(good, workload=""),
    ):
        with pytest.raises(ValidationFailed) as err:
            ix.place([bad])
        assert err.value.code in ("invalid_endpoint", "invalid_workload_key")
    # the services' keys: tenant/workload[#member]
    key = "acme/train-7#3"
    assert ix.place([dataclasses.replace(good, workload=key, mac=endpoint_mac("acme", key))])
    # the agent's side: a desired state whose fields would inject is refused before its hash
    data = desired_to_json(ix.desired("gpu-a"))
    data["segments"][0]["remote"][0]["vtep"] = "10.250.0.2 self\nfdb flush"
    with pytest.raises(ValidationFailed) as err:
        desired_from_json(data)
    assert err.value.code == "invalid_desired_state"
