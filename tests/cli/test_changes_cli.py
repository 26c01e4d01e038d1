"""The CLI under change control against a live server (issue 12): ``nodes certify`` and ``keys
destroy`` request the governed change and print its id; ``changes rules list|set`` (a rule
change is itself a governed change under enforce, direct with control off)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from live_server import serve
from proofplane.access import SYSTEM, Actor, Role
from proofplane.cli.main import app as cli_app
from proofplane.config import Settings
from proofplane.model import Gpu, Node, NodeState
from proofplane.service import changes as svc
from proofplane.service import key_inventory as inventory
from proofplane.service.access import create_user, issue_token
from proofplane.service.context import Store
from proofplane.service.nodes import get_node, register_node, set_node_state
from proofplane.store import migrate

runner = CliRunner()
ADMIN = Actor("alice", frozenset({Role.ADMIN}), token_id="setup")


def _store(path: Path) -> tuple[Store, str]:
    store = Store(f"sqlite:///{path}")
    migrate.upgrade(store.engine)
    register_node(
        store, SYSTEM, Node("gpu-01", "r1", "z1", gpus=(Gpu(0, "GPU-1", "H100-80GB", 81920),))
    )
    set_node_state(store, SYSTEM, "gpu-01", NodeState.ADMITTED, "test")
    create_user(store, SYSTEM, "alice", None, ["admin"], [])
    token = issue_token(store, ADMIN, roles=None, tenants=None, expires_in=3600).token
    inventory.create_key(store, ADMIN, "k1", "encrypt")
    inventory.rotate_key(store, ADMIN, "k1")
    return store, token


@pytest.fixture(params=["enforce", "off"])
def live(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, str, Store, str]]:
    store, token = _store(tmp_path / "cli.db")
    settings = Settings(cookie_secure=False, change_control=request.param)
    with serve(store, settings) as url:
        yield url, token, store, request.param
    store.dispose()


def cli(live: tuple[str, str, Store, str], *args: str) -> Any:
    url, token, _, _ = live
    result = runner.invoke(cli_app, ["--server", url, "--token", token, *args])
    assert result.exit_code == 0, (result.exit_code, result.output, result.exception)
    return result.stdout


def test_governed_commands_request_the_change_under_enforce(
    live: tuple[str, str, Store, str],
) -> None:
    _, _, store, control = live
    certify = cli(live, "nodes", "certify", "gpu-01", "hipaa=true")
    destroy = cli(live, "keys", "destroy", "k1", "1")
    rule = cli(live, "changes", "rules", "set", "quota.set", "--approvals", "2",
               "--role", "admin", "--role", "security-officer")  # fmt: skip
    changes = {c["type"]: c for c in svc.list_changes(store, SYSTEM)}
    if control == "enforce":
        for out, kind in ((certify, "certification.grant"), (destroy, "key.destroy"),
                          (rule, "change.rules")):  # fmt: skip
            found = re.search(r"change (\d+) \(" + re.escape(kind) + r"\) requested", out)
            assert found, out
            assert changes[kind]["id"] == int(found.group(1))
            assert changes[kind]["state"] == "pending"
        assert changes["key.destroy"]["payload"] == {"key": "k1", "version": 1}
        assert get_node(store, SYSTEM, "gpu-01").certifications == {}
    else:
        assert changes == {}
        assert get_node(store, SYSTEM, "gpu-01").certifications == {"hipaa": "true"}
        assert "version 1 destroyed" in destroy
        assert "quota.set now needs 2 approval(s) from admin, security-officer" in rule
    listed = json.loads(cli(live, "changes", "rules", "list", "--json"))["items"]
    quota = next(r for r in listed if r["type"] == "quota.set")
    assert quota["approvals"] == (1 if control == "enforce" else 2)
    assert "key.destroy" in cli(live, "changes", "rules", "list")
