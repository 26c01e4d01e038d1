"""The HTTP API, end to end through FastAPI, on SQLite and on PostgreSQL."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from proofplane.service.context import Store
from proofplane.store.tables import Base, EventRow

H100 = "H100-80GB"


def node_body(name: str, *, gpus: int = 4, model: str = H100, mig: int = 0, **extra: Any) -> dict:
    body: dict[str, Any] = {
        "name": name,
        "region": "eu-frankfurt",
        "zone": "eu-frankfurt-1a",
        "gpus": [
            {
                "index": i,
                "uuid": f"GPU-{name}-{i}",
                "model": model,
                "mig_enabled": i < mig,
                "mig_instances": (
                    [{"profile": "3g.40gb", "start": 0}, {"profile": "3g.40gb", "start": 4}]
                    if i < mig
                    else []
                ),
            }
            for i in range(gpus)
        ],
    }
    body.update(extra)
    return body


def admitted_node(
    client: TestClient, name: str, certs: dict[str, str] | None = None, **kw: Any
) -> dict:
    assert client.post("/api/v1/nodes", json=node_body(name, **kw)).status_code == 201
    r = client.post(f"/api/v1/nodes/{name}/state", json={"state": "admitted"})
    assert r.status_code == 200, r.text
    for key, value in (certs or {}).items():
        r = client.post(f"/api/v1/nodes/{name}/certifications", json={"key": key, "value": value})
        assert r.status_code == 200, r.text
    return r.json()


def tenant(client: TestClient, name: str, **profile: Any) -> None:
    r = client.post("/api/v1/tenants", json={"name": name, "profile": profile})
    assert r.status_code == 201, r.text


def submit(client: TestClient, name: str, tenant: str, **kw: Any) -> dict:
    r = client.post("/api/v1/workloads", json={"name": name, "tenant": tenant, **kw})
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
    assert body["error"]["message"]
    return body["error"]


# --- health, docs, error shape -----------------------------------------------------------------


def test_health_and_readiness(client: TestClient, store: Store) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz")
    assert ready.status_code == 200
    assert ready.json()["database"] == store.engine.dialect.name


def test_readyz_reports_pending_migrations(tmp_path) -> None:
    store = Store(f"sqlite:///{tmp_path / 'unmigrated.db'}")
    from proofplane.api.app import create_app

    with TestClient(create_app(store)) as c:
        err = error(c.get("/readyz"), 503, "migrations_pending")
        assert err["details"]["current"] is None


def test_openapi_and_docs(client: TestClient) -> None:
    spec = client.get("/openapi.json").json()
    for path in (
        "/api/v1/nodes",
        "/api/v1/tenants",
        "/api/v1/workloads",
        "/api/v1/events",
        "/api/v1/nodes/{name}/certifications",
        "/api/v1/nodes/{name}/state",
    ):
        assert path in spec["paths"], path
    assert client.get("/docs").status_code == 404  # off unless PROOFPLANE_API_DOCS=1 (issue 19)


def test_unknown_route_and_method_use_error_shape(client: TestClient) -> None:
    error(client.get("/api/v1/nope"), 404, "not_found")
    error(client.put("/api/v1/nodes"), 405, "method_not_allowed")


def test_malformed_json_and_wrong_types(client: TestClient) -> None:
    r = client.post(
        "/api/v1/tenants", content=b"{bad", headers={"content-type": "application/json"}
    )
    error(r, 422, "malformed_json")
    err = error(client.post("/api/v1/tenants", json={"name": 5}), 422, "validation_failed")
    assert err["details"][0]["loc"] == ["body", "name"]
    error(client.post("/api/v1/tenants", json={"name": "x", "extra": 1}), 422, "validation_failed")
    error(client.get("/api/v1/nodes?limit=0"), 422, "validation_failed")
    error(client.get("/api/v1/nodes?state=sleeping"), 422, "validation_failed")
    error(client.get("/api/v1/events/abc"), 422, "validation_failed")


# --- tenants -----------------------------------------------------------------------------------


def test_tenant_create_get_list_update(client: TestClient) -> None:
    r = client.post(
        "/api/v1/tenants",
        json={
            "name": "clinic",
            "description": "HIPAA",
            "profile": {"required_tags": {"hipaa": "true"}, "min_isolation": "mig"},
        },
    )
    assert r.status_code == 201 and r.headers["location"] == "/api/v1/tenants/clinic"
    assert r.json()["profile"]["min_isolation"] == "mig"
    error(client.post("/api/v1/tenants", json={"name": "clinic"}), 409, "conflict")
    error(client.get("/api/v1/tenants/ghost"), 404, "not_found")
    error(client.post("/api/v1/tenants", json={"name": "Bad Name"}), 422, "validation_failed")
    error(
        client.post(
            "/api/v1/tenants", json={"name": "t2", "profile": {"required_tags": {"HIPAA!": "x"}}}
        ),
        422,
        "invalid_tag",
    )
    r = client.patch("/api/v1/tenants/clinic", json={"description": "changed"})
    assert r.status_code == 200 and r.json()["description"] == "changed"
    assert r.json()["profile"]["required_tags"] == {"hipaa": "true"}
    error(client.patch("/api/v1/tenants/ghost", json={"description": "x"}), 404, "not_found")
    names = [t["name"] for t in client.get("/api/v1/tenants").json()["items"]]
    assert names == ["clinic"]


# --- nodes -------------------------------------------------------------------------------------


def test_node_registration_and_inventory_validation(client: TestClient, store: Store) -> None:
    r = client.post("/api/v1/nodes", json=node_body("n1", mig=1, rack="r1", labels={"a": "b"}))
    assert r.status_code == 201, r.text
    node = r.json()
    assert node["state"] == "registered" and node["certifications"] == {}
    assert node["gpus"][0]["mig_enabled"] and node["gpus"][0]["memory_mb"] == 81920
    assert [i["start"] for i in node["gpus"][0]["mig_instances"]] == [0, 4]
    before = counts(store)
    error(client.post("/api/v1/nodes", json=node_body("n1")), 409, "conflict")
    dup_uuid = node_body("n2")
    dup_uuid["gpus"][0]["uuid"] = "GPU-n1-0"
    error(client.post("/api/v1/nodes", json=dup_uuid), 409, "conflict")
    error(
        client.post("/api/v1/nodes", json=node_body("n3", model="GTX-1080", mig=1)),
        422,
        "invalid_inventory",
    )
    bad_layout = node_body("n4", mig=1)
    bad_layout["gpus"][0]["mig_instances"].append({"profile": "1g.10gb", "start": 1})
    err = error(client.post("/api/v1/nodes", json=bad_layout), 422, "invalid_inventory")
    assert any("overlaps" in p for p in err["details"])
    # Certifications are issued by the control plane, never declared at registration.
    error(
        client.post("/api/v1/nodes", json=node_body("n5", certifications={"hipaa": "true"})),
        422,
        "validation_failed",
    )
    assert counts(store) == before


def test_node_state_machine(client: TestClient) -> None:
    client.post("/api/v1/nodes", json=node_body("n1"))
    error(client.post("/api/v1/nodes/n1/state", json={"state": "registered"}), 409, "no_change")
    r = client.post("/api/v1/nodes/n1/state", json={"state": "admitted", "reason": "attested"})
    assert r.json()["state"] == "admitted" and r.json()["state_reason"] == "attested"
    assert (
        client.post("/api/v1/nodes/n1/state", json={"state": "decommissioned"}).status_code == 200
    )
    error(
        client.post("/api/v1/nodes/n1/state", json={"state": "admitted"}), 409, "invalid_transition"
    )
    error(client.post("/api/v1/nodes/ghost/state", json={"state": "failed"}), 404, "not_found")


def test_certifications_are_issued_only_to_admitted_nodes(client: TestClient) -> None:
    client.post("/api/v1/nodes", json=node_body("n1"))
    error(
        client.post("/api/v1/nodes/n1/certifications", json={"key": "hipaa", "value": "true"}),
        409,
        "node_not_admitted",
    )
    client.post("/api/v1/nodes/n1/state", json={"state": "admitted"})
    r = client.post("/api/v1/nodes/n1/certifications", json={"key": "hipaa", "value": "true"})
    assert r.json()["certifications"] == {"hipaa": "true"}
    error(
        client.post("/api/v1/nodes/n1/certifications", json={"key": "Bad Key", "value": "x"}),
        422,
        "invalid_tag",
    )
    error(client.delete("/api/v1/nodes/n1/certifications/pci-dss"), 404, "not_found")
    assert client.delete("/api/v1/nodes/n1/certifications/hipaa").json()["certifications"] == {}


def test_node_list_filters_and_pagination(client: TestClient) -> None:
    for i in range(5):
        admitted_node(client, f"n{i}", certs={"hipaa": "true"} if i % 2 == 0 else None)
    client.post("/api/v1/nodes", json=node_body("r1"))
    seen, cursor = [], None
    while True:
        page = client.get(
            "/api/v1/nodes", params={"limit": 2, **({"cursor": cursor} if cursor else {})}
        ).json()
        seen += [n["name"] for n in page["items"]]
        cursor = page["next"]
        if cursor is None:
            break
    assert seen == ["n0", "n1", "n2", "n3", "n4", "r1"]
    hipaa = client.get("/api/v1/nodes", params={"certification": "hipaa=true"}).json()["items"]
    assert [n["name"] for n in hipaa] == ["n0", "n2", "n4"]
    regs = client.get("/api/v1/nodes", params={"state": "registered"}).json()["items"]
    assert [n["name"] for n in regs] == ["r1"]
    error(client.get("/api/v1/nodes", params={"certification": "hipaa"}), 422, "invalid_tag")
    error(client.get("/api/v1/nodes", params={"cursor": "garbage!"}), 422, "invalid_cursor")
    r = client.patch("/api/v1/nodes/n1", json={"labels": {"rack-row": "7"}, "rack": "r9"})
    assert r.json()["labels"] == {"rack-row": "7"} and r.json()["rack"] == "r9"


# --- workloads and placement -------------------------------------------------------------------


def test_hipaa_workload_lands_only_on_certified_node(client: TestClient) -> None:
    tenant(client, "clinic", required_tags={"hipaa": "true"}, min_isolation="mig")
    admitted_node(client, "general", gpus=8, mig=8)
    w = submit(client, "scan", "clinic", gpus={"mig_profile": "3g.40gb"})
    assert w["status"] == "pending" and w["reason"] == "no_compliant_capacity"
    assert w["tags"] == {"hipaa": "true"} and w["isolation"] == "mig"
    assert w["reason_details"]["rejections"] == {"missing_certification": 1}
    # Certifying a node makes room: the pending workload is placed there and nowhere else.
    admitted_node(client, "certified", certs={"hipaa": "true"}, gpus=2, mig=2)
    w = client.get("/api/v1/workloads/scan").json()
    assert w["status"] == "placed" and w["placement"]["node"] == "certified"
    dev = w["placement"]["devices"][0]
    assert dev["mig_profile"] == "3g.40gb" and dev["mig_start"] in (0, 4)


def test_tenant_profile_raises_isolation_and_refuses_conflicts(client: TestClient) -> None:
    tenant(
        client,
        "bank",
        required_tags={"pci-dss": "isolated"},
        min_isolation="exclusive-gpu",
        isolation_rules={"pci-dss=isolated": "dedicated-node"},
    )
    admitted_node(client, "pci", certs={"pci-dss": "isolated"})
    w = submit(client, "fraud", "bank", gpus={"count": 1})
    assert w["isolation"] == "dedicated-node" and w["status"] == "placed"
    error(
        client.post(
            "/api/v1/workloads", json={"name": "x", "tenant": "bank", "gpus": {"share_milli": 100}}
        ),
        422,
        "isolation_conflict",
    )
    error(
        client.post(
            "/api/v1/workloads", json={"name": "y", "tenant": "bank", "tags": {"pci-dss": "none"}}
        ),
        422,
        "tag_conflict",
    )
    tenant(client, "other")
    w2 = submit(client, "intruder", "other", gpus={"count": 1})
    assert w2["status"] == "pending"
    assert w2["reason_details"]["rejections"] == {"node_dedicated_to_other_tenant": 1}


@pytest.mark.parametrize(
    ("gpus", "code"),
    [
        ({"count": 0}, "invalid_gpu_request"),
        ({"count": 65}, "invalid_gpu_request"),
        ({"share_milli": 1000}, "invalid_gpu_request"),
        ({"share_milli": 100, "count": 2}, "invalid_gpu_request"),
        ({"mig_profile": "3g.40gb", "share_milli": 10}, "invalid_gpu_request"),
        ({"mig_profile": "9g.1tb"}, "unknown_mig_profile"),
        ({"mig_profile": "3g.71gb", "model": "H100-80GB"}, "unknown_mig_profile"),
        ({"model": "TPU v5!"}, "unknown_gpu_model"),
        ({"model": "TPUv5", "mig_profile": "1g.10gb"}, "unknown_gpu_model"),
        ({"count": 0, "share_milli": 100}, "invalid_gpu_request"),
    ],
)
def test_bad_gpu_requests(client: TestClient, store: Store, gpus: dict, code: str) -> None:
    tenant(client, "lab")
    before = counts(store)
    r = client.post("/api/v1/workloads", json={"name": "w", "tenant": "lab", "gpus": gpus})
    error(r, 422, code)
    assert counts(store) == before


def test_workload_errors(client: TestClient, store: Store) -> None:
    tenant(client, "lab")
    submit(client, "w1", "lab")
    before = counts(store)
    error(client.post("/api/v1/workloads", json={"name": "w1", "tenant": "lab"}), 409, "conflict")
    error(
        client.post("/api/v1/workloads", json={"name": "w2", "tenant": "ghost"}), 404, "not_found"
    )
    error(
        client.post("/api/v1/workloads", json={"name": "W 3", "tenant": "lab"}),
        422,
        "validation_failed",
    )
    error(
        client.post("/api/v1/workloads", json={"name": "w4", "tenant": "lab", "isolation": "mig"}),
        422,
        "isolation_conflict",
    )
    error(client.get("/api/v1/workloads/ghost"), 404, "not_found")
    error(client.post("/api/v1/workloads/ghost/cancel"), 404, "not_found")
    error(client.get("/api/v1/workloads?status=weird"), 422, "validation_failed")
    assert counts(store) == before


def test_cancel_releases_capacity_to_pending_work(client: TestClient) -> None:
    tenant(client, "lab")
    admitted_node(client, "n1", gpus=2)
    a = submit(client, "a", "lab", gpus={"count": 2})
    b = submit(client, "b", "lab", gpus={"count": 1})
    assert a["status"] == "placed" and b["status"] == "pending"
    assert b["reason"] == "insufficient_capacity"
    r = client.post("/api/v1/workloads/a/cancel", json={"reason": "done"})
    assert r.json()["status"] == "cancelled" and r.json()["placement"] is None
    assert client.get("/api/v1/workloads/b").json()["status"] == "placed"
    error(client.post("/api/v1/workloads/a/cancel"), 409, "invalid_state")
    listed = client.get("/api/v1/workloads", params={"status": "placed"}).json()["items"]
    assert [w["name"] for w in listed] == ["b"]
    on_node = client.get("/api/v1/workloads", params={"node": "n1"}).json()["items"]
    assert [w["name"] for w in on_node] == ["b"]


def test_node_failure_moves_work_only_to_compliant_nodes(client: TestClient) -> None:
    tenant(client, "clinic", required_tags={"hipaa": "true"})
    admitted_node(client, "h1", certs={"hipaa": "true"}, gpus=2)
    admitted_node(client, "plain", gpus=8)
    submit(client, "scan", "clinic", gpus={"count": 2})
    assert client.get("/api/v1/workloads/scan").json()["placement"]["node"] == "h1"
    client.post("/api/v1/nodes/h1/state", json={"state": "failed", "reason": "PSU"})
    w = client.get("/api/v1/workloads/scan").json()
    assert w["status"] == "pending" and w["reason"] == "no_compliant_capacity"
    admitted_node(client, "h2", certs={"hipaa": "true"}, gpus=4)
    w = client.get("/api/v1/workloads/scan").json()
    assert w["status"] == "placed" and w["placement"]["node"] == "h2"
    evictions = client.get("/api/v1/events", params={"action": "workload.evict"}).json()["items"]
    assert evictions[0]["details"]["node"] == "h1"
    assert evictions[0]["details"]["reason"] == "node_failed"
    assert evictions[0]["details"]["tags"] == {"hipaa": "true"}


def test_revoking_a_certification_evicts_work_that_needs_it(client: TestClient) -> None:
    tenant(client, "clinic", required_tags={"hipaa": "true"})
    tenant(client, "lab")
    admitted_node(client, "h1", certs={"hipaa": "true"}, gpus=4)
    submit(client, "scan", "clinic", gpus={"count": 1})
    submit(client, "nb", "lab", gpus={"share_milli": 300})
    client.delete("/api/v1/nodes/h1/certifications/hipaa")
    assert client.get("/api/v1/workloads/scan").json()["reason"] == "no_compliant_capacity"
    assert client.get("/api/v1/workloads/nb").json()["placement"]["node"] == "h1"


def test_a_new_certification_value_evicts_work_that_needed_the_old_one(
    client: TestClient,
) -> None:
    """Granting a key the node already holds with another value replaces it: work that needed
    the old value leaves (issue 12's grant path); a new key takes nothing away and places
    pending work that was waiting for it."""
    tenant(client, "clinic", required_tags={"hipaa": "true"})
    tenant(client, "lab", required_tags={"gxp": "yes"})
    admitted_node(client, "h1", certs={"hipaa": "true"}, gpus=4)
    submit(client, "scan", "clinic", gpus={"count": 1})
    submit(client, "assay", "lab", gpus={"count": 1})
    assert client.get("/api/v1/workloads/assay").json()["reason"] == "no_compliant_capacity"
    grant = client.post("/api/v1/nodes/h1/certifications", json={"key": "gxp", "value": "yes"})
    assert grant.status_code == 200, grant.text
    assert grant.json()["certifications"] == {"hipaa": "true", "gxp": "yes"}
    assert client.get("/api/v1/workloads/scan").json()["placement"]["node"] == "h1"
    assert client.get("/api/v1/workloads/assay").json()["placement"]["node"] == "h1"
    again = client.post("/api/v1/nodes/h1/certifications", json={"key": "hipaa", "value": "no"})
    assert again.json()["certifications"] == {"hipaa": "no", "gxp": "yes"}
    assert client.get("/api/v1/workloads/scan").json()["reason"] == "no_compliant_capacity"
    assert client.get("/api/v1/workloads/assay").json()["placement"]["node"] == "h1"
    grants = client.get("/api/v1/events", params={"action": "node.certification.grant"})
    assert [
        (e["target_id"], e["details"]["key"], e["details"]["value"], e["details"]["previous"])
        for e in grants.json()["items"]
    ] == [("h1", "hipaa", "true", None), ("h1", "gxp", "yes", None), ("h1", "hipaa", "no", "true")]


# --- events and atomicity ----------------------------------------------------------------------


def test_every_mutation_writes_its_event(client: TestClient) -> None:
    tenant(client, "lab")
    admitted_node(client, "n1", certs={"zone-ok": "yes"})
    submit(client, "w", "lab", tags={"zone-ok": "yes"})
    client.post("/api/v1/workloads/w/cancel")
    events = client.get("/api/v1/events").json()["items"]
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    assert [e["action"] for e in events] == [
        "user.create",  # the bootstrap admin and its token
        "token.issue",
        "tenant.create",
        "network.segment.allocate",  # its VXLAN VNI and InfiniBand PKey (issue 14)
        "node.register",
        "node.state",
        "node.certification.grant",
        "workload.submit",
        "workload.place",
        "network.endpoints",  # its overlay IP and MAC, at the end of the transaction
        "workload.cancel",
        "network.endpoints",  # released
    ]
    place = events[8]
    assert place["target_id"] == "w" and place["outcome"] == "success"
    assert place["details"]["tags"] == {"zone-ok": "yes"} and place["details"]["node"] == "n1"
    assert place["actor"] == "admin" and place["ts"].endswith("Z")
    only = client.get("/api/v1/events", params={"action": "workload.*", "limit": 2}).json()
    assert [e["action"] for e in only["items"]] == ["workload.submit", "workload.place"]
    rest = client.get("/api/v1/events", params={"action": "workload.*", "cursor": only["next"]})
    assert [e["action"] for e in rest.json()["items"]] == ["workload.cancel"]
    assert rest.json()["next"] is None
    by_target = client.get(
        "/api/v1/events", params={"target_type": "node", "target_id": "n1"}
    ).json()["items"]
    assert len(by_target) == 3
    assert client.get("/api/v1/events/3").json()["action"] == "tenant.create"
    error(client.get("/api/v1/events/999"), 404, "not_found")
    error(client.get("/api/v1/events", params={"outcome": "meh"}), 422, "validation_failed")
    since = client.get("/api/v1/events", params={"since": "2999-01-01T00:00:00"}).json()
    assert since["items"] == []


def test_a_crash_mid_transaction_leaves_nothing(
    client: TestClient, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    tenant(client, "lab")
    admitted_node(client, "n1")
    before = counts(store)

    def boom(*_a: Any, **_k: Any) -> None:
        raise RuntimeError("power cut between the change and the commit")

    # The workload row is written before placement decides: a failure inside placement must
    # take it back (and whatever else the transaction wrote).
    monkeypatch.setattr("proofplane.schedule.engine.Scheduler.schedule", boom)
    r = client.post("/api/v1/workloads", json={"name": "w", "tenant": "lab"})
    error(r, 500, "internal_error")
    assert "Traceback" not in r.text and "power cut" not in r.text
    assert counts(store) == before


def test_events_are_append_only_in_the_database(store: Store, client: TestClient) -> None:
    tenant(client, "lab")
    from sqlalchemy import delete, update
    from sqlalchemy.exc import DatabaseError

    for stmt in (update(EventRow).values(actor="mallory"), delete(EventRow)):
        with pytest.raises(DatabaseError, match="append-only"), store.engine.begin() as conn:
            conn.execute(stmt)
    with store.read() as s:
        assert s.scalar(select(EventRow.action).order_by(EventRow.seq)) == "user.create"


def test_values_the_database_cannot_hold_are_422_not_500(client: TestClient, store: Store) -> None:
    before = counts(store)
    r = client.post("/api/v1/tenants", json={"name": "t", "description": "a\u0000b"})
    assert "NUL" in error(r, 422, "validation_failed")["message"]
    r = client.get("/api/v1/nodes", params={"region": "eu\u0000x"})
    if store.engine.dialect.name == "postgresql":
        error(r, 422, "invalid_value")
    else:  # SQLite compares it like any other character: simply no match
        assert r.status_code == 200 and r.json()["items"] == []
    error(client.get(f"/api/v1/events/{2**70}"), 422, "validation_failed")
    body = node_body("big")
    body["gpus"][0]["memory_mb"] = 2**40
    error(client.post("/api/v1/nodes", json=body), 422, "validation_failed")
    r = client.post(
        "/api/v1/workloads", json={"name": "w", "tenant": "t", "gpus": {"count": 2**40}}
    )
    error(r, 422, "validation_failed")
    assert counts(store) == before


def test_events_newest_first_with_cursor(client: TestClient) -> None:
    for i in range(5):
        tenant(client, f"t{i}")
    # each tenant: tenant.create, then network.segment.allocate (its segment, issue 14)
    page = client.get("/api/v1/events", params={"order": "desc", "limit": 4}).json()
    assert [e["target_id"] for e in page["items"]] == ["t4", "t4", "t3", "t3"]
    assert [e["action"] for e in page["items"]][:2] == ["network.segment.allocate", "tenant.create"]
    rest = client.get("/api/v1/events", params={"order": "desc", "cursor": page["next"]}).json()
    assert [e["target_id"] for e in rest["items"]][:6] == ["t2", "t2", "t1", "t1", "t0", "t0"]
    assert [e["action"] for e in rest["items"]][6:] == ["token.issue", "user.create"]
    # A cursor from one order is not accepted by the other.
    error(client.get("/api/v1/events", params={"cursor": page["next"]}), 422, "invalid_cursor")


def test_workload_names_are_per_tenant(client: TestClient) -> None:
    """The same name in two tenants: no 409 across tenants (which would let one tenant learn
    another's names); an admin who sees both must say which."""
    tenant(client, "a")
    tenant(client, "b")
    submit(client, "train", "a")
    submit(client, "train", "b")
    error(client.post("/api/v1/workloads", json={"name": "train", "tenant": "a"}), 409, "conflict")
    err = error(client.get("/api/v1/workloads/train"), 409, "ambiguous_name")
    assert err["details"]["tenants"] == ["a", "b"]
    assert client.get("/api/v1/workloads/train", params={"tenant": "b"}).json()["tenant"] == "b"
    r = client.post("/api/v1/workloads/train/cancel", params={"tenant": "a"})
    assert r.json()["status"] == "cancelled" and r.json()["tenant"] == "a"
    other = client.get("/api/v1/workloads/train", params={"tenant": "b"}).json()
    assert other["status"] != "cancelled"
    error(client.get("/api/v1/workloads/train", params={"tenant": "c"}), 404, "not_found")
