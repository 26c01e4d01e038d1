"""Network segmentation per tenant (issue 14), the service side: segments allocated with their
tenant and released into a cool-down, pool exhaustion, per-workload segments, stable endpoints,
each node's desired state kept (incrementally, and equal to a fresh computation), the agents'
reports, drift and readiness for placement, the network policy, the segmentation map. Every
test runs on SQLite and PostgreSQL (the ``store`` fixture)."""

from __future__ import annotations

import csv
import io
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import func, select

from dbtest import demo_text, migrate_to
from proofplane.access import SYSTEM, Actor, Role
from proofplane.config import NetworkSettings
from proofplane.errors import ProofplaneError
from proofplane.hardware.cluster_file import parse_cluster
from proofplane.model import (
    ComplianceProfile,
    Gpu,
    GpuRequest,
    IsolationLevel,
    Node,
    NodeState,
    Tenant,
    WorkloadStatus,
)
from proofplane.network.desired import compute_all
from proofplane.network.policy import CrossTenantRule
from proofplane.schedule.reasons import INSUFFICIENT_CAPACITY, NETWORK_NOT_APPLIED
from proofplane.service import changes as changes_svc
from proofplane.service import netstate, network
from proofplane.service import nodes as nodes_svc
from proofplane.service import tenants as tenants_svc
from proofplane.service import workloads as workloads_svc
from proofplane.service.cluster import load_cluster
from proofplane.service.context import Store
from proofplane.service.workloads import WorkloadSpec
from proofplane.store.tables import (
    EndpointRow,
    EventRow,
    NodeNetworkRow,
    NodeRow,
    SegmentRow,
    TenantRow,
)

H100 = "H100-80GB"


def actions(store: Store, after: int = 0) -> list[str]:
    with store.read() as s:
        return list(s.scalars(select(EventRow.action).where(EventRow.seq > after)
                              .order_by(EventRow.seq)))  # fmt: skip


def last_seq(store: Store) -> int:
    with store.read() as s:
        return s.scalar(select(func.max(EventRow.seq))) or 0


def segments(store: Store, tenant: str | None = None) -> list[tuple[Any, ...]]:
    with store.read() as s:
        q = select(SegmentRow.tenant, SegmentRow.workload, SegmentRow.vni, SegmentRow.pkey,
                   SegmentRow.state).order_by(SegmentRow.id)  # fmt: skip
        if tenant is not None:
            q = q.where(SegmentRow.tenant == tenant)
        return [tuple(r) for r in s.execute(q)]


def refused(fn: Any, code: str) -> ProofplaneError:
    with pytest.raises(ProofplaneError) as exc:
        fn()
    assert exc.value.code == code, exc.value
    return exc.value


def node(name: str, gpus: int = 4) -> Node:
    return Node(name, "r", "z", gpus=tuple(Gpu(i, f"GPU-{name}-{i}", H100, 0) for i in range(gpus)))


def cluster(store: Store, names: tuple[str, ...] = ("n1", "n2", "n3"), gpus: int = 4) -> None:
    """Admitted nodes with underlay facts (VTEP 10.250.0.i)."""
    for i, name in enumerate(names, start=1):
        nodes_svc.register_node(store, SYSTEM, node(name, gpus))
        nodes_svc.set_node_state(store, SYSTEM, name, NodeState.ADMITTED)
        network.set_underlay(store, SYSTEM, name, vtep=f"10.250.0.{i}",
                             hca_guids=[f"0x0002c9030000000{i}"])  # fmt: skip


def submit(store: Store, name: str, tenant: str, count: int = 1) -> Any:
    return workloads_svc.submit_workload(
        store, SYSTEM, WorkloadSpec(name, tenant, gpus=GpuRequest(count))
    )


def consistent(store: Store) -> dict[str, tuple[int, str]]:
    """Every node's stored desired hash equals a fresh computation from the database (the
    pure core's ``compute_all``) and what ``GET …/network`` serves; (generation, sha) per node."""
    out: dict[str, tuple[int, str]] = {}
    with store.read() as s:
        fresh = netstate.load_index(s)
        everything = compute_all(
            fresh.nodes.values(), fresh.segments.values(),
            {t: fresh.policy(t) for t in {seg.tenant for seg in fresh.segments.values()}},
            fresh.endpoints.values(),
        )  # fmt: skip
        for nn, name in s.execute(
            select(NodeNetworkRow, NodeRow.name).join(NodeRow, NodeRow.id == NodeNetworkRow.node_id)
        ):
            served, _ = network.desired_of(s, name)
            assert nn.desired_sha256 == served.sha256 == everything[name].sha256, name
            out[name] = (nn.desired_generation, nn.desired_sha256)
    return out


def endpoints(store: Store) -> dict[str, tuple[str, str, str | None]]:
    with store.read() as s:
        return {e.key: (e.ip, e.mac, e.node) for e in s.scalars(select(EndpointRow))}


def report(store: Store, name: str, *, ok: bool = True, ruleset: str | None = None,
           generation: int | None = None) -> dict[str, Any]:  # fmt: skip
    """The node's agent reports it applied the current desired state (or ``generation``)."""
    st = network.node_status(store, SYSTEM, name)
    body = {
        "applied_generation": st["desired_generation"] if generation is None else generation,
        "applied_sha256": st["desired_sha256"],
        "ruleset_sha256": ruleset or st["expected_ruleset_sha256"],
        "self_check": {"ok": ok},
    }
    return network.report(store, SYSTEM, name, body)


# --- segments ------------------------------------------------------------------------------------


def test_every_tenant_gets_a_vni_and_a_pkey_with_its_creation(store: Store) -> None:
    start = last_seq(store)
    tenants_svc.create_tenant(store, SYSTEM, Tenant("a"))
    tenants_svc.create_tenant(store, SYSTEM, Tenant("b"))
    assert segments(store) == [("a", None, 10000, 1, "active"), ("b", None, 10001, 2, "active")]
    assert actions(store, start) == ["tenant.create", "network.segment.allocate"] * 2
    with store.read() as s:  # one transaction: the same time on both events
        rows = s.scalars(select(EventRow).where(EventRow.seq > start).order_by(EventRow.seq))
        ts = [e.ts for e in rows]
    assert ts[0] == ts[1] and ts[2] == ts[3]
    view = network.tenant_segments(store, SYSTEM, "a")
    assert [(g["vni"], g["pkey"]) for g in view["segments"]] == [(10000, "0x0001")]
    assert view["default"] is True and view["segment_mode"] == "per-tenant"


def test_manual_assignment_is_checked_and_nothing_is_half_created(store: Store) -> None:
    tenants_svc.create_tenant(store, SYSTEM, Tenant("a"), vni=20000, pkey=0x10)
    assert segments(store) == [("a", None, 20000, 0x10, "active")]
    before = last_seq(store)
    refused(lambda: tenants_svc.create_tenant(store, SYSTEM, Tenant("b"), vni=5), "invalid_segment")
    refused(lambda: tenants_svc.create_tenant(store, SYSTEM, Tenant("b"), vni=2**24),
            "invalid_segment")  # fmt: skip
    refused(lambda: tenants_svc.create_tenant(store, SYSTEM, Tenant("b"), pkey=0x7FFF),
            "invalid_segment")  # fmt: skip
    err = refused(lambda: tenants_svc.create_tenant(store, SYSTEM, Tenant("b"), vni=20000),
                  "segment_in_use")  # fmt: skip
    assert err.details["reason"] == "in_use"
    refused(lambda: tenants_svc.create_tenant(store, SYSTEM, Tenant("b"), pkey=0x10),
            "segment_in_use")  # fmt: skip
    assert last_seq(store) == before  # nothing written, not even the tenant
    with store.read() as s:
        assert s.scalar(select(TenantRow).where(TenantRow.name == "b")) is None


def test_pool_exhaustion_is_a_409_an_event_and_nothing_else(store: Store) -> None:
    store.network = NetworkSettings(vni_pool=(10000, 10001))
    tenants_svc.create_tenant(store, SYSTEM, Tenant("a"))
    tenants_svc.create_tenant(store, SYSTEM, Tenant("b"))
    before = last_seq(store)
    err = refused(lambda: tenants_svc.create_tenant(store, SYSTEM, Tenant("c")),
                  "segment_pool_exhausted")  # fmt: skip
    assert err.details["kind"] == "vni" and err.details["tenant"] == "c"
    assert actions(store, before) == ["network.segment.exhausted"]  # its own transaction
    with store.read() as s:
        ev = s.scalar(select(EventRow).where(EventRow.seq > before))
        assert ev.outcome == "failure" and ev.target_id == "c"
        assert ev.details["pool"] == [10000, 10001] and ev.details["kind"] == "vni"
        assert s.scalar(select(TenantRow).where(TenantRow.name == "c")) is None
    # the PKey pool too
    store.network = NetworkSettings(pkey_pool=(1, 2))
    refused(lambda: tenants_svc.create_tenant(store, SYSTEM, Tenant("c")), "segment_pool_exhausted")


def test_deleting_a_tenant_releases_its_segment_into_the_cool_down(store: Store) -> None:
    tenants_svc.create_tenant(store, SYSTEM, Tenant("a"))
    tenants_svc.create_tenant(store, SYSTEM, Tenant("b"))
    out = tenants_svc.delete_tenant(store, SYSTEM, "a")
    assert out["released"] == [{"vni": 10000, "pkey": 1}]
    assert segments(store, "a") == [("a", None, 10000, 1, "released")]
    refused(lambda: tenants_svc.get_tenant(store, SYSTEM, "a"), "not_found")
    assert [t.name for t in tenants_svc.list_tenants(store, SYSTEM).items] == ["b"]
    refused(lambda: tenants_svc.create_tenant(store, SYSTEM, Tenant("a")), "tenant_name_retired")
    refused(lambda: tenants_svc.delete_tenant(store, SYSTEM, "a"), "not_found")
    # a late packet never reaches a new owner: 10000 cools down
    tenants_svc.create_tenant(store, SYSTEM, Tenant("c"))
    assert segments(store, "c") == [("c", None, 10002, 3, "active")]
    err = refused(lambda: tenants_svc.create_tenant(store, SYSTEM, Tenant("d"), vni=10000),
                  "segment_in_use")  # fmt: skip
    assert err.details["reason"] == "cooling"
    released = network.list_segments(store, SYSTEM, state="released").items
    assert [(r["tenant"], r["vni"]) for r in released] == [("a", 10000)]
    assert "reusable_after" in released[0]
    # once cooled down (30 days by default), it is the lowest free again
    with store.write(SYSTEM) as tx:
        row = tx.session.scalar(select(SegmentRow).where(SegmentRow.tenant == "a"))
        row.released_at = tx.now - timedelta(days=31)
    tenants_svc.create_tenant(store, SYSTEM, Tenant("e"))
    assert segments(store, "e") == [("e", None, 10000, 1, "active")]


def test_no_cool_down_when_it_is_zero(store: Store) -> None:
    store.network = NetworkSettings(cooldown=timedelta(0))
    tenants_svc.create_tenant(store, SYSTEM, Tenant("a"))
    tenants_svc.delete_tenant(store, SYSTEM, "a")
    tenants_svc.create_tenant(store, SYSTEM, Tenant("b"))
    assert segments(store, "b") == [("b", None, 10000, 1, "active")]


def test_a_tenant_with_unfinished_work_is_not_deleted(store: Store) -> None:
    tenants_svc.create_tenant(store, SYSTEM, Tenant("a"))
    submit(store, "w", "a")  # pending: no node
    err = refused(lambda: tenants_svc.delete_tenant(store, SYSTEM, "a"), "tenant_has_workloads")
    assert err.details["workloads"] == ["w"]
    workloads_svc.cancel_workload(store, SYSTEM, "w")
    tenants_svc.delete_tenant(store, SYSTEM, "a")
    refused(lambda: submit(store, "w2", "a"), "not_found")


def test_per_workload_segments_come_with_the_workload_and_go_with_it(store: Store) -> None:
    cluster(store, ("n1",))
    profile = ComplianceProfile(segment="per-workload")
    tenants_svc.create_tenant(store, SYSTEM, Tenant("iso", profile=profile))
    submit(store, "w1", "iso")
    workloads_svc.submit_workloads(
        store, SYSTEM, [WorkloadSpec("w2", "iso"), WorkloadSpec("w3", "iso")]
    )
    assert segments(store, "iso") == [
        ("iso", None, 10000, 1, "active"),
        ("iso", "w1", 10001, 2, "active"),
        ("iso", "w2", 10002, 3, "active"),
        ("iso", "w3", 10003, 4, "active"),
    ]
    with store.read() as s:
        vni = {e.key: e.vni for e in s.scalars(select(EndpointRow))}
    assert vni == {"iso/w1": 10001, "iso/w2": 10002, "iso/w3": 10003}
    workloads_svc.cancel_workload(store, SYSTEM, "w2")
    assert ("iso", "w2", 10002, 3, "released") in segments(store, "iso")
    assert "iso/w2" not in endpoints(store)
    d = network.node_network(store, SYSTEM, "n1").desired
    assert [(s.vni, s.workload) for s in d.segments] == [(10001, "iso/w1"), (10003, "iso/w3")]
    consistent(store)


def test_per_workload_pool_exhaustion_refuses_the_submission(store: Store) -> None:
    store.network = NetworkSettings(vni_pool=(10000, 10001))
    tenants_svc.create_tenant(
        store, SYSTEM, Tenant("iso", profile=ComplianceProfile(segment="per-workload"))
    )
    submit(store, "w1", "iso")
    before = last_seq(store)
    refused(lambda: submit(store, "w2", "iso"), "segment_pool_exhausted")
    assert actions(store, before) == ["network.segment.exhausted"]
    with pytest.raises(ProofplaneError) as exc:
        workloads_svc.submit_workloads(store, SYSTEM, [WorkloadSpec("w3", "iso")])
    assert exc.value.code == "segment_pool_exhausted"
    assert "items[0]" in exc.value.message
    refused(lambda: workloads_svc.get_workload(store, SYSTEM, "w2"), "not_found")


# --- endpoints and desired state -----------------------------------------------------------------


def test_the_demo_tenants_have_segments_and_the_demo_nodes_simulated_underlay(
    demo: Store,
) -> None:
    page = network.list_segments(demo, SYSTEM)
    assert [s["tenant"] for s in page.items] == [
        "st-marys-hospital", "nordbank", "berlin-telco", "paris-insurance", "research-lab",
    ]  # fmt: skip
    assert all(s["nodes"] for s in page.items)
    statuses = network.list_node_status(demo, SYSTEM, limit=500).items
    assert len(statuses) == 24 and all(st["simulated"] for st in statuses)
    assert all(st["managed"] is False and st["network_drift"] is None for st in statuses)
    consistent(demo)
    policy = network.tenant_segments(demo, SYSTEM, "st-marys-hospital")
    assert policy["default"] is False
    assert {"proto": "tcp", "ports": [29500, 29500], "source": "tenant"} in policy["policy"][
        "allow"
    ]


def test_endpoints_are_stable_across_failover_and_desired_state_follows(demo: Store) -> None:
    before_eps = endpoints(demo)
    before = consistent(demo)
    moved = {k for k, (_ip, _mac, n) in before_eps.items() if n == "fra-h100-01"}
    assert moved
    nodes_svc.set_node_state(demo, SYSTEM, "fra-h100-01", NodeState.FAILED, "psu")
    after_eps = endpoints(demo)
    for key in moved:  # same address and MAC, another node (or none while it waits)
        assert after_eps[key][:2] == before_eps[key][:2]
        assert after_eps[key][2] != "fra-h100-01"
    after = consistent(demo)
    changed = {n for n in after if after[n] != before[n]}
    assert "fra-h100-01" in changed
    assert after["fra-h100-01"][0] == before["fra-h100-01"][0] + 1
    d = network.node_network(demo, SYSTEM, "fra-h100-01").desired
    assert d.segments == ()  # a failed node carries nothing
    # nodes that share no segment with the moved work kept their generation
    quiet = {"fra-a100-01", "fra-a100-03"}
    assert quiet.isdisjoint(changed)
    # a cancelled workload's endpoint goes, and its address is free again
    key = sorted(moved)[0]
    tenant, name = key.split("/")
    workloads_svc.cancel_workload(demo, SYSTEM, name, tenant=tenant)
    assert key not in endpoints(demo)
    consistent(demo)


def test_another_writers_placements_are_followed_not_rebuilt(demo: Store) -> None:
    """A second store on the same database (another worker, another replica) places and
    cancels: this store's cached index follows those workloads' endpoints instead of being
    rebuilt, and every node's desired state stays what a fresh computation gives."""
    other = Store(demo.url)
    try:
        cache = netstate.network_cache(demo.engine)
        submit(demo, "one", "research-lab")
        loads, hits = cache.loads, cache.hits
        placed = submit(other, "two", "nordbank")
        assert placed.status is WorkloadStatus.PLACED
        submit(demo, "three", "research-lab")  # follows "two"
        assert (cache.loads, cache.hits) == (loads, hits + 1)
        assert "nordbank/two" in cache.index.endpoints
        consistent(demo)
        workloads_svc.cancel_workload(other, SYSTEM, "two", tenant="nordbank")
        workloads_svc.cancel_workload(demo, SYSTEM, "three", tenant="research-lab")
        assert cache.loads == loads and "nordbank/two" not in cache.index.endpoints
        # what the followed index derived is what a rebuilt one derives, node for node
        with demo.read() as s:
            assert cache.index.desired_all() == netstate.load_index(s).desired_all()
        consistent(demo)
    finally:
        other.dispose()


def test_another_writers_policy_change_makes_the_cached_index_rebuild(demo: Store) -> None:
    """What following placements cannot bring (here a tenant's profile, which may carry its
    network policy) makes the index rebuild from the database."""
    other = Store(demo.url)
    try:
        cache = netstate.network_cache(demo.engine)
        submit(demo, "one", "research-lab")
        loads = cache.loads
        tenants_svc.create_tenant(other, SYSTEM, Tenant("late-tenant"))
        submit(demo, "two", "research-lab")
        assert cache.loads == loads + 1
        submit(demo, "three", "research-lab")
        assert cache.loads == loads + 1  # reused after that
        consistent(demo)
    finally:
        other.dispose()


def test_a_full_subnet_leaves_the_workload_placed_without_an_endpoint(store: Store) -> None:
    cluster(store, ("n1",), gpus=8)
    tiny = {"subnet": "10.20.0.0/30"}  # two host addresses
    tenants_svc.create_tenant(store, SYSTEM, Tenant("t", profile=ComplianceProfile(
        network_policy=tiny)))  # fmt: skip
    for i in range(3):
        assert submit(store, f"w{i}", "t").status is WorkloadStatus.PLACED
    eps = endpoints(store)
    assert sorted(ip for ip, _m, _n in eps.values()) == ["10.20.0.1", "10.20.0.2"]
    with store.read() as s:
        query = select(EventRow).where(
            EventRow.outcome == "failure", EventRow.action == "network.endpoints"
        )
        failed = s.scalars(query).all()
    assert [e.details["unassigned"][0]["why"] for e in failed] == ["subnet_exhausted"]
    consistent(store)


# --- reports, drift and readiness ---------------------------------------------------------------


def test_reports_drift_and_node_json(store: Store) -> None:
    cluster(store, ("n1",))
    tenants_svc.create_tenant(store, SYSTEM, Tenant("a"))
    assert nodes_svc.get_node(store, SYSTEM, "n1").network_drift is None  # not reporting
    st = report(store, "n1")
    assert st["managed"] and st["network_drift"] is False and st["drift"] == []
    assert nodes_svc.get_node(store, SYSTEM, "n1").network_drift is False
    submit(store, "w", "a")  # a new desired generation: the agent lags
    st = network.node_status(store, SYSTEM, "n1")
    assert st["drift"] == ["generation_lag"]
    assert nodes_svc.get_node(store, SYSTEM, "n1").network_drift is True
    assert [n.network_drift for n in nodes_svc.list_nodes(store, SYSTEM).items] == [True]
    assert report(store, "n1")["drift"] == []
    assert report(store, "n1", ruleset="f" * 64)["drift"] == ["ruleset_mismatch"]
    assert report(store, "n1", ok=False)["drift"] == ["self_check_failed"]
    st = network.report(store, SYSTEM, "n1", {
        "applied_generation": st["desired_generation"], "applied_sha256": "e" * 64,
        "ruleset_sha256": None, "self_check": {"ok": True}})  # fmt: skip
    assert st["drift"] == ["sha256_mismatch"]
    drifting = network.list_node_status(store, SYSTEM, drift_only=True).items
    assert [d["node"] for d in drifting] == ["n1"]
    assert actions(store)[-1] == "node.network.report"


def test_bad_reports_are_refused(store: Store) -> None:
    cluster(store, ("n1",))
    good = {"applied_generation": 1, "applied_sha256": "a" * 64, "self_check": {"ok": True}}
    for bad in (
        None, [], {**good, "applied_generation": -1}, {**good, "applied_generation": True},
        {**good, "applied_generation": 2**63}, {**good, "applied_sha256": "A" * 64},
        {**good, "ruleset_sha256": "x"}, {**good, "self_check": {}},
        {**good, "self_check": {"ok": "yes"}}, {**good, "self_check": []},
        {**good, "self_check": {"ok": True, "log": "x" * 70_000}},
        {**good, "self_check": {"ok": True, "n": float("nan")}},
    ):  # fmt: skip
        refused(lambda b=bad: network.report(store, SYSTEM, "n1", b), "invalid_report")
    nodes_svc.register_node(store, SYSTEM, node("bare"))
    refused(lambda: network.report(store, SYSTEM, "bare", good), "network_underlay_unknown")
    refused(lambda: network.report(store, SYSTEM, "nope", good), "not_found")


def test_an_agent_acts_for_its_own_node_only(store: Store) -> None:
    cluster(store, ("n1", "n2"))
    agent = Actor("node:n1", token_id="t")
    assert network.node_network(store, agent, "n1").desired.node == "n1"
    refused(lambda: network.node_network(store, agent, "n2"), "not_found")
    refused(lambda: network.report(store, agent, "n2", {}), "not_found")
    st = network.set_underlay(store, agent, "n1", vtep="10.250.0.11")
    assert st["source"] == "agent" and st["vtep"] == "10.250.0.11"
    developer = Actor("dev", frozenset({Role.DEVELOPER}), frozenset({"a"}))
    refused(lambda: network.node_network(store, developer, "n1"), "forbidden")


def test_underlay_facts_are_checked(store: Store) -> None:
    cluster(store, ("n1", "n2"))
    refused(lambda: network.set_underlay(store, SYSTEM, "n2", vtep="10.250.0.1"), "vtep_in_use")
    for vtep in ("nope", "10.0.0.0.1", "::1", "0.0.0.0", "239.1.1.1", "", None):
        refused(lambda v=vtep: network.set_underlay(store, SYSTEM, "n2", vtep=v),
                "invalid_underlay")  # fmt: skip
    for dev in ("", "a" * 16, "eth/0", "..", "a b"):
        refused(
            lambda d=dev: network.set_underlay(
                store, SYSTEM, "n2", vtep="10.250.0.9", underlay_dev=d
            ),
            "invalid_underlay",
        )
    refused(lambda: network.set_underlay(store, SYSTEM, "n2", vtep="10.250.0.9",
                                         hca_guids=["zz"]), "invalid_guid")  # fmt: skip
    st = network.set_underlay(store, SYSTEM, "n2", vtep="10.250.0.9",
                              hca_guids=["0002:c903:00a1:b2c3"])  # fmt: skip
    assert st["hca_guids"] == ["0x0002c90300a1b2c3"] and st["source"] == "api"


def test_placement_waits_for_a_node_to_apply_its_segment(store: Store) -> None:
    """A managed node that has not applied the generation that brought a segment gets no new
    work of that segment; the agent's report lets the waiting work in."""
    cluster(store, ("n1",), gpus=8)
    tenants_svc.create_tenant(store, SYSTEM, Tenant("a"))
    tenants_svc.create_tenant(store, SYSTEM, Tenant("b"))
    report(store, "n1")  # under network management, in sync
    assert submit(store, "a1", "a").status is WorkloadStatus.PLACED  # brings a's segment
    waiting = submit(store, "a2", "a")
    assert waiting.status is WorkloadStatus.PENDING
    assert waiting.reason == INSUFFICIENT_CAPACITY
    assert waiting.reason_details["rejections"] == {NETWORK_NOT_APPLIED: 1}
    assert "wait for their agent" in waiting.reason_details["message"] or (
        "network_not_applied" in waiting.reason_details["message"]
    )
    explained = workloads_svc.explain_workload(store, SYSTEM, "a2")
    assert explained["analysis"]["filters"] == {NETWORK_NOT_APPLIED: 1}
    # another tenant's first workload is not held back
    assert submit(store, "b1", "b").status is WorkloadStatus.PLACED
    report(store, "n1")  # the agent applied it: a2 is placed by the report's transaction
    assert workloads_svc.get_workload(store, SYSTEM, "a2").status is WorkloadStatus.PLACED
    # a node whose ruleset differs takes no new work at all
    report(store, "n1", ruleset="f" * 64)
    tenants_svc.create_tenant(store, SYSTEM, Tenant("c"))
    assert submit(store, "c1", "c").status is WorkloadStatus.PENDING
    report(store, "n1")
    assert workloads_svc.get_workload(store, SYSTEM, "c1").status is WorkloadStatus.PLACED


def test_nodes_that_never_reported_are_not_held_back(store: Store) -> None:
    cluster(store, ("n1",), gpus=8)
    tenants_svc.create_tenant(store, SYSTEM, Tenant("a"))
    assert all(submit(store, f"w{i}", "a").status is WorkloadStatus.PLACED for i in range(4))


# --- the network policy --------------------------------------------------------------------------

POLICY = {
    "subnet": "10.10.0.0/24",
    "allow": [{"proto": "tcp", "ports": 29500}, {"proto": "tcp", "ports": 22,
                                                 "source": "10.10.0.250/32"}],
    "egress": [{"proto": "tcp", "ports": [443, 443], "destination": "192.0.2.0/24"}],
}  # fmt: skip


def test_a_policy_change_reaches_the_nodes_running_the_tenant(store: Store) -> None:
    cluster(store, ("n1", "n2"))
    tenants_svc.create_tenant(store, SYSTEM, Tenant("a"))
    tenants_svc.create_tenant(store, SYSTEM, Tenant("b"))
    submit(store, "w", "a", count=4)
    submit(store, "x", "b", count=4)
    before = consistent(store)
    where_a = endpoints(store)["a/w"][2]
    view = network.set_network_policy(store, SYSTEM, "a", POLICY)
    assert view["default"] is False and actions(store)[-2:] == [
        "tenant.network_policy", "network.desired"]  # fmt: skip
    after = consistent(store)
    assert {n for n in after if after[n] != before[n]} == {where_a}
    assert view == network.set_network_policy(store, SYSTEM, "a", POLICY)  # unchanged: no event
    assert actions(store)[-1] == "network.desired"
    d = network.node_network(store, SYSTEM, where_a)
    assert "29500" in d.render("nftables")
    network.set_network_policy(store, SYSTEM, "a", None)
    assert network.tenant_segments(store, SYSTEM, "a")["default"] is True


def test_bad_policies_are_refused_and_nothing_is_applied(store: Store) -> None:
    tenants_svc.create_tenant(store, SYSTEM, Tenant("a"))
    tenants_svc.create_tenant(store, SYSTEM, Tenant("b"))
    before = last_seq(store)
    cases = [
        ({"allow": [{"proto": "tcp", "ports": 70000}]}, "invalid_network_policy"),
        ({"allow": [{"proto": "sctp"}]}, "invalid_network_policy"),
        ({"subnet": "10.10.0.1/24"}, "invalid_network_policy"),
        ({"nope": 1}, "invalid_network_policy"),
        ({"allow": [{"proto": "tcp", "source": {"tenant": "ghost"}}]}, "unknown_tenant"),
        ({"allow": [{"proto": "tcp", "source": {"tenant": "b"}}]}, "cross_tenant_rule"),
    ]
    for policy, code in cases:
        refused(lambda p=policy: network.set_network_policy(store, SYSTEM, "a", p), code)
        profile = ComplianceProfile(network_policy=policy)
        refused(lambda p=profile: tenants_svc.create_tenant(store, SYSTEM, Tenant("c", profile=p)),
                code)  # fmt: skip
    with pytest.raises(CrossTenantRule):
        network.check_policy_change(store, "a", cases[-1][0])
    assert last_seq(store) == before
    refused(lambda: network.set_network_policy(store, SYSTEM, "ghost", POLICY), "not_found")
    # its own name is the tenant itself
    own = {"allow": [{"proto": "tcp", "source": {"tenant": "a"}}]}
    assert network.set_network_policy(store, SYSTEM, "a", own)["policy"]["allow"] == [
        {"proto": "tcp", "ports": None, "source": "tenant"}
    ]


def test_a_subnet_that_would_lose_addresses_is_refused(store: Store) -> None:
    cluster(store, ("n1",))
    tenants_svc.create_tenant(store, SYSTEM, Tenant("a"))
    submit(store, "w", "a")
    refused(lambda: network.set_network_policy(store, SYSTEM, "a", {"subnet": "10.30.0.0/24"}),
            "subnet_in_use")  # fmt: skip
    network.set_network_policy(store, SYSTEM, "a", {"subnet": "10.10.0.0/16"})  # still holds it


def test_the_profile_keeps_the_policy_unless_it_sets_one(store: Store) -> None:
    tenants_svc.create_tenant(store, SYSTEM, Tenant("a"))
    network.set_network_policy(store, SYSTEM, "a", POLICY)
    t = tenants_svc.update_tenant(
        store, SYSTEM, "a", profile=ComplianceProfile(min_isolation=IsolationLevel.MIG)
    )
    assert t.profile.network_policy is not None
    assert t.profile.network_policy["subnet"] == "10.10.0.0/24"


def test_network_policy_and_tenant_delete_are_governed_changes(store: Store) -> None:
    cluster(store, ("n1",))
    tenants_svc.create_tenant(store, SYSTEM, Tenant("a"))
    asker = Actor("alice", frozenset({Role.ADMIN}))
    approvers = [Actor(n, frozenset({Role.ADMIN})) for n in ("bob", "carol")]
    bad = {"tenant": "a", "policy": {"allow": [{"proto": "tcp", "source": {"tenant": "zz"}}]}}
    refused(lambda: changes_svc.create_change(store, asker, "network.policy", bad),
            "unknown_tenant")  # fmt: skip
    change = changes_svc.create_change(store, asker, "network.policy",
                                       {"tenant": "a", "policy": POLICY})  # fmt: skip
    assert change["tenant"] == "a" and change["state"] == "pending"
    changes_svc.vote(store, approvers[0], change["id"], "approve")
    changes_svc.apply_change(store, asker, change["id"])
    assert network.tenant_segments(store, SYSTEM, "a")["default"] is False
    with store.read() as s:
        ev = s.scalar(select(EventRow).where(EventRow.action == "tenant.network_policy"))
        assert ev.details["change_id"] == change["id"]
    delete = changes_svc.create_change(store, asker, "tenant.delete", {"tenant": "a"})
    for a in approvers:
        changes_svc.vote(store, a, delete["id"], "approve")
    changes_svc.apply_change(store, asker, delete["id"])
    assert segments(store, "a")[0][-1] == "released"


# --- the segmentation map ------------------------------------------------------------------------


def test_the_segmentation_map(store: Store) -> None:
    cluster(store, ("n1", "n2"))
    tenants_svc.create_tenant(store, SYSTEM, Tenant("a"))
    tenants_svc.create_tenant(store, SYSTEM, Tenant("idle"))
    submit(store, "w", "a", count=4)
    where = endpoints(store)["a/w"][2]
    data = network.segmentation_map(store, SYSTEM)
    a, idle = data["tenants"]
    assert a["tenant"] == "a" and a["nodes"] == [where] and a["last_isolation_check"] is None
    seg = a["segments"][0]
    assert (seg["vni"], seg["pkey"]) == (10000, "0x0001")
    guid = {"n1": "0x0002c90300000001", "n2": "0x0002c90300000002"}[where]
    assert seg["pkey_members"] == [{"node": where, "guid": guid, "membership": "full"}]
    assert idle["nodes"] == [] and idle["segments"][0]["nodes"] == []
    report(store, where)
    check = network.segmentation_map(store, SYSTEM)["tenants"][0]["last_isolation_check"]
    assert check["ok"] is True and check["nodes_reported"] == 1
    report(store, where, ok=False)
    check = network.segmentation_map(store, SYSTEM)["tenants"][0]["last_isolation_check"]
    assert check["ok"] is False and check["failing"] == [where]
    rows = list(csv.DictReader(io.StringIO(network.segmentation_csv(
        network.segmentation_map(store, SYSTEM)))))  # fmt: skip
    assert [r["tenant"] for r in rows] == ["a", "idle"]
    assert rows[0]["vni"] == "10000" and rows[0]["pkey"] == "0x0001"
    assert rows[0]["pkey_members"] == f"{guid}=full@{where}"
    assert rows[0]["last_isolation_check_ok"] == "false"
    auditor = Actor("aud", frozenset({Role.AUDITOR}))
    assert network.segmentation_map(store, auditor)["tenants"]
    developer = Actor("dev", frozenset({Role.DEVELOPER}), frozenset({"a"}))
    refused(lambda: network.segmentation_map(store, developer), "forbidden")


def test_segment_lists_are_pages_of_what_the_caller_may_see(store: Store) -> None:
    for name in ("a", "b", "c"):
        tenants_svc.create_tenant(store, SYSTEM, Tenant(name))
    first = network.list_segments(store, SYSTEM, limit=2)
    assert [s["tenant"] for s in first.items] == ["a", "b"] and first.next
    rest = network.list_segments(store, SYSTEM, limit=2, cursor=first.next)
    assert [s["tenant"] for s in rest.items] == ["c"] and rest.next is None
    developer = Actor("dev", frozenset({Role.DEVELOPER}), frozenset({"b"}))
    assert [s["tenant"] for s in network.list_segments(store, developer).items] == ["b"]
    refused(lambda: network.list_segments(store, developer, tenant="a"), "not_found")
    refused(lambda: network.tenant_segments(store, developer, "a"), "not_found")
    refused(lambda: network.list_segments(store, SYSTEM, cursor="garbage"), "invalid_cursor")
    refused(lambda: network.list_segments(store, SYSTEM, state="gone"), "validation_failed")


def test_demo_cluster_file_underlay(store: Store) -> None:
    spec = parse_cluster(demo_text())
    assert all(ns.underlay is not None and ns.underlay.simulated for ns in spec.nodes)
    vteps = [ns.underlay.vtep for ns in spec.nodes if ns.underlay is not None]
    assert len(set(vteps)) == len(vteps) and vteps[0] == "10.250.0.1"
    load_cluster(store, SYSTEM, spec)
    st = network.node_status(store, SYSTEM, spec.nodes[0].node.name)
    assert st["simulated"] and st["source"] == "simulated" and st["desired_generation"] >= 1


def test_network_settings_from_the_environment() -> None:
    from proofplane.config import network_from_env

    s = network_from_env({})
    assert (s.vni_pool, s.pkey_pool, s.cooldown) == ((10000, 16_000_000), (1, 0x7FFE),
                                                     timedelta(days=30))  # fmt: skip
    s = network_from_env({"PROOFPLANE_VNI_POOL": "100-200", "PROOFPLANE_PKEY_POOL": "0x10-0x20",
                          "PROOFPLANE_SEGMENT_COOLDOWN_DAYS": "0.5"})  # fmt: skip
    assert (s.vni_pool, s.pkey_pool, s.cooldown) == ((100, 200), (16, 32), timedelta(hours=12))
    for env in (
        {"PROOFPLANE_VNI_POOL": "0-5"}, {"PROOFPLANE_VNI_POOL": "200-100"},
        {"PROOFPLANE_VNI_POOL": "1-16777216"}, {"PROOFPLANE_VNI_POOL": "lots"},
        {"PROOFPLANE_PKEY_POOL": "1-0x7fff"}, {"PROOFPLANE_SEGMENT_COOLDOWN_DAYS": "-1"},
        {"PROOFPLANE_SEGMENT_COOLDOWN_DAYS": "nan"}, {"PROOFPLANE_SEGMENT_COOLDOWN_DAYS": "9999"},
    ):  # fmt: skip
        refused(lambda e=env: network_from_env(e), "invalid_setting")


def test_work_placed_before_the_underlay_gets_its_endpoints_with_it(store: Store) -> None:
    """An existing cluster (before segments, or before its nodes reported underlay facts):
    registering a node's underlay brings its running work into the desired state."""
    nodes_svc.register_node(store, SYSTEM, node("n1"))
    nodes_svc.set_node_state(store, SYSTEM, "n1", NodeState.ADMITTED)
    tenants_svc.create_tenant(store, SYSTEM, Tenant("a"))
    submit(store, "w", "a")
    with store.write(SYSTEM) as tx:  # as if it had been placed before segments existed
        tx.session.execute(EndpointRow.__table__.delete())
    assert endpoints(store) == {}
    network.set_underlay(store, SYSTEM, "n1", vtep="10.250.0.1")
    assert endpoints(store)["a/w"][2] == "n1"
    d = network.node_network(store, SYSTEM, "n1").desired
    assert [e.workload for s in d.segments for e in s.local] == ["a/w"]
    consistent(store)


def test_migration_0015_downgrades_and_upgrades_again(demo: Store) -> None:
    migrate_to(demo.engine, "0014")
    assert network.list_segments(demo, SYSTEM).items == []  # the network state starts again
    tenants_svc.create_tenant(demo, SYSTEM, Tenant("after"))
    assert segments(demo, "after") == [("after", None, 10000, 1, "active")]


def test_a_new_per_workload_segment_is_not_held_back(store: Store) -> None:
    cluster(store, ("n1",), gpus=8)
    tenants_svc.create_tenant(
        store, SYSTEM, Tenant("iso", profile=ComplianceProfile(segment="per-workload"))
    )
    report(store, "n1")
    assert submit(store, "w1", "iso").status is WorkloadStatus.PLACED
    # its own new segment: not held back by w1's, which n1 has not applied yet
    out = workloads_svc.submit_workloads(store, SYSTEM, [WorkloadSpec("w2", "iso")])
    assert out[0].status is WorkloadStatus.PLACED


def test_an_address_freed_and_taken_in_one_transaction(store: Store) -> None:
    """Cancelling a workload frees its address and places a waiting one in the same
    transaction, which may take that very address."""
    cluster(store, ("n1",), gpus=2)
    tiny = ComplianceProfile(network_policy={"subnet": "10.20.0.0/30"})
    tenants_svc.create_tenant(store, SYSTEM, Tenant("t", profile=tiny))
    submit(store, "w1", "t")
    submit(store, "w2", "t")
    assert submit(store, "w3", "t").status is WorkloadStatus.PENDING
    freed = endpoints(store)["t/w1"][0]
    workloads_svc.cancel_workload(store, SYSTEM, "w1")
    assert workloads_svc.get_workload(store, SYSTEM, "w3").status is WorkloadStatus.PLACED
    assert endpoints(store)["t/w3"][0] == freed
    consistent(store)


def test_a_desired_state_that_cannot_be_computed_never_fails_a_placement(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster(store, ("n1", "n2"))
    tenants_svc.create_tenant(store, SYSTEM, Tenant("a"))
    before = consistent(store)

    def broken(_d: Any) -> str:
        raise ProofplaneError("renderer broke", code="boom")

    monkeypatch.setattr(netstate, "expected_ruleset_sha256", broken)
    assert submit(store, "w", "a").status is WorkloadStatus.PLACED
    with store.read() as s:
        ev = s.scalars(select(EventRow).order_by(EventRow.seq.desc())).first()
        query = select(NodeNetworkRow, NodeRow.name).join(
            NodeRow, NodeRow.id == NodeNetworkRow.node_id
        )
        stored = {n: (nn.desired_generation, nn.desired_sha256) for nn, n in s.execute(query)}
    assert (ev.action, ev.outcome, ev.details["error"]) == ("network.desired", "failure", "boom")
    assert stored == before  # no node half-done
    monkeypatch.undo()
    submit(store, "x", "a")  # the next change recomputes every node
    consistent(store)
