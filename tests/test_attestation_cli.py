"""The attestation commands end to end: a real server, a real swtpm, ``proofplane agent --once``,
``attest policy set|show``, ``nodes attest``, ``nodes evidence --save`` and ``attest replay``.
Without swtpm/tpm2-tools: skipped locally, failed in CI (CI=true)."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn
from typer.testing import CliRunner

from proofplane.api.app import create_app
from proofplane.cli.main import app
from proofplane.config import Settings
from proofplane.service.access import bootstrap_admin
from proofplane.service.context import Store
from proofplane.store import migrate
from swtpm import AK_HANDLES, SwtpmNode, boot_log, manufacture, measure, missing_tools
from test_attestation_swtpm import INVENTORY, golden_policy, node_body

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
ADMIN = "ppt_attestation-cli-admin-0123456789"
runner = CliRunner()


@pytest.fixture
def tpm(tmp_path: Path) -> Iterator[SwtpmNode]:
    missing = missing_tools()
    if missing:
        msg = f"swtpm/tpm2-tools missing: {', '.join(missing)} (scripts/test-deps.sh installs them)"
        if IN_CI:
            pytest.fail(msg)
        pytest.skip(msg)
    node = SwtpmNode.start(manufacture(tmp_path / "template"), tmp_path / "tpm")
    try:
        yield node
    finally:
        node.stop()


@pytest.fixture
def server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    for var in ("PROOFPLANE_SERVER", "PROOFPLANE_TOKEN", "PROOFPLANE_AGENT_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    store = Store(f"sqlite:///{tmp_path / 'cli.db'}")
    migrate.upgrade(store.engine)
    bootstrap_admin(store, ADMIN)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(
        uvicorn.Config(
            create_app(store, Settings(cookie_secure=False)),
            host="127.0.0.1",
            port=port,
            log_level="warning",
        )  # fmt: skip
    )
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while True:
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if not thread.is_alive() or time.monotonic() > deadline:
            pytest.fail("the test server did not start")
        time.sleep(0.05)
    yield url
    srv.should_exit = True
    thread.join(timeout=10)
    store.dispose()


def run(server: str, *args: str, code: int = 0) -> str:
    result = runner.invoke(app, ["--server", server, "--token", ADMIN, *args])
    assert result.exit_code == code, (result.exit_code, result.output, result.exception)
    assert "Traceback" not in result.output
    return result.stdout


def test_agent_round_and_commands(server: str, tpm: SwtpmNode, tmp_path: Path) -> None:
    log = boot_log()
    measure(tpm, log)
    (tmp_path / "boot.bin").write_bytes(log)
    (tmp_path / "inv.json").write_text(json.dumps(INVENTORY))
    (tmp_path / "node.json").write_text(json.dumps(node_body("gpu-a")))
    (tmp_path / "policy.json").write_text(json.dumps(golden_policy(log)))
    run(server, "nodes", "register", "-f", str(tmp_path / "node.json"))
    assert "enforced" in run(server, "attest", "policy", "set", str(tmp_path / "policy.json"))
    shown = json.loads(run(server, "attest", "policy", "show", "--json"))
    assert shown["items"][0]["policy"]["id"] == "h100-golden"
    token = json.loads(run(server, "nodes", "agent-credential", "gpu-a", "--json"))["token"]

    agent = [
        "agent", "--server", server, "--token", token, "--node", "gpu-a",
        "--tcti", tpm.env["TPM2TOOLS_TCTI"], "--ak-handle", AK_HANDLES["ecc"],
        "--eventlog", str(tmp_path / "boot.bin"), "--inventory", str(tmp_path / "inv.json"),
        "--once",
    ]  # fmt: skip
    result = runner.invoke(app, agent)
    assert result.exit_code == 0, (result.output, result.exception)
    assert "attestation accepted; state admitted" in result.stdout

    status = json.loads(run(server, "nodes", "attest", "gpu-a", "--json"))
    assert status["state"] == "admitted" and status["latest"]["ok"]
    assert "ACCEPTED" in run(server, "nodes", "attest", "gpu-a")

    # drift: the next round is rejected (exit 1) and the node quarantined
    tpm.extend([(4, {"sha1": b"\x01" * 20, "sha256": b"\x01" * 32})])
    result = runner.invoke(app, agent)
    assert result.exit_code == 1 and "REJECTED" in result.stdout, result.output
    assert "pcr_policy_violation" in run(server, "nodes", "attest", "gpu-a")

    rec = tmp_path / "rec.json"
    listing = run(server, "nodes", "evidence", "gpu-a", "--save", str(rec))
    assert "REJECTED" in listing and " ok " in listing
    out = runner.invoke(app, ["attest", "replay", str(rec)])  # offline: same rejection
    assert out.exit_code == 1 and "pcr_policy_violation" in out.stdout, out.output
