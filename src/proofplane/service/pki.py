"""Channel certificates for node agents, given only to attested nodes (issue 13, part 5).

The agent CA (``proofplane.pki.agent_ca``) is made on first use; its private key is stored only
as KMS ciphertext (``service/keys.py``, the ``secrets`` key, bound to the CA row). A node's
agent sends a CSR for its own node (its bearer agent credential for the first one, or its
current certificate): the server signs it only while the node is admitted and its latest
attestation passed. When the node is quarantined, fails or is decommissioned
(``revoke_node``, called from the node lifecycle) every certificate of it is revoked at once
and listed on the CRL; an operator can revoke one by serial. A certificate presented on a
TLS connection (``actor_for_certificate``) acts as ``node:<name>`` while it is valid, not
revoked, the node still in service and its latest attestation passed (a round that failed under
a policy that does not quarantine leaves the node admitted, but its certificate is not accepted,
nor renewed, until a round passes again).

On a server with a client CA (mutual TLS), a node that holds such a certificate must use it:
``refuse_bearer_when_certified`` refuses its bearer agent credential (401
``agent_certificate_required``) everywhere but enrolling and asking for a certificate, the
credential's "first enrollment" uses (and the way back for an agent that lost its certificate).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from proofplane.access import Actor, Permission, authorize
from proofplane.access.authz import Unauthenticated
from proofplane.errors import InvalidState, NotFound, ValidationFailed
from proofplane.model import NodeState
from proofplane.pki import agent_ca
from proofplane.service import keys as keys_svc
from proofplane.service.attestation import agent_node
from proofplane.service.context import Store, Tx
from proofplane.service.lifecycle import REVOKING_STATES
from proofplane.store.tables import (
    AgentCertRow,
    EvidenceRow,
    NodeAttestationRow,
    NodeRow,
    PkiCaRow,
)

CA_ROW = 1


@dataclass(frozen=True, slots=True)
class CaMaterial:
    cluster_id: str
    cert_pem: str
    key_der: bytes


_CACHE: dict[str, CaMaterial] = {}  # store url -> its CA (the key opened once per process)
_CACHE_LOCK = threading.Lock()


def _ca(tx: Tx, store: Store, cluster_id: str) -> CaMaterial:
    cached = _CACHE.get(store.url)
    if cached is not None:
        return cached
    kms = keys_svc.kms_for(store)
    row = tx.session.get(PkiCaRow, CA_ROW)
    aad = keys_svc.secret_aad("pki_ca", CA_ROW, "key")
    if row is None:
        cert_pem, key_der = agent_ca.new_ca(cluster_id, tx.now)
        sealed = keys_svc.seal_secret(kms, tx, key_der.hex(), aad)
        row = PkiCaRow(id=CA_ROW, cluster_id=cluster_id, cert_pem=cert_pem, key_sealed=sealed,
                       created_at=tx.now)  # fmt: skip
        tx.session.add(row)
        tx.session.flush()
        tx.record("pki.ca.create", "pki_ca", cluster_id,
                  details={"certificate_sha256": _fingerprint(cert_pem)})  # fmt: skip
    key_der = bytes.fromhex(keys_svc.open_secret(kms, tx.session, row.key_sealed, aad))
    material = CaMaterial(row.cluster_id, row.cert_pem, key_der)
    with _CACHE_LOCK:
        _CACHE[store.url] = material
    return material


def _read_ca(store: Store) -> CaMaterial | None:
    cached = _CACHE.get(store.url)
    if cached is not None:
        return cached
    with store.read() as session:
        row = session.get(PkiCaRow, CA_ROW)
        if row is None:
            return None
        kms = keys_svc.kms_for(store)
        aad = keys_svc.secret_aad("pki_ca", CA_ROW, "key")
        key_der = bytes.fromhex(keys_svc.open_secret(kms, session, row.key_sealed, aad))
        material = CaMaterial(row.cluster_id, row.cert_pem, key_der)
    with _CACHE_LOCK:
        _CACHE[store.url] = material
    return material


def _fingerprint(pem: str) -> str:
    from cryptography.hazmat.primitives import hashes

    return agent_ca.load_ca_cert(pem).fingerprint(hashes.SHA256()).hex()


def _attested(tx: Tx, name: str) -> NodeRow:
    """The node, when it may hold a certificate: admitted, not quarantined by attestation,
    and its latest attestation passed. ``node_not_attested`` otherwise."""
    row = tx.session.scalar(select(NodeRow).where(NodeRow.name == name))
    if row is None:
        raise NotFound(f"node {name!r} not found", details={"node": name})
    ident = tx.session.scalar(
        select(NodeAttestationRow).where(NodeAttestationRow.node_id == row.id)
    )
    latest = tx.session.scalar(
        select(EvidenceRow)
        .where(EvidenceRow.node_id == row.id)
        .order_by(EvidenceRow.id.desc())
        .limit(1)
    )
    if NodeState(row.state) is not NodeState.ADMITTED or ident is None or ident.quarantined:
        why = f"node {name!r} is {row.state}"
    elif latest is None or not latest.ok:
        why = f"node {name!r}'s latest attestation did not pass"
    else:
        return row
    raise InvalidState(f"{why}: only an attested, admitted node gets an agent certificate",
                       code="node_not_attested", details={"node": name})  # fmt: skip


def issue_agent_certificate(
    store: Store,
    actor: Actor,
    name: str,
    csr_pem: str,
    *,
    cluster_id: str,
    ttl: timedelta = agent_ca.DEFAULT_TTL,
    now: datetime | None = None,
) -> dict[str, Any]:
    """Sign the agent's CSR for its own node (see the module's docstring)."""
    if agent_node(actor) != name:
        # Only the node's own agent holds the key the certificate binds: nobody else asks.
        raise NotFound(f"node {name!r} not found", details={"node": name})
    agent_ca.parse_csr(csr_pem)  # refused before anything is written
    with store.write(actor, now) as tx:
        _attested(tx, name)
        ca = _ca(tx, store, cluster_id)
        issued = agent_ca.issue(
            ca_pem=ca.cert_pem,
            ca_key_der=ca.key_der,
            csr_pem=csr_pem,
            node=name,
            cluster_id=ca.cluster_id,
            now=tx.now,
            ttl=ttl,
        )
        tx.session.add(
            AgentCertRow(
                serial=format(issued.serial, "x"),
                node_name=name,
                fingerprint=issued.fingerprint,
                not_before=issued.not_before,
                not_after=issued.not_after,
                issued_at=tx.now,
            )  # fmt: skip
        )
        tx.record("pki.issue", "node", name, details={
            "serial": format(issued.serial, "x"), "not_after": issued.not_after.isoformat(),
            "sha256": issued.fingerprint})  # fmt: skip
    return {
        "certificate": issued.pem,
        "ca": ca.cert_pem,
        "serial": format(issued.serial, "x"),
        "not_after": issued.not_after.isoformat(),
        "spiffe_id": agent_ca.spiffe_id(ca.cluster_id, name),
    }


def revoke_node(tx: Tx, name: str, reason: str) -> int:
    """Revoke every unexpired, unrevoked certificate of the node (inside the state change's
    transaction); returns how many."""
    rows = list(
        tx.session.scalars(
            select(AgentCertRow).where(
                AgentCertRow.node_name == name,
                AgentCertRow.revoked_at.is_(None),
                AgentCertRow.not_after > tx.now,
            )
        )
    )
    for row in rows:
        row.revoked_at, row.revoke_reason = tx.now, reason[:200]
    if rows:
        tx.record("pki.revoke", "node", name, details={
            "serials": [r.serial for r in rows], "reason": reason})  # fmt: skip
    return len(rows)


def revoke_certificate(
    store: Store, actor: Actor, serial: str, reason: str = "revoked by an operator"
) -> dict[str, Any]:
    authorize(actor, Permission.NODES_WRITE)
    with store.write(actor) as tx:
        row = tx.session.get(AgentCertRow, serial.lower())
        if row is None:
            raise NotFound(f"certificate {serial!r} not found", details={"serial": serial})
        if row.revoked_at is None:
            row.revoked_at, row.revoke_reason = tx.now, reason[:200]
            tx.record("pki.revoke", "node", row.node_name,
                      details={"serials": [row.serial], "reason": reason})  # fmt: skip
        return _view(row)


def _view(row: AgentCertRow) -> dict[str, Any]:
    return {
        "serial": row.serial,
        "node": row.node_name,
        "sha256": row.fingerprint,
        "not_before": row.not_before.isoformat(),
        "not_after": row.not_after.isoformat(),
        "issued_at": row.issued_at.isoformat(),
        "revoked_at": row.revoked_at.isoformat() if row.revoked_at else None,
        "revoke_reason": row.revoke_reason,
    }


def list_certificates(store: Store, actor: Actor, node: str | None = None) -> list[dict[str, Any]]:
    authorize(actor, Permission.NODES_READ)
    with store.read() as session:
        query = select(AgentCertRow).order_by(AgentCertRow.issued_at, AgentCertRow.serial)
        if node is not None:
            query = query.where(AgentCertRow.node_name == node)
        return [_view(r) for r in session.scalars(query)]


def ca_certificate(store: Store, cluster_id: str) -> str:
    """The agent CA certificate (PEM), made now if there is none yet."""
    material = _read_ca(store)
    if material is None:
        from proofplane.access import SYSTEM

        with store.write(SYSTEM) as tx:
            material = _ca(tx, store, cluster_id)
    return material.cert_pem


def crl_der(store: Store, cluster_id: str, now: datetime | None = None) -> bytes:
    """The CRL: every revoked certificate not yet expired, signed by the agent CA."""
    ca_certificate(store, cluster_id)
    material = _read_ca(store)
    assert material is not None
    when = now or datetime.now(UTC)
    with store.read() as session:
        rows = session.scalars(
            select(AgentCertRow).where(
                AgentCertRow.revoked_at.is_not(None), AgentCertRow.not_after > when
            )
        )
        revoked = [(int(r.serial, 16), r.revoked_at) for r in rows if r.revoked_at is not None]
    return agent_ca.crl(ca_pem=material.cert_pem, ca_key_der=material.key_der, revoked=revoked,
                        now=when)  # fmt: skip


CERTIFICATE_REQUIRED = "agent_certificate_required"


def _not_accepted(session: Session, node: NodeRow | None, name: str) -> tuple[str, str] | None:
    """Why the node's certificates are not accepted now, (message, code), or None: the node
    left service, or its latest attestation did not pass."""
    if node is None or NodeState(node.state) in REVOKING_STATES:
        return f"node {name!r} is not in service", "agent_certificate_revoked"
    latest_ok = session.scalar(
        select(EvidenceRow.ok)
        .where(EvidenceRow.node_id == node.id)
        .order_by(EvidenceRow.id.desc())
        .limit(1)
    )
    if not latest_ok:
        return (
            f"node {name!r}'s latest attestation did not pass (attest again with the agent "
            "credential; a passing round gets a new certificate)",
            "node_not_attested",
        )
    return None


def actor_for_certificate(store: Store, cert_der: bytes, now: datetime) -> Actor:
    """The node agent a client certificate stands for: issued by our CA, valid, not revoked,
    its node still in service and its latest attestation passed. ``Unauthenticated``
    otherwise."""
    material = _read_ca(store)
    if material is None:
        raise Unauthenticated("no agent certificates are issued here",
                              code="agent_certificate_invalid")  # fmt: skip
    try:
        name, serial = agent_ca.node_of(cert_der, ca_pem=material.cert_pem,
                                        cluster_id=material.cluster_id, now=now)  # fmt: skip
    except ValidationFailed as exc:
        raise Unauthenticated(exc.message, code="agent_certificate_invalid") from None
    with store.read() as session:
        row = session.get(AgentCertRow, format(serial, "x"))
        node = session.scalar(select(NodeRow).where(NodeRow.name == name))
        if row is None or row.node_name != name:
            raise Unauthenticated("client certificate refused: not issued by this server",
                                  code="agent_certificate_invalid")  # fmt: skip
        if row.revoked_at is not None:
            raise Unauthenticated("client certificate refused: revoked",
                                  code="agent_certificate_revoked")  # fmt: skip
        refused = _not_accepted(session, node, name)
        if refused is not None:
            raise Unauthenticated(f"client certificate refused: {refused[0]}", code=refused[1])
    return Actor(f"node:{name}", token_id=f"x509:{row.serial}")


def holds_certificate(store: Store, name: str, now: datetime) -> bool:
    """Whether node ``name`` holds a certificate the server would accept now: issued, in its
    validity period, not revoked, and the node's certificates accepted (``_not_accepted``)."""
    with store.read() as session:
        live = session.scalar(
            select(AgentCertRow.serial)
            .where(
                AgentCertRow.node_name == name,
                AgentCertRow.revoked_at.is_(None),
                AgentCertRow.not_before <= now,
                AgentCertRow.not_after > now,
            )
            .limit(1)
        )
        if live is None:
            return False
        node = session.scalar(select(NodeRow).where(NodeRow.name == name))
        return _not_accepted(session, node, name) is None


def refuse_bearer_when_certified(store: Store, actor: Actor, now: datetime) -> None:
    """On a mutual-TLS server: a node agent's bearer credential is refused (401
    ``agent_certificate_required``) while its node holds a certificate the server accepts; the
    caller (``api.deps``) exempts the routes that enroll and issue certificates. Anyone else,
    and an agent that connected with its certificate, passes."""
    name = agent_node(actor)
    if name is None or actor.token_id is None or actor.token_id.startswith("x509:"):
        return
    if holds_certificate(store, name, now):
        raise Unauthenticated(
            f"node {name!r} holds an agent certificate: connect with it (mutual TLS); the "
            "bearer agent credential is for enrolling and asking for a certificate only",
            code=CERTIFICATE_REQUIRED,
            details={"node": name},
        )


def forget_cached_ca() -> None:
    """Drop the per-process CA cache (tests that recreate databases under one URL)."""
    with _CACHE_LOCK:
        _CACHE.clear()
