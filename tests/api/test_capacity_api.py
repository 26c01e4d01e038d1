"""``GET /api/v1/capacity`` and ``GET /api/v1/alerts`` (issue 15, §8 and §10), and the
``proofplane capacity`` / ``proofplane alerts list`` commands against a real server: the demo
cluster's pools, their headroom and N+1 verdicts, who sees which workloads, the forecast from
metered demand, and bad input answered 422, never 500."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from dbtest import ADMIN_TOKEN, demo_text
from live_server import serve
from proofplane.access import SYSTEM, Actor, Role
from proofplane.cli.main import app as cli_app
from proofplane.hardware.cluster_file import parse_cluster
from proofplane.meter.capacity import pool_label
from proofplane.service import access as access_svc
from proofplane.service import capacity as capacity_svc
from proofplane.service.access import bootstrap_admin
from proofplane.service.cluster import load_cluster
from proofplane.service.context import Store
from proofplane.store import migrate


def token(store: Store, role: Role) -> str:
    name = f"cap-{role.value}"
    access_svc.create_user(store, SYSTEM, name, None, [role.value], [])
    actor = Actor(name, frozenset({role}), token_id="setup")
    return access_svc.issue_token(
        store, actor, roles=None, tenants=None, expires_in=3600, name="t"
    ).token


def test_capacity_of_the_demo_cluster(client: TestClient, demo: Store) -> None:
    r = client.get("/api/v1/capacity")
    assert r.status_code == 200, r.text
    body = r.json()
    pools = {p["pool"]: p for p in body["pools"]}
    assert "general" in pools and "hipaa=true" in pools and "pci-dss=isolated" in pools
    general = pools["general"]
    assert general["nodes"] == body["nodes"] and general["gpus"] >= general["headroom"]["gpus"]
    for p in body["pools"]:
        check = p["n_plus_one"]
        assert set(check) >= {"ok", "lost_node", "displaced", "replaced", "unplaced"}
        assert p["headroom"]["gpus"] == p["gpus_idle"] and "forecast" in p
        if not check["ok"]:
            assert all("workload" in u and u["reason"] for u in check["unplaced"])
    assert body["ok"] is all(p["n_plus_one"]["ok"] for p in body["pools"])
    assert not body["ok"]  # the demo's Paris pool cannot lose its largest node
    paris = pools["gdpr-zone=paris"]["n_plus_one"]
    assert [u["workload"] for u in paris["unplaced"]] == ["paris-insurance/claims-ocr"]


def test_who_sees_which_workloads(client: TestClient, demo: Store) -> None:
    monitoring = token(demo, Role.MONITORING)
    r = client.get("/api/v1/capacity", headers={"Authorization": f"Bearer {monitoring}"},
                   params={"forecast": "false"})  # fmt: skip
    assert r.status_code == 200
    for p in r.json()["pools"]:
        check = p["n_plus_one"]
        assert isinstance(check["displaced"], int) and "forecast" not in p
        assert all(set(u) == {"reason"} for u in check["unplaced"])
    dev = client.post("/api/v1/users", json={"username": "cap-dev", "roles": ["developer"],
                                             "tenants": ["research-lab"]})  # fmt: skip
    assert dev.status_code == 201
    dev_token = access_svc.issue_token(
        demo, Actor("cap-dev", frozenset({Role.DEVELOPER}), frozenset({"research-lab"}),
                    token_id="x"), roles=None, tenants=None, expires_in=600, name="t",
    ).token  # fmt: skip
    refused = client.get("/api/v1/capacity", headers={"Authorization": f"Bearer {dev_token}"})
    assert refused.status_code == 403


@pytest.mark.parametrize(
    "params",
    [{"weeks": 0}, {"weeks": 13}, {"weeks": "x"}, {"forecast": "maybe"}, {"weeks": "1e9"}],
)
def test_capacity_bad_input(client: TestClient, params: dict[str, Any]) -> None:
    r = client.get("/api/v1/capacity", params=params)
    assert r.status_code == 422 and r.json()["error"]["code"] == "validation_failed", r.text


@pytest.mark.parametrize("status", ["open", "", "FIRING", "\x00"])
def test_alerts_bad_status(client: TestClient, status: str) -> None:
    r = client.get("/api/v1/alerts", params={"status": status})
    assert r.status_code == 422, r.text


def test_alerts_list(client: TestClient, demo: Store) -> None:
    from proofplane.service import alerts as alerts_svc

    alerts_svc.evaluate(demo, alerts_svc.AlertState(), alerts_svc.load_rules(),
                        datetime.now(UTC), capacity=True)  # fmt: skip
    items = client.get("/api/v1/alerts").json()["items"]
    assert {a["rule"] for a in items} >= {"capacity_n_plus_one"}
    for a in items:
        assert a["status"] == "firing" and a["runbook"] and a["event_seq"] > 0
    assert client.get("/api/v1/alerts", params={"status": "resolved"}).json()["items"] == []
    everything = client.get("/api/v1/alerts", params={"status": "all"}).json()["items"]
    assert len(everything) == len(items)


def test_forecast_from_metered_demand(demo: Store) -> None:
    """Two days on: yesterday (the placements' day, a partial one) and a whole day holding
    what the pools hold now. The whole day's mean is exactly what is held."""
    later = datetime.now(UTC) + timedelta(days=2)
    days, demand = capacity_svc.daily_demand(demo, later, weeks=1)
    assert len(days) == 7 and demand
    snap = capacity_svc.snapshot(demo)
    from proofplane.meter.capacity import fleet
    from proofplane.schedule.quota import mig_slices

    held: dict[str, float] = {}
    for h in snap.held:
        label = pool_label(h.pool)
        for part in h.placement.parts:
            for d in part.devices:
                if d.mig_profile is not None:
                    share = mig_slices(d.mig_profile) / 7
                elif d.share_milli is not None:
                    share = d.share_milli / 1000
                else:
                    share = 1.0
                held[label] = held.get(label, 0.0) + share
    assert fleet(snap.nodes, snap.held).holdings  # the pools hold something
    for label, series in demand.items():
        assert len(series) == 2, (label, series)  # leading empty days dropped
        assert series[-1] == pytest.approx(held[label], abs=1e-9), label
    report = capacity_svc.capacity_report(demo, SYSTEM, later, weeks=1)
    general = next(p for p in report["pools"] if p["pool"] == "general")
    assert general["forecast"]["days"] == len(demand.get("general", []))


# --- the commands ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    db = tmp_path_factory.mktemp("capacity-cli") / "cli.db"
    store = Store(f"sqlite:///{db}")
    migrate.upgrade(store.engine)
    load_cluster(store, SYSTEM, parse_cluster(demo_text()))
    assert bootstrap_admin(store, ADMIN_TOKEN)
    with serve(store) as url:
        yield url, store


def cli(url: str, tmp: Path, *args: str) -> Any:
    env = {"XDG_CONFIG_HOME": str(tmp / "cfg"), "XDG_DATA_HOME": str(tmp / "data")}
    return CliRunner().invoke(cli_app, ["--server", url, "--token", ADMIN_TOKEN, *args], env=env)


def test_capacity_command(server: Any, tmp_path: Path) -> None:
    url, _store = server
    table = cli(url, tmp_path, "capacity", "--no-forecast")
    assert table.exit_code == 1, table.output  # a pool fails its N+1 check
    assert "gdpr-zone=paris" in table.output and "FAILS without" in table.output
    assert "paris-insurance/claims-ocr would wait" in table.output
    raw = cli(url, tmp_path, "capacity", "--json", "--weeks", "2")
    assert raw.exit_code == 1 and json.loads(raw.stdout)["pools"]
    bad = cli(url, tmp_path, "capacity", "--weeks", "0")
    assert bad.exit_code == 2


def test_alerts_command(server: Any, tmp_path: Path) -> None:
    url, store = server
    from proofplane.service import alerts as alerts_svc

    alerts_svc.evaluate(store, alerts_svc.AlertState(), alerts_svc.load_rules(),
                        datetime.now(UTC), capacity=True)  # fmt: skip
    out = cli(url, tmp_path, "alerts", "list")
    assert out.exit_code == 0, out.output
    assert "capacity_n_plus_one" in out.output and "capacity-n-plus-one@v1" in out.output
    none = cli(url, tmp_path, "alerts", "list", "--status", "resolved")
    assert none.exit_code == 0 and "no resolved alerts" in none.output
    bad = cli(url, tmp_path, "alerts", "list", "--status", "open")
    assert bad.exit_code == 1 and "Traceback" not in bad.output
