"""The telemetry API: a node's agent posts its readings, readers list them, bad input is a
4xx (never a 500), drained GPUs and idle policies."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

from fastapi.testclient import TestClient

import telemetry_cluster as tc
from proofplane.hardware.cluster_file import gpu_uuid
from proofplane.meter import fields as F
from proofplane.service.context import Store

API = "/api/v1"


def _agent(client: TestClient, node: str) -> dict[str, str]:
    token = client.post(f"{API}/nodes/{node}/agent-credentials", json={}).json()["token"]
    return {"Authorization": f"Bearer {token}"}


def _err(resp, status: int, code: str) -> None:
    assert resp.status_code == status, resp.text
    assert resp.json()["error"]["code"] == code, resp.text


def test_agent_posts_and_readers_list(client: TestClient, store: Store) -> None:
    tc.load(store)
    agent = _agent(client, "n1")
    now = datetime.now(UTC)
    body = {"samples": [
        tc.entry(gpu_uuid("n1", 1), now, {F.POWER_USAGE: 250, F.GR_ENGINE_ACTIVE: 0.7}),
        tc.entry(tc.MIG_GPU, now, {F.GR_ENGINE_ACTIVE: 0.2}, gi_id=1, profile="3g.40gb"),
        tc.entry(tc.MIG_GPU, now, {"DCGM_FI_DEV_SOMETHING_NEW": 1}),
    ]}  # fmt: skip
    r = client.post(f"{API}/nodes/n1/telemetry", json=body, headers=agent)
    assert r.status_code == 200, r.text
    assert r.json() == {"node": "n1", "accepted": 3, "stored": 3,
                        "ignored": {"unknown_field": 1}, "drained": []}  # fmt: skip
    # the agent reads nothing
    _err(client.get(f"{API}/telemetry", headers=agent), 403, "forbidden")
    page = client.get(f"{API}/telemetry", params={"limit": 2}).json()
    assert len(page["items"]) == 2 and page["next"]
    rest = client.get(f"{API}/telemetry", params={"limit": 2, "cursor": page["next"]}).json()
    items = page["items"] + rest["items"]
    assert {(i["field"], i["tenant"], i["unit"]) for i in items} == {
        (F.POWER_USAGE, "acme", "W"), (F.GR_ENGINE_ACTIVE, "acme", "ratio"),
        (F.GR_ENGINE_ACTIVE, "beta", "ratio"),
    }  # fmt: skip
    assert all(i["simulated"] is False and i["ts"].endswith("+00:00") for i in items)
    got = client.get(
        f"{API}/telemetry",
        params={
            "tenant": "beta",
            "field": F.GR_ENGINE_ACTIVE,
            "from": (now - timedelta(minutes=1)).isoformat(),
            "to": (now + timedelta(minutes=1)).isoformat(),
        },
    )
    assert [i["workload"] for i in got.json()["items"]] == ["slice"]
    latest = client.get(f"{API}/telemetry/latest", params={"node": "n1"}).json()["items"]
    assert len(latest) == 3
    assert client.get(f"{API}/telemetry", params={"resolution": "hour"}).json()["items"] == []


def test_bad_input_is_a_4xx(client: TestClient, store: Store) -> None:
    tc.load(store)
    agent = _agent(client, "n1")
    now = datetime.now(UTC)
    post = lambda body, node="n1", **kw: client.post(  # noqa: E731
        f"{API}/nodes/{node}/telemetry", headers=agent, **({"json": body} | kw)
    )
    # another node's GPU, another node, a node that does not exist
    _err(post({"samples": [tc.entry(gpu_uuid("n2", 0), now, {F.POWER_USAGE: 1})]}), 422,
         "gpu_not_on_node")  # fmt: skip
    _err(post({"samples": []}, node="n2"), 404, "not_found")
    _err(post({"samples": []}, node="ghost"), 404, "not_found")
    # malformed bodies
    for body in ([], "x", {"samples": [{"gpu_uuid": 1}]}, {"samples": [], "extra": 1},
                 {"samples": [tc.entry(tc.MIG_GPU, now, {F.POWER_USAGE: "hot"})]}):  # fmt: skip
        _err(post(body), 422, "invalid_telemetry")
    r = client.post(f"{API}/nodes/n1/telemetry", headers={**agent, "content-type":
                    "application/json"}, content=b"{not json")  # fmt: skip
    assert r.status_code == 422
    nan = json.dumps({"samples": [{"gpu_uuid": tc.MIG_GPU, "ts": now.isoformat(),
                                   "values": {F.POWER_USAGE: float("nan")}}]})  # fmt: skip
    r = client.post(f"{API}/nodes/n1/telemetry", headers={**agent, "content-type":
                    "application/json"}, content=nan.encode())  # fmt: skip
    assert r.status_code in (400, 422), r.text
    # huge: over the readings limit (422) and over the body limit (413)
    many = {"samples": [tc.entry(tc.MIG_GPU, now, {f"k{k}": 1 for k in range(20001)})]}
    _err(post(many), 422, "too_many_samples")
    huge = {"samples": [tc.entry(tc.MIG_GPU, now, {F.POWER_USAGE: 1.0})] * 20000}
    _err(post(huge), 413, "payload_too_large")
    # list queries
    _err(client.get(f"{API}/telemetry", params={"field": "DCGM_FI_NOPE"}), 422, "unknown_field")
    assert client.get(f"{API}/telemetry", params={"resolution": "day"}).status_code == 422
    assert client.get(f"{API}/telemetry", params={"from": "yesterday"}).status_code == 422
    _err(client.get(f"{API}/telemetry", params={"cursor": "!!"}), 422, "invalid_cursor")
    assert client.get(f"{API}/telemetry", params={"from": "9999-12-31T23:59:59-14:00"}
                      ).status_code == 422  # fmt: skip


def test_gpu_health_and_idle_policy_routes(client: TestClient, store: Store) -> None:
    tc.load(store)
    agent = _agent(client, "n1")
    now = datetime.now(UTC)
    body = {"samples": [tc.entry(gpu_uuid("n1", 1), now, {F.XID_ERRORS: 95})]}
    out = client.post(f"{API}/nodes/n1/telemetry", json=body, headers=agent).json()
    assert out["drained"][0]["xid"] == 95 and out["drained"][0]["evicted"] == ["whole"]
    drained = client.get(f"{API}/gpu-health").json()["items"]
    assert [d["gpu_uuid"] for d in drained] == [gpu_uuid("n1", 1)]
    _err(client.post(f"{API}/nodes/n1/gpus/{gpu_uuid('n1', 1)}/recover", headers=agent), 403,
         "forbidden")  # fmt: skip
    r = client.post(f"{API}/nodes/n1/gpus/{gpu_uuid('n1', 1)}/recover")
    assert r.status_code == 200 and r.json()["state"] == "recovered"
    _err(client.post(f"{API}/nodes/n1/gpus/{gpu_uuid('n1', 1)}/recover"), 404, "gpu_not_drained")
    assert client.get(f"{API}/tenants/acme/idle-policy").json()["default"] is True
    r = client.put(f"{API}/tenants/acme/idle-policy", json={"action": "reclaim"})
    assert r.status_code == 200 and r.json()["idle_policy"]["action"] == "reclaim"
    _err(client.put(f"{API}/tenants/acme/idle-policy", json={"action": "x"}), 422,
         "invalid_idle_policy")  # fmt: skip
    _err(client.put(f"{API}/tenants/ghost/idle-policy", json={}), 404, "not_found")
