"""``proofplane agent --apply-network`` against a real server: it registers its underlay,
fetches the node's desired state, applies it (or says why it could not) and reports; the
server then knows the node is under network management and whether it drifted.

Without root the agent's apply fails (no namespace to apply in) and that is what it reports:
a failed self-check, exit status 1. With root, a node namespace gets the state applied and
the round passes (exit 0), and a second one-shot run changes nothing."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

import netns
from dbtest import ADMIN_TOKEN
from live_server import serve
from proofplane.cli.main import app
from proofplane.service.context import Store

runner = CliRunner()
API = "/api/v1"


@pytest.fixture
def server(store: Store, client: TestClient) -> Iterator[tuple[str, TestClient]]:
    """A served API (and the admin's in-process client on the same store)."""
    with serve(store) as url:
        yield url, client


def _node(client: TestClient, name: str) -> str:
    body = {"name": name, "region": "eu", "zone": "eu-1",
            "gpus": [{"index": 0, "uuid": f"GPU-{name}-0", "model": "H100-80GB"}]}  # fmt: skip
    assert client.post(f"{API}/nodes", json=body).status_code == 201
    r = client.post(f"{API}/nodes/{name}/agent-credentials", json={"ttl_days": 1})
    assert r.status_code == 201, r.text
    return str(r.json()["token"])


def _agent(url: str, token: str, node: str, *extra: str) -> Any:
    return runner.invoke(
        app,
        ["agent", "--apply-network", "--once", "--json", "--server", url, "--token", token,
         "--node", node, *extra],
    )  # fmt: skip


def _status(client: TestClient, node: str) -> dict[str, Any]:
    items = client.get(f"{API}/network/nodes").json()["items"]
    return next(i for i in items if i["node"] == node)


def test_a_round_that_cannot_apply_reports_why(
    server: tuple[str, TestClient], tmp_path: Path
) -> None:
    url, client = server
    token = _node(client, "gpu-x")
    # no underlay registered and none given: the server cannot say what to apply
    res = _agent(url, token, "gpu-x", "--state-dir", str(tmp_path))
    assert res.exit_code == 1 and "network_underlay_unknown" in res.output

    # the agent registers its underlay; its namespace does not exist: nothing applied, and
    # the report says so
    res = _agent(url, token, "gpu-x", "--netns", "ppno-such-ns", "--underlay-dev", "ul0",
                 "--vtep", "10.250.0.77", "--state-dir", str(tmp_path))  # fmt: skip
    assert res.exit_code == 1, res.output
    out = json.loads(res.stdout)
    assert out["self_check"]["ok"] is False
    assert out["self_check"]["reasons"] == ["network_apply_failed"]
    assert out["generation"] == 0  # nothing applied yet
    st = _status(client, "gpu-x")
    assert st["vtep"] == "10.250.0.77" and st["managed"] is True
    assert st["network_drift"] is True and "self_check_failed" in st["drift"]


def test_an_unknown_node_or_a_wrong_credential_is_refused(
    server: tuple[str, TestClient], tmp_path: Path
) -> None:
    url, client = server
    token = _node(client, "gpu-y")
    res = _agent(url, token, "gpu-z", "--state-dir", str(tmp_path))
    assert res.exit_code == 1
    res = _agent(url, ADMIN_TOKEN[:-4] + "zzzz", "gpu-y", "--state-dir", str(tmp_path))
    assert res.exit_code == 1


def test_a_round_in_a_node_namespace_passes_and_the_next_changes_nothing(
    server: tuple[str, TestClient], tmp_path: Path
) -> None:
    netns.require()
    url, client = server
    token = _node(client, "gpu-n")
    with netns.lab() as lab:
        (n,) = lab.underlay(1)
        args = ("--netns", n.netns, "--underlay-dev", "ul0", "--state-dir", str(tmp_path))
        res = _agent(url, token, "gpu-n", *args)  # the VTEP read from ul0
        assert res.exit_code == 0, res.output
        first = json.loads(res.stdout)
        assert first["self_check"]["ok"] is True and first["changes"]["ruleset"] == 1
        st = _status(client, "gpu-n")
        assert st["vtep"] == n.vtep and st["network_drift"] is False
        assert st["ruleset_sha256"] == st["expected_ruleset_sha256"]

        res = _agent(url, token, "gpu-n", *args)
        assert res.exit_code == 0, res.output
        assert not any(json.loads(res.stdout)["changes"].values())
