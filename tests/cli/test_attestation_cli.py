"""The attestation commands end to end: a real server, a real swtpm, ``proofplane agent --once``,
``attest policy set|show``, ``nodes attest``, ``nodes evidence --save`` and ``attest replay``.
Without swtpm/tpm2-tools: skipped locally, failed in CI (CI=true)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ci import unavailable
from live_server import free_port, serve
from proofplane.cli.main import app
from proofplane.service.access import bootstrap_admin
from proofplane.service.context import Store
from proofplane.store import migrate
from swtpm import (
    AK_HANDLES,
    INVENTORY,
    SwtpmNode,
    boot_log,
    golden_policy,
    manufacture,
    measure,
    missing_tools,
    node_body,
)

ADMIN = "ppt_attestation-cli-admin-0123456789"
runner = CliRunner()


@pytest.fixture
def tpm(tmp_path: Path) -> Iterator[SwtpmNode]:
    missing = missing_tools()
    if missing:
        msg = f"swtpm/tpm2-tools missing: {', '.join(missing)} (scripts/test-deps.sh installs them)"
        unavailable(msg)
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
    with serve(store) as url:
        yield url


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
        "--tcti", tpm.tcti, "--ak-handle", AK_HANDLES["ecc"],
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


def _agent_args(server: str, token: str, tmp_path: Path, tcti: str, *extra: str) -> list[str]:
    (tmp_path / "inv.json").write_text(json.dumps(INVENTORY))
    return [
        "agent", "--server", server, "--token", token, "--node", "gpu-a", "--tcti", tcti,
        "--eventlog", str(tmp_path / "boot.bin"), "--inventory", str(tmp_path / "inv.json"),
        *extra,
    ]  # fmt: skip


def test_agent_once_without_a_reachable_tpm_is_a_clear_error(
    server: str, tpm: SwtpmNode, tmp_path: Path
) -> None:
    """The real tpm2-tools against a TCTI where no TPM answers: exit 1 naming the tool, no
    traceback, and the node is still registered, not enrolled."""
    (tmp_path / "boot.bin").write_bytes(boot_log())
    (tmp_path / "node.json").write_text(json.dumps(node_body("gpu-a")))
    run(server, "nodes", "register", "-f", str(tmp_path / "node.json"))
    token = json.loads(run(server, "nodes", "agent-credential", "gpu-a", "--json"))["token"]
    dead = free_port()  # nothing listens there
    args = _agent_args(server, token, tmp_path, f"swtpm:host=127.0.0.1,port={dead}", "--once")
    result = runner.invoke(app, args)
    assert result.exit_code == 1, (result.output, result.exception)
    assert "proofplane agent: tpm2_readpublic" in result.stderr
    assert "Traceback" not in result.output
    status = json.loads(run(server, "nodes", "attest", "gpu-a", "--json"))
    assert status["state"] == "registered" and status["latest"] is None


def test_a_long_running_agent_rides_out_transient_failures(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Without --once the agent keeps attesting through a TPM tool failure, an unreachable
    server and a server error (each said on stderr, next round after --interval), and exits
    on an error that needs an operator (a revoked credential: 401)."""
    from proofplane.agent.tpm.tpm2tools import TpmToolError
    from proofplane.cli import agent as agent_mod
    from proofplane.cli.client import ApiError, ServerUnreachable

    accepted = {"verdict": {"ok": True, "reasons": []}, "state": "admitted"}
    script: list[Any] = [
        TpmToolError("tpm2_quote failed (1): TPM busy"),
        ServerUnreachable("http://cp.example:8470", "connection refused"),
        ApiError(503, "unavailable", "database is restarting"),
        accepted,
        ApiError(401, "unauthenticated", "the agent credential was revoked"),
        AssertionError("the agent went on after a 401"),
    ]
    calls: list[dict[str, Any]] = []

    def fake_round(api: Any, node: str, tpm: Any, **kw: Any) -> dict[str, Any]:
        calls.append(kw)
        step = script.pop(0)
        if isinstance(step, BaseException):
            raise step
        return step  # type: ignore[no-any-return]

    sleeps: list[float] = []
    monkeypatch.setattr(agent_mod, "attest_once", fake_round)
    monkeypatch.setattr(agent_mod.time, "sleep", sleeps.append)
    (tmp_path / "boot.bin").write_bytes(b"")
    args = _agent_args("http://cp.example:8470", "ppa_x", tmp_path, "device:/dev/null",
                       "--interval", "7")  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 1, (result.output, result.exception)
    assert len(calls) == 5 and sleeps == [7.0] * 4
    err = result.stderr
    assert "proofplane agent: tpm2_quote failed (1): TPM busy; next round in 7 s" in err
    assert "cannot reach the proofplane server" in err and "database is restarting" in err
    assert "node gpu-a: attestation accepted; state admitted" in result.stdout
    assert "the agent credential was revoked" in err and "Traceback" not in result.output
    assert isinstance(script[0], AssertionError)  # nothing ran after the 401


def test_agent_once_stops_at_the_first_transient_failure(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from proofplane.cli import agent as agent_mod
    from proofplane.cli.client import ServerUnreachable

    def down(*a: Any, **kw: Any) -> dict[str, Any]:
        raise ServerUnreachable("http://cp.example:8470", "connection refused")

    monkeypatch.setattr(agent_mod, "attest_once", down)
    monkeypatch.setattr(agent_mod.time, "sleep", lambda s: pytest.fail("--once must not wait"))
    (tmp_path / "boot.bin").write_bytes(b"")
    args = _agent_args("http://cp.example:8470", "ppa_x", tmp_path, "device:/dev/null", "--once")
    result = runner.invoke(app, args)
    assert result.exit_code == 3 and "cannot reach the proofplane server" in result.stderr
