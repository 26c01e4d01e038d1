"""The network segmentation routes (issue 14) over HTTP: shapes, the four formats of a node's
desired state (text ones as text/plain), the agent's credential acting for its own node only,
change control on the governed routes, and bad input answered 4xx, never 5xx."""

from __future__ import annotations

import csv
import io
from typing import Any

import pytest
from fastapi.testclient import TestClient

from dbtest import ADMIN_TOKEN
from proofplane.access import SYSTEM
from proofplane.api.app import create_app
from proofplane.config import Settings
from proofplane.network.desired import desired_from_json
from proofplane.network.render.partitions import parse_partitions
from proofplane.service.access import issue_agent_credential
from proofplane.service.context import Store

API = "/api/v1"


def ok(response: Any, status: int = 200) -> Any:
    assert response.status_code == status, response.text
    return response.json() if "json" in response.headers.get("content-type", "") else response.text


def error(response: Any, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()["error"]
    assert body["code"] == code, body
    return body  # type: ignore[no-any-return]


@pytest.fixture
def demo_client(demo: Store, client: TestClient) -> TestClient:
    return client


def test_segments_of_a_tenant_and_of_all(demo_client: TestClient) -> None:
    c = demo_client
    page = ok(c.get(f"{API}/network/segments", params={"limit": 2}))
    assert [s["vni"] for s in page["items"]] == [10000, 10001] and page["next"]
    rest = ok(c.get(f"{API}/network/segments", params={"cursor": page["next"]}))
    assert [s["vni"] for s in rest["items"]] == [10002, 10003, 10004]
    one = ok(c.get(f"{API}/tenants/st-marys-hospital/segments"))
    assert one["tenant"] == "st-marys-hospital" and len(one["policy_sha256"]) == 64
    seg = one["segments"][0]
    assert (seg["vni"], seg["pkey"], seg["state"]) == (10000, "0x0001", "active")
    assert {e["workload"] for e in seg["endpoints"]} >= {"radiology-triage"}
    assert all(e["ip"].startswith("10.10.0.") and e["mac"] for e in seg["endpoints"])
    error(c.get(f"{API}/tenants/nope/segments"), 404, "not_found")
    error(c.get(f"{API}/network/segments", params={"state": "gone"}), 422, "validation_failed")
    error(c.get(f"{API}/network/segments", params={"cursor": "!!"}), 422, "invalid_cursor")


def test_a_nodes_desired_state_in_every_format(demo_client: TestClient) -> None:
    c = demo_client
    r = c.get(f"{API}/nodes/fra-h100-01/network")
    body = ok(r)
    d = desired_from_json(body)  # what the agent does with it: the hash checks out
    assert d.node == "fra-h100-01" and body["generation"] >= 1 and body["simulated"] is True
    assert r.headers["etag"] == f'"{d.sha256}"'
    assert r.headers["x-proofplane-generation"] == str(body["generation"])
    assert {s["vni"] for s in body["segments"]} == {10000, 10004}
    status = ok(c.get(f"{API}/network/nodes", params={"limit": 500}))["items"]
    mine = next(s for s in status if s["node"] == "fra-h100-01")
    assert (
        mine["desired_sha256"] == d.sha256
        and mine["expected_ruleset_sha256"] == (body["ruleset_sha256"])
    )
    for fmt, needle in (
        ("iproute2", "type vxlan id 10000"),
        ("nftables", "table inet proofplane"),
        ("partitions", "tenant_st-marys-hospital=0x0001"),
    ):
        r = c.get(f"{API}/nodes/fra-h100-01/network", params={"format": fmt})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        assert needle in r.text, (fmt, r.text[:500])
    parse_partitions(c.get(f"{API}/nodes/fra-h100-01/network?format=partitions").text)
    error(c.get(f"{API}/nodes/fra-h100-01/network", params={"format": "yaml"}), 422,
          "validation_failed")  # fmt: skip
    error(c.get(f"{API}/nodes/nope/network"), 404, "not_found")


def test_a_node_without_underlay(client: TestClient) -> None:
    body = {"name": "bare", "region": "r", "zone": "z", "gpus": []}
    ok(client.post(f"{API}/nodes", json=body), 201)
    error(client.get(f"{API}/nodes/bare/network"), 409, "network_underlay_unknown")
    assert ok(client.get(f"{API}/nodes/bare"))["network_drift"] is None
    st = ok(client.put(f"{API}/nodes/bare/network/underlay", json={"vtep": "10.9.0.1"}))
    assert st["desired_generation"] == 1 and st["managed"] is False
    assert ok(client.get(f"{API}/nodes/bare/network"))["segments"] == []


def test_the_agent_applies_and_reports(demo: Store, demo_client: TestClient) -> None:
    c = demo_client
    agent = issue_agent_credential(demo, SYSTEM, "fra-h100-01").token
    other = issue_agent_credential(demo, SYSTEM, "fra-h100-02").token
    own = {"Authorization": f"Bearer {agent}"}
    state = ok(c.get(f"{API}/nodes/fra-h100-01/network", headers=own))
    error(c.get(f"{API}/nodes/fra-h100-02/network", headers=own), 404, "not_found")
    body = {
        "applied_generation": state["generation"],
        "applied_sha256": state["sha256"],
        "ruleset_sha256": state["ruleset_sha256"],
        "self_check": {"ok": True, "segments": {"10000": True}},
    }
    st = ok(c.post(f"{API}/nodes/fra-h100-01/network/report", json=body, headers=own))
    assert st["managed"] and st["network_drift"] is False
    assert ok(c.get(f"{API}/nodes/fra-h100-01"))["network_drift"] is False
    error(c.post(f"{API}/nodes/fra-h100-01/network/report", json=body,
                 headers={"Authorization": f"Bearer {other}"}), 404, "not_found")  # fmt: skip
    lag = {**body, "applied_generation": state["generation"] - 1}
    st = ok(c.post(f"{API}/nodes/fra-h100-01/network/report", json=lag, headers=own))
    assert st["drift"] == ["generation_lag"]
    nodes = ok(c.get(f"{API}/nodes", params={"limit": 500}))["items"]
    assert {n["name"]: n["network_drift"] for n in nodes if n["network_drift"] is not None} == {
        "fra-h100-01": True
    }
    drifting = ok(c.get(f"{API}/network/nodes", params={"drift": "true"}))["items"]
    assert [n["node"] for n in drifting] == ["fra-h100-01"]


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"applied_generation": -1, "applied_sha256": "a" * 64, "self_check": {"ok": True}},
        {"applied_generation": 2**63, "applied_sha256": "a" * 64, "self_check": {"ok": True}},
        {"applied_generation": 1, "applied_sha256": "xyz", "self_check": {"ok": True}},
        {"applied_generation": 1, "applied_sha256": "a" * 64, "self_check": {}},
        {"applied_generation": 1, "applied_sha256": "a" * 64, "self_check": {"ok": 1}},
        {"applied_generation": 1.5, "applied_sha256": "a" * 64, "self_check": {"ok": True}},
        {"applied_generation": 1, "applied_sha256": "a" * 64, "self_check": {"ok": True},
         "extra": 1},
    ],
)  # fmt: skip
def test_bad_reports_are_422(demo_client: TestClient, body: dict[str, Any]) -> None:
    r = demo_client.post(f"{API}/nodes/fra-h100-01/network/report", json=body)
    assert r.status_code == 422, r.text


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"vtep": "10.250.0.2"}, 409, "vtep_in_use"),  # fra-h100-02's
        ({"vtep": "not-an-ip"}, 422, "invalid_underlay"),
        ({"vtep": "fe80::1"}, 422, "invalid_underlay"),
        ({"vtep": "10.9.9.9", "underlay_dev": "a/b"}, 422, "invalid_underlay"),
        ({"vtep": "10.9.9.9", "hca_guids": ["0xZZ"]}, 422, "invalid_guid"),
        ({"vtep": "10.9.9.9", "hca_guids": ["1"] * 65}, 422, "validation_failed"),
    ],
)
def test_bad_underlay_facts(
    demo_client: TestClient, body: dict[str, Any], status: int, code: str
) -> None:
    error(demo_client.put(f"{API}/nodes/fra-h100-01/network/underlay", json=body), status, code)


@pytest.mark.parametrize(
    ("policy", "status", "code"),
    [
        ({"allow": [{"proto": "tcp", "ports": 0}]}, 422, "invalid_network_policy"),
        ({"allow": [{"proto": "tcp", "ports": "1-99999"}]}, 422, "invalid_network_policy"),
        ({"subnet": "2001:db8::/64"}, 422, "invalid_network_policy"),
        ({"allow": [{"proto": "any", "source": {"tenant": "ghost"}}]}, 422, "unknown_tenant"),
        ({"allow": [{"proto": "any", "source": {"tenant": "nordbank"}}]}, 403, "cross_tenant_rule"),
        ({"subnet": "10.99.0.0/24"}, 409, "subnet_in_use"),  # its workloads' addresses
    ],
)
def test_bad_policies(demo_client: TestClient, policy: Any, status: int, code: str) -> None:
    before = ok(demo_client.get(f"{API}/tenants/st-marys-hospital/segments"))["policy_sha256"]
    r = demo_client.put(f"{API}/tenants/st-marys-hospital/network-policy", json={"policy": policy})
    error(r, status, code)
    after = ok(demo_client.get(f"{API}/tenants/st-marys-hospital/segments"))["policy_sha256"]
    assert after == before  # nothing applied


def test_tenants_with_manual_segments_and_their_deletion(client: TestClient) -> None:
    made = ok(client.post(f"{API}/tenants", json={"name": "m", "vni": 12345, "pkey": 0x42}), 201)
    assert made["profile"]["segment"] == "per-tenant"
    seg = ok(client.get(f"{API}/tenants/m/segments"))["segments"][0]
    assert (seg["vni"], seg["pkey"]) == (12345, "0x0042")
    error(client.post(f"{API}/tenants", json={"name": "n", "vni": 12345}), 409, "segment_in_use")
    error(client.post(f"{API}/tenants", json={"name": "n", "vni": 99}), 422, "invalid_segment")
    error(client.post(f"{API}/tenants", json={"name": "n", "vni": 2**31 - 1}), 422,
          "invalid_segment")  # fmt: skip
    error(client.post(f"{API}/tenants", json={"name": "n", "pkey": 0x7FFF}), 422, "invalid_segment")
    error(client.get(f"{API}/tenants/n"), 404, "not_found")  # nothing half-created
    gone = ok(client.delete(f"{API}/tenants/m"))
    assert gone["released"] == [{"vni": 12345, "pkey": 0x42}]
    error(client.get(f"{API}/tenants/m"), 404, "not_found")
    error(client.delete(f"{API}/tenants/m"), 404, "not_found")
    error(client.post(f"{API}/tenants", json={"name": "m"}), 409, "tenant_name_retired")
    released = ok(client.get(f"{API}/network/segments", params={"state": "released"}))["items"]
    assert [(s["tenant"], s["vni"]) for s in released] == [("m", 12345)]
    per = {"name": "pw", "profile": {"segment": "per-workload"}}
    assert ok(client.post(f"{API}/tenants", json=per), 201)["profile"]["segment"] == "per-workload"
    r = client.post(f"{API}/tenants", json={"name": "pw2", "profile": {"segment": "per-node"}})
    assert r.status_code == 422


def test_the_segmentation_map_as_json_and_csv(demo_client: TestClient) -> None:
    data = ok(demo_client.get(f"{API}/network/export"))
    tenants = {t["tenant"]: t for t in data["tenants"]}
    assert set(tenants) == {
        "st-marys-hospital", "nordbank", "berlin-telco", "paris-insurance", "research-lab",
    }  # fmt: skip
    hosp = tenants["st-marys-hospital"]
    assert hosp["segments"][0]["pkey_members"] and hosp["nodes"]
    r = demo_client.get(f"{API}/network/export", params={"format": "csv"})
    assert r.headers["content-type"].startswith("text/csv")
    rows = list(csv.DictReader(io.StringIO(r.text)))
    assert {row["tenant"] for row in rows} == set(tenants)
    error(demo_client.get(f"{API}/network/export", params={"format": "xml"}), 422,
          "validation_failed")  # fmt: skip


def test_change_control_governs_policy_and_deletion(store: Store) -> None:
    from proofplane.service.access import bootstrap_admin

    bootstrap_admin(store, ADMIN_TOKEN)
    settings = Settings(change_control="enforce")
    with TestClient(
        create_app(store, settings),
        raise_server_exceptions=False,
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
    ) as c:
        ok(c.post(f"{API}/tenants", json={"name": "t"}), 201)
        body = {"policy": {"allow": [{"proto": "tcp", "ports": 22}]}}
        err = error(c.put(f"{API}/tenants/t/network-policy", json=body), 409,
                    "change_request_required")  # fmt: skip
        assert err["details"]["change"]["type"] == "network.policy"
        assert err["details"]["change"]["payload"] == {"tenant": "t", **body}
        err = error(c.delete(f"{API}/tenants/t"), 409, "change_request_required")
        assert err["details"]["change"]["payload"] == {"tenant": "t"}
        assert ok(c.get(f"{API}/tenants/t/segments"))["default"] is True
        change = ok(c.post(f"{API}/changes", json=err["details"]["change"]), 201)
        assert change["type"] == "tenant.delete" and change["tenant"] == "t"


def test_a_cursor_holding_nul_is_a_422_on_both_stores(demo_client: TestClient) -> None:
    from proofplane.service.pagination import encode_cursor

    forged = encode_cursor("network-nodes", "a\x00b")
    error(demo_client.get(f"{API}/network/nodes", params={"cursor": forged}), 422,
          "invalid_cursor")  # fmt: skip
    r = demo_client.get(f"{API}/network/segments", params={"tenant": "a\x00b"})
    assert r.status_code < 500, r.text  # SQLite: no such tenant; PostgreSQL: 422 invalid_value
