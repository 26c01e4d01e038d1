"""Attestation and admission (issue 5): enrollment, nonces, evidence, quarantine, staleness.

The thin shell around the pure verifier (``proofplane.attest``): each function checks who may
act, loads what the server knows (bound AK, EK, nonce, previous clock, policy), calls the core,
and stores the outcome with its event in one transaction.

Flow of one node:

1. ``enroll``: the agent sends its EK and AK public areas (and EK certificate). The AK must be
   a restricted signing key made in the TPM; the EK must not belong to another node. The server
   answers with a MakeCredential challenge; only the hash of its secret is kept.
2. ``activate``: the agent returns the secret ActivateCredential recovered, proving that AK and
   EK live in the same TPM. The AK is now bound.
3. ``issue_nonce`` then ``submit_evidence``, every round. Under an enforcing policy a pass
   admits a registered node and releases a quarantine that attestation imposed; a failure
   quarantines the node (its work moves to compliant nodes through ``change_node_state``).
4. ``check_stale``: nodes that have not passed within the grace period are quarantined (the
   server runs it in the background: ``proofplane.workers.staleness``).

An agent credential (actor ``node:<name>``) acts only for its own node: any other node does not
exist for it (404).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import bindparam, delete, insert, or_, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from proofplane.access import Actor, Permission, authorize
from proofplane.attest import AttestError, Evidence, Expected, Policy, PolicyError, VerifierCache
from proofplane.attest import nonce as nonces
from proofplane.attest.credential import (
    CredentialError,
    make_credential,
    tpm2_tools_credential_file,
)
from proofplane.attest.ekcert import verify_ek_certificate
from proofplane.attest.policy import canonical_json
from proofplane.attest.record import EvidenceRecord, make_record
from proofplane.attest.tpm import ClockInfo, parse_public
from proofplane.attest.verifier import Verdict, check_ak, evidence_hash
from proofplane.errors import Conflict, InvalidState, NotFound, ValidationFailed
from proofplane.model import KEEPS_WORK, NodeState, Outcome, validate_name, validate_topology
from proofplane.service.context import Store, Tx
from proofplane.service.instruments import count_verdict, on_commit
from proofplane.service.lifecycle import change_node_state
from proofplane.service.runbooks import with_runbook
from proofplane.store.repo import node_row
from proofplane.store.tables import (
    AttestationNonceKeyRow,
    AttestationNonceRow,
    AttestationPolicyRow,
    EvidenceRow,
    GpuRow,
    NodeAttestationRow,
    NodeRow,
    RetiredEkRow,
)

NONCE_TTL = timedelta(minutes=2)
CHALLENGE_TTL = timedelta(minutes=10)
NODE_CLASS_LABEL = "node-class"
DEFAULT_CLASS = "default"

#: Reasons the service adds before the verifier runs (the verifier's own are ``REASONS``).
SERVICE_REASONS: dict[str, str] = {
    "nonce_unknown": "the quote names a nonce this server never issued to this node",
    "nonce_replayed": "the nonce was already used by an earlier attestation round",
    "nonce_expired": "the nonce expired (2 minutes after it was issued) before its evidence came",
    "simulated_attester_refused": "the node enrolled with a simulated (software-key) attester, "
    "which this server accepts only in demo mode (PROOFPLANE_DEMO_ATTESTER=simulated)",
}


@dataclass(frozen=True, slots=True)
class Challenge:
    """What ``enroll`` returns: the tpm2-tools credential file for ActivateCredential."""

    node: str
    credential: bytes
    expires_at: datetime
    ak_name: str


@dataclass(frozen=True, slots=True)
class Nonce:
    node: str
    nonce: bytes
    issued_at: datetime
    expires_at: datetime
    pcr_bank: str
    pcrs: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AttestOutcome:
    """What one evidence submission led to."""

    node: str
    evidence_id: int
    verdict: dict[str, Any]
    state: str
    state_reason: str | None


# --- who may act -----------------------------------------------------------------------------


def agent_node(actor: Actor) -> str | None:
    """The node an agent credential speaks for; None for every other identity."""
    if not actor.roles and actor.name.startswith("node:"):
        return actor.name.removeprefix("node:")
    return None


def authorize_node(actor: Actor, name: str) -> None:
    """An agent acts for its own node only (another node does not exist for it); anyone else
    needs ``nodes:write``."""
    own = agent_node(actor)
    if own is not None:
        if own != name:
            raise NotFound(f"node {name!r} not found", details={"node": name})
        return
    authorize(actor, Permission.NODES_WRITE)


# --- helpers ---------------------------------------------------------------------------------


def node_class(row: NodeRow) -> str:
    return str((row.labels or {}).get(NODE_CLASS_LABEL, DEFAULT_CLASS))


def _policy_row(session: Any, row: NodeRow) -> AttestationPolicyRow | None:
    cls = node_class(row)
    found = session.scalar(
        select(AttestationPolicyRow).where(AttestationPolicyRow.node_class == cls)
    )
    if found is None and cls != DEFAULT_CLASS:
        found = session.scalar(
            select(AttestationPolicyRow).where(AttestationPolicyRow.node_class == DEFAULT_CLASS)
        )
    return found  # type: ignore[no-any-return]


# --- one round's reads (issue 20: ~170 rounds/s on two cores) ----------------------------------
#
# A round reads the node, its attestation identity and its class's policy. These statements are
# built once, read only the columns a round uses and load no GPU or certification rows: the ORM
# node row is loaded only by the evidence round, which may change the node's state.

#: The verifier's memo of pure functions of bytes (event-log parse + replay by the log's SHA-256,
#: parsed AKs by their bytes), shared by this process's rounds; never a verdict.
VERIFIER_CACHE = VerifierCache(max_entries=20_000)

_POLICY_CACHE_SIZE = 64
_policies: OrderedDict[bytes, Policy] = OrderedDict()
_policies_lock = threading.Lock()

_NONCE_ROUND = (
    select(NodeRow.id, NodeRow.labels, NodeAttestationRow.bound_at)
    .outerjoin(NodeAttestationRow, NodeAttestationRow.node_id == NodeRow.id)
    .where(NodeRow.name == bindparam("name"))
)
_EVIDENCE_ROUND = (
    select(NodeRow, NodeAttestationRow)
    .outerjoin(NodeAttestationRow, NodeAttestationRow.node_id == NodeRow.id)
    .where(NodeRow.name == bindparam("name"))
)
_POLICY_COLUMNS = (
    AttestationPolicyRow.node_class,
    AttestationPolicyRow.policy,
    AttestationPolicyRow.enforce,
)
_POLICIES_OF = select(*_POLICY_COLUMNS).where(
    AttestationPolicyRow.node_class.in_([bindparam("cls"), bindparam("default")])
)
_GPU_UUIDS = select(GpuRow.__table__.c.uuid).where(GpuRow.__table__.c.node_id == bindparam("node"))
_NONCES = AttestationNonceRow.__table__
# a nonce spent: one statement, which returns nothing when it was spent before (a replay)
_SPEND_NONCE = {
    "postgresql": pg_insert(_NONCES)
    .on_conflict_do_nothing(index_elements=["nonce"])
    .returning(_NONCES.c.id),
    "sqlite": sqlite_insert(_NONCES)
    .on_conflict_do_nothing(index_elements=["nonce"])
    .returning(_NONCES.c.id),
}
NONCE_KEY_ROW = 1
# A spent nonce's row is kept while its nonce could still be presented: past NONCE_TTL it is
# refused as expired whatever the table holds. The minute beyond covers replicas' clocks.
SPENT_NONCE_KEEP = NONCE_TTL + timedelta(minutes=1)
_OLD_SPENT = select(_NONCES.c.id).where(_NONCES.c.issued_at < bindparam("cutoff")).limit(1)
_PRUNE_SPENT = delete(_NONCES).where(_NONCES.c.issued_at < bindparam("cutoff"))
_NEW_EVIDENCE = insert(EvidenceRow.__table__).returning(EvidenceRow.__table__.c.id)


def parsed_policy(doc: Mapping[str, Any]) -> Policy:
    """``Policy.from_json(doc)``, memoized by the document's canonical JSON: a round reads its
    policy row every time (a changed policy judges the very next round) and parses a document
    only the first time this process sees it."""
    key = canonical_json(doc)
    with _policies_lock:
        found = _policies.get(key)
        if found is not None:
            _policies.move_to_end(key)
            return found
    policy = Policy.from_json(doc)
    with _policies_lock:
        _policies[key] = policy
        if len(_policies) > _POLICY_CACHE_SIZE:
            _policies.popitem(last=False)
    return policy


def _round_policy(session: Any, name: str, labels: Mapping[str, Any] | None) -> tuple[bool, Policy]:
    """(enforce, policy) of the node's class, else of ``default`` (one statement)."""
    cls = str((labels or {}).get(NODE_CLASS_LABEL, DEFAULT_CLASS))
    rows = {r.node_class: (bool(r.enforce), r.policy) for r in session.execute(
        _POLICIES_OF, {"cls": cls, "default": DEFAULT_CLASS})}  # fmt: skip
    return _pick_policy(rows, name, labels)


def _pick_policy(
    rows: Mapping[str, tuple[bool, Mapping[str, Any]]], name: str, labels: Mapping[str, Any] | None
) -> tuple[bool, Policy]:
    """(enforce, policy) of the node's class among ``rows`` (class → enforce, document), else
    of ``default``; ``attestation_policy_missing`` when neither is there."""
    cls = str((labels or {}).get(NODE_CLASS_LABEL, DEFAULT_CLASS))
    found = rows.get(cls) or rows.get(DEFAULT_CLASS)
    if found is None:
        raise InvalidState(
            f"no attestation policy for node class {cls!r} (nor 'default'): "
            "an admin sets one with PUT /api/v1/attestation/policy",
            code="attestation_policy_missing",
            details={"node": name, "node_class": cls},
        )
    return found[0], parsed_policy(found[1])


def _not_bound(name: str) -> InvalidState:
    return InvalidState(
        f"node {name!r} has no bound attestation key: enroll and activate first",
        code="not_enrolled",
        details={"node": name},
    )


def _identity(session: Any, row: NodeRow) -> NodeAttestationRow | None:
    return session.get(NodeAttestationRow, row.id)  # type: ignore[no-any-return]


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _public(blob: bytes, what: str) -> Any:
    try:
        return parse_public(blob)
    except AttestError as exc:
        raise ValidationFailed(
            f"{what} is not a TPM2B_PUBLIC/TPMT_PUBLIC: {exc.message}",
            code=f"{what}_invalid",
        ) from None


# --- enrollment ------------------------------------------------------------------------------


def enroll(
    store: Store,
    actor: Actor,
    name: str,
    ek_public: bytes,
    ak_public: bytes,
    ek_certificate: bytes | None = None,
    *,
    ca_bundle: bytes | None = None,
    now: datetime | None = None,
    simulated: bool = False,
    allow_simulated: bool = False,
) -> Challenge:
    """Start binding the node's AK to its EK: check both keys, refuse an EK another node holds,
    and return a MakeCredential challenge. With ``ca_bundle`` the EK certificate is required and
    must chain to it and certify this EK.

    ``simulated``: the keys are software keys of the demo's simulated attester; accepted only
    with ``allow_simulated`` (the server's demo mode) and marked on the identity for good."""
    authorize_node(actor, name)
    if simulated and not allow_simulated:
        raise InvalidState(
            SERVICE_REASONS["simulated_attester_refused"],
            code="simulated_attester_refused",
            details={"node": name},
        )
    _public(ek_public, "ek")
    ak = _public(ak_public, "ak")
    problem = check_ak(ak)
    if problem:
        raise ValidationFailed(
            f"the AK is not an attestation key: {problem}", code="ak_attributes_invalid"
        )
    secret = secrets.token_bytes(32)
    try:
        blob, enc_secret = make_credential(ek_public, ak.name, secret, rng=os.urandom)
    except CredentialError as exc:
        raise ValidationFailed(
            f"cannot challenge this EK: {exc.message}", code=exc.reason
        ) from None
    with store.write(actor, now) as tx:
        if ca_bundle is not None:
            if ek_certificate is None:
                raise ValidationFailed(
                    "an EK certificate is required (a CA bundle is configured)",
                    code="ek_cert_missing",
                )
            try:
                verify_ek_certificate(ek_certificate, ca_bundle, tx.now, ek_public=ek_public)
            except AttestError as exc:
                raise ValidationFailed(exc.message, code=exc.reason) from None
        row = node_row(tx.session, name)
        if NodeState(row.state) == NodeState.DECOMMISSIONED:
            raise InvalidState(f"node {name!r} is decommissioned", code="node_decommissioned")
        ek_hash = _sha256(ek_public)
        retired = tx.session.get(RetiredEkRow, ek_hash)
        if retired is not None:  # issue 12: a decommissioned board must not come back quietly
            raise Conflict(
                f"this TPM's endorsement key was retired when node {retired.node_name!r} was "
                "decommissioned: a decommissioned node's TPM needs a new approved change "
                "(node.readmit) to come back",
                code="ek_retired",
                details={"ek_sha256": ek_hash, "node": retired.node_name,
                         "retired_at": retired.retired_at.isoformat()},
            )  # fmt: skip
        other = tx.session.scalar(
            select(NodeAttestationRow).where(NodeAttestationRow.ek_sha256 == ek_hash)
        )
        if other is not None and other.node_id != row.id:
            raise Conflict(
                "this EK is already enrolled for another node (a cloned TPM?)",
                code="duplicate_ek",
                details={"ek_sha256": ek_hash},
            )
        ident = _identity(tx.session, row)
        if ident is not None and ident.bound_at is not None:
            raise Conflict(
                f"node {name!r} already has a bound attestation key",
                code="already_enrolled",
                details={"node": name, "ak_name": ident.ak_name},
            )
        if ident is None:
            ident = NodeAttestationRow(node_id=row.id, created_at=tx.now, quarantined=False)
            tx.session.add(ident)
        ident.ek_public = ek_public
        ident.ek_sha256 = ek_hash
        ident.ek_cert_sha256 = None if ek_certificate is None else _sha256(ek_certificate)
        ident.ak_public = ak_public
        ident.ak_name = ak.name.hex()
        ident.simulated = simulated
        ident.challenge_sha256 = _sha256(secret)
        ident.challenge_expires_at = tx.now + CHALLENGE_TTL
        ident.updated_at = tx.now
        tx.session.flush()
        tx.record(
            "node.attest.enroll",
            "node",
            name,
            details={
                "ek_sha256": ek_hash,
                "ek_cert_sha256": ident.ek_cert_sha256,
                "ak_name": ident.ak_name,
                "ek_cert_verified": ca_bundle is not None,
                **_sim(simulated),
            },
        )
        return Challenge(
            name, tpm2_tools_credential_file(blob, enc_secret), ident.challenge_expires_at,
            ident.ak_name,
        )  # fmt: skip


def activate(
    store: Store, actor: Actor, name: str, secret: bytes, *, now: datetime | None = None
) -> dict[str, Any]:
    """Finish binding: the secret ActivateCredential recovered must match the challenge's."""
    authorize_node(actor, name)
    with store.write(actor, now) as tx:
        row = node_row(tx.session, name)
        ident = _identity(tx.session, row)
        if ident is None or ident.challenge_sha256 is None:
            raise InvalidState(
                f"node {name!r} has no pending enrollment challenge",
                code="no_challenge",
                details={"node": name},
            )
        assert ident.challenge_expires_at is not None
        if tx.now > ident.challenge_expires_at:
            raise InvalidState("the enrollment challenge expired: enroll again",
                               code="challenge_expired")  # fmt: skip
        if not hmac.compare_digest(_sha256(secret), ident.challenge_sha256):
            raise ValidationFailed(
                "the secret does not answer the challenge: the AK and EK are not in one TPM",
                code="activation_failed",
            )
        ident.challenge_sha256 = None
        ident.challenge_expires_at = None
        ident.bound_at = tx.now
        ident.updated_at = tx.now
        tx.record(
            "node.attest.bind",
            "node",
            name,
            details={
                "ek_sha256": ident.ek_sha256,
                "ak_name": ident.ak_name,
                **_sim(ident.simulated),
            },  # fmt: skip
        )
        return _status(tx.session, row)


# --- rounds ----------------------------------------------------------------------------------


def nonce_key(store: Store, actor: Actor, *, create: bool = True) -> bytes | None:
    """The key this deployment's attestation nonces are made and checked with: opened once per
    process (KMS ``secrets`` key, bound to its row), made on first use (``create``) with an
    ``attest.nonce_key.create`` event; None when there is none and ``create`` is false. Called
    outside any transaction of ``store``: it may open its own."""
    key = store.nonce_key
    if key is not None:
        return key
    from proofplane.service import keys as keys_svc  # keys imports nothing of attestation

    kms = keys_svc.kms_for(store)
    aad = keys_svc.secret_aad("attestation_nonce_key", NONCE_KEY_ROW, "key")
    with store.read() as session:
        row = session.get(AttestationNonceKeyRow, NONCE_KEY_ROW)
        sealed = None if row is None else row.key_sealed
    if sealed is None:
        if not create:
            return None
        with store.write(actor) as tx:
            row = tx.session.get(AttestationNonceKeyRow, NONCE_KEY_ROW)
            if row is None:  # nobody made it since the read
                made = secrets.token_bytes(nonces.KEY_SIZE)
                row = AttestationNonceKeyRow(
                    id=NONCE_KEY_ROW,
                    key_sealed=keys_svc.seal_secret(kms, tx, made.hex(), aad),
                    created_at=tx.now,
                )
                tx.session.add(row)
                tx.record("attest.nonce_key.create", "attestation", "nonce-key",
                          details={"kms_key": keys_svc.SECRETS_KEY})  # fmt: skip
            sealed = row.key_sealed
    with store.read() as session:
        key = bytes.fromhex(keys_svc.open_secret(kms, session, sealed, aad))
    store.nonce_key = key
    return key


def issue_nonce(store: Store, actor: Actor, name: str, now: datetime | None = None) -> Nonce:
    """A fresh single-use nonce, and which PCRs the policy wants quoted.

    A read: the nonce carries its issue time and the node it is for under the server's nonce key
    (``proofplane.attest.nonce``), and is recorded when evidence spends it, with the round's
    verdict. Nothing is written here, so no write lock is taken (issue 20: with it, each of a
    fleet's rounds took the one write lock twice)."""
    authorize_node(actor, name)
    key = nonce_key(store, actor)
    assert key is not None
    at = nonces.at_ms(nonces.issued_ms(now or datetime.now(UTC)))
    with store.read() as session:
        found = session.execute(_NONCE_ROUND, {"name": name}).one_or_none()
        if found is None:
            raise NotFound(f"node {name!r} not found", details={"node": name})
        if found.bound_at is None:
            raise _not_bound(name)
        _enforce, policy = _round_policy(session, name, found.labels)
    nonce = nonces.make_nonce(key, found.id, name, at, secrets.token_bytes(nonces.RANDOM_SIZE))
    pcrs = tuple(
        sorted(
            set(policy.required_pcrs)
            | set(policy.golden_pcrs)
            | (set(policy.eventlog_pcrs) if policy.require_eventlog else set())
        )
    )
    return Nonce(name, nonce, at, at + NONCE_TTL, policy.pcr_bank, pcrs)


def parse_evidence(data: Any) -> Evidence:
    """Evidence from its JSON form; ValidationFailed(code='evidence_malformed') otherwise."""
    try:
        return Evidence.from_json(data)
    except AttestError as exc:
        raise ValidationFailed(exc.message, code="evidence_malformed") from None
    except (TypeError, ValueError, AttributeError) as exc:
        raise ValidationFailed(f"bad evidence: {exc}", code="evidence_malformed") from None


@dataclass(frozen=True, slots=True)
class _Round:
    """One evidence submission on its way to the write lock."""

    name: str
    nonce: bytes
    evidence: Evidence
    allow_simulated: bool
    key: bytes | None


def submit_evidence(
    store: Store,
    actor: Actor,
    name: str,
    nonce: bytes,
    evidence: Evidence,
    now: datetime | None = None,
    *,
    allow_simulated: bool = False,
) -> AttestOutcome:
    """Judge one round and act on the verdict. Every attempt is stored with its verdict and an
    event carrying the evidence hash. Under an enforcing policy: pass → a registered node is
    admitted, an attestation quarantine is released; fail → the node is quarantined with the
    failing codes as reason and its work moves to compliant nodes (or waits, with a reason).

    A node enrolled by a simulated attester is judged only with ``allow_simulated`` (demo
    mode); otherwise its round is refused (``simulated_attester_refused``). Its records,
    events and state reasons say ``simulated``.

    Rounds that arrive while another write holds the lock are judged and committed together
    (``Store.write_grouped``, issue 20), each as its own agent at its own time."""
    authorize_node(actor, name)
    key = nonce_key(store, actor, create=False)  # none yet: no nonce was ever issued
    return store.write_grouped(
        actor, now, _record_round, _Round(name, nonce, evidence, allow_simulated, key)
    )


_TX_POLICIES = "attestation.policies"  # Tx.extras: this transaction's policies, read once
_ALL_POLICIES = select(*_POLICY_COLUMNS)


def _tx_policy(tx: Tx, name: str, labels: Mapping[str, Any] | None) -> tuple[bool, Policy]:
    """``_round_policy`` read once per write transaction (one statement for a group of
    rounds; ``set_policy`` forgets it)."""
    rows = tx.extras.get(_TX_POLICIES)
    if rows is None:
        rows = tx.extras[_TX_POLICIES] = {
            r.node_class: (bool(r.enforce), r.policy) for r in tx.session.execute(_ALL_POLICIES)
        }
    return _pick_policy(rows, name, labels)


def _record_round(tx: Tx, r: _Round) -> AttestOutcome:
    """One round under the write lock: the nonce spent, the quote verified on what the server
    knows now, the verdict stored with its event, the node admitted or quarantined."""
    name = r.name
    found = tx.session.execute(_EVIDENCE_ROUND, {"name": name}).one_or_none()
    if found is None:
        raise NotFound(f"node {name!r} not found", details={"node": name})
    row, ident = found
    if ident is None or ident.bound_at is None:
        raise _not_bound(name)
    enforce, policy = _tx_policy(tx, name, row.labels)
    # the nonce is spent here, pass or fail (single use): one statement when it is ours
    issued_at = None if r.key is None else nonces.open_nonce(r.key, row.id, name, r.nonce)
    unknown = issued_at is None
    expired = issued_at is not None and tx.now > issued_at + NONCE_TTL
    fresh = False
    if issued_at is not None and not expired:
        spend = _SPEND_NONCE[tx.session.get_bind().dialect.name]
        fresh = tx.session.execute(
            spend,
            {"node_id": row.id, "nonce": r.nonce.hex(), "issued_at": issued_at,
             "expires_at": issued_at + NONCE_TTL, "used_at": tx.now},
        ).scalar() is not None  # fmt: skip
    previous = None if ident.last_clock is None else ClockInfo.from_json(ident.last_clock)
    expected = Expected(r.nonce, issued_at or tx.now, ident.ak_public, ident.ek_public, previous)
    simulated = bool(ident.simulated)
    evidence = r.evidence
    if simulated and not r.allow_simulated:
        verdict = _refused("simulated_attester_refused", evidence, expected, policy)
        record = EvidenceRecord(name, evidence, expected, policy, tx.now, verdict.to_json())
    elif not fresh:
        code = "nonce_unknown" if unknown else "nonce_expired" if expired else "nonce_replayed"
        verdict = _refused(code, evidence, expected, policy)
        record = EvidenceRecord(name, evidence, expected, policy, tx.now, verdict.to_json())
    else:
        record, verdict = make_record(
            name, evidence, expected, policy, tx.now, cache=VERIFIER_CACHE
        )
    evidence_id = tx.session.execute(
        _NEW_EVIDENCE,
        {"node_id": row.id, "created_at": tx.now, "ok": verdict.ok,
         "reasons": list(verdict.reasons), "evidence_hash": verdict.evidence_hash,
         "policy_id": policy.id, "policy_hash": policy.hash,
         "record": {**record.to_json(), **_sim(simulated)}},
    ).scalar_one()  # fmt: skip
    # /metrics counts the verdict once it is recorded
    on_commit(tx.session, lambda: count_verdict(verdict.ok, verdict.reasons))
    tx.record(
        "node.attest",
        "node",
        name,
        outcome=Outcome.SUCCESS if verdict.ok else Outcome.FAILURE,
        details={
            "evidence_id": evidence_id,
            "evidence_hash": verdict.evidence_hash,
            "policy_id": policy.id,
            "policy_hash": policy.hash,
            "node_class": policy.node_class,
            "ok": verdict.ok,
            "reasons": list(verdict.reasons),
            "enforce": enforce,
            "gpu_uuids": sorted(tx.session.scalars(_GPU_UUIDS, {"node": row.id})),
            **_sim(simulated),
            # a failed verdict names the runbook that answers it
            **({} if verdict.ok else with_runbook({}, "node.attest", "failure", tx.session)),
        },
    )
    ident.updated_at = tx.now
    if verdict.ok:
        assert verdict.clock is not None
        ident.last_clock = verdict.clock.to_json()
        ident.last_passed_at = tx.now
        _hardware_topology(tx, row, evidence)
        if enforce:
            _admit(tx, row, ident, "attestation passed" + _sim_note(simulated))
    elif enforce:
        _quarantine(
            tx, row, ident,
            "attestation failed: " + ",".join(verdict.reasons) + _sim_note(simulated),
        )  # fmt: skip
    return AttestOutcome(name, evidence_id, verdict.to_json(), row.state, row.state_reason)


def _hardware_topology(tx: Tx, row: NodeRow, evidence: Evidence) -> None:
    """A passing round's GPU inventory may name the node's NVLink domain (the NVML collector
    reads it from the GPUs' fabric, ``hardware.nvml``): the node takes it, with a
    ``node.update`` event (issue 17 §4; rule 6: hardware facts come from hardware). A name
    that is not a valid domain, or an inventory that names none, changes nothing."""
    topology = (evidence.inventory or {}).get("topology")
    found = topology.get("nvlink_domain") if isinstance(topology, Mapping) else None
    before = dict(row.topology or {})
    if not isinstance(found, str) or before.get("nvlink_domain") == found:
        return
    try:
        validate_name(found, "topology nvlink_domain")
    except ValidationFailed:
        return
    after = validate_topology({**before, "nvlink_domain": found})
    change = {"topology": {"before": before, "after": after}, "source": "attested inventory"}
    row.topology, row.updated_at = after, tx.now
    tx.record("node.update", "node", row.name, details=change)


def _refused(code: str, evidence: Evidence, expected: Expected, policy: Policy) -> Verdict:
    try:
        ehash = evidence_hash(evidence, expected)
    except Exception:  # an unhashable evidence is still a refusal
        ehash = ""
    return Verdict(
        ok=False, reasons=(code,), messages={code: SERVICE_REASONS[code]}, details={},
        evidence_hash=ehash, policy_id=policy.id, policy_hash=policy.hash,
    )  # fmt: skip


def _sim(simulated: bool) -> dict[str, bool]:
    """``{"simulated": True}`` for what a simulated attester produced (nothing otherwise)."""
    return {"simulated": True} if simulated else {}


def _sim_note(simulated: bool) -> str:
    return " (simulated attester)" if simulated else ""


def _admit(tx: Tx, row: NodeRow, ident: NodeAttestationRow, reason: str) -> None:
    state = NodeState(row.state)
    if state == NodeState.REGISTERED or (state == NodeState.QUARANTINED and ident.quarantined):
        ident.quarantined = False
        change_node_state(tx, row, NodeState.ADMITTED, reason)


def _quarantine(tx: Tx, row: NodeRow, ident: NodeAttestationRow, reason: str) -> None:
    if NodeState(row.state) in (NodeState.QUARANTINED, NodeState.FAILED,
                                NodeState.DECOMMISSIONED):  # fmt: skip
        if NodeState(row.state) == NodeState.QUARANTINED and ident.quarantined:
            row.state_reason = reason  # attestation's own quarantine: the latest failure
        return
    ident.quarantined = True
    change_node_state(tx, row, NodeState.QUARANTINED, reason)


_STALE = (
    select(NodeRow.id, NodeRow.labels)
    .outerjoin(NodeAttestationRow, NodeAttestationRow.node_id == NodeRow.id)
    .where(
        NodeRow.state.in_([s.value for s in KEEPS_WORK]),
        or_(
            NodeAttestationRow.last_passed_at.is_(None),
            NodeAttestationRow.last_passed_at < bindparam("cutoff"),
        ),
    )
    .order_by(NodeRow.name)
)
_ENFORCING = select(AttestationPolicyRow.node_class, AttestationPolicyRow.enforce)


def _stale_ids(session: Any, cutoff: datetime) -> list[int]:
    """The nodes in service whose last pass is before ``cutoff`` (or that never passed) under
    an enforcing policy, by name: one statement for the policies and, when one enforces, one
    for the nodes, whatever the fleet's size (the fresh nodes, nearly all, are not read)."""
    enforce = {cls: bool(on) for cls, on in session.execute(_ENFORCING)}
    if not any(enforce.values()):
        return []
    out = []
    for r in session.execute(_STALE, {"cutoff": cutoff}):
        cls = str((r.labels or {}).get(NODE_CLASS_LABEL, DEFAULT_CLASS))
        # the class's own policy, else the default one (as _policy_row chooses)
        if enforce[cls] if cls in enforce else enforce.get(DEFAULT_CLASS, False):
            out.append(r.id)
    return out


def check_stale(
    store: Store, actor: Actor, grace: timedelta, now: datetime | None = None
) -> list[str]:
    """Quarantine every node in service under an enforcing policy whose last passing
    attestation is older than ``grace`` (or that never passed). Returns their names.

    A pass with nothing stale reads two statements and takes no write lock (one without an
    enforcing policy); the write transaction, when there is something to do, reads the stale
    nodes again under the lock."""
    authorize(actor, Permission.NODES_WRITE)
    done: list[str] = []
    at = now or datetime.now(UTC)
    with store.read() as session:  # no enforcing policy or nothing stale: nothing to write
        if not _stale_ids(session, at - grace):
            return done
    with store.write(actor, now) as tx:
        for node_id in _stale_ids(tx.session, tx.now - grace):
            row = tx.session.get(NodeRow, node_id)
            ident = _identity(tx.session, row)
            if ident is None:
                reason = "attestation stale: never attested"
                change_node_state(tx, row, NodeState.QUARANTINED, reason)
            else:
                last = ident.last_passed_at
                when = "never passed" if last is None else f"last pass {last.isoformat()}"
                _quarantine(tx, row, ident, f"attestation stale: {when}")
            done.append(row.name)
    return done


def prune_spent_nonces(store: Store, actor: Actor, now: datetime | None = None) -> int:
    """Forget the spent nonces that can no longer be presented (issued more than
    ``SPENT_NONCE_KEEP`` ago: their nonces are refused as expired whatever this table holds), so
    the table holds a few minutes of rounds, not every round ever. Returns how many went. A
    pass with nothing to forget is one read and takes no write lock. Bookkeeping of single use,
    not a record: each round's record is its verdict (``node.attest`` and the stored evidence),
    which stays."""
    authorize(actor, Permission.NODES_WRITE)
    cutoff = (now or datetime.now(UTC)) - SPENT_NONCE_KEEP
    with store.read() as session:
        if session.execute(_OLD_SPENT, {"cutoff": cutoff}).first() is None:
            return 0
    with store.write(actor, now) as tx:
        return int(tx.session.execute(_PRUNE_SPENT, {"cutoff": cutoff}).rowcount or 0)


def manual_admission_refused(tx: Tx, row: NodeRow, target: NodeState) -> str | None:
    """Why an operator may not move this node to ``target`` by hand (None: they may). Under an
    enforcing policy a registered node is admitted only by attestation; a quarantine imposed
    by attestation is released only by a fresh passing attestation."""
    if target != NodeState.ADMITTED:
        return None
    ident = _identity(tx.session, row)
    if NodeState(row.state) == NodeState.QUARANTINED and ident is not None and ident.quarantined:
        return (
            "the node was quarantined by attestation: only a fresh passing attestation releases it"
        )
    prow = _policy_row(tx.session, row)
    if prow is not None and prow.enforce and NodeState(row.state) in (
        NodeState.REGISTERED, NodeState.QUARANTINED
    ):  # fmt: skip
        return f"policy {prow.node_class!r} enforces attestation: the node is admitted by attesting"
    return None


# --- reads and policies ----------------------------------------------------------------------


def _status(session: Any, row: NodeRow) -> dict[str, Any]:
    ident = _identity(session, row)
    latest = session.scalar(
        select(EvidenceRow).where(EvidenceRow.node_id == row.id).order_by(EvidenceRow.id.desc())
    )
    return {
        "node": row.name,
        "state": row.state,
        "state_reason": row.state_reason,
        "node_class": node_class(row),
        "enrolled": ident is not None,
        "bound": ident is not None and ident.bound_at is not None,
        "ek_sha256": None if ident is None else ident.ek_sha256,
        "ak_name": None if ident is None else ident.ak_name,
        "bound_at": None if ident is None or ident.bound_at is None else ident.bound_at.isoformat(),
        "last_passed_at": None
        if ident is None or ident.last_passed_at is None
        else ident.last_passed_at.isoformat(),
        "last_clock": None if ident is None else ident.last_clock,
        "quarantined_by_attestation": bool(ident is not None and ident.quarantined),
        "simulated": bool(ident is not None and ident.simulated),
        "latest": None if latest is None else _evidence_summary(latest),
    }


def _evidence_summary(e: EvidenceRow) -> dict[str, Any]:
    return {
        "id": e.id,
        "at": e.created_at.isoformat(),
        "ok": e.ok,
        "reasons": list(e.reasons),
        "messages": dict((e.record.get("verdict") or {}).get("messages") or {}),
        "evidence_hash": e.evidence_hash,
        "policy_id": e.policy_id,
        "policy_hash": e.policy_hash,
        "simulated": bool((e.record or {}).get("simulated", False)),
    }


def attestation_status(store: Store, actor: Actor, name: str) -> dict[str, Any]:
    """The node's TPM identity and its latest verdict."""
    authorize(actor, Permission.NODES_READ)
    with store.read() as session:
        return _status(session, node_row(session, name))


def list_evidence(
    store: Store, actor: Actor, name: str, *, limit: int = 20, records: bool = True
) -> list[dict[str, Any]]:
    """The node's attestation attempts, newest first, each with its replayable record."""
    authorize(actor, Permission.AUDIT_READ)
    if not 1 <= limit <= 500:
        raise ValidationFailed("limit must be 1 to 500", code="invalid_limit")
    with store.read() as session:
        row = node_row(session, name)
        rows = session.scalars(
            select(EvidenceRow)
            .where(EvidenceRow.node_id == row.id)
            .order_by(EvidenceRow.id.desc())
            .limit(limit)
        )
        return [{**_evidence_summary(e), **({"record": e.record} if records else {})} for e in rows]


def list_policies(store: Store, actor: Actor) -> list[dict[str, Any]]:
    authorize(actor, Permission.AUDIT_READ)
    with store.read() as session:
        rows = session.scalars(
            select(AttestationPolicyRow).order_by(AttestationPolicyRow.node_class)
        )
        return [_policy_out(p) for p in rows]


def _policy_out(p: AttestationPolicyRow) -> dict[str, Any]:
    return {
        "node_class": p.node_class,
        "enforce": p.enforce,
        "policy": p.policy,
        "policy_hash": p.policy_hash,
        "updated_by": p.updated_by,
        "updated_at": p.updated_at.isoformat(),
    }


def set_policy(
    store: Store, actor: Actor, policy: Mapping[str, Any], *, enforce: bool = True,
    now: datetime | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Create or replace the policy of ``policy['node_class']`` (default ``default``)."""
    authorize(actor, Permission.ATTEST_POLICY_WRITE)
    try:
        parsed = Policy.from_json(policy)
    except PolicyError as exc:
        raise ValidationFailed(exc.message, code=exc.reason) from None
    doc = parsed.to_json()
    with store.write(actor, now) as tx:
        tx.extras.pop(_TX_POLICIES, None)  # a round later in this transaction reads it anew
        row = tx.session.scalar(
            select(AttestationPolicyRow).where(AttestationPolicyRow.node_class == parsed.node_class)
        )
        before = None if row is None else row.policy_hash
        if row is None:
            row = AttestationPolicyRow(node_class=parsed.node_class)
            tx.session.add(row)
        row.policy, row.policy_hash, row.enforce = doc, parsed.hash, enforce
        row.updated_by, row.updated_at = actor.name, tx.now
        tx.session.flush()
        tx.record(
            "attest.policy.set",
            "attestation_policy",
            parsed.node_class,
            details={"policy_id": parsed.id, "policy_hash": parsed.hash,
                     "previous_hash": before, "enforce": enforce},
        )  # fmt: skip
        return _policy_out(row)
