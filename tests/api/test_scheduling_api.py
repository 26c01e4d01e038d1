"""Quotas, gang workloads, preemption, MIG repartitioning and explanations through the HTTP API,
on SQLite and PostgreSQL (the ``client`` fixture)."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from api_nodes import register_admitted
from proofplane.service.context import Store
from proofplane.store.tables import Base

API = "/api/v1"


def node_body(name: str, gpus: int, mig: int) -> dict[str, Any]:
    three_g = [{"profile": "3g.40gb", "start": 0}, {"profile": "3g.40gb", "start": 4}]
    return {
        "name": name,
        "region": "eu-frankfurt",
        "zone": "eu-frankfurt-1a",
        "gpus": [
            {
                "index": i,
                "uuid": f"GPU-{name}-{i}",
                "model": "H100-80GB",
                "mig_enabled": i < mig,
                "mig_instances": three_g if i < mig else [],
            }
            for i in range(gpus)
        ],
    }


def admitted_node(
    client: TestClient, name: str, certs: dict[str, str] | None = None, gpus: int = 4, mig: int = 0
) -> None:
    register_admitted(client, node_body(name, gpus, mig), certs)


def tenant(client: TestClient, name: str, **profile: Any) -> None:
    r = client.post(f"{API}/tenants", json={"name": name, "profile": profile})
    assert r.status_code == 201, r.text


def submit(client: TestClient, name: str, tenant: str, **kw: Any) -> dict:
    r = client.post(f"{API}/workloads", json={"name": name, "tenant": tenant, **kw})
    assert r.status_code == 201, r.text
    return r.json()


def counts(store: Store) -> dict[str, int]:
    with store.read() as s:
        return {
            t.name: s.scalar(select(func.count()).select_from(t)) or 0
            for t in Base.metadata.sorted_tables
        }


def error(r: Any, status: int, code: str) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and body["error"]["code"] == code, body
    return body["error"]


def events(client: TestClient, action: str) -> list[dict[str, Any]]:
    return client.get(f"{API}/events", params={"action": action, "limit": 500}).json()["items"]


# --- quotas ------------------------------------------------------------------------------------


def test_quota_is_enforced_and_raising_it_places_waiting_work(client: TestClient) -> None:
    tenant(client, "lab")
    admitted_node(client, "n1", gpus=4, mig=1)
    r = client.put(f"{API}/tenants/lab/quota", json={"gpus": 2, "mig_slices": 3})
    assert r.status_code == 200, r.text
    assert r.json()["quota"] == {"gpus": 2, "mig_slices": 3}
    assert client.get(f"{API}/tenants/lab").json()["quota"] == {"gpus": 2, "mig_slices": 3}
    assert submit(client, "a", "lab", gpus={"count": 2})["status"] == "placed"
    w = submit(client, "b", "lab", gpus={"count": 1})
    assert w["status"] == "pending" and w["reason"] == "quota_exceeded"
    assert w["reason_details"]["rejections"] == {"quota_exceeded": 1}
    assert w["reason_details"]["quota"]["gpus"]["limit"] == 2
    # MIG slices are a separate budget: a 3g instance fits, a second does not
    assert submit(client, "m1", "lab", gpus={"mig_profile": "3g.40gb"})["status"] == "placed"
    m2 = submit(client, "m2", "lab", gpus={"mig_profile": "3g.40gb"})
    assert m2["reason"] == "quota_exceeded"
    # raising the quota places the waiting workload in the same request
    r = client.put(f"{API}/tenants/lab/quota", json={"gpus": 3, "mig_slices": 3})
    assert r.status_code == 200
    assert client.get(f"{API}/workloads/b").json()["status"] == "placed"
    assert client.get(f"{API}/workloads/m2").json()["reason"] == "quota_exceeded"
    quota_events = events(client, "tenant.quota")
    assert [e["details"]["after"] for e in quota_events] == [
        {"gpus": 2, "mig_slices": 3},
        {"gpus": 3, "mig_slices": 3},
    ]
    # null removes a limit
    r = client.put(f"{API}/tenants/lab/quota", json={"gpus": None, "mig_slices": None})
    assert r.json()["quota"] == {"gpus": None, "mig_slices": None}
    assert client.get(f"{API}/workloads/m2").json()["status"] == "placed"


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"gpus": -1}, 422, "invalid_quota"),
        ({"mig_slices": 10**7}, 422, "invalid_quota"),
        ({"gpus": "many"}, 422, "validation_failed"),
        ({"gpus": 1, "cpus": 4}, 422, "validation_failed"),
        ({"gpus": 1.5}, 422, "validation_failed"),
    ],
)
def test_bad_quota_input(
    client: TestClient, store: Store, body: dict, status: int, code: str
) -> None:
    tenant(client, "lab")
    before = counts(store)
    error(client.put(f"{API}/tenants/lab/quota", json=body), status, code)
    assert counts(store) == before  # nothing written, no event
    error(client.put(f"{API}/tenants/nobody/quota", json={"gpus": 1}), 404, "not_found")
    assert counts(store) == before


# --- gang --------------------------------------------------------------------------------------


def test_gang_workload_is_placed_all_or_nothing_and_fails_over_as_one(client: TestClient) -> None:
    tenant(client, "lab")
    for name in ("n1", "n2"):
        admitted_node(client, name, gpus=4)
    w = submit(client, "big", "lab", gpus={"count": 12, "nodes": 3})
    assert w["status"] == "pending" and w["reason"] == "insufficient_capacity"
    assert w["gpus"]["nodes"] == 3 and w["placement"] is None
    admitted_node(client, "n3", gpus=4)  # admitting a third node places the whole gang
    w = client.get(f"{API}/workloads/big").json()
    assert w["status"] == "placed"
    members = w["placement"]["members"]
    assert sorted(m["node"] for m in members) == ["n1", "n2", "n3"]
    assert all(len(m["devices"]) == 4 for m in members)
    assert w["placement"]["node"] == members[0]["node"]
    # the node filter finds gang members on every node
    for name in ("n1", "n2", "n3"):
        listed = client.get(f"{API}/workloads", params={"node": name}).json()["items"]
        assert [x["name"] for x in listed] == ["big"]
    # one member's node fails: the whole gang is evicted, and waits (2 nodes are not enough)
    last = members[-1]["node"]
    client.post(f"{API}/nodes/{last}/state", json={"state": "failed"})
    w = client.get(f"{API}/workloads/big").json()
    assert w["status"] == "pending" and w["placement"] is None
    evicted = events(client, "workload.evict")
    assert evicted[-1]["details"]["nodes"] and len(evicted[-1]["details"]["nodes"]) == 3
    for name in ("n1", "n2", "n3"):
        assert client.get(f"{API}/workloads", params={"node": name}).json()["items"] == []


@pytest.mark.parametrize(
    "gpus",
    [
        {"count": 3, "nodes": 2},
        {"count": 2, "nodes": 2, "mig_profile": "1g.10gb"},
        {"count": 1, "nodes": 2, "share_milli": 500},
        {"count": 2, "nodes": 0},
        {"count": 2, "nodes": -5},
        {"count": 130, "nodes": 2},
        {"count": 2, "nodes": 100},
    ],
)
def test_bad_gang_requests(client: TestClient, store: Store, gpus: dict) -> None:
    tenant(client, "lab")
    before = counts(store)
    r = client.post(f"{API}/workloads", json={"name": "g", "tenant": "lab", "gpus": gpus})
    error(r, 422, "invalid_gpu_request")
    assert counts(store) == before


# --- preemption --------------------------------------------------------------------------------


def test_preemption_within_a_pool_is_recorded(client: TestClient) -> None:
    tenant(client, "clinic", required_tags={"hipaa": "true"})
    tenant(client, "lab")
    admitted_node(client, "h1", certs={"hipaa": "true"}, gpus=2)
    assert submit(client, "low", "clinic", gpus={"count": 2}, priority=1)["status"] == "placed"
    # the general pool may not preempt HIPAA work, whatever its priority
    w = submit(client, "general", "lab", gpus={"count": 2}, priority=1000)
    assert w["status"] == "pending" and w["reason"] == "insufficient_capacity"
    # equal priority in the same pool: no
    same = submit(client, "same", "clinic", gpus={"count": 2}, priority=1)
    assert same["status"] == "pending"
    high = submit(client, "high", "clinic", gpus={"count": 2}, priority=5)
    assert high["status"] == "placed" and high["placement"]["node"] == "h1"
    low = client.get(f"{API}/workloads/low").json()
    assert low["status"] == "pending" and low["reason"] == "preempted"
    assert low["reason_details"]["preempted_by"] == "clinic/high"
    ev = [e for e in events(client, "workload.evict") if e["target_id"] == "low"]
    assert len(ev) == 1 and ev[0]["details"]["reason"] == "preempted"
    placed = [e for e in events(client, "workload.place") if e["target_id"] == "high"]
    assert placed[-1]["details"]["preempted"] == ["clinic/low"]


def test_a_gang_preempts_and_every_eviction_is_recorded(client: TestClient) -> None:
    tenant(client, "clinic", required_tags={"hipaa": "true"})
    for name in ("h1", "h2"):
        admitted_node(client, name, certs={"hipaa": "true"}, gpus=2)
    for name in ("s1", "s2"):
        assert submit(client, name, "clinic", gpus={"count": 2}, priority=1)["status"] == "placed"
    g = submit(client, "gang", "clinic", gpus={"count": 4, "nodes": 2}, priority=5)
    assert g["status"] == "placed"
    assert sorted(m["node"] for m in g["placement"]["members"]) == ["h1", "h2"]
    for name in ("s1", "s2"):
        w = client.get(f"{API}/workloads/{name}").json()
        assert w["status"] == "pending" and w["reason"] == "preempted"
        assert w["reason_details"]["preempted_by"] == "clinic/gang"
    evicted = {e["target_id"] for e in events(client, "workload.evict")}
    assert evicted == {"s1", "s2"}
    placed = [e for e in events(client, "workload.place") if e["target_id"] == "gang"]
    assert sorted(placed[-1]["details"]["preempted"]) == ["clinic/s1", "clinic/s2"]


# --- MIG repartitioning ------------------------------------------------------------------------


def test_idle_mig_gpu_is_repartitioned_and_the_change_recorded(client: TestClient) -> None:
    tenant(client, "lab")
    admitted_node(client, "m", gpus=2, mig=2)  # both GPUs: 3g.40gb@0 + 3g.40gb@4
    assert submit(client, "big", "lab", gpus={"mig_profile": "3g.40gb"})["status"] == "placed"
    busy = client.get(f"{API}/workloads/big").json()["placement"]["devices"][0]["gpu_index"]
    w = submit(client, "small", "lab", gpus={"mig_profile": "1g.10gb"})
    assert w["status"] == "placed"
    dev = w["placement"]["devices"][0]
    assert dev["gpu_index"] != busy  # the GPU with work kept its layout
    gpus = {g["index"]: g for g in client.get(f"{API}/nodes/m").json()["gpus"]}
    assert gpus[busy]["mig_instances"] == [
        {"profile": "3g.40gb", "start": 0},
        {"profile": "3g.40gb", "start": 4},
    ]
    layout = {(i["profile"], i["start"]) for i in gpus[dev["gpu_index"]]["mig_instances"]}
    assert ("1g.10gb", dev["mig_start"]) in layout
    assert ("4g.40gb", 0) in layout  # the large profile stays placeable
    changes = events(client, "node.gpu.repartition")
    assert len(changes) == 1 and changes[0]["target_id"] == "m"
    assert changes[0]["details"]["before"] == ["3g.40gb@0", "3g.40gb@4"]
    assert changes[0]["details"]["for_workload"] == "lab/small"


# --- GPU co-residency --------------------------------------------------------------------------


def gpu_of(client: TestClient, name: str) -> int | None:
    w = client.get(f"{API}/workloads/{name}").json()
    return w["placement"]["devices"][0]["gpu_index"] if w["placement"] else None


def test_a_tenant_refusing_co_residency_never_shares_a_physical_gpu(client: TestClient) -> None:
    tenant(client, "clinic", co_residency=False)
    tenant(client, "lab")
    tenant(client, "lab2")
    admitted_node(client, "m", gpus=2, mig=2)  # both GPUs: 3g.40gb@0 + 3g.40gb@4
    assert submit(client, "lab-1", "lab", gpus={"mig_profile": "3g.40gb"})["status"] == "placed"
    shared = gpu_of(client, "lab-1")
    c1 = submit(client, "clinic-1", "clinic", gpus={"mig_profile": "3g.40gb"})
    assert c1["status"] == "placed" and c1["co_residency"] is False
    assert gpu_of(client, "clinic-1") != shared  # not beside lab's slice
    # two tenants that both allow it share a GPU; the clinic's own work shares its own
    assert submit(client, "lab2-1", "lab2", gpus={"mig_profile": "3g.40gb"})["status"] == "placed"
    assert gpu_of(client, "lab2-1") == shared
    assert submit(client, "clinic-2", "clinic", gpus={"mig_profile": "3g.40gb"})["status"] == (
        "placed"
    )
    assert gpu_of(client, "clinic-2") == gpu_of(client, "clinic-1")
    # the node is full; freeing the clinic's GPU lets nobody else in while one slice is held
    assert client.post(f"{API}/workloads/clinic-2/cancel", json={}).status_code == 200
    w = submit(client, "lab-2", "lab", gpus={"mig_profile": "3g.40gb"})
    assert w["status"] == "pending" and w["reason"] == "insufficient_capacity"
    # when lab's GPU empties, a waiting clinic workload takes it (never the one lab2 holds)
    c3 = submit(client, "clinic-3", "clinic", gpus={"mig_profile": "3g.40gb"})
    assert c3["status"] == "placed" and gpu_of(client, "clinic-3") == gpu_of(client, "clinic-1")
    c4 = submit(client, "clinic-4", "clinic", gpus={"mig_profile": "3g.40gb"})
    assert c4["status"] == "pending" and c4["reason"] == "insufficient_capacity"
    assert "refuses GPU co-residency" in c4["reason_details"]["message"]
    assert c4["reason_details"]["co_residency"] is False
    assert "co-residency" not in w["reason_details"]["message"]  # lab allows it
    # lab's freed slot goes to lab's own waiting work first; once both other tenants are gone
    # from that GPU, the clinic's waiting workload takes it
    assert client.post(f"{API}/workloads/lab-1/cancel", json={}).status_code == 200
    assert gpu_of(client, "lab-2") == shared
    assert client.get(f"{API}/workloads/clinic-4").json()["status"] == "pending"
    for name in ("lab-2", "lab2-1"):
        assert client.post(f"{API}/workloads/{name}/cancel", json={}).status_code == 200
    placed = client.get(f"{API}/workloads/clinic-4").json()
    assert placed["status"] == "placed" and gpu_of(client, "clinic-4") == shared
    # the decision events say what constrained them
    ev = [e for e in events(client, "workload.place") if e["target_id"] == "clinic-1"]
    assert ev[0]["details"]["co_residency"] is False
    ev = [e for e in events(client, "workload.place") if e["target_id"] == "lab-1"]
    assert "co_residency" not in ev[0]["details"]


def test_co_residency_holds_for_gpu_shares_and_batches(client: TestClient) -> None:
    tenant(client, "clinic", co_residency=False)
    tenant(client, "lab")
    admitted_node(client, "p", gpus=2)
    items = [
        {"name": "lab-a", "tenant": "lab", "gpus": {"share_milli": 300}},
        {"name": "clinic-a", "tenant": "clinic", "gpus": {"share_milli": 300}},
        {"name": "lab-b", "tenant": "lab", "gpus": {"share_milli": 300}},
        {"name": "clinic-b", "tenant": "clinic", "gpus": {"share_milli": 300}},
        {"name": "lab-c", "tenant": "lab", "gpus": {"share_milli": 500}},
    ]
    r = client.post(f"{API}/workloads/batch", json={"items": items})
    assert r.status_code == 201, r.text
    got = {w["name"]: w for w in r.json()["items"]}
    gpu = {n: w["placement"]["devices"][0]["gpu_index"] for n, w in got.items() if w["placement"]}
    assert gpu["lab-a"] == gpu["lab-b"] != gpu["clinic-a"] == gpu["clinic-b"]
    # lab's GPU has 400 milli left and the clinic's GPU is closed to lab
    assert got["lab-c"]["status"] == "pending"


def test_bad_co_residency_input(client: TestClient, store: Store) -> None:
    before = counts(store)
    for bad in ("no", 0, None, [False]):
        r = client.post(f"{API}/tenants", json={"name": "t", "profile": {"co_residency": bad}})
        error(r, 422, "validation_failed")
    assert counts(store) == before


# --- explain -----------------------------------------------------------------------------------


def test_explain_answers_for_every_demo_workload(demo: Store, client: TestClient) -> None:
    items = client.get(f"{API}/workloads", params={"limit": 500}).json()["items"]
    assert len(items) >= 10
    for w in items:
        r = client.get(f"{API}/workloads/{w['name']}/explain", params={"tenant": w["tenant"]})
        assert r.status_code == 200, r.text
        e = r.json()
        assert e["workload"] == w["name"] and e["status"] == w["status"] and e["summary"]
        a = e["analysis"]
        assert a["nodes_total"] == 24
        if w["status"] == "pending":
            assert e["reason"] and e["message"]
            assert sum(a["filters"].values()) + a["candidates_total"] == 24
            assert w["reason"] in e["summary"]
        else:
            nodes = [m["node"] for m in e["placement"]["members"]]
            assert [p["node"] for p in a["placed_on"]] == nodes
            assert nodes[0] in e["summary"]


def test_explain_access_and_ambiguous_names(client: TestClient) -> None:
    tenant(client, "one")
    tenant(client, "two")
    admitted_node(client, "n1", gpus=2)
    submit(client, "job", "one")
    submit(client, "job", "two", tags={"hipaa": "true"})
    error(client.get(f"{API}/workloads/job/explain"), 409, "ambiguous_name")
    e = client.get(f"{API}/workloads/job/explain", params={"tenant": "two"}).json()
    assert e["tenant"] == "two" and e["reason"] == "no_compliant_capacity"
    assert e["analysis"]["filters"] == {"missing_certification": 1}
    error(client.get(f"{API}/workloads/nope/explain"), 404, "not_found")
    error(client.get(f"{API}/workloads/job/explain", params={"tenant": "zzz"}), 404, "not_found")
    client.post(f"{API}/workloads/job/cancel", params={"tenant": "one"})
    e = client.get(f"{API}/workloads/job/explain", params={"tenant": "one"}).json()
    assert e["status"] == "cancelled" and e["analysis"] is None and "cancelled" in e["summary"]
