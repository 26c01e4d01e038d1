"""Defragmentation through the HTTP API (issue 17 §3), on SQLite and PostgreSQL: a pending 4g
request is placed after moving restartable work, each move recorded as an eviction and a
placement with reason ``defragmentation``, ``workloads explain`` says so for both workloads;
a request whose only obstacle is running work that is not restartable says that; the move
budget is counted from the record; ``restartable`` must be a boolean."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select
from sqlalchemy.orm import Session

from proofplane import config
from proofplane.errors import ValidationFailed
from proofplane.model import WorkloadStatus
from proofplane.service import defrag as defrag_store
from proofplane.service.context import Store
from proofplane.store.tables import ExecutionJobRow, WorkloadRow

API = "/api/v1"
SEVEN_1G = [{"profile": "1g.10gb", "start": s} for s in range(7)]


def mig_node(client: TestClient, name: str) -> None:
    body = {
        "name": name,
        "region": "eu-frankfurt",
        "zone": "eu-frankfurt-1a",
        "gpus": [
            {
                "index": 0,
                "uuid": f"GPU-{name}-0",
                "model": "H100-80GB",
                "mig_enabled": True,
                "mig_instances": SEVEN_1G,
            }
        ],
    }
    assert client.post(f"{API}/nodes", json=body).status_code == 201
    state(client, name, "admitted")


def state(client: TestClient, name: str, to: str) -> None:
    r = client.post(f"{API}/nodes/{name}/state", json={"state": to})
    assert r.status_code == 200, r.text


def submit(client: TestClient, name: str, profile: str, **kw: Any) -> dict[str, Any]:
    body = {"name": name, "tenant": "lab", "gpus": {"mig_profile": profile}, **kw}
    r = client.post(f"{API}/workloads", json=body)
    assert r.status_code == 201, r.text
    return r.json()  # type: ignore[no-any-return]


def events(client: TestClient, action: str) -> list[dict[str, Any]]:
    r = client.get(f"{API}/events", params={"action": action, "limit": 500})
    return r.json()["items"]  # type: ignore[no-any-return]


def started(store: Store, name: str) -> None:
    """The engine started the workload's job (what a backend's dispatch records)."""
    with Session(store.engine) as s, s.begin():
        row = s.scalars(select(WorkloadRow).where(WorkloadRow.name == name)).one()
        now = datetime.now(UTC)
        s.add(
            ExecutionJobRow(
                workload_id=row.id,
                backend="local",
                job_id=f"job-{name}",
                state="running",
                created_at=now,
                updated_at=now,
            )
        )
        row.status = WorkloadStatus.RUNNING.value


def test_a_waiting_4g_is_placed_after_moving_restartable_work(
    client: TestClient, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert client.post(f"{API}/tenants", json={"name": "lab", "profile": {}}).status_code == 201
    mig_node(client, "n1")
    a = submit(client, "a", "1g.10gb", restartable=True)
    assert a["restartable"] is True and a["placement"]["node"] == "n1"
    state(client, "n1", "cordoned")
    mig_node(client, "n2")
    b = submit(client, "b", "1g.10gb")
    assert b["restartable"] is False and b["placement"]["node"] == "n2"
    state(client, "n1", "admitted")
    started(store, "a")  # running, but restartable: may move
    started(store, "b")  # running and not restartable: its GPU is never touched

    big = submit(client, "big", "4g.40gb")
    assert big["status"] == "placed", big
    assert big["placement"]["node"] == "n1"
    assert big["placement"]["devices"][0]["mig_profile"] == "4g.40gb"
    moved = client.get(f"{API}/workloads/a").json()
    assert moved["status"] == "placed" and moved["placement"] != a["placement"]
    b_now = client.get(f"{API}/workloads/b").json()
    assert b_now["placement"] == b["placement"] and b_now["status"] == "running"

    # the move: an eviction and a placement with reason defragmentation, the new layout
    evicted = [e for e in events(client, "workload.evict") if e["target_id"] == "a"]
    assert [e["details"]["reason"] for e in evicted] == ["defragmentation"]
    assert evicted[0]["details"]["for_workload"] == "lab/big"
    places = {e["target_id"]: e["details"] for e in events(client, "workload.place")}
    assert places["a"]["reason"] == "defragmentation"
    assert places["a"]["moved_from"] == "n1/gpu0/1g.10gb@0"
    assert places["big"]["reason"] == "defragmentation"
    assert [m["workload"] for m in places["big"]["moved"]] == ["lab/a"]
    changes = events(client, "node.gpu.repartition")
    assert changes[-1]["target_id"] == "n1" and "4g.40gb@0" in changes[-1]["details"]["after"]
    assert "defragmentation" in changes[-1]["details"]["why"]
    # the running job of the moved workload was stopped; it is dispatched again where it went
    with Session(store.engine) as s:
        jobs = s.scalars(select(ExecutionJobRow.state).where(ExecutionJobRow.job_id == "job-a"))
        assert list(jobs) in (["running"], ["cancelled"])  # no engine in this test: kept

    # explain: placed after defragmentation, and why the other one moved
    e = client.get(f"{API}/workloads/big/explain").json()
    assert "after defragmentation" in e["summary"] and "lab/a" in e["summary"]
    assert e["defrag"]["moves"][0]["workload"] == "lab/a"
    (change,) = e["mig_layout"]["changes"]  # the freed GPU's new layout, and why
    assert change["step"] == "repartition" and change["freed_by_defragmentation"] is True
    e = client.get(f"{API}/workloads/a/explain").json()
    assert e["defrag"] == {"moved": True, "for_workload": "lab/big", "from": "n1/gpu0/1g.10gb@0"}
    assert "moved from n1/gpu0/1g.10gb@0" in e["summary"]

    # the budget is counted from the record, in a rolling hour
    monkeypatch.setenv(config.DEFRAG_MAX_MOVES_ENV, "1")
    with Session(store.engine) as s:
        now = datetime.now(UTC)
        assert defrag_store.moves_in_window(s, now) == 1
        assert defrag_store.budget_left(s, now) == 0
        assert defrag_store.budget_left(s, now + timedelta(hours=2)) == 1

    # a second 4g: every GPU now holds running work that is not restartable
    started(store, "big")
    monkeypatch.setenv(config.DEFRAG_MAX_MOVES_ENV, "5")
    w = submit(client, "big2", "4g.40gb")
    assert w["status"] == "pending" and w["reason"] == "insufficient_capacity"
    assert w["reason_details"]["defrag"]["refused"] == "non_restartable_work"
    assert "not restartable" in w["reason_details"]["message"]
    e = client.get(f"{API}/workloads/big2/explain").json()
    assert "not restartable" in e["summary"]
    assert e["defrag"]["refused"] == "non_restartable_work"


def test_a_budget_of_zero_moves_nothing(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(config.DEFRAG_MAX_MOVES_ENV, "0")
    assert client.post(f"{API}/tenants", json={"name": "lab", "profile": {}}).status_code == 201
    mig_node(client, "n1")
    submit(client, "a", "1g.10gb", restartable=True)
    w = submit(client, "big", "4g.40gb")
    assert w["status"] == "pending" and "defrag" not in w["reason_details"]
    assert events(client, "workload.evict") == []


@pytest.mark.parametrize("value", ["yes", 1, None, [True]])
def test_restartable_must_be_a_boolean(client: TestClient, value: object) -> None:
    assert client.post(f"{API}/tenants", json={"name": "lab", "profile": {}}).status_code == 201
    body = {"name": "w", "tenant": "lab", "gpus": {"count": 1}, "restartable": value}
    r = client.post(f"{API}/workloads", json=body)
    assert r.status_code == 422, r.text
    assert r.json()["error"]["code"] == "validation_failed"


def test_the_pending_retry_defragments(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(config.DEFRAG_MAX_MOVES_ENV, "0")
    assert client.post(f"{API}/tenants", json={"name": "lab", "profile": {}}).status_code == 201
    mig_node(client, "n1")
    state(client, "n1", "cordoned")
    mig_node(client, "n2")
    submit(client, "a", "1g.10gb", restartable=True)  # n2, slot 0
    submit(client, "other", "1g.10gb")  # packs onto n2 too
    state(client, "n1", "admitted")
    state(client, "n2", "cordoned")
    submit(client, "filler", "1g.10gb")  # n1: no GPU is idle now
    state(client, "n2", "admitted")
    w = submit(client, "big", "4g.40gb")
    assert w["status"] == "pending"
    # budget back; a capacity change (a cancel) retries the pending work, which defragments
    monkeypatch.setenv(config.DEFRAG_MAX_MOVES_ENV, "20")
    r = client.post(f"{API}/workloads/other/cancel", json={})
    assert r.status_code == 200, r.text
    big = client.get(f"{API}/workloads/big").json()
    assert big["status"] == "placed", big
    assert big["reason_details"]["defrag"]["moves"]
    assert all(
        e["details"]["reason"] == "defragmentation" for e in events(client, "workload.evict")
    )


@pytest.mark.parametrize("raw", ["-1", "lots", "1.5", "1000001"])
def test_a_malformed_move_budget_is_refused_at_start(raw: str) -> None:
    """The server's settings are read at start (``config.from_env``, what ``serve`` does): a
    malformed budget stops it there with invalid_setting, not on some later MIG submit."""
    with pytest.raises(ValidationFailed) as err:
        config.from_env({config.DEFRAG_MAX_MOVES_ENV: raw})
    assert err.value.code == "invalid_setting"
    assert config.from_env({config.DEFRAG_MAX_MOVES_ENV: "7"}).defrag_max_moves_per_hour == 7
    assert config.from_env({}).defrag_max_moves_per_hour == 20
