"""Topology-aware gangs through the HTTP API (issue 17 §4), on SQLite and PostgreSQL: nodes
carry topology, gangs ask for it, ``required`` waits with ``topology_unsatisfiable``,
``preferred`` degrades and says how far, explain and the decision record show the outcome, bad
input answers 4xx with a machine-readable code."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient

API = "/api/v1"


def node(client: TestClient, name: str, rack: str | None, **topology: str) -> None:
    body: dict[str, Any] = {
        "name": name,
        "region": "eu",
        "zone": "eu-1a",
        "gpus": [{"index": i, "uuid": f"GPU-{name}-{i}", "model": "H100-80GB"} for i in range(4)],
        "topology": topology,
    }
    if rack is not None:
        body["rack"] = rack
    r = client.post(f"{API}/nodes", json=body)
    assert r.status_code == 201, r.text
    r = client.post(f"{API}/nodes/{name}/state", json={"state": "admitted"})
    assert r.status_code == 200, r.text


def gang_body(name: str, nodes: int, **topology: str) -> dict[str, Any]:
    body: dict[str, Any] = {
        "name": name,
        "tenant": "acme",
        "gpus": {"count": 4 * nodes, "nodes": nodes},
    }
    if topology:
        body["topology"] = topology
    return body


def error(r: Any, status: int, code: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["error"]["code"] == code, body
    return dict(body["error"])


def setup(client: TestClient) -> None:
    assert client.post(f"{API}/tenants", json={"name": "acme"}).status_code == 201
    for i in range(2):
        node(client, f"a{i}", "ra", nvlink_domain="nvl-1")
        node(client, f"b{i}", "rb", nvlink_domain="nvl-1")


def test_nodes_carry_topology(client: TestClient) -> None:
    setup(client)
    got = client.get(f"{API}/nodes/a0").json()
    assert got["rack"] == "ra" and got["topology"] == {"nvlink_domain": "nvl-1"}
    listed = {n["name"]: n for n in client.get(f"{API}/nodes").json()["items"]}
    assert listed["b1"]["topology"] == {"nvlink_domain": "nvl-1"}
    r = client.patch(f"{API}/nodes/a0", json={"topology": {"rack": "rc", "block": "blk-1"}})
    assert r.status_code == 200, r.text
    assert r.json()["rack"] == "rc" and r.json()["topology"] == {"block": "blk-1", "rack": "rc"}
    updates = client.get(f"{API}/events", params={"action": "node.update"}).json()["items"]
    assert updates[-1]["details"]["topology"]["after"] == {"block": "blk-1", "rack": "rc"}


def test_required_gang_waits_then_places_within_one_rack(client: TestClient) -> None:
    setup(client)
    r = client.post(f"{API}/workloads", json=gang_body("big", 3, level="rack", mode="required"))
    assert r.status_code == 201, r.text
    w = r.json()
    assert w["status"] == "pending" and w["reason"] == "topology_unsatisfiable"
    assert w["topology"] == {"level": "rack", "mode": "required"}
    assert w["reason_details"]["topology"]["most_in_one_domain"] == 2
    ex = client.get(f"{API}/workloads/big/explain").json()
    assert ex["reason"] == "topology_unsatisfiable"
    assert ex["analysis"]["topology"]["satisfiable_now"] is False
    # at the nvlink_domain level all four nodes are one domain: the same gang fits
    r = client.post(
        f"{API}/workloads", json=gang_body("nvl", 3, level="nvlink_domain", mode="required")
    )
    assert r.json()["status"] == "placed", r.text
    r = client.post(f"{API}/workloads/nvl/cancel", json={})
    assert r.status_code == 200, r.text
    r = client.post(f"{API}/workloads", json=gang_body("pair", 2, level="rack"))
    w = r.json()
    assert w["status"] == "placed", r.text
    nodes = {m["node"] for m in w["placement"]["members"]}
    assert nodes in ({"a0", "a1"}, {"b0", "b1"})
    placed = client.get(f"{API}/events", params={"action": "workload.place"}).json()["items"]
    record = next(e for e in placed if e["target_id"] == "pair")
    assert record["details"]["topology"]["domains_used"] == 1
    ex = client.get(f"{API}/workloads/pair/explain").json()
    assert len(ex["analysis"]["topology"]["placed_domains"]) == 1


def test_preferred_gang_degrades_and_says_how_far(client: TestClient) -> None:
    setup(client)
    r = client.post(f"{API}/workloads", json=gang_body("big", 3, level="rack", mode="preferred"))
    w = r.json()
    assert w["status"] == "placed", r.text
    placed = client.get(f"{API}/events", params={"action": "workload.place"}).json()["items"]
    topo = placed[-1]["details"]["topology"]
    assert topo["domains_used"] == 2 and topo["fewest_possible"] == 2 and topo["best_possible"]
    ex = client.get(f"{API}/workloads/big/explain").json()
    assert sorted(ex["analysis"]["topology"]["placed_domains"]) == ["ra", "rb"]
    assert "its gang asks rack (preferred) and spans 2" in ex["summary"]


def test_bad_topology_is_refused_with_a_code(client: TestClient) -> None:
    setup(client)
    error(client.post(f"{API}/workloads", json=gang_body("x", 2, level="pod")), 422,
          "invalid_topology_level")  # fmt: skip
    error(client.post(f"{API}/workloads", json=gang_body("x", 2, level="rack", mode="maybe")),
          422, "invalid_topology_mode")  # fmt: skip
    one = {"name": "x", "tenant": "acme", "gpus": {"count": 1}, "topology": {"level": "rack"}}
    error(client.post(f"{API}/workloads", json=one), 422, "topology_requires_gang")
    batch = {"items": [gang_body("y", 2, level="rack"), gang_body("z", 2, level="spine")]}
    err = error(client.post(f"{API}/workloads/batch", json=batch), 422, "invalid_topology_level")
    assert err["details"]["index"] == 1 and err["message"].startswith("items[1]: ")
    bad = {"name": "n9", "region": "eu", "zone": "eu-1a", "topology": {"pod": "p1"}}
    error(client.post(f"{API}/nodes", json=bad), 422, "invalid_topology_level")
    bad["topology"] = {"rack": "Not A Name"}
    error(client.post(f"{API}/nodes", json=bad), 422, "invalid_name")
    bad["topology"], bad["rack"] = {"rack": "r1"}, "r2"
    error(client.post(f"{API}/nodes", json=bad), 422, "invalid_topology")
    r = client.patch(f"{API}/nodes/a0", json={"topology": {"pod": "p"}})
    error(r, 422, "invalid_topology_level")
    before = client.get(f"{API}/nodes/a0").json()
    r = client.patch(f"{API}/nodes/a0", json={"rack": "r2", "topology": {"rack": "r1"}})
    error(r, 422, "invalid_topology")
    after = client.get(f"{API}/nodes/a0").json()
    assert (after["rack"], after["topology"]) == (before["rack"], before["topology"])
    assert client.get(f"{API}/workloads").json()["items"] == []


def test_batch_submits_gangs_with_topology(client: TestClient) -> None:
    setup(client)
    items = [
        gang_body("p1", 2, level="rack"),
        gang_body("p2", 2, level="rack"),
        gang_body("p3", 2, level="rack"),  # both racks taken: waits for one
    ]
    r = client.post(f"{API}/workloads/batch", json={"items": items})
    assert r.status_code == 201, r.text
    out = {w["name"]: w for w in r.json()["items"]}
    racks = [{m["node"][0] for m in out[n]["placement"]["members"]} for n in ("p1", "p2")]
    assert sorted(map(sorted, racks)) == [["a"], ["b"]]  # one rack each
    assert out["p3"]["status"] == "pending" and out["p3"]["reason"] == "insufficient_capacity"
    assert out["p3"]["topology"] == {"level": "rack", "mode": "required"}
    submits = client.get(f"{API}/events", params={"action": "workload.submit"}).json()["items"]
    assert all(e["details"]["topology"]["level"] == "rack" for e in submits)
    placed = client.get(f"{API}/events", params={"action": "workload.place"}).json()["items"]
    assert [e["details"]["topology"]["domains_used"] for e in placed] == [1, 1]
    got = client.get(f"{API}/workloads/p1").json()
    assert got["topology"] == {"level": "rack", "mode": "required"}
