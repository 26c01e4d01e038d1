"""With change control on (PROOFPLANE_CHANGE_CONTROL=enforce, serve's and up's default) the
direct governed calls answer 409 change_request_required with the change request that would do
them, and write nothing; safety moves (quarantine, cordon) stay immediate; /readyz says which
mode the server is in."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from proofplane.access import SYSTEM
from proofplane.api.app import create_app
from proofplane.config import Settings, from_env
from proofplane.errors import ValidationFailed
from proofplane.hardware.cluster_file import parse_cluster
from proofplane.service import changes as changes_svc
from proofplane.service.access import bootstrap_admin
from proofplane.service.cluster import load_cluster
from proofplane.service.context import Store
from proofplane.store import migrate
from proofplane.store.tables import EventRow

TOKEN = "ppt_change-control-admin-0123456789ab"
API = "/api/v1"


@pytest.fixture
def store(tmp_path: Path) -> Store:
    from dbtest import demo_text

    s = Store(f"sqlite:///{tmp_path / 'gov.db'}")
    migrate.upgrade(s.engine)
    load_cluster(s, SYSTEM, parse_cluster(demo_text()))
    bootstrap_admin(s, TOKEN)
    return s


def _client(store: Store, control: str) -> Iterator[TestClient]:
    app = create_app(store, Settings(change_control=control, cookie_secure=False))
    with TestClient(app, raise_server_exceptions=False,
                    headers={"Authorization": f"Bearer {TOKEN}"}) as c:  # fmt: skip
        yield c


@pytest.fixture
def enforced(store: Store) -> Iterator[TestClient]:
    yield from _client(store, "enforce")


def _seq(store: Store) -> int:
    with store.read() as session:
        return session.query(EventRow).count()


def _a_node(client: TestClient, state: str = "admitted") -> str:
    nodes = client.get(f"{API}/nodes", params={"limit": 200}).json()["items"]
    return next(n["name"] for n in nodes if n["state"] == state)


def test_governed_direct_calls_answer_409_with_the_change_that_would_do_them(
    store: Store, enforced: TestClient
) -> None:
    node = _a_node(enforced)
    calls = [
        ("post", f"{API}/nodes/{node}/certifications", {"key": "pci", "value": "true"},
         "certification.grant", {"node": node, "key": "pci", "value": "true"}),
        ("delete", f"{API}/nodes/{node}/certifications/hipaa", None,
         "certification.revoke", {"node": node, "key": "hipaa"}),
        ("put", f"{API}/attestation/policy", {"policy": {"node_class": "gpu"}, "enforce": True},
         "attestation.policy", {"node_class": "gpu", "policy": {"node_class": "gpu"},
                                "enforce": True}),
        ("put", f"{API}/tenants/nordbank/quota", {"gpus": 4, "mig_slices": None},
         "quota.set", {"tenant": "nordbank", "gpus": 4, "mig_slices": None}),
        ("post", f"{API}/nodes/{node}/state", {"state": "decommissioned", "reason": "eol"},
         "node.decommission", {"node": node, "reason": "eol"}),
    ]  # fmt: skip
    for method, url, body, change_type, payload in calls:
        before = _seq(store)
        kwargs = {"json": body} if body is not None else {}
        r = getattr(enforced, method)(url, **kwargs)
        assert r.status_code == 409, (url, r.text)
        error = r.json()["error"]
        assert error["code"] == "change_request_required"
        change = error["details"]["change"]
        assert (change["type"], change["payload"]) == (change_type, payload)
        assert _seq(store) == before  # nothing written
        # the body it names is a valid change request
        made = changes_svc.create_change(store, SYSTEM, change["type"], change["payload"])
        assert made["state"] == "pending"
    r = enforced.patch(f"{API}/tenants/nordbank",
                       json={"profile": {"required_tags": {"pci-dss": "true"}}})  # fmt: skip
    assert (
        r.status_code == 409 and r.json()["error"]["details"]["change"]["type"] == "tenant.profile"
    )
    # a description alone is not governed
    assert (
        enforced.patch(f"{API}/tenants/nordbank", json={"description": "bank"}).status_code == 200
    )


def test_safety_moves_stay_immediate_and_lifting_a_quarantine_is_governed(
    enforced: TestClient,
) -> None:
    node = _a_node(enforced)
    r = enforced.post(f"{API}/nodes/{node}/state", json={"state": "quarantined", "reason": "x"})
    assert r.status_code == 200
    back = enforced.post(f"{API}/nodes/{node}/state", json={"state": "admitted", "reason": "ok"})
    assert back.status_code == 409
    assert back.json()["error"]["details"]["change"]["type"] == "node.readmit"
    other = _a_node(enforced)
    url = f"{API}/nodes/{other}/state"
    assert enforced.post(url, json={"state": "cordoned", "reason": "maint"}).status_code == 200
    assert enforced.post(url, json={"state": "admitted", "reason": "done"}).status_code == 200


def test_readyz_says_the_mode_and_off_lets_direct_calls_through(store: Store) -> None:
    for control in ("enforce", "off"):
        for client in _client(store, control):
            ready = client.get("/readyz").json()
            assert ready["change_control"] == control
            node = _a_node(client)
            r = client.post(f"{API}/nodes/{node}/certifications", json={"key": "k", "value": "v"})
            assert r.status_code == (409 if control == "enforce" else 200)


def test_the_setting() -> None:
    assert from_env({}).change_control == "enforce"  # serve's and up's default
    assert from_env({"PROOFPLANE_CHANGE_CONTROL": "off"}).change_control == "off"
    with pytest.raises(ValidationFailed) as bad:
        from_env({"PROOFPLANE_CHANGE_CONTROL": "maybe"})
    assert bad.value.code == "invalid_setting"
    assert Settings().change_control == "off"
