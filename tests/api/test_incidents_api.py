"""Incidents through the API (issue 12, §9): POST opens one on an attested node (quarantined,
its work moved), the downloaded bundle verifies with ``proofplane audit verify-bundle`` and its
attestation records replay with ``proofplane attest replay``; PATCH moves forward only, closing
needs the post-mortem; GET shows the timeline; a developer gets 403; bad input gets a 4xx and
changes nothing. Then the ``proofplane incident`` commands against a live server."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from live_server import serve
from proofplane.access import SYSTEM, Actor, Role
from proofplane.attest.simulate import SimulatedAttester, demo_boot_log
from proofplane.cli.main import app as cli
from proofplane.model import Gpu, Node
from proofplane.service import access as access_svc
from proofplane.service import attestation as att
from proofplane.service.access import bootstrap_admin
from proofplane.service.context import Store
from proofplane.service.nodes import register_node
from proofplane.store import migrate

API = "/api/v1"
ADMIN = "ppt_incident-cli-admin-token-0123456789"
POLICY = {
    "id": "p",
    "node_class": "default",
    "require_eventlog": False,
    "require_secure_boot": False,
    "require_inventory": False,
}
runner = CliRunner()


def _attested(store: Store, name: str) -> None:
    register_node(
        store, SYSTEM, Node(name, "r1", "z1", gpus=(Gpu(0, f"GPU-{name}", "H100-80GB", 81920),))
    )
    att.set_policy(store, SYSTEM, POLICY, enforce=True)
    a = SimulatedAttester.create()
    agent = Actor(f"node:{name}")
    ch = att.enroll(
        store, agent, name, a.ek_public, a.ak_public, simulated=True, allow_simulated=True
    )
    att.activate(store, agent, name, a.activate(ch.credential))
    a.boot(demo_boot_log(b"kernel"))
    nonce = att.issue_nonce(store, agent, name)
    evidence = a.evidence(nonce.nonce, list(nonce.pcrs))
    out = att.submit_evidence(store, agent, name, nonce.nonce, evidence, allow_simulated=True)
    assert out.verdict["ok"]


def _setup(client: TestClient, store: Store) -> None:
    """n1 and n2 attested and certified tier=gold, tenant acme's w1 placed on n1."""
    for name in ("n1", "n2"):
        _attested(store, name)
        body = {"key": "tier", "value": "gold"}
        client.post(f"{API}/nodes/{name}/certifications", json=body).raise_for_status()
    client.post(f"{API}/nodes/n2/state", json={"state": "cordoned"}).raise_for_status()
    client.post(f"{API}/tenants", json={"name": "acme"}).raise_for_status()
    wl: dict[str, Any] = {"name": "w1", "tenant": "acme", "tags": {"tier": "gold"},
                          "gpus": {"count": 1}}  # fmt: skip
    placed = client.post(f"{API}/workloads", json=wl)
    assert placed.status_code == 201 and placed.json()["placement"]["node"] == "n1"
    client.post(f"{API}/nodes/n2/state", json={"state": "admitted"}).raise_for_status()


def _token(
    client: TestClient, store: Store, username: str, role: Role, tenants: frozenset[str]
) -> str:
    user = {"username": username, "roles": [role.value], "tenants": sorted(tenants)}
    client.post(f"{API}/users", json=user).raise_for_status()
    actor = Actor(username, frozenset({role}), tenants, token_id="setup")
    issued = access_svc.issue_token(
        store, actor, roles=None, tenants=None, expires_in=3600, name="incident test"
    )
    return issued.token


def test_open_download_verify_replay_and_move(
    client: TestClient, store: Store, tmp_path: Path
) -> None:
    _setup(client, store)
    r = client.post(
        f"{API}/incidents",
        json={"subject": "n1", "reason": "PCR drift", "severity": "critical", "owner": "alice"},
    )
    assert r.status_code == 201, r.text
    inc = r.json()
    assert r.headers["location"] == f"{API}/incidents/{inc['id']}"
    assert (inc["state"], inc["subject_type"], inc["owner"]) == ("open", "node", "alice")
    assert [e["action"] for e in inc["timeline"]] == ["incident.open"]
    assert client.get(f"{API}/nodes/n1").json()["state"] == "quarantined"
    assert client.get(f"{API}/workloads/w1").json()["placement"]["node"] == "n2"

    got = client.get(f"{API}/incidents/{inc['id']}/bundle")
    assert got.status_code == 200 and got.headers["content-type"] == "application/json"
    digest = hashlib.sha256(got.content).hexdigest()
    assert digest == got.headers["x-content-sha256"] == inc["bundle_sha256"]
    path = tmp_path / "bundle.json"
    path.write_bytes(got.content)
    out = runner.invoke(cli, ["audit", "verify-bundle", str(path)])
    assert out.exit_code == 0 and out.output.startswith("ok: "), out.output
    records = json.loads(got.content)["incident"]["attestation"]
    assert records and all(r["ok"] for r in records)
    rec = tmp_path / "record.json"
    rec.write_text(json.dumps(records[-1]["record"]))
    out = runner.invoke(cli, ["attest", "replay", str(rec)])
    assert out.exit_code == 0 and "ACCEPTED" in out.output, out.output

    iid = inc["id"]
    r = client.patch(f"{API}/incidents/{iid}", json={"state": "contained", "note": "isolated"})
    assert r.status_code == 200 and r.json()["state"] == "contained"
    for body, code in (
        ({"state": "open"}, "invalid_transition"),
        ({"state": "contained"}, "invalid_transition"),
        ({"state": "closed"}, "postmortem_required"),
    ):
        r = client.patch(f"{API}/incidents/{iid}", json=body)
        assert r.status_code == 409 and r.json()["error"]["code"] == code, r.text
    r = client.patch(f"{API}/incidents/{iid}", json={"state": "resolved", "severity": "medium"})
    assert r.status_code == 200 and r.json()["severity"] == "medium"
    assert client.post(f"{API}/incidents/{iid}/close", json={}).status_code == 422
    assert client.post(f"{API}/incidents/{iid}/close", json={"postmortem": ""}).status_code == 422
    r = client.post(f"{API}/incidents/{iid}/close", json={"postmortem": "a rogue boot loader"})
    assert r.status_code == 200 and r.json()["state"] == "closed"
    r = client.post(f"{API}/incidents/{iid}/close", json={"postmortem": "again"})
    assert r.status_code == 409 and r.json()["error"]["code"] == "invalid_transition"

    shown = client.get(f"{API}/incidents/{iid}").json()
    assert [e["action"] for e in shown["timeline"]] == [
        "incident.open",
        "incident.update",
        "incident.update",
        "incident.close",
    ]
    assert shown["postmortem"] == "a rogue boot loader" and shown["closed_at"]
    listed = client.get(f"{API}/incidents", params={"state": "closed"}).json()
    assert [i["id"] for i in listed["items"]] == [iid] and listed["items"][0]["timeline"] is None
    assert client.get(f"{API}/incidents", params={"state": "open"}).json()["items"] == []


def test_permissions_and_bad_input(client: TestClient, store: Store) -> None:
    _setup(client, store)
    dev_token = _token(client, store, "dev", Role.DEVELOPER, frozenset({"acme"}))
    dev = {"Authorization": f"Bearer {dev_token}"}
    aud = {"Authorization": f"Bearer {_token(client, store, 'aud', Role.AUDITOR, frozenset())}"}
    body = {"subject": "n1", "reason": "x"}
    for method, path, payload in (
        ("POST", f"{API}/incidents", body),
        ("GET", f"{API}/incidents", None),
        ("GET", f"{API}/incidents/1", None),
        ("GET", f"{API}/incidents/1/bundle", None),
        ("PATCH", f"{API}/incidents/1", {"note": "x"}),
        ("POST", f"{API}/incidents/1/close", {"postmortem": "x"}),
    ):
        r = client.request(method, path, json=payload, headers=dev)
        assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden", (path, r.text)
    r = client.post(f"{API}/incidents", json=body, headers=aud)  # auditors read, never act
    assert r.status_code == 403

    before = client.get(f"{API}/events", params={"limit": 500}).json()
    bad: list[tuple[Any, int]] = [
        ({"subject": "nope", "reason": "x"}, 404),
        ({"subject": "acme", "subject_type": "node", "reason": "x"}, 404),
        ({"subject": "n1", "reason": "x", "severity": "urgent"}, 422),
        ({"subject": "n1", "reason": ""}, 422),
        ({"subject": "n1"}, 422),
        ({"subject": "n1", "reason": "x", "extra": 1}, 422),
        ({"subject": "n1", "reason": "x", "subject_type": "gpu"}, 422),
        ({"subject": "n1" * 40, "reason": "x"}, 422),
        ({"subject": "n1", "reason": "x", "owner": "  "}, 422),
        ({"subject": "n1", "reason": "x" * 20_000}, 422),
        ([1, 2], 422),
    ]
    for payload, status in bad:
        r = client.post(f"{API}/incidents", json=payload)
        assert r.status_code == status, (payload, r.text)
        assert set(r.json()) == {"error"}
    for path in ("abc", "0", "-1", str(2**64)):
        assert client.get(f"{API}/incidents/{path}").status_code == 422
    assert client.get(f"{API}/incidents/99").status_code == 404
    assert client.get(f"{API}/incidents/99/bundle").status_code == 404
    assert client.patch(f"{API}/incidents/99", json={"note": "x"}).status_code == 404
    assert client.get(f"{API}/incidents", params={"state": "done"}).status_code == 422
    assert client.get(f"{API}/incidents", params={"limit": 0}).status_code == 422
    assert client.get(f"{API}/incidents", params={"cursor": "garbage"}).status_code == 422
    after = client.get(f"{API}/events", params={"limit": 500}).json()
    assert len(after["items"]) == len(before["items"])  # nothing written
    assert client.get(f"{API}/nodes/n1").json()["state"] == "admitted"

    # a decommissioned node cannot be quarantined: no incident either
    client.post(f"{API}/nodes/n2/state", json={"state": "decommissioned"}).raise_for_status()
    r = client.post(f"{API}/incidents", json={"subject": "n2", "reason": "x"})
    assert r.status_code == 409 and r.json()["error"]["code"] == "invalid_transition"
    assert client.get(f"{API}/incidents").json()["items"] == []

    # a tenant incident: nothing quarantined; then an empty PATCH is refused
    r = client.post(f"{API}/incidents", json={"subject": "acme", "reason": "breakout?"})
    assert r.status_code == 201 and r.json()["subject_type"] == "tenant"
    assert client.get(f"{API}/nodes/n1").json()["state"] == "admitted"
    iid = r.json()["id"]
    r = client.patch(f"{API}/incidents/{iid}", json={})
    assert r.status_code == 422 and r.json()["error"]["code"] == "empty_update"
    r = client.get(f"{API}/incidents/{iid}", headers=aud)
    assert r.status_code == 200 and r.json()["timeline"][0]["action"] == "incident.open"


@pytest.fixture
def server(tmp_path: Path) -> object:
    store = Store(f"sqlite:///{tmp_path / 'cli.db'}")
    migrate.upgrade(store.engine)
    bootstrap_admin(store, ADMIN)
    with serve(store) as url:
        headers = {"Authorization": f"Bearer {ADMIN}"}
        import httpx

        with httpx.Client(base_url=url, headers=headers) as c:
            _setup(c, store)  # type: ignore[arg-type]
        yield url


def _run(server: str, *args: str, code: int = 0) -> str:
    result = runner.invoke(cli, ["--server", server, "--token", ADMIN, *args])
    assert result.exit_code == code, (result.exit_code, result.output, result.exception)
    assert "Traceback" not in result.output
    return result.output


def test_incident_commands(server: str, tmp_path: Path) -> None:
    out = _run(server, "incident", "open", "n1", "--reason", "PCR drift", "--severity", "high")
    assert "incident 1 opened on node/n1" in out and "quarantined" in out
    out = _run(server, "incident", "list", "--state", "open")
    assert "node/n1" in out and "1 incident" in out
    bundle = tmp_path / "b.json"
    records = tmp_path / "records"
    out = _run(server, "incident", "bundle", "1", "-o", str(bundle), "--records", str(records))
    assert "wrote 1 attestation evidence record" in out
    assert _run(server, "audit", "verify-bundle", str(bundle)).startswith("ok: ")
    (record,) = records.iterdir()
    assert "ACCEPTED" in _run(server, "attest", "replay", str(record))
    _run(server, "incident", "update", "1", "--state", "contained", "--note", "isolated")
    out = _run(server, "incident", "update", "1", "--state", "open", code=1)
    assert "invalid_transition" in out or "only forward" in out
    _run(server, "incident", "update", "1", "--severity", "nope", code=2)
    _run(server, "incident", "close", "1", code=2)  # no post-mortem given
    _run(server, "incident", "close", "1", "--postmortem", "bad disk image")
    out = _run(server, "incident", "show", "1")
    for action in ("incident.open", "incident.update", "incident.close"):
        assert action in out
    shown = json.loads(_run(server, "incident", "show", "1", "--json"))
    assert shown["state"] == "closed" and shown["postmortem"] == "bad disk image"
    out = _run(server, "incident", "open", "nope", "--reason", "x", code=1)
    assert "not found" in out
