"""The node agent posts telemetry to a real server: NVML (the fake 8 x H100 node) and a
dcgm-exporter scrape over HTTP; --collect-telemetry; a node's credential posts only for it."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fake_nvml import FakeNvml, h100_node
from live_server import serve
from proofplane.access import SYSTEM
from proofplane.cli.agent import TelemetryPoster, telemetry_source
from proofplane.cli.client import ApiClient, ApiError
from proofplane.cli.main import app
from proofplane.meter import fields as F
from proofplane.model import Gpu, MigInstance, Node, NodeState
from proofplane.service import nodes as nodes_svc
from proofplane.service import telemetry as tel
from proofplane.service.access.bootstrap import issue_agent_credential
from proofplane.service.context import Store
from proofplane.store import migrate

PROFILES = {9: "3g.40gb", 19: "1g.10gb", 14: "2g.20gb", 15: "1g.20gb", 20: "1g.10gb+me"}


def _node(name: str) -> Node:
    gpus = []
    for i, g in enumerate(h100_node()):
        mig = tuple(MigInstance(PROFILES[pid], start) for _gi, pid, start, _s in g.instances)
        gpus.append(Gpu(i, g.uuid, "H100-80GB", 81920, mig_enabled=g.mig[0] == 1,
                        mig_instances=mig if g.mig[0] == 1 else ()))  # fmt: skip
    return Node(name, "r", "z", gpus=tuple(gpus), state=NodeState.ADMITTED)


@pytest.fixture
def world(tmp_path: Path) -> Iterator[tuple[str, str, Store]]:
    store = Store(f"sqlite:///{tmp_path / 'agent.db'}")
    migrate.upgrade(store.engine)
    nodes_svc.register_node(store, SYSTEM, _node("n1"))
    nodes_svc.register_node(store, SYSTEM, Node("n2", "r", "z", state=NodeState.ADMITTED))
    nodes_svc.set_node_state(store, SYSTEM, "n1", NodeState.ADMITTED)
    token = issue_agent_credential(store, SYSTEM, "n1").token
    with serve(store) as url:
        yield url, token, store


def test_agent_posts_nvml_telemetry(world) -> None:
    url, token, store = world
    gpus = h100_node()
    gpus[2].gpm_mig = {1: {1: 60.0}}
    poster = TelemetryPoster(url, token, "n1", None,
                             telemetry_source(None, FakeNvml(gpus)), 15)  # fmt: skip
    assert poster.tick() and poster.tick(), poster.last_error
    out = poster.last
    assert out["accepted"] > 100 and out["ignored"] == {} and out["drained"] == []
    latest = {(r["gpu_uuid"], r["gi_id"], r["field"]): r for r in tel.latest(store, node="n1")}
    assert latest[(gpus[0].uuid, None, F.POWER_USAGE)]["value"] == 312.5
    assert latest[(gpus[2].uuid, 1, F.GR_ENGINE_ACTIVE)]["value"] == pytest.approx(0.6)
    assert latest[(gpus[2].uuid, 1, F.GR_ENGINE_ACTIVE)]["profile"] == "3g.40gb"
    # an XID 79 from NVML's event set reaches the server: the node is cordoned
    gpus[4].xids = [79]
    assert poster.tick(), poster.last_error
    assert poster.last["drained"][0]["gpu_uuid"] == gpus[4].uuid
    assert nodes_svc.get_node(store, SYSTEM, "n1").state is NodeState.CORDONED
    poster.stop()


def test_the_node_credential_posts_for_its_node_only(world) -> None:
    url, token, _store = world
    with ApiClient(url, token=token) as api:
        with pytest.raises(ApiError) as err:
            api.post("/api/v1/nodes/n2/telemetry", {"samples": []})
        assert err.value.status == 404
        with pytest.raises(ApiError) as err:
            api.post("/api/v1/nodes/n1/telemetry", {"samples": [{
                "gpu_uuid": "GPU-of-someone-else", "ts": datetime.now(UTC).isoformat(),
                "values": {F.POWER_USAGE: 1}}]})  # fmt: skip
        assert (err.value.status, err.value.code) == (422, "gpu_not_on_node")


DCGM = """\
# HELP DCGM_FI_DEV_POWER_USAGE Power draw (in W).
# TYPE DCGM_FI_DEV_POWER_USAGE gauge
DCGM_FI_DEV_POWER_USAGE{{gpu="0",UUID="{uuid}",Hostname="n1"}} 290.5
# TYPE DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION counter
DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION{{gpu="0",UUID="{uuid}",Hostname="n1"}} 123456
DCGM_FI_DEV_SM_CLOCK{{gpu="0",UUID="{uuid}",Hostname="n1"}} 1980
"""


@pytest.fixture
def exporter() -> Iterator[str]:
    """A stand-in dcgm-exporter: the text format over HTTP on loopback."""
    body = DCGM.format(uuid=h100_node()[0].uuid).encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/metrics"
    srv.shutdown()
    srv.server_close()


def test_agent_scrapes_dcgm_exporter(world, exporter: str) -> None:
    url, token, store = world
    poster = TelemetryPoster(url, token, "n1", None, telemetry_source(exporter), 15)
    assert poster.tick(), poster.last_error
    assert poster.last["accepted"] == 2  # the SM clock is not a field proofplane keeps
    fields = {r["field"]: r["value"] for r in tel.latest(store, node="n1")}
    assert fields == {F.POWER_USAGE: 290.5, F.TOTAL_ENERGY: 123456.0}


def test_collect_telemetry_prints_one_read(exporter: str) -> None:
    result = CliRunner().invoke(app, ["agent", "--collect-telemetry", "--dcgm-url", exporter,
                                      "--node", "n1"])  # fmt: skip
    assert result.exit_code == 0, result.output
    body = json.loads(result.stdout)
    assert body["simulated"] is False and len(body["samples"]) == 1
    assert body["samples"][0]["values"][F.POWER_USAGE] == 290.5
    # without a driver: a clear error, no traceback
    result = CliRunner().invoke(app, ["agent", "--collect-telemetry"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "telemetry" in result.output
