"""``proofplane telemetry``: readings, rollups, the newest readings, drained GPUs and their
recovery, idle policies, against a real server."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from typer.testing import CliRunner

import telemetry_cluster as tc
from live_server import serve
from proofplane.access import SYSTEM
from proofplane.cli.main import app
from proofplane.hardware.cluster_file import gpu_uuid
from proofplane.meter import fields as F
from proofplane.service import telemetry as tel
from proofplane.service.access import bootstrap_admin
from proofplane.service.context import Store
from proofplane.store import migrate

ADMIN = "ppt_telemetry-cli-admin-token-0123456789"
runner = CliRunner()


@pytest.fixture
def server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, Store]]:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    for var in ("PROOFPLANE_SERVER", "PROOFPLANE_TOKEN", "PROOFPLANE_AGENT_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    store = Store(f"sqlite:///{tmp_path / 'cli.db'}")
    migrate.upgrade(store.engine)
    bootstrap_admin(store, ADMIN)
    tc.load(store)
    with serve(store) as url:
        yield url, store


def run(url: str, *args: str, code: int = 0) -> str:
    result = runner.invoke(app, ["--server", url, "--token", ADMIN, "telemetry", *args])
    assert result.exit_code == code, (result.exit_code, result.output, result.exception)
    assert "Traceback" not in result.output
    return result.stdout


def test_telemetry_commands(server) -> None:
    url, store = server
    now = datetime.now(UTC)
    whole = gpu_uuid("n1", 1)
    tel.ingest(store, SYSTEM, "n1", {"simulated": True, "samples": [
        tc.entry(whole, now - timedelta(hours=2), {F.POWER_USAGE: 100}),
        tc.entry(whole, now, {F.POWER_USAGE: 250, F.GR_ENGINE_ACTIVE: 0.5}),
    ]}, now=now)  # fmt: skip
    out = run(url, "list")
    assert "DCGM_FI_DEV_POWER_USAGE" in out and "simulated" in out and "3 readings" in out
    assert "acme/whole" in out
    data = json.loads(run(url, "list", "--json", "--field", F.POWER_USAGE, "--tenant", "acme"))
    assert [i["value"] for i in data["items"]] == [250.0]
    assert all(i["simulated"] for i in data["items"])
    tel.rollup_hours(store, SYSTEM, now)
    out = run(url, "list", "--hourly")
    assert "1 rollup" in out and "simulated" in out
    out = run(url, "latest", "--node", "n1")
    assert "2 readings" in out
    latest = json.loads(run(url, "latest", "--json", "--field", F.GR_ENGINE_ACTIVE))
    assert [i["value"] for i in latest["items"]] == [0.5]
    # a fatal XID drains the GPU; an operator recovers it
    tel.ingest(store, SYSTEM, "n1", {"samples": [tc.entry(whole, now, {F.XID_ERRORS: 95})]},
               now=now)  # fmt: skip
    out = run(url, "health")
    assert "XID 95" in out and "1 drained GPU" in out
    out = run(url, "recover", "n1", whole)
    assert "back in service" in out
    err = runner.invoke(app, ["--server", url, "--token", ADMIN, "telemetry", "recover", "n1",
                              whole])  # fmt: skip
    assert err.exit_code == 1 and "not drained" in err.output
    # idle policies
    assert "(the default: none set)" in run(url, "idle-policy", "acme")
    out = run(url, "idle-policy", "acme", "--action", "reclaim", "--window-minutes", "10")
    assert "reclaim" in out and "10 min" in out and "default" not in out
    policy = json.loads(run(url, "idle-policy", "acme", "--json"))["idle_policy"]
    assert policy == {"action": "reclaim", "window_s": 600.0, "threshold": 0.05,
                      "preemptible_priority": 0}  # fmt: skip
    bad = runner.invoke(app, ["--server", url, "--token", ADMIN, "telemetry", "list", "--field",
                              "NOPE"])  # fmt: skip
    assert bad.exit_code == 1 and "unknown field" in bad.output
