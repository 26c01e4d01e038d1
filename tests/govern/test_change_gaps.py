"""Change control, the gaps an audit found (issue 12): overdue emergency reviews alert from a
worker (an injected clock); approval rules are data, changed only through a governed
``change.rules`` change; ``mig.layout``, ``key.destroy`` (dual control) and ``node.reenroll``
types; every failed apply records its error; applies link their events to the change; a bad
runbook is refused when the change is asked for; the change-control mode is in the evidence;
the change TTL; tenant-admin approvals."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from proofplane.access import SYSTEM, Actor, Role
from proofplane.api.app import create_app
from proofplane.attest.simulate import SimulatedAttester, demo_boot_log
from proofplane.config import Settings, from_env
from proofplane.errors import Conflict, ProofplaneError, ValidationFailed
from proofplane.model import Gpu, GpuRequest, MigInstance, Node, NodeState, Tenant
from proofplane.service import attestation as att
from proofplane.service import changes as svc
from proofplane.service import key_inventory as inventory
from proofplane.service import runbooks as runbooks_svc
from proofplane.service.access import bootstrap_admin, create_user
from proofplane.service.access.mfa import seal_totp_seed
from proofplane.service.context import Store
from proofplane.service.decommission import decommission_node
from proofplane.service.incidents import get_bundle, open_incident
from proofplane.service.nodes import get_node, register_node, set_node_state
from proofplane.service.tenants import create_tenant, get_tenant
from proofplane.service.workloads import WorkloadSpec, get_workload, submit_workload
from proofplane.store import migrate
from proofplane.store.tables import EventRow, UserRow
from proofplane.workers.change_reviews import ReviewWorker

ALICE = Actor("alice", frozenset({Role.ADMIN}))
BOB = Actor("bob", frozenset({Role.ADMIN}))
CAROL = Actor("carol", frozenset({Role.ADMIN}))
SEC = Actor("sec", frozenset({Role.SECURITY_OFFICER}))
TOKEN = "ppt_change-gaps-admin-0123456789abcdef"
MIG_GPU = Gpu(1, "GPU-M", "H100-80GB", 81920, mig_enabled=True,
              mig_instances=(MigInstance("3g.40gb", 0), MigInstance("3g.40gb", 4)))  # fmt: skip
POLICY = {"id": "p", "node_class": "default", "require_eventlog": False,
          "require_secure_boot": False, "require_inventory": False}  # fmt: skip


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store(f"sqlite:///{tmp_path / 'gaps.db'}")
    migrate.upgrade(s.engine)
    gpus = (Gpu(0, "GPU-1", "H100-80GB", 81920), MIG_GPU)
    register_node(s, SYSTEM, Node("gpu-01", "r1", "z1", gpus=gpus))
    set_node_state(s, SYSTEM, "gpu-01", NodeState.ADMITTED, "test")
    create_tenant(s, SYSTEM, Tenant("t1"))
    create_tenant(s, SYSTEM, Tenant("t2"))
    yield s
    s.dispose()


def _events(store: Store, action: str) -> list[EventRow]:
    with store.read() as session:
        return list(
            session.scalars(
                select(EventRow).where(EventRow.action == action).order_by(EventRow.seq)
            )
        )


def _rule(store: Store, change_type: str) -> tuple[int, list[str]]:
    with store.read() as session:
        rule = svc.rule_for(session, change_type)
    return rule.approvals, list(rule.roles)


def _approved(store: Store, change_type: str, payload: dict[str, Any], *voters: Actor) -> int:
    change = svc.create_change(store, ALICE, change_type, payload, reason="test")
    for v in voters or (BOB, SEC):
        svc.vote(store, v, change["id"], "approve")
    assert svc.get_change(store, SYSTEM, change["id"])["state"] == "approved"
    return int(change["id"])


# --- 1. overdue emergency reviews ----------------------------------------------------------------


def test_an_overdue_emergency_review_alerts_hourly_from_the_worker(store: Store) -> None:
    t0 = datetime.now(UTC)
    change = svc.create_change(store, ALICE, "quota.set", {"tenant": "t1", "gpus": 2},
                               reason="incident", emergency=True,
                               review_within=timedelta(hours=2), now=t0)  # fmt: skip
    due = datetime.fromisoformat(change["review_due_at"])
    assert due == t0 + timedelta(hours=2)
    clock = [t0 + timedelta(hours=1)]
    worker = ReviewWorker(store, interval_s=60, now=lambda: clock[0])
    assert worker.run_once() == []  # not due yet: no event
    clock[0] = due + timedelta(minutes=1)
    assert worker.run_once() == [change["id"]]
    clock[0] = due + timedelta(minutes=40)
    assert worker.run_once() == []  # at most once an hour
    clock[0] = due + timedelta(minutes=62)
    assert worker.tick() and worker.alerted == [change["id"], change["id"]]
    alerts = _events(store, "alert.change_review_overdue")
    assert len(alerts) == 2 and alerts[0].target_id == str(change["id"])
    assert alerts[0].details["severity"] == "high"
    assert f"proofplane changes review {change['id']}" in alerts[0].details["next_step"]
    # once reviewed, nothing more
    svc.vote(store, BOB, change["id"], "review", now=clock[0])
    clock[0] = due + timedelta(hours=5)
    assert worker.run_once() == []


def test_the_overdue_alert_names_a_published_runbook(store: Store) -> None:
    text = ("---\nid: emergency-review\ntitle: Overdue emergency review\nversion: 1\n"
            'triggers: ["alert.change_review_overdue"]\n---\n\n1. Review it: '
            "`proofplane changes show`\n")  # fmt: skip
    with store.write(ALICE) as tx:
        runbooks_svc.publish_runbook(tx, text)
    t0 = datetime.now(UTC)
    svc.create_change(store, ALICE, "quota.set", {"tenant": "t1", "gpus": 2}, reason="r",
                      emergency=True, now=t0)  # fmt: skip
    svc.overdue_reviews(store, t0 + timedelta(hours=25))
    (alert,) = _events(store, "alert.change_review_overdue")
    assert alert.details["runbook"] == "emergency-review@v1"


def test_the_review_window_is_a_setting_and_the_app_runs_the_worker(store: Store) -> None:
    assert from_env({}).emergency_review_hours == 24.0
    assert from_env({"PROOFPLANE_EMERGENCY_REVIEW_HOURS": "4"}).emergency_review_hours == 4.0
    assert from_env({}).change_review_check_interval_s == 60.0
    for bad in ("x", "0", "-1", "nan", "100000"):
        with pytest.raises(ValidationFailed) as refused:
            from_env({"PROOFPLANE_EMERGENCY_REVIEW_HOURS": bad})
        assert refused.value.code == "invalid_setting"
        assert "PROOFPLANE_EMERGENCY_REVIEW_HOURS" in refused.value.message
    bootstrap_admin(store, TOKEN)
    settings = Settings(cookie_secure=False, emergency_review_hours=3.0,
                        change_review_check_interval_s=3600)  # fmt: skip
    app = create_app(store, settings)
    with TestClient(app, headers={"Authorization": f"Bearer {TOKEN}"}) as client:
        assert app.state.change_reviews is not None and app.state.change_reviews.running
        made = client.post("/api/v1/changes", json={
            "type": "quota.set", "payload": {"tenant": "t1", "gpus": 3}, "reason": "now",
            "emergency": True})  # fmt: skip
        assert made.status_code == 201, made.text
        body = made.json()
        applied = datetime.fromisoformat(body["applied_at"])
        assert datetime.fromisoformat(body["review_due_at"]) - applied == timedelta(hours=3)
    assert not app.state.change_reviews.running


# --- 2. approval rules as data -------------------------------------------------------------------


def test_rules_are_changed_through_a_governed_change(store: Store) -> None:
    assert _rule(store, "quota.set") == (1, ["admin", "security-officer",
                                                         "tenant-admin"])  # fmt: skip
    with pytest.raises(ProofplaneError) as auditor:
        svc.create_change(store, ALICE, "change.rules",
                          {"type": "quota.set", "approvals": 1, "roles": ["auditor"]})  # fmt: skip
    assert auditor.value.code == "invalid_rule"
    with pytest.raises(ProofplaneError) as unknown:
        svc.create_change(store, ALICE, "change.rules",
                          {"type": "nope", "approvals": 1, "roles": ["admin"]})  # fmt: skip
    assert unknown.value.code == "unknown_change_type"
    with pytest.raises(ProofplaneError) as zero:
        svc.create_change(store, ALICE, "change.rules",
                          {"type": "quota.set", "approvals": 0, "roles": ["admin"]})  # fmt: skip
    assert zero.value.code == "invalid_payload"
    ops = Actor("ops", frozenset({Role.OPERATOR}))
    with pytest.raises(ProofplaneError) as operator:
        svc.create_change(store, ops, "change.rules",
                          {"type": "quota.set", "approvals": 2, "roles": ["admin"]})  # fmt: skip
    assert operator.value.code == "forbidden"
    payload = {"type": "quota.set", "approvals": 2, "roles": ["admin", "security-officer"]}
    change = svc.create_change(store, ALICE, "change.rules", payload)
    svc.vote(store, BOB, change["id"], "approve")
    assert svc.get_change(store, SYSTEM, change["id"])["state"] == "pending"  # needs two
    svc.vote(store, SEC, change["id"], "approve")
    svc.apply_change(store, ALICE, change["id"])
    assert _rule(store, "quota.set") == (2, ["admin", "security-officer"])
    (event,) = _events(store, "change.rule.set")
    assert event.details["change_id"] == change["id"] and event.details["before"]["approvals"] == 1
    # the new rule holds: one approval no longer approves a quota change
    quota = svc.create_change(store, ALICE, "quota.set", {"tenant": "t1", "gpus": 1})
    assert svc.vote(store, BOB, quota["id"], "approve")["state"] == "pending"
    assert svc.vote(store, SEC, quota["id"], "approve")["state"] == "approved"
    listed = {r["type"]: r for r in svc.list_rules(store, SEC)}
    assert listed["quota.set"]["source"] == "set" and listed["quota.set"]["updated_by"] == "alice"
    assert listed["change.rules"]["approvals"] == 2 and listed["key.destroy"]["approvals"] == 2


def _client(store: Store, control: str) -> Iterator[TestClient]:
    bootstrap_admin(store, TOKEN)
    app = create_app(store, Settings(change_control=control, cookie_secure=False))
    with TestClient(app, raise_server_exceptions=False,
                    headers={"Authorization": f"Bearer {TOKEN}"}) as c:  # fmt: skip
        yield c


def test_the_rules_api(store: Store) -> None:
    for client in _client(store, "enforce"):
        rules = client.get("/api/v1/changes/rules").json()["items"]
        assert {r["type"] for r in rules} >= {"change.rules", "mig.layout", "key.destroy"}
        url = "/api/v1/changes/rules/quota.set"
        refused = client.put(url, json={"approvals": 1, "roles": ["auditor"]})
        assert refused.status_code == 422 and refused.json()["error"]["code"] == "invalid_rule"
        unknown = client.put(
            "/api/v1/changes/rules/nope", json={"approvals": 1, "roles": ["admin"]}
        )
        assert unknown.json()["error"]["code"] == "unknown_change_type"
        assert client.put(url, json={"approvals": 0, "roles": ["admin"]}).status_code == 422
        gated = client.put(url, json={"approvals": 2, "roles": ["admin"]})
        assert gated.status_code == 409
        assert gated.json()["error"]["code"] == "change_request_required"
        assert gated.json()["error"]["details"]["change"]["type"] == "change.rules"
    assert _events(store, "change.rule.set") == []
    for client in _client(store, "off"):
        done = client.put("/api/v1/changes/rules/quota.set",
                          json={"approvals": 2, "roles": ["admin"]})  # fmt: skip
        assert done.status_code == 200, done.text
        assert done.json()["approvals"] == 2
    assert _rule(store, "quota.set") == (2, ["admin"])
    assert len(_events(store, "change.rule.set")) == 1


# --- 3. mig.layout -------------------------------------------------------------------------------


def test_a_mig_layout_change_sets_the_layout_and_never_destroys_held_instances(
    store: Store,
) -> None:
    with pytest.raises(ValidationFailed) as bad:  # checked against the SKU when asked for
        svc.create_change(store, ALICE, "mig.layout",
                          {"node": "gpu-01", "gpu": 1,
                           "layout": ["7g.80gb@0", "1g.10gb@0"]})  # fmt: skip
    assert bad.value.code == "invalid_mig_layout"
    for start in ("1" * 5000, "007"):  # no memory slot has that many digits: refused, never a 500
        with pytest.raises(ValidationFailed) as huge:
            payload = {"node": "gpu-01", "gpu": 1, "layout": [f"1g.10gb@{start}"]}
            svc.create_change(store, ALICE, "mig.layout", payload)
        assert huge.value.code == "invalid_mig_layout"
    wl = submit_workload(store, SYSTEM, WorkloadSpec(
        "w", "t1", gpus=GpuRequest(count=1, mig_profile="3g.40gb")))  # fmt: skip
    assert wl.placement is not None
    (device,) = wl.placement.devices
    held = device.mig_start
    cid = _approved(store, "mig.layout", {"node": "gpu-01", "gpu": 1, "layout": ["7g.80gb@0"]})
    with pytest.raises(Conflict) as busy:
        svc.apply_change(store, ALICE, cid)
    assert busy.value.code == "mig_instances_in_use"
    assert busy.value.details["held"] == [{"workload": "t1/w", "holds": f"3g.40gb@{held}"}]
    after = svc.get_change(store, SYSTEM, cid)
    assert after["state"] == "approved" and after["error"].startswith("mig_instances_in_use")
    keep = [f"3g.40gb@{held}", "1g.10gb@0" if held == 4 else "1g.10gb@4"]
    cid = _approved(store, "mig.layout", {"node": "gpu-01", "gpu": 1, "layout": keep})
    svc.apply_change(store, ALICE, cid)
    gpu = next(g for g in get_node(store, SYSTEM, "gpu-01").gpus if g.index == 1)
    assert sorted(f"{i.profile}@{i.start}" for i in gpu.mig_instances) == sorted(keep)
    (event,) = _events(store, "node.gpu.layout")
    assert event.details["change_id"] == cid and event.details["after"] == sorted(
        keep, key=lambda x: int(x.split("@")[1])
    )
    assert get_workload(store, SYSTEM, "w", tenant="t1").placement is not None


# --- 4. a failed apply records every error -------------------------------------------------------


def test_a_conflicting_apply_is_recorded_and_the_change_stays_approved(store: Store) -> None:
    first = _approved(store, "node.decommission", {"node": "gpu-01", "reason": "eol"})
    second = _approved(store, "node.decommission", {"node": "gpu-01", "reason": "eol again"})
    svc.apply_change(store, ALICE, first)
    with pytest.raises(Conflict) as again:
        svc.apply_change(store, ALICE, second)
    assert again.value.code == "already_decommissioned"
    after = svc.get_change(store, SYSTEM, second)
    assert after["state"] == "approved" and "already_decommissioned" in after["error"]
    failed = [e for e in _events(store, "change.apply") if e.outcome == "failure"]
    assert failed[-1].details["code"] == "already_decommissioned"


# --- 5. key.destroy under dual control -----------------------------------------------------------


def _seal_seed(store: Store, username: str) -> None:
    create_user(store, SYSTEM, username, None, ["developer"], ["t1"])
    with store.write(SYSTEM) as tx:
        row = tx.session.scalar(select(UserRow).where(UserRow.username == username))
        assert row is not None
        row.totp_secret = seal_totp_seed(store, tx, row, "JBSWY3DPEHPK3PXP")


def test_destroying_a_key_version_needs_two_approvals_and_no_secret_under_it(
    store: Store,
) -> None:
    _seal_seed(store, "dana")
    inventory.rotate_key(store, ALICE, "secrets")
    payload = {"key": "secrets", "version": 1}
    with pytest.raises(Conflict) as in_use:  # refused when asked for: rewrap first
        svc.create_change(store, ALICE, "key.destroy", payload)
    assert in_use.value.code == "key_version_in_use"
    assert in_use.value.details["protects"] == {"users.totp_secret": 1}
    with pytest.raises(Conflict):  # and directly
        inventory.destroy_version(store, ALICE, "secrets", 1)
    assert inventory.rewrap_batch(store, ALICE, "secrets").done
    change = svc.create_change(store, ALICE, "key.destroy", payload)
    assert svc.vote(store, BOB, change["id"], "approve")["state"] == "pending"  # dual control
    with pytest.raises(ProofplaneError):
        svc.apply_change(store, ALICE, change["id"])
    assert svc.vote(store, SEC, change["id"], "approve")["state"] == "approved"
    svc.apply_change(store, CAROL, change["id"])
    key = inventory.get_key(store, SEC, "secrets").to_json()
    assert key["versions"][0]["destroyed_at"] is not None
    (event,) = _events(store, "key.destroy")
    assert event.details == {"version": 1, "change_id": change["id"]}


def test_the_destroy_route_is_gated_under_enforce(store: Store) -> None:
    inventory.create_key(store, ALICE, "k1", "encrypt")
    inventory.rotate_key(store, ALICE, "k1")
    url = "/api/v1/keys/k1/versions/1/destroy"
    for client in _client(store, "enforce"):
        gated = client.post(url)
        assert gated.status_code == 409, gated.text
        assert gated.json()["error"]["details"]["change"]["payload"] == {"key": "k1",
                                                                        "version": 1}  # fmt: skip
        current = client.post("/api/v1/keys/k1/versions/2/destroy")
        assert current.status_code == 409 and current.json()["error"]["code"] == "key_disabled"
        assert client.post("/api/v1/keys/k1/versions/9/destroy").status_code == 404
    assert _events(store, "key.destroy") == []
    for client in _client(store, "off"):
        done = client.post(url)
        assert done.status_code == 200, done.text
        assert done.json()["versions"][0]["destroyed_at"] is not None


# --- 6. a retired EK comes back only through an approved change ----------------------------------


def _attested(store: Store, name: str) -> SimulatedAttester:
    register_node(store, SYSTEM, Node(name, "r1", "z1", gpus=(Gpu(0, f"GPU-{name}", "H100-80GB",
                                                                  81920),)))  # fmt: skip
    att.set_policy(store, SYSTEM, POLICY, enforce=True)
    a = SimulatedAttester.create()
    agent = Actor(f"node:{name}")
    ch = att.enroll(store, agent, name, a.ek_public, a.ak_public, simulated=True,
                    allow_simulated=True)  # fmt: skip
    att.activate(store, agent, name, a.activate(ch.credential))
    a.boot(demo_boot_log(b"kernel"))
    nonce = att.issue_nonce(store, agent, name)
    evidence = a.evidence(nonce.nonce, list(nonce.pcrs))
    out = att.submit_evidence(store, agent, name, nonce.nonce, evidence, allow_simulated=True)
    assert out.state == "admitted"
    return a


def test_a_retired_ek_enrolls_again_only_after_an_approved_reenroll(store: Store) -> None:
    a = _attested(store, "n1")
    decommission_node(store, SYSTEM, "n1", "board back from repair")
    register_node(store, SYSTEM, Node("n9", "r1", "z1", gpus=(Gpu(0, "GPU-n9", "H100-80GB",
                                                                  81920),)))  # fmt: skip
    agent = Actor("node:n9")
    with pytest.raises(Conflict) as refused:
        att.enroll(store, agent, "n9", a.ek_public, a.ak_public, simulated=True,
                   allow_simulated=True)  # fmt: skip
    assert refused.value.code == "ek_retired"
    # node.readmit cannot do it (a decommissioned node is terminal)
    with pytest.raises(ProofplaneError):
        readmit = _approved(store, "node.readmit", {"node": "n1", "reason": "back"}, BOB)
        svc.apply_change(store, ALICE, readmit)
    with pytest.raises(ValidationFailed):
        svc.create_change(store, ALICE, "node.reenroll", {"reason": "neither"})
    cid = _approved(store, "node.reenroll", {"node": "n1", "reason": "repaired, checked"}, BOB, SEC)
    out = svc.apply_change(store, ALICE, cid)
    assert out["state"] == "applied"
    (event,) = _events(store, "node.attest.ek_unretire")
    assert event.details["change_id"] == cid and event.details["node"] == "n1"
    att.enroll(store, agent, "n9", a.ek_public, a.ak_public, simulated=True,
               allow_simulated=True)  # fmt: skip


# --- 7. applying through a change does what the direct call does ---------------------------------


def _pair(tmp_path: Path) -> tuple[Store, Store]:
    out = []
    for n in ("direct", "change"):
        s = Store(f"sqlite:///{tmp_path / f'{n}.db'}")
        migrate.upgrade(s.engine)
        register_node(s, SYSTEM, Node("gpu-01", "r1", "z1",
                                      gpus=(Gpu(0, "GPU-1", "H100-80GB", 81920),)))  # fmt: skip
        set_node_state(s, SYSTEM, "gpu-01", NodeState.ADMITTED, "test")
        create_tenant(s, SYSTEM, Tenant("t1"))
        out.append(s)
    return out[0], out[1]


def _same(a: Any, b: Any) -> bool:
    """Equal but for when (created/updated times differ between two stores)."""

    def strip(x: Any) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(x).items() if not k.endswith("_at")}

    return strip(a) == strip(b)


def _last(store: Store, action: str) -> dict[str, Any]:
    details = dict(_events(store, action)[-1].details or {})
    details.pop("change_id", None)
    return details


def test_decommission_through_a_change(tmp_path: Path) -> None:
    direct, changed = _pair(tmp_path)
    decommission_node(direct, ALICE, "gpu-01", "eol")
    cid = _approved(changed, "node.decommission", {"node": "gpu-01", "reason": "eol"})
    svc.apply_change(changed, ALICE, cid)
    assert _same(get_node(direct, SYSTEM, "gpu-01"), get_node(changed, SYSTEM, "gpu-01"))
    assert _events(changed, "node.decommission")[-1].details["change_id"] == cid
    assert _last(direct, "node.decommission") == _last(changed, "node.decommission")


def test_tenant_profile_through_a_change(tmp_path: Path) -> None:
    from proofplane.model.tenant import profile_from_json
    from proofplane.service.tenants import update_tenant

    profile = {"required_tags": {"hipaa": "true"}}
    direct, changed = _pair(tmp_path)
    update_tenant(direct, ALICE, "t1", description="d", profile=profile_from_json(profile))
    cid = _approved(changed, "tenant.profile", {"tenant": "t1", "profile": profile,
                                                "description": "d"})  # fmt: skip
    svc.apply_change(changed, ALICE, cid)
    assert _same(get_tenant(direct, SYSTEM, "t1"), get_tenant(changed, SYSTEM, "t1"))


def test_attestation_policy_through_a_change(tmp_path: Path) -> None:
    direct, changed = _pair(tmp_path)
    att.set_policy(direct, ALICE, POLICY, enforce=True)
    body = {k: v for k, v in POLICY.items() if k != "node_class"}
    cid = _approved(changed, "attestation.policy", {"node_class": "default", "policy": body,
                                                    "enforce": True})  # fmt: skip
    svc.apply_change(changed, ALICE, cid)

    def policies(s: Store) -> list[dict[str, Any]]:
        return [{k: v for k, v in p.items() if k not in ("updated_at", "created_at")}
                for p in att.list_policies(s, SYSTEM)]  # fmt: skip

    assert policies(direct) == policies(changed) != []


def test_readmit_through_a_change(tmp_path: Path) -> None:
    direct, changed = _pair(tmp_path)
    for s in (direct, changed):
        set_node_state(s, SYSTEM, "gpu-01", NodeState.QUARANTINED, "suspect")
    set_node_state(direct, ALICE, "gpu-01", NodeState.ADMITTED, "cleared")
    cid = _approved(changed, "node.readmit", {"node": "gpu-01", "reason": "cleared"}, BOB)
    svc.apply_change(changed, ALICE, cid)
    assert _same(get_node(direct, SYSTEM, "gpu-01"), get_node(changed, SYSTEM, "gpu-01"))


GOOD_RUNBOOK = ("---\nid: test-book\ntitle: Test\nversion: 2\ntriggers: []\n---\n\n"
                "1. Look: `proofplane nodes list`\n")  # fmt: skip


def test_runbook_publish_through_a_change_and_a_bad_one_is_refused_at_once(
    tmp_path: Path,
) -> None:
    direct, changed = _pair(tmp_path)
    with direct.write(ALICE) as tx:
        runbooks_svc.publish_runbook(tx, GOOD_RUNBOOK)
    with pytest.raises(ValidationFailed) as bad:
        svc.create_change(changed, ALICE, "runbook.publish", {"text": "not a runbook"})
    assert bad.value.code == "invalid_runbook"
    assert svc.list_changes(changed, SYSTEM) == []  # nothing pending to fail later
    cid = _approved(changed, "runbook.publish", {"text": GOOD_RUNBOOK}, BOB)
    svc.apply_change(changed, ALICE, cid)
    one = runbooks_svc.get_runbook(direct, SYSTEM, "test-book")
    two = runbooks_svc.get_runbook(changed, SYSTEM, "test-book")
    assert (one["text"], one["versions"]) == (two["text"], two["versions"])
    assert two["change_id"] == cid
    with pytest.raises(Conflict) as old:  # the same version again: refused when asked for
        svc.create_change(changed, ALICE, "runbook.publish", {"text": GOOD_RUNBOOK})
    assert old.value.code == "runbook_version_not_newer"


# --- 10. the change-control mode in the evidence -------------------------------------------------


def test_the_register_and_incident_bundles_record_the_mode(store: Store) -> None:
    for client in _client(store, "enforce"):
        exported = client.get("/api/v1/changes/export")
        assert exported.json()["change_control"] == "enforce"
        opened = client.post("/api/v1/incidents", json={"subject": "t1", "reason": "r",
                                                        "severity": "low"})  # fmt: skip
        assert opened.status_code == 201, opened.text
        raw, _ = get_bundle(store, SYSTEM, opened.json()["id"])
        assert json.loads(raw)["incident"]["change_control"] == "enforce"
    other = Store(store.url)  # a store no server runs: service calls are not gated
    try:
        from proofplane.service.audit import AuditKeys, origin_for

        keys = AuditKeys(origin=origin_for("default"))
        inc = open_incident(other, ALICE, keys, "t2", reason="r", subject_type="tenant",
                            severity="low")  # fmt: skip
        raw, _ = get_bundle(other, SYSTEM, inc.id)
        assert json.loads(raw)["incident"]["change_control"] == "off"
    finally:
        other.dispose()


# --- 11. TTL and tenant-admin approvals ----------------------------------------------------------


def test_the_change_ttl_setting(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PROOFPLANE_CHANGE_TTL_SECONDS", "120")
    t0 = datetime.now(UTC)
    change = svc.create_change(store, ALICE, "quota.set", {"tenant": "t1", "gpus": 1}, now=t0)
    assert datetime.fromisoformat(change["expires_at"]) == t0 + timedelta(seconds=120)
    assert svc.vote(store, BOB, change["id"], "approve",
                    now=t0 + timedelta(seconds=121))["state"] == "expired"  # fmt: skip
    for bad in ("59", "abc", "9999999999"):
        monkeypatch.setenv("PROOFPLANE_CHANGE_TTL_SECONDS", bad)
        with pytest.raises(ValidationFailed) as refused:
            svc.create_change(store, ALICE, "quota.set", {"tenant": "t1", "gpus": 1})
        assert refused.value.code == "invalid_setting"


def test_a_tenant_admin_approves_only_its_own_tenants_changes(store: Store) -> None:
    ta1 = Actor("ta1", frozenset({Role.TENANT_ADMIN}), frozenset({"t1"}))
    ta2 = Actor("ta2", frozenset({Role.TENANT_ADMIN}), frozenset({"t2"}))
    change = svc.create_change(store, ALICE, "quota.set", {"tenant": "t1", "gpus": 1})
    with pytest.raises(ProofplaneError) as other:
        svc.vote(store, ta2, change["id"], "approve")
    assert other.value.code == "not_an_approver"
    assert svc.vote(store, ta1, change["id"], "approve")["state"] == "approved"
    grant = svc.create_change(store, ALICE, "certification.grant",
                              {"node": "gpu-01", "key": "hipaa", "value": "true"})  # fmt: skip
    with pytest.raises(ProofplaneError) as unscoped:  # a cluster-wide change: no tenant-admin
        svc.vote(store, ta1, grant["id"], "approve")
    assert unscoped.value.code == "not_an_approver"
