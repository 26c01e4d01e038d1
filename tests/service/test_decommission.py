"""Node decommissioning (issue 12, §10), on SQLite and PostgreSQL: one transaction moves an
attested node to ``decommissioned``, evicts its work and re-places it only where its tags hold,
revokes its certifications, its agent credentials and its agent certificates, and retires the
endorsement key it enrolled with, so the same TPM is refused at enrollment (``ek_retired``)
until ``unretire_ek`` (the future ``node.readmit`` change) lets it back. The agent then reports
the sanitisation, marked simulated on a simulated node. Refusals write nothing."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from proofplane.access import SYSTEM, Actor, Forbidden, Role
from proofplane.access.authz import Unauthenticated
from proofplane.attest.simulate import SimulatedAttester, demo_boot_log
from proofplane.errors import Conflict, InvalidState, NotFound, ValidationFailed
from proofplane.model import Gpu, GpuRequest, Node, NodeState, Tenant
from proofplane.service import access, pki
from proofplane.service import attestation as att
from proofplane.service.context import Store
from proofplane.service.decommission import decommission_node, report_sanitisation, unretire_ek
from proofplane.service.nodes import get_node, grant_certification, register_node, set_node_state
from proofplane.service.tenants import create_tenant
from proofplane.service.workloads import WorkloadSpec, get_workload, submit_workload
from proofplane.store.tables import EventRow, RetiredEkRow

CLUSTER = "decommission-test"
POLICY = {"id": "p", "node_class": "default", "require_eventlog": False,
          "require_secure_boot": False, "require_inventory": False}  # fmt: skip
OPERATOR = Actor("op", frozenset({Role.OPERATOR}))  # nodes:write, but not nodes:certify
CLEAN = {"mig_instances_destroyed": True, "gpu_memory_cleared": True,
         "method": "nvidia-smi mig -dci; nvidia-smi mig -dgi; nvidia-smi -r"}  # fmt: skip


def attested_node(store: Store, name: str, gpus: int = 1) -> SimulatedAttester:
    """Register ``name`` and admit it by a passing (simulated) attestation; its attester."""
    devices = tuple(Gpu(i, f"GPU-{name}-{i}", "H100-80GB", 81920) for i in range(gpus))
    register_node(store, SYSTEM, Node(name, "r1", "z1", gpus=devices))
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
    assert out.verdict["ok"] and out.state == "admitted"
    return a


def _csr(name: str) -> str:
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .sign(ec.generate_private_key(ec.SECP256R1()), hashes.SHA256())
    )
    return csr.public_bytes(serialization.Encoding.PEM).decode()


def _der(pem: str) -> bytes:
    return x509.load_pem_x509_certificate(pem.encode()).public_bytes(serialization.Encoding.DER)


def _events(store: Store, action: str | None = None) -> list[EventRow]:
    with store.read() as session:
        query = select(EventRow).order_by(EventRow.seq)
        if action is not None:
            query = query.where(EventRow.action == action)
        rows = list(session.scalars(query))
        session.expunge_all()
        return rows


def _count(store: Store) -> int:
    with store.read() as session:
        return int(session.scalar(select(func.count()).select_from(EventRow)) or 0)


@pytest.fixture
def cluster(store: Store) -> dict[str, Any]:
    """n1 (tier=gold, zone=eu) and n2 (tier=gold) attested; w-gold and w-eu run on n1: only n2
    can take w-gold, nothing else can take w-eu. n1's agent holds a credential and a
    certificate."""
    pki.forget_cached_ca()
    n1 = attested_node(store, "n1", gpus=2)
    attested_node(store, "n2")
    grant_certification(store, SYSTEM, "n1", "tier", "gold")
    grant_certification(store, SYSTEM, "n1", "zone", "eu")
    grant_certification(store, SYSTEM, "n2", "tier", "gold")
    set_node_state(store, SYSTEM, "n2", NodeState.CORDONED, "keep n1 first")
    create_tenant(store, SYSTEM, Tenant("acme"))
    for name, tags in (("w-gold", {"tier": "gold"}), ("w-eu", {"zone": "eu"})):
        spec = WorkloadSpec(name, "acme", tags=tags, gpus=GpuRequest(count=1, model=None))
        wl = submit_workload(store, SYSTEM, spec)
        assert wl.placement is None or wl.placement.node == "n1"
    set_node_state(store, SYSTEM, "n2", NodeState.ADMITTED, "room for n1's work")
    token = access.issue_agent_credential(store, SYSTEM, "n1", ttl_days=1).token
    cert = pki.issue_agent_certificate(store, Actor("node:n1"), "n1", _csr("n1"),
                                       cluster_id=CLUSTER)  # fmt: skip
    return {"store": store, "attester": n1, "token": token, "cert": cert}


def test_decommission_end_to_end(cluster: dict[str, Any]) -> None:
    store: Store = cluster["store"]
    a: SimulatedAttester = cluster["attester"]
    placed = {w: get_workload(store, SYSTEM, w) for w in ("w-gold", "w-eu")}
    assert {w.placement.node for w in placed.values() if w.placement} == {"n1"}
    now = datetime.now(UTC)
    assert access.authenticate(store, cluster["token"], now).name == "node:n1"

    out = decommission_node(store, SYSTEM, "n1", "end of life", change_id=42)

    ek = hashlib.sha256(a.ek_public).hexdigest()
    assert out["state"] == "decommissioned" and out["change_id"] == 42
    assert (out["evicted"], out["replaced"], out["pending"]) == (2, 1, 1)
    assert out["certifications_revoked"] == ["tier", "zone"]
    assert (out["agent_credentials_revoked"], out["agent_certificates_revoked"]) == (1, 1)
    assert out["ek_retired"] == ek and out["simulated"] is True
    # the work moved compliantly: w-gold to the other gold node, w-eu waits with a reason
    gold, eu = get_workload(store, SYSTEM, "w-gold"), get_workload(store, SYSTEM, "w-eu")
    assert gold.placement is not None and gold.placement.node == "n2"
    assert eu.placement is None and eu.status.value == "pending" and eu.reason
    node = get_node(store, SYSTEM, "n1")
    assert node.state is NodeState.DECOMMISSIONED and dict(node.certifications) == {}
    # its credential and its certificate no longer act for it
    with pytest.raises(Unauthenticated):
        access.authenticate(store, cluster["token"], now)
    with pytest.raises(Unauthenticated) as revoked:
        pki.actor_for_certificate(store, _der(cluster["cert"]["certificate"]), now)
    assert revoked.value.code == "agent_certificate_revoked"
    # every step is an event, the summary last
    (summary,) = _events(store, "node.decommission")
    assert summary.target_id == "n1" and summary.details["evicted"] == 2
    assert summary.details["ek_retired"] == ek
    revokes = [e for e in _events(store, "node.certification.revoke") if e.target_id == "n1"]
    assert sorted(e.details["key"] for e in revokes) == ["tier", "zone"]
    assert all(e.details["change_id"] == 42 for e in revokes)
    assert [e.details["kind"] for e in _events(store, "token.revoke")] == ["agent"]
    assert _events(store, "pki.revoke")[-1].target_id == "n1"
    with store.read() as session:
        row = session.get(RetiredEkRow, ek)
        assert row is not None and (row.node_name, row.change_id) == ("n1", 42)
        assert row.reason == "end of life"


def test_a_retired_ek_is_refused_until_unretired(cluster: dict[str, Any]) -> None:
    store: Store = cluster["store"]
    a: SimulatedAttester = cluster["attester"]
    decommission_node(store, SYSTEM, "n1", "board returned to the vendor")
    register_node(
        store, SYSTEM, Node("n9", "r1", "z1", gpus=(Gpu(0, "GPU-n9", "H100-80GB", 81920),))
    )
    agent = Actor("node:n9")
    before = _count(store)
    with pytest.raises(Conflict) as refused:
        att.enroll(store, agent, "n9", a.ek_public, a.ak_public, simulated=True,
                   allow_simulated=True)  # fmt: skip
    assert refused.value.code == "ek_retired"
    assert "new approved change" in refused.value.message
    assert refused.value.details["node"] == "n1"
    assert _count(store) == before
    # the decommissioned node itself cannot enroll either
    with pytest.raises(InvalidState):
        att.enroll(store, Actor("node:n1"), "n1", a.ek_public, a.ak_public, simulated=True,
                   allow_simulated=True)  # fmt: skip

    ek = hashlib.sha256(a.ek_public).hexdigest()
    with store.write(SYSTEM) as tx:
        lifted = unretire_ek(tx, ek, change_id=7, reason="repaired board, approved")
    assert lifted["node"] == "n1" and lifted["identity_released"] is True
    (event,) = _events(store, "node.attest.ek_unretire")
    assert event.details["ek_sha256"] == ek and event.details["change_id"] == 7
    ch = att.enroll(store, agent, "n9", a.ek_public, a.ak_public, simulated=True,
                    allow_simulated=True)  # fmt: skip
    att.activate(store, agent, "n9", a.activate(ch.credential))
    assert att.attestation_status(store, SYSTEM, "n9")["ek_sha256"] == ek
    with store.write(SYSTEM) as tx, pytest.raises(NotFound) as unknown:
        unretire_ek(tx, ek)
    assert unknown.value.code == "ek_not_retired"


def test_refusals_write_nothing(cluster: dict[str, Any]) -> None:
    store: Store = cluster["store"]
    before = _count(store)
    with pytest.raises(NotFound):
        decommission_node(store, SYSTEM, "nope", "gone")
    with pytest.raises(Forbidden):
        decommission_node(store, OPERATOR, "n1", "operators do not certify")
    for reason in ("", "   ", "x" * 501):
        with pytest.raises(ValidationFailed):
            decommission_node(store, SYSTEM, "n1", reason)
    assert _count(store) == before
    assert get_node(store, SYSTEM, "n1").state is NodeState.ADMITTED
    decommission_node(store, SYSTEM, "n1", "first")
    after = _count(store)
    with pytest.raises(Conflict) as again:
        decommission_node(store, SYSTEM, "n1", "second")
    assert again.value.code == "already_decommissioned"
    assert _count(store) == after


def test_a_node_that_never_attested_is_decommissioned_without_an_ek(store: Store) -> None:
    register_node(
        store, SYSTEM, Node("bare", "r1", "z1", gpus=(Gpu(0, "GPU-b", "H100-80GB", 81920),))
    )
    out = decommission_node(store, SYSTEM, "bare", "never used")
    assert out["ek_retired"] is None and out["evicted"] == 0 and "simulated" not in out


def test_sanitisation_report(cluster: dict[str, Any]) -> None:
    store: Store = cluster["store"]
    agent = Actor("node:n1")
    with pytest.raises(InvalidState) as early:
        report_sanitisation(store, agent, "n1", CLEAN)
    assert early.value.code == "node_not_decommissioned"
    decommission_node(store, SYSTEM, "n1", "end of life")
    before = _count(store)
    bad: Any
    for bad in (
        None,
        [],
        {},
        {**CLEAN, "extra": 1},
        {k: v for k, v in CLEAN.items() if k != "method"},
        {**CLEAN, "gpu_memory_cleared": "yes"},
        {**CLEAN, "mig_instances_destroyed": 1},
        {**CLEAN, "method": ""},
        {**CLEAN, "method": "a\nb"},
        {**CLEAN, "method": "m" * 201},
    ):
        with pytest.raises(ValidationFailed) as refused:
            report_sanitisation(store, agent, "n1", bad)
        assert refused.value.code == "invalid_sanitisation_report"
    with pytest.raises(NotFound):  # another node's agent: n1 does not exist for it
        report_sanitisation(store, Actor("node:n2"), "n1", CLEAN)
    with pytest.raises(Forbidden):
        report_sanitisation(store, Actor("dev", frozenset({Role.DEVELOPER}), frozenset({"acme"})),
                            "n1", CLEAN)  # fmt: skip
    assert _count(store) == before

    partial = report_sanitisation(store, agent, "n1", {**CLEAN, "gpu_memory_cleared": False})
    assert partial["complete"] is False and partial["simulated"] is True
    # a credential issued for the step is revoked by the complete report
    step = access.issue_agent_credential(store, SYSTEM, "n1", ttl_days=1).token
    done = report_sanitisation(store, agent, "n1", CLEAN)
    assert done["complete"] is True and done["reported_by"] == "agent"
    assert done["agent_credentials_revoked"] == 1
    with pytest.raises(Unauthenticated):
        access.authenticate(store, step, datetime.now(UTC))
    events = _events(store, "node.sanitise")
    assert [e.outcome for e in events] == ["failure", "success"]
    assert events[-1].details["simulated"] is True and events[-1].details["method"].startswith(
        "nvidia"
    )
    with pytest.raises(Conflict) as twice:
        report_sanitisation(store, SYSTEM, "n1", CLEAN)
    assert twice.value.code == "already_sanitised"


def test_sanitisation_route(client: TestClient, store: Store) -> None:
    pki.forget_cached_ca()
    attested_node(store, "n1")
    url = "/api/v1/nodes/n1/sanitisation"
    assert client.post(url, json=CLEAN).json()["error"]["code"] == "node_not_decommissioned"
    decommission_node(store, SYSTEM, "n1", "end of life")
    assert client.post("/api/v1/nodes/nope/sanitisation", json=CLEAN).status_code == 404
    for bad in ({}, {**CLEAN, "gpu_memory_cleared": "true"}, {**CLEAN, "x": 1}, [1]):
        resp = client.post(url, json=bad)
        assert resp.status_code == 422, resp.text
    token = access.issue_agent_credential(store, SYSTEM, "n1", ttl_days=1).token
    resp = client.post(url, json=CLEAN, headers={"Authorization": f"Bearer {token}"})
    assert resp.status_code == 201, resp.text
    body = resp.json()
    assert body["node"] == "n1" and body["reported_by"] == "agent" and body["simulated"] is True
    again = client.post(url, json=CLEAN, headers={"Authorization": f"Bearer {token}"})
    assert again.status_code == 401  # the complete report revoked the step's credential
