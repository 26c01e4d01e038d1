"""Agent channel certificates only for attested nodes (issue 13, part 5): a CSR is signed only
while the node is admitted and its latest attestation passed, for its own name only; the
certificate carries the node's SPIFFE ID and is a client certificate; quarantining the node
revokes its certificates at once (the CRL lists them) and a presented certificate then no
longer acts for the node; expired or foreign certificates are refused."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from proofplane.access import SYSTEM, Actor
from proofplane.access.authz import Unauthenticated
from proofplane.attest.simulate import SimulatedAttester, demo_boot_log
from proofplane.errors import InvalidState, NotFound, ProofplaneError
from proofplane.model import Gpu, Node, NodeState
from proofplane.pki import agent_ca
from proofplane.service import attestation as att
from proofplane.service import pki
from proofplane.service.context import Store
from proofplane.service.nodes import register_node, set_node_state
from proofplane.store import migrate
from proofplane.store.tables import EventRow

CLUSTER = "test-cluster"
POLICY = {"id": "p", "node_class": "default", "require_eventlog": False,
          "require_secure_boot": False, "require_inventory": False}  # fmt: skip


@pytest.fixture
def store(tmp_path: Path) -> Store:
    s = Store(f"sqlite:///{tmp_path / 'pki.db'}")
    migrate.upgrade(s.engine)
    pki.forget_cached_ca()
    return s


def _attest(store: Store, name: str, *, passing: bool = True) -> SimulatedAttester:
    node = Node(name, "r1", "z1", gpus=(Gpu(0, f"GPU-{name}", "H100-80GB", 81920),))
    register_node(store, SYSTEM, node)
    att.set_policy(store, SYSTEM, POLICY, enforce=True)
    a = SimulatedAttester.create()
    actor = Actor(f"node:{name}")
    ch = att.enroll(store, actor, name, a.ek_public, a.ak_public, simulated=True,
                    allow_simulated=True)  # fmt: skip
    att.activate(store, actor, name, a.activate(ch.credential))
    a.boot(demo_boot_log(b"kernel"))
    nonce = att.issue_nonce(store, actor, name)
    evidence = a.evidence(nonce.nonce, list(nonce.pcrs))
    out = att.submit_evidence(store, actor, name, nonce.nonce, evidence, allow_simulated=True)
    assert out.verdict["ok"] and out.state == "admitted"
    return a


def _csr(*names: str, key: object | None = None) -> str:
    key = key or ec.generate_private_key(ec.SECP256R1())
    builder = x509.CertificateSigningRequestBuilder().subject_name(
        x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])])
    )
    if len(names) > 1:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName(n) for n in names[1:]]), critical=False
        )
    csr = builder.sign(key, hashes.SHA256())  # type: ignore[arg-type]
    return csr.public_bytes(serialization.Encoding.PEM).decode()


def _der(pem: str) -> bytes:
    return x509.load_pem_x509_certificate(pem.encode()).public_bytes(serialization.Encoding.DER)


def test_an_attested_node_gets_a_short_lived_client_certificate_naming_it(store: Store) -> None:
    _attest(store, "gpu-01")
    out = pki.issue_agent_certificate(store, Actor("node:gpu-01"), "gpu-01", _csr("gpu-01"),
                                      cluster_id=CLUSTER)  # fmt: skip
    cert = x509.load_pem_x509_certificate(out["certificate"].encode())
    ca = x509.load_pem_x509_certificate(out["ca"].encode())
    cert.verify_directly_issued_by(ca)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == [
        "spiffe://test-cluster/node/gpu-01"
    ]
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    life = cert.not_valid_after_utc - cert.not_valid_before_utc
    assert dt.timedelta(hours=24) <= life <= dt.timedelta(hours=24, minutes=6)
    now = dt.datetime.now(dt.UTC)
    assert pki.actor_for_certificate(store, _der(out["certificate"]), now).name == "node:gpu-01"
    listed = pki.list_certificates(store, SYSTEM, node="gpu-01")
    assert [c["serial"] for c in listed] == [out["serial"]]


def test_no_certificate_without_a_passing_attestation_or_for_another_node(store: Store) -> None:
    register_node(
        store, SYSTEM, Node("gpu-02", "r1", "z1", gpus=(Gpu(0, "GPU-x", "H100-80GB", 81920),))
    )
    with pytest.raises(InvalidState) as refused:
        pki.issue_agent_certificate(store, Actor("node:gpu-02"), "gpu-02", _csr("gpu-02"),
                                    cluster_id=CLUSTER)  # fmt: skip
    assert refused.value.code == "node_not_attested"
    _attest(store, "gpu-01")
    for actor in (Actor("node:gpu-02"), SYSTEM):  # another node's agent, or an admin
        with pytest.raises(NotFound):
            pki.issue_agent_certificate(store, actor, "gpu-01", _csr("gpu-01"),
                                        cluster_id=CLUSTER)  # fmt: skip
    for csr, code in (
        (_csr("gpu-02"), "csr_wrong_node"),
        (_csr("gpu-01", "gpu-02"), "csr_wrong_node"),
        (_csr("gpu-01", key=rsa.generate_private_key(65537, 1024)), "csr_invalid"),
        ("-----BEGIN CERTIFICATE REQUEST-----\nAAAA\n-----END CERTIFICATE REQUEST-----\n",
         "csr_invalid"),
        ("not a csr", "csr_invalid"),
    ):  # fmt: skip
        with pytest.raises(ProofplaneError) as bad:
            pki.issue_agent_certificate(store, Actor("node:gpu-01"), "gpu-01", csr,
                                        cluster_id=CLUSTER)  # fmt: skip
        assert bad.value.code == code
    assert pki.list_certificates(store, SYSTEM) == []  # nothing half-written


def test_quarantine_revokes_at_once_and_the_crl_lists_it(store: Store) -> None:
    _attest(store, "gpu-01")
    agent = Actor("node:gpu-01")
    first = pki.issue_agent_certificate(store, agent, "gpu-01", _csr("gpu-01"), cluster_id=CLUSTER)
    second = pki.issue_agent_certificate(store, agent, "gpu-01", _csr("gpu-01"), cluster_id=CLUSTER)
    set_node_state(store, SYSTEM, "gpu-01", NodeState.QUARANTINED, "operator says so")
    now = dt.datetime.now(dt.UTC)
    crl = x509.load_der_x509_crl(pki.crl_der(store, CLUSTER, now))
    ca = x509.load_pem_x509_certificate(first["ca"].encode())
    assert crl.is_signature_valid(ca.public_key())  # type: ignore[arg-type]
    assert {format(r.serial_number, "x") for r in crl} == {first["serial"], second["serial"]}
    with pytest.raises(Unauthenticated) as refused:
        pki.actor_for_certificate(store, _der(first["certificate"]), now)
    assert refused.value.code == "agent_certificate_revoked"
    with pytest.raises(InvalidState):  # no renewal while quarantined
        pki.issue_agent_certificate(store, agent, "gpu-01", _csr("gpu-01"), cluster_id=CLUSTER)
    with store.read() as session:
        actions = [e.action for e in session.query(EventRow).order_by(EventRow.seq)]
    assert actions.count("pki.issue") == 2 and "pki.revoke" in actions


def test_expired_and_foreign_certificates_are_refused(store: Store) -> None:
    _attest(store, "gpu-01")
    out = pki.issue_agent_certificate(store, Actor("node:gpu-01"), "gpu-01", _csr("gpu-01"),
                                      cluster_id=CLUSTER, ttl=dt.timedelta(minutes=1))  # fmt: skip
    later = dt.datetime.now(dt.UTC) + dt.timedelta(minutes=2)
    with pytest.raises(Unauthenticated) as expired:
        pki.actor_for_certificate(store, _der(out["certificate"]), later)
    assert "expired" in expired.value.message
    other_ca, other_key = agent_ca.new_ca(CLUSTER, dt.datetime.now(dt.UTC))
    now = dt.datetime.now(dt.UTC)
    foreign = agent_ca.issue(ca_pem=other_ca, ca_key_der=other_key, csr_pem=_csr("gpu-01"),
                             node="gpu-01", cluster_id=CLUSTER, now=now)  # fmt: skip
    with pytest.raises(Unauthenticated) as refused:
        pki.actor_for_certificate(store, _der(foreign.pem), dt.datetime.now(dt.UTC))
    assert "not issued by this cluster" in refused.value.message
    with pytest.raises(Unauthenticated):
        pki.actor_for_certificate(store, b"garbage", dt.datetime.now(dt.UTC))


def test_an_operator_revokes_by_serial_and_the_ca_key_is_sealed(store: Store) -> None:
    _attest(store, "gpu-01")
    out = pki.issue_agent_certificate(store, Actor("node:gpu-01"), "gpu-01", _csr("gpu-01"),
                                      cluster_id=CLUSTER)  # fmt: skip
    revoked = pki.revoke_certificate(store, SYSTEM, out["serial"])
    assert revoked["revoked_at"] is not None
    with pytest.raises(NotFound):
        pki.revoke_certificate(store, SYSTEM, "abc")
    with pytest.raises(ProofplaneError) as denied:
        pki.revoke_certificate(store, Actor("dev", frozenset()), out["serial"])
    assert denied.value.code in ("forbidden", "permission_denied")
    raw = (Path(store.url.removeprefix("sqlite:///"))).read_bytes()
    assert b"PRIVATE KEY" not in raw
    with store.read() as session:
        from proofplane.store.tables import PkiCaRow

        ca_row = session.get(PkiCaRow, 1)
        assert ca_row is not None and ca_row.key_sealed.startswith("ppk1.secrets.")


def test_a_failed_round_that_does_not_quarantine_suspends_the_certificate(store: Store) -> None:
    """Under a policy that does not enforce, a failed round leaves the node admitted; its
    certificate is then not accepted, nor renewed, until a round passes again."""
    a = _attest(store, "gpu-01")
    agent = Actor("node:gpu-01")
    out = pki.issue_agent_certificate(store, agent, "gpu-01", _csr("gpu-01"), cluster_id=CLUSTER)
    now = dt.datetime.now(dt.UTC)
    assert pki.actor_for_certificate(store, _der(out["certificate"]), now).name == "node:gpu-01"
    assert pki.holds_certificate(store, "gpu-01", now)
    strict = {**POLICY, "require_inventory": True, "min_driver": "550.0"}
    att.set_policy(store, SYSTEM, strict, enforce=False)
    nonce = att.issue_nonce(store, agent, "gpu-01")  # a round without a GPU inventory
    evidence = a.evidence(nonce.nonce, list(nonce.pcrs))
    failed = att.submit_evidence(store, agent, "gpu-01", nonce.nonce, evidence,
                                 allow_simulated=True)  # fmt: skip
    assert not failed.verdict["ok"] and failed.state == "admitted"
    with pytest.raises(Unauthenticated) as refused:
        pki.actor_for_certificate(store, _der(out["certificate"]), dt.datetime.now(dt.UTC))
    assert refused.value.code == "node_not_attested"
    assert not pki.holds_certificate(store, "gpu-01", dt.datetime.now(dt.UTC))
    with pytest.raises(InvalidState) as no_renewal:
        pki.issue_agent_certificate(store, agent, "gpu-01", _csr("gpu-01"), cluster_id=CLUSTER)
    assert no_renewal.value.code == "node_not_attested"
    att.set_policy(store, SYSTEM, POLICY, enforce=False)
    nonce = att.issue_nonce(store, agent, "gpu-01")
    assert att.submit_evidence(store, agent, "gpu-01", nonce.nonce,
                               a.evidence(nonce.nonce, list(nonce.pcrs)),
                               allow_simulated=True).verdict["ok"]  # fmt: skip
    later = dt.datetime.now(dt.UTC)
    assert pki.actor_for_certificate(store, _der(out["certificate"]), later).name == "node:gpu-01"


def test_bearer_refusal_spares_people_and_certificate_connections(store: Store) -> None:
    _attest(store, "gpu-01")
    agent = Actor("node:gpu-01", token_id="tok-1")
    now = dt.datetime.now(dt.UTC)
    pki.refuse_bearer_when_certified(store, agent, now)  # no certificate yet: the credential
    out = pki.issue_agent_certificate(store, agent, "gpu-01", _csr("gpu-01"), cluster_id=CLUSTER)
    with pytest.raises(Unauthenticated) as refused:
        pki.refuse_bearer_when_certified(store, agent, dt.datetime.now(dt.UTC))
    assert refused.value.code == "agent_certificate_required"
    assert refused.value.details == {"node": "gpu-01"}
    by_cert = Actor("node:gpu-01", token_id=f"x509:{out['serial']}")
    pki.refuse_bearer_when_certified(store, by_cert, dt.datetime.now(dt.UTC))
    pki.refuse_bearer_when_certified(store, SYSTEM, dt.datetime.now(dt.UTC))
    pki.refuse_bearer_when_certified(store, Actor("node:gpu-02", token_id="t"), now)
    later = dt.datetime.now(dt.UTC) + dt.timedelta(days=2)  # expired: the credential again
    pki.refuse_bearer_when_certified(store, agent, later)
