"""Incidents (issue 12, §9), on SQLite and PostgreSQL: opening one on an attested node
quarantines it and moves its work compliantly, in the same transaction as the incident and its
evidence bundle; the bundle verifies offline with ``audit verify-bundle``'s code and carries
evidence records that ``attest replay`` accepts; states only move forward; every step is an
event on the incident's timeline; bad input changes nothing."""

from __future__ import annotations

import base64
import hashlib
import json
from datetime import UTC, datetime
from pathlib import Path

import pytest
from sqlalchemy import select
from typer.testing import CliRunner

from proofplane.access import SYSTEM, Actor, Forbidden, Role
from proofplane.attest import load_record, replay_record
from proofplane.attest.simulate import SimulatedAttester, demo_boot_log
from proofplane.audit import bundle as bundle_mod
from proofplane.cli.main import app as cli
from proofplane.errors import InvalidState, NotFound, ValidationFailed
from proofplane.model import Gpu, GpuRequest, Node, NodeState, Tenant
from proofplane.service import attestation as att
from proofplane.service import incidents as svc
from proofplane.service.audit import AuditKeys
from proofplane.service.context import Store
from proofplane.service.nodes import get_node, grant_certification, register_node, set_node_state
from proofplane.service.tenants import create_tenant
from proofplane.service.workloads import WorkloadSpec, get_workload, submit_workload
from proofplane.store.tables import AuditCheckpointRow, EventRow, IncidentRow

KEYS = AuditKeys(origin="proofplane/incident-test")
POLICY = {
    "id": "p",
    "node_class": "default",
    "require_eventlog": False,
    "require_secure_boot": False,
    "require_inventory": False,
}
OPERATOR = Actor("op", frozenset({Role.OPERATOR}))
DEVELOPER = Actor("dev", frozenset({Role.DEVELOPER}), frozenset({"acme"}))
AUDITOR = Actor("aud", frozenset({Role.AUDITOR}))


def attested_node(store: Store, name: str) -> None:
    """Register ``name`` and admit it by a passing (simulated) attestation."""
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
    out = att.submit_evidence(
        store,
        agent,
        name,
        nonce.nonce,
        a.evidence(nonce.nonce, list(nonce.pcrs)),
        allow_simulated=True,
    )
    assert out.verdict["ok"] and out.state == "admitted"


@pytest.fixture
def cluster(store: Store) -> Store:
    """Attested nodes n1 and n2, both certified tier=gold; tenant acme with workload w1 on n1."""
    for name in ("n1", "n2"):
        attested_node(store, name)
        grant_certification(store, SYSTEM, name, "tier", "gold")
    set_node_state(store, SYSTEM, "n2", NodeState.CORDONED, "keep n1 first")
    create_tenant(store, SYSTEM, Tenant("acme"))
    wl = submit_workload(
        store, SYSTEM, WorkloadSpec("w1", "acme", tags={"tier": "gold"}, gpus=GpuRequest(count=1))
    )
    assert wl.placement is not None and wl.placement.node == "n1"
    set_node_state(store, SYSTEM, "n2", NodeState.ADMITTED, "room for n1's work")
    return store


def _entries(raw: bytes) -> list[dict[str, object]]:
    data = json.loads(raw)
    return [json.loads(base64.b64decode(e["entry"])) for e in data["entries"]]


def test_opening_quarantines_moves_work_and_captures_a_verifiable_bundle(
    cluster: Store, tmp_path: Path
) -> None:
    store = cluster
    inc = svc.open_incident(
        store, OPERATOR, KEYS, "n1", reason="suspected tampering", severity="critical"
    )
    assert (inc.subject_type, inc.state, inc.severity, inc.owner) == (
        "node",
        "open",
        "critical",
        "op",
    )
    node = get_node(store, SYSTEM, "n1")
    assert node.state == NodeState.QUARANTINED and f"incident {inc.id}" in (node.state_reason or "")
    moved = get_workload(store, SYSTEM, "w1")
    assert moved.placement is not None and moved.placement.node == "n2"  # still tier=gold

    raw, digest = svc.get_bundle(store, AUDITOR, inc.id)
    assert hashlib.sha256(raw).hexdigest() == digest == inc.bundle_sha256
    report = bundle_mod.verify(raw)
    assert report.ok, report.failures
    data = json.loads(raw)
    # the checkpoint was signed in the incident's transaction, after the quarantine
    actions = [(e["action"], e["target_id"]) for e in _entries(raw)]
    assert ("node.register", "n1") in actions and ("node.attest", "n1") in actions
    assert ("node.state", "n1") in actions  # the quarantine itself
    assert ("workload.place", "w1") in actions and ("workload.evict", "w1") in actions
    ev = data["incident"]
    assert ev["format"] == svc.EVIDENCE_FORMAT and ev["subject"] == "n1"
    assert ev["inventory"]["gpus"][0]["uuid"] == "GPU-n1"
    assert ev["inventory"]["tpm_identity"]["simulated"] is True
    assert [h["workload"] for h in ev["held_at_open"]] == ["w1"] and ev["holding_now"] == []
    assert {h["action"] for h in ev["placement_history"]} >= {"workload.place", "workload.evict"}
    assert len(ev["attestation"]) == 1
    # the stored bytes are anchored in the log: incident.open names their hash
    (opened,) = [t for t in inc.timeline if t.action == "incident.open"]
    assert opened.details["bundle_sha256"] == digest and opened.details["quarantined"] is True

    # offline, with the CLI commands an auditor runs
    path = tmp_path / "incident.json"
    path.write_bytes(raw)
    runner = CliRunner()
    out = runner.invoke(cli, ["audit", "verify-bundle", str(path)])
    assert out.exit_code == 0, out.output
    assert f"{report.entries} entries" in out.output
    record = tmp_path / "record.json"
    record.write_text(json.dumps(ev["attestation"][0]["record"]))
    out = runner.invoke(cli, ["attest", "replay", str(record), "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["verdict"]["ok"] is True
    assert replay_record(load_record(record.read_text())).ok

    # a tampered bundle does not verify
    data["entries"][0]["entry"] = base64.b64encode(b"{}").decode()
    assert not bundle_mod.verify(json.dumps(data)).ok


def test_a_tenant_incident_quarantines_nothing(cluster: Store) -> None:
    inc = svc.open_incident(
        cluster, OPERATOR, KEYS, "acme", reason="breakout suspected", owner="secops"
    )
    assert inc.subject_type == "tenant" and inc.owner == "secops" and inc.severity == "high"
    assert get_node(cluster, SYSTEM, "n1").state == NodeState.ADMITTED
    raw, _ = svc.get_bundle(cluster, SYSTEM, inc.id)
    assert bundle_mod.verify(raw).ok
    data = json.loads(raw)
    assert data["incident"]["tenant"]["name"] == "acme" and data["incident"]["attestation"] == []
    assert ("tenant.create", "acme") in [(e["action"], e["target_id"]) for e in _entries(raw)]
    assert inc.timeline[0].details["quarantined"] is False


def test_states_move_only_forward_and_closing_needs_a_postmortem(cluster: Store) -> None:
    store = cluster
    inc = svc.open_incident(store, OPERATOR, KEYS, "n1", reason="r")
    for bad in ("open",):
        with pytest.raises(InvalidState) as e:
            svc.update_incident(store, OPERATOR, inc.id, state=bad)
        assert e.value.code == "invalid_transition"
    with pytest.raises(InvalidState) as e:
        svc.update_incident(store, OPERATOR, inc.id, state="closed")
    assert e.value.code == "postmortem_required"
    svc.update_incident(store, OPERATOR, inc.id, state="contained", note="node isolated")
    with pytest.raises(InvalidState):
        svc.update_incident(store, OPERATOR, inc.id, state="contained")
    up = svc.update_incident(
        store, OPERATOR, inc.id, state="resolved", severity="low", owner="alice"
    )
    assert (up.state, up.severity, up.owner) == ("resolved", "low", "alice")
    with pytest.raises(InvalidState) as e:
        svc.update_incident(store, OPERATOR, inc.id, state="open")
    assert e.value.code == "invalid_transition"
    with pytest.raises(ValidationFailed):
        svc.close_incident(store, OPERATOR, inc.id, postmortem="   ")
    closed = svc.close_incident(store, OPERATOR, inc.id, postmortem="root cause: a bad disk")
    assert closed.state == "closed" and closed.postmortem == "root cause: a bad disk"
    assert closed.closed_at is not None
    with pytest.raises(InvalidState):
        svc.close_incident(store, OPERATOR, inc.id, postmortem="again")
    with pytest.raises(InvalidState):
        svc.update_incident(store, OPERATOR, inc.id, note="late")
    # the timeline: every step, in order
    shown = svc.get_incident(store, AUDITOR, inc.id)
    assert [t.action for t in shown.timeline] == [
        "incident.open",
        "incident.update",
        "incident.update",
        "incident.close",
    ]
    assert shown.timeline[1].details == {
        "state": {"from": "open", "to": "contained"},
        "note": "node isolated",
    }
    assert shown.timeline[3].details["postmortem"] == "root cause: a bad disk"
    assert [i.id for i in svc.list_incidents(store, AUDITOR, state="closed").items] == [inc.id]
    assert svc.list_incidents(store, AUDITOR, state="open").items == []


def test_refusals_write_nothing(cluster: Store) -> None:
    store = cluster

    def counts() -> tuple[int, int, int]:
        with store.read() as s:
            return (
                s.query(IncidentRow).count(),
                s.query(EventRow).count(),
                s.query(AuditCheckpointRow).count(),
            )

    before = counts()
    with pytest.raises(Forbidden):
        svc.open_incident(store, DEVELOPER, KEYS, "n1", reason="r")
    with pytest.raises(Forbidden):
        svc.list_incidents(store, DEVELOPER)
    with pytest.raises(NotFound):
        svc.open_incident(store, OPERATOR, KEYS, "nope", reason="r")
    with pytest.raises(NotFound):
        svc.open_incident(store, OPERATOR, KEYS, "acme", subject_type="node", reason="r")
    for kwargs in (
        {"severity": "urgent"},
        {"reason": ""},
        {"subject_type": "gpu"},
        {"reason": "a\x00b"},
        {"owner": " "},
    ):
        args = {"reason": "r", **kwargs}
        with pytest.raises(ValidationFailed):
            svc.open_incident(store, OPERATOR, KEYS, "n1", **args)  # type: ignore[arg-type]
    # a node that cannot be quarantined: the incident is not created either
    set_node_state(store, SYSTEM, "n2", NodeState.DECOMMISSIONED, "gone")
    mid = counts()
    with pytest.raises(InvalidState) as e:
        svc.open_incident(store, OPERATOR, KEYS, "n2", reason="r")
    assert e.value.code == "invalid_transition"
    assert counts() == mid and counts()[0] == before[0] == 0
    with pytest.raises(NotFound):
        svc.get_incident(store, AUDITOR, 1)
    with pytest.raises(NotFound):
        svc.update_incident(store, OPERATOR, 10**30, note="x")
    with pytest.raises(ValidationFailed):
        svc.list_incidents(store, AUDITOR, state="done")
    assert get_node(store, SYSTEM, "n1").state == NodeState.ADMITTED


def test_an_already_quarantined_node_stays_quarantined(cluster: Store) -> None:
    set_node_state(cluster, SYSTEM, "n1", NodeState.QUARANTINED, "by hand")
    inc = svc.open_incident(
        cluster, OPERATOR, KEYS, "n1", reason="follow-up", now=datetime.now(UTC)
    )
    assert inc.timeline[0].details["already_quarantined"] is True
    assert bundle_mod.verify(svc.get_bundle(cluster, SYSTEM, inc.id)[0]).ok


def test_pure_rules() -> None:
    assert svc.transition_refusal("open", "resolved") is None
    assert svc.transition_refusal("resolved", "contained") is not None
    assert svc.transition_refusal("open", "open") is not None
    assert svc.mentions({"nodes": ["n1"]}, "n1") and svc.mentions({"x": "n1/gpu0"}, "n1")
    assert not svc.mentions({"node": "n10"}, "n1")


def test_a_failed_attestation_and_a_quarantine_name_their_runbooks(store: Store) -> None:
    """The events that open a runbook say which one (issue 12 §8): a failed verdict names
    attestation-failure, the node's move to quarantined (or failed) names node-failure."""
    attested_node(store, "n1")
    a = SimulatedAttester.create()  # a different TPM: its quote cannot verify for n1's AK
    agent = Actor("node:n1")
    nonce = att.issue_nonce(store, agent, "n1")
    a.boot(demo_boot_log(b"kernel"))
    out = att.submit_evidence(
        store, agent, "n1", nonce.nonce, a.evidence(nonce.nonce, list(nonce.pcrs)),
        allow_simulated=True,
    )  # fmt: skip
    assert not out.verdict["ok"] and out.state == "quarantined"
    with store.read() as session:
        events = list(session.scalars(select(EventRow).order_by(EventRow.seq)))
    verdicts = [e for e in events if e.action == "node.attest"]
    assert verdicts[0].details["ok"] and "runbook" not in verdicts[0].details
    assert verdicts[-1].details["runbook"] == "attestation-failure@v1"
    moves = [e for e in events if e.action == "node.state"]
    assert moves[-1].details["to"] == "quarantined"
    assert moves[-1].details["runbook"] == "node-failure@v1"
    assert all("runbook" not in m.details for m in moves if m.details["to"] == "admitted")
    set_node_state(store, SYSTEM, "n1", NodeState.FAILED, "psu")
    with store.read() as session:
        failed = session.scalars(
            select(EventRow).where(EventRow.action == "node.state").order_by(EventRow.seq.desc())
        ).first()
    assert failed is not None and failed.details["to"] == "failed"
    assert failed.details["runbook"] == "node-failure@v1"
