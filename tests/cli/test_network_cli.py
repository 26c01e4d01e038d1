"""``proofplane network …`` (issue 14) against a real API server holding the demo cluster (what
``make up`` loads): the demo tenants' segments, a node rendered in every format, the drift
report and its exit status, the segmentation map, a tenant's policy."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from dbtest import demo_text
from live_server import serve
from proofplane.access import SYSTEM
from proofplane.cli import credentials as cli_credentials
from proofplane.cli.main import app
from proofplane.hardware.cluster_file import parse_cluster
from proofplane.network.desired import desired_from_json
from proofplane.service import network
from proofplane.service.access import bootstrap_admin
from proofplane.service.cluster import load_cluster
from proofplane.service.context import Store
from proofplane.store import migrate

runner = CliRunner()
TOKEN = "ppt_network-cli-admin-token-0123456789"
DEMO_TENANTS = ("st-marys-hospital", "nordbank", "berlin-telco", "paris-insurance", "research-lab")


@pytest.fixture(autouse=True)
def config_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("PROOFPLANE_TOKEN", "PROOFPLANE_SERVER"):
        monkeypatch.delenv(var, raising=False)
    where = tmp_path / "xdg-config" / "proofplane"
    monkeypatch.setattr(cli_credentials, "config_dir", lambda: where)


@pytest.fixture
def demo_store(tmp_path: Path) -> Iterator[Store]:
    store = Store(f"sqlite:///{tmp_path / 'cli.db'}")
    migrate.upgrade(store.engine)
    load_cluster(store, SYSTEM, parse_cluster(demo_text()))
    assert bootstrap_admin(store, TOKEN)
    yield store
    store.dispose()


@pytest.fixture
def server(demo_store: Store) -> Iterator[str]:
    with serve(demo_store) as url:
        yield url


def cli(server: str, *args: str) -> Any:
    return runner.invoke(app, ["--server", server, "--token", TOKEN, *args])


def ok(result: Any) -> Any:
    assert result.exit_code == 0, (result.exit_code, result.output, result.exception)
    return result


def test_segments_shows_the_demo_tenants(server: str) -> None:
    out = ok(cli(server, "network", "segments")).stdout
    for vni, tenant in enumerate(DEMO_TENANTS, start=10000):
        line = next(x for x in out.splitlines() if tenant in x)
        assert str(vni) in line and f"0x{vni - 9999:04x}" in line and "active" in line
    assert "5 segments" in out
    data = json.loads(ok(cli(server, "network", "segments", "--json")).stdout)
    assert [s["tenant"] for s in data["items"]] == list(DEMO_TENANTS)
    one = json.loads(ok(cli(server, "network", "segments", "-t", "nordbank", "--json")).stdout)
    assert [s["vni"] for s in one["items"]] == [10001]
    bad = cli(server, "network", "segments", "--state", "gone")
    assert bad.exit_code == 2


def test_render_in_every_format(server: str, tmp_path: Path) -> None:
    doc = json.loads(ok(cli(server, "network", "render", "fra-h100-01")).stdout)
    assert desired_from_json(doc).node == "fra-h100-01"
    ip = ok(cli(server, "network", "render", "fra-h100-01", "--format", "iproute2")).stdout
    assert "# ip -batch -" in ip and "# bridge -batch -" in ip and "nolearning" in ip
    nft = ok(cli(server, "network", "render", "fra-h100-01", "-f", "nftables")).stdout
    assert "table inet proofplane" in nft and "@vteps" in nft
    out = tmp_path / "partitions.conf"
    ok(cli(server, "network", "render", "fra-h100-01", "-f", "partitions", "-o", str(out)))
    assert "Default=0x7fff" in out.read_text()
    assert cli(server, "network", "render", "fra-h100-01", "-f", "yaml").exit_code == 2
    missing = cli(server, "network", "render", "nope")
    assert missing.exit_code == 1 and "not found" in missing.output


def test_check_reports_drift_and_exits_1(server: str, demo_store: Store) -> None:
    out = ok(cli(server, "network", "check")).stdout
    assert "0 of 24 node(s) report their network; 0 drifted" in " ".join(out.split())
    st = network.node_status(demo_store, SYSTEM, "fra-h100-01")
    network.report(demo_store, SYSTEM, "fra-h100-01", {
        "applied_generation": st["desired_generation"] - 1, "applied_sha256": "a" * 64,
        "self_check": {"ok": True}})  # fmt: skip
    result = cli(server, "network", "check")
    assert result.exit_code == 1
    assert "network drift on 1 node(s)" in result.output
    assert "generation_lag" in result.output
    data = json.loads(cli(server, "network", "check", "--json").stdout)
    assert data["drifting"] == ["fra-h100-01"] and len(data["items"]) == 24


def test_export_the_segmentation_map(server: str, tmp_path: Path) -> None:
    data = json.loads(ok(cli(server, "network", "export")).stdout)
    assert [t["tenant"] for t in data["tenants"]] == sorted(DEMO_TENANTS)
    path = tmp_path / "map.csv"
    ok(cli(server, "network", "export", "--format", "csv", "-o", str(path)))
    rows = list(csv.DictReader(io.StringIO(path.read_text())))
    assert {r["tenant"] for r in rows} == set(DEMO_TENANTS)
    assert all(r["policy_sha256"] for r in rows)
    assert cli(server, "network", "export", "--format", "xml").exit_code == 2


def test_policy_show_set_and_reset(server: str, tmp_path: Path) -> None:
    shown = json.loads(ok(cli(server, "network", "policy", "research-lab")).stdout)
    assert shown["default"] is True
    policy = tmp_path / "p.json"
    policy.write_text(json.dumps({"allow": [{"proto": "tcp", "ports": 29500}]}))
    out = ok(cli(server, "network", "policy", "research-lab", "--file", str(policy))).stdout
    assert "research-lab network policy" in out
    shown = json.loads(ok(cli(server, "network", "policy", "research-lab")).stdout)
    assert shown["default"] is False
    ok(cli(server, "network", "policy", "research-lab", "--default"))
    policy.write_text(json.dumps({"allow": [{"proto": "any", "source": {"tenant": "nordbank"}}]}))
    refused = cli(server, "network", "policy", "research-lab", "--file", str(policy))
    assert refused.exit_code == 1 and "nordbank" in refused.output
    policy.write_text("{not json")
    assert cli(server, "network", "policy", "research-lab", "--file", str(policy)).exit_code == 1
