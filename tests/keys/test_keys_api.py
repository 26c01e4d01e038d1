"""The key inventory through the API and the CLI (issue 13, part 6): list and show with what
each key protects, create, rotate, rewrap in resumable batches, disable/enable; permissions
(a developer gets 403, an auditor reads), bad names 422, unknown keys 404, lifecycle events."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select
from typer.testing import CliRunner

from live_server import serve
from proofplane.access import Actor, Role
from proofplane.api.app import create_app
from proofplane.cli.main import app as cli_app
from proofplane.service import access as access_svc
from proofplane.service import keys as keys_svc
from proofplane.service.access import bootstrap_admin
from proofplane.service.context import Store
from proofplane.store import migrate
from proofplane.store.tables import EventRow, UserRow

ADMIN = "ppt_keys-api-admin-token-0123456789abcdef"
API = "/api/v1/keys"
runner = CliRunner()


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _token(store: Store, username: str, role: Role, tenants: frozenset[str]) -> str:
    actor = Actor(username, frozenset({role}), tenants, token_id="setup")
    issued = access_svc.issue_token(
        store, actor, roles=None, tenants=None, expires_in=3600, name="keys test"
    )
    return issued.token


@pytest.fixture
def world(tmp_path: Path) -> Iterator[tuple[Store, TestClient, dict[str, str]]]:
    """An admin, a developer and an auditor (tokens), and three users with TOTP seeds sealed
    under the ``secrets`` key (version 1)."""
    store = Store(f"sqlite:///{tmp_path / 'keys.db'}")
    migrate.upgrade(store.engine)
    bootstrap_admin(store, ADMIN)
    tokens = {"admin": ADMIN}
    with TestClient(create_app(store), raise_server_exceptions=False) as client:
        admin = _bearer(ADMIN)
        assert client.post("/api/v1/tenants", json={"name": "t1"}, headers=admin).is_success
        for name, role, tenants in (
            ("dev", Role.DEVELOPER, ["t1"]),
            ("aud", Role.AUDITOR, []),
            *((f"u{i}", Role.OPERATOR, []) for i in range(3)),
        ):
            body = {"username": name, "roles": [role], "tenants": tenants}
            assert client.post("/api/v1/users", json=body, headers=admin).status_code == 201
        tokens["dev"] = _token(store, "dev", Role.DEVELOPER, frozenset({"t1"}))
        tokens["aud"] = _token(store, "aud", Role.AUDITOR, frozenset())
        for i in range(3):
            access_svc.mfa_begin(store, Actor(f"u{i}", token_id="setup"))
        yield store, client, tokens
    store.dispose()


def _get(client: TestClient, path: str, token: str, **kw: Any) -> Any:
    return client.get(path, headers=_bearer(token), **kw)


def _post(client: TestClient, path: str, token: str, **kw: Any) -> Any:
    return client.post(path, headers=_bearer(token), **kw)


def test_list_and_show_say_what_each_key_protects(world: Any) -> None:
    store, client, tokens = world
    r = _get(client, API, tokens["aud"])  # auditors read the inventory
    assert r.status_code == 200, r.text
    (secrets,) = [k for k in r.json()["items"] if k["name"] == "secrets"]
    assert secrets["purpose"] == "encrypt" and secrets["backend"] == "local"
    assert secrets["current_version"] == 1 and secrets["disabled_at"] is None
    assert secrets["protects"]["users.totp_secret"] == 3 and secrets["protects"]["total"] == 3
    assert secrets["stale"] == 0 and secrets["operations"].get("encrypt", 0) >= 3
    assert [v["version"] for v in secrets["versions"]] == [1]
    one = _get(client, f"{API}/secrets", tokens["admin"]).json()
    assert one["protects"] == secrets["protects"]
    assert "handle" not in json.dumps(one)  # no key material, no handle


def test_permissions_names_and_unknown_keys(world: Any) -> None:
    _store, client, tokens = world
    for method, path, body in (
        ("GET", API, None),
        ("GET", f"{API}/secrets", None),
        ("POST", API, {"name": "k1", "purpose": "encrypt"}),
        ("POST", f"{API}/secrets/rotate", None),
        ("POST", f"{API}/secrets/rewrap", None),
        ("POST", f"{API}/secrets/disable", None),
    ):
        r = client.request(method, path, json=body, headers=_bearer(tokens["dev"]))
        assert r.status_code == 403, (method, path, r.text)
    assert _post(client, f"{API}/secrets/rotate", tokens["aud"]).status_code == 403
    assert client.get(API).status_code == 401
    for bad in ("Bad_Name", "-x", "a" * 64):
        r = _post(client, API, tokens["admin"], json={"name": bad, "purpose": "encrypt"})
        assert r.status_code == 422, (bad, r.text)
        assert _get(client, f"{API}/{bad}", tokens["admin"]).status_code == 422
    r = _post(client, API, tokens["admin"], json={"name": "k1", "purpose": "wrap"})
    assert r.status_code == 422
    r = _get(client, f"{API}/nope", tokens["admin"])
    assert r.status_code == 404 and r.json()["error"]["code"] == "key_not_found"
    for action in ("rotate", "rewrap", "disable", "enable"):
        r = _post(client, f"{API}/nope/{action}", tokens["admin"])
        assert r.status_code == 404, (action, r.text)
    r = _post(client, f"{API}/secrets/rewrap", tokens["admin"], params={"limit": 0})
    assert r.status_code == 422


def test_create_rotate_disable_enable_are_events(world: Any) -> None:
    store, client, tokens = world
    r = _post(client, API, tokens["admin"], json={"name": "k1", "purpose": "sign"})
    assert r.status_code == 201 and r.headers["location"] == f"{API}/k1"
    assert r.json()["algorithm"] == "ed25519" and len(r.json()["versions"][0]["public_key"]) == 64
    r = _post(client, API, tokens["admin"], json={"name": "k1", "purpose": "sign"})
    assert r.status_code == 409 and r.json()["error"]["code"] == "key_exists"
    r = _post(client, f"{API}/k1/rotate", tokens["admin"])
    assert r.status_code == 200 and r.json()["current_version"] == 2
    v1, v2 = r.json()["versions"]
    assert v1["retired_at"] is not None and v2["retired_at"] is None
    r = _post(client, f"{API}/k1/disable", tokens["admin"])
    assert r.status_code == 200 and r.json()["disabled_at"] is not None
    r = _post(client, f"{API}/k1/rotate", tokens["admin"])
    assert r.status_code == 409 and r.json()["error"]["code"] == "key_disabled"
    r = _post(client, f"{API}/k1/rewrap", tokens["admin"])
    assert r.status_code == 422 and r.json()["error"]["code"] == "key_wrong_purpose"
    assert _post(client, f"{API}/k1/enable", tokens["admin"]).json()["disabled_at"] is None
    with store.read() as s:
        rows = s.scalars(select(EventRow).where(EventRow.target_id == "k1")).all()
    assert [e.action for e in rows] == [
        "key.create", "key.rotate", "key.disable", "key.enable"
    ]  # fmt: skip


def test_rewrap_progresses_in_batches_until_done(world: Any) -> None:
    store, client, tokens = world
    assert _post(client, f"{API}/secrets/rotate", tokens["admin"]).status_code == 200
    key = _get(client, f"{API}/secrets", tokens["admin"]).json()
    assert key["current_version"] == 2 and key["stale"] == 3
    first = _post(client, f"{API}/secrets/rewrap", tokens["admin"], params={"limit": 2}).json()
    assert first == {"key": "secrets", "version": 2, "rewrapped": 2, "remaining": 1,
                     "done": False, "failed": []}  # fmt: skip
    second = _post(client, f"{API}/secrets/rewrap", tokens["admin"], params={"limit": 2}).json()
    assert (second["rewrapped"], second["remaining"], second["done"]) == (1, 0, True)
    again = _post(client, f"{API}/secrets/rewrap", tokens["admin"]).json()
    assert (again["rewrapped"], again["done"]) == (0, True)
    kms = keys_svc.kms_for(store)
    with store.read() as s:
        for row in s.scalars(select(UserRow).where(UserRow.totp_secret.is_not(None))):
            assert row.totp_secret.startswith("ppk1.secrets.2.")
            aad = keys_svc.secret_aad("users", row.id, "totp_secret")
            assert len(keys_svc.open_secret(kms, s, row.totp_secret, aad)) >= 16
        actions = [
            e.action for e in s.scalars(select(EventRow).where(EventRow.target_id == "secrets"))
        ]
    assert actions.count("key.rewrap") == 2  # one per batch that changed something


def test_the_cli_lists_shows_creates_rotates_rewraps_and_disables(world: Any) -> None:
    store, _client, _tokens = world
    with serve(store) as url:

        def cli(*args: str) -> Any:
            return runner.invoke(cli_app, ["--server", url, "--token", ADMIN, "keys", *args])

        listed = cli("list", "--json")
        assert listed.exit_code == 0, listed.output
        assert "secrets" in {k["name"] for k in json.loads(listed.stdout)["items"]}
        table = cli("list")
        assert table.exit_code == 0 and "secrets" in table.stdout
        created = cli("create", "k2", "--purpose", "encrypt", "--json")
        assert created.exit_code == 0 and json.loads(created.stdout)["name"] == "k2"
        assert cli("create", "k2", "--purpose", "encrypt").exit_code == 1
        shown = cli("show", "secrets")
        assert shown.exit_code == 0 and "users.totp_secret" in shown.stdout
        rotated = cli("rotate", "secrets")
        assert rotated.exit_code == 0 and "version 2" in rotated.stdout
        done = cli("rewrap", "secrets", "--batch", "1", "--json")
        assert done.exit_code == 0, done.output
        assert json.loads(done.stdout)["rewrapped"] == 3
        assert json.loads(done.stdout)["done"] is True
        disabled = cli("disable", "k2")
        assert disabled.exit_code == 0 and "disabled" in disabled.stdout
        assert cli("enable", "k2").exit_code == 0
        missing = cli("show", "nope")
        assert missing.exit_code == 1 and "not found" in missing.output
        assert "Traceback" not in missing.output
