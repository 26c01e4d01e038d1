"""SQLAlchemy tables. The schema itself is owned by the Alembic migrations in ``migrations/``;
these classes must match them (``tests/test_migrations.py`` compares the two)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Table,
    Text,
    TypeDecorator,
    UniqueConstraint,
    false,
    text,
    true,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

from proofplane.meter.fields import FIELDS as TELEMETRY_FIELDS

JsonType = JSON().with_variant(JSONB(), "postgresql")
BigId = BigInteger().with_variant(Integer(), "sqlite")


class UTCDateTime(TypeDecorator[datetime]):
    """Stores naive UTC, returns aware UTC, refuses naive input: no local-time surprises."""

    impl = DateTime
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to a UTC column")
        return value.astimezone(UTC).replace(tzinfo=None)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        return None if value is None else value.replace(tzinfo=UTC)


class Base(DeclarativeBase):
    pass


class TenantRow(Base):
    __tablename__ = "tenants"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(63), unique=True)
    description: Mapped[str] = mapped_column(Text, default="")
    profile: Mapped[dict[str, Any]] = mapped_column(JsonType)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime)
    # Quotas (NULL: no limit): whole GPUs (shares count as fractions), MIG compute slices.
    quota_gpus: Mapped[int | None] = mapped_column(Integer, nullable=True)
    quota_mig_slices: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # Deleted tenants stay as rows (issue 14): their name is never handed out again, so no user
    # binding, token or policy rule written for the old tenant can reach a new one.
    deleted_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    # What happens to its idle workloads (issue 15; None: notify with the defaults):
    # {"action": "notify"|"reclaim", "window_s", "threshold", "preemptible_priority"}
    idle_policy: Mapped[dict[str, Any] | None] = mapped_column(JsonType, nullable=True)


class NodeRow(Base):
    __tablename__ = "nodes"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(63), unique=True)
    region: Mapped[str] = mapped_column(String(63), index=True)
    zone: Mapped[str] = mapped_column(String(63), index=True)
    rack: Mapped[str | None] = mapped_column(String(63), nullable=True)
    labels: Mapped[dict[str, str]] = mapped_column(JsonType)
    state: Mapped[str] = mapped_column(String(32), index=True)
    state_reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime)
    # issue 17: allocatable CPU (milli-cores) and memory (MiB); NULL: not tracked
    cpu_milli: Mapped[int | None] = mapped_column(Integer, nullable=True)
    memory_mib: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # issue 17 §4: topology level → domain ({"nvlink_domain": "nvl72-3"}); NULL: none
    topology: Mapped[dict[str, str] | None] = mapped_column(JsonType, nullable=True)

    gpus: Mapped[list[GpuRow]] = relationship(
        back_populates="node", order_by="GpuRow.index", cascade="all, delete-orphan"
    )
    certifications: Mapped[list[CertificationRow]] = relationship(
        back_populates="node", order_by="CertificationRow.key", cascade="all, delete-orphan"
    )


class GpuRow(Base):
    __tablename__ = "gpus"
    __table_args__ = (UniqueConstraint("node_id", "index", name="uq_gpus_node_index"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    node_id: Mapped[int] = mapped_column(ForeignKey("nodes.id", ondelete="CASCADE"))
    index: Mapped[int] = mapped_column(Integer)
    uuid: Mapped[str] = mapped_column(String(64), unique=True)
    model: Mapped[str] = mapped_column(String(63))
    memory_mb: Mapped[int] = mapped_column(Integer)
    mig_enabled: Mapped[bool] = mapped_column(Boolean)
    mig_instances: Mapped[list[dict[str, Any]]] = mapped_column(JsonType)
    vbios_version: Mapped[str | None] = mapped_column(String(63), nullable=True)
    driver_version: Mapped[str | None] = mapped_column(String(63), nullable=True)

    node: Mapped[NodeRow] = relationship(back_populates="gpus")


class CertificationRow(Base):
    """A certification the control plane issued to a node (never one the node declared)."""

    __tablename__ = "node_certifications"
    __table_args__ = (UniqueConstraint("node_id", "key", name="uq_certifications_node_key"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    node_id: Mapped[int] = mapped_column(ForeignKey("nodes.id", ondelete="CASCADE"))
    key: Mapped[str] = mapped_column(String(63))
    value: Mapped[str] = mapped_column(String(63))
    issued_by: Mapped[str] = mapped_column(String(255))
    issued_at: Mapped[datetime] = mapped_column(UTCDateTime)

    node: Mapped[NodeRow] = relationship(back_populates="certifications")


class WorkloadRow(Base):
    """Workload names are unique per tenant: a tenant cannot learn another's names by trying."""

    __tablename__ = "workloads"
    __table_args__ = (UniqueConstraint("tenant_id", "name", name="uq_workloads_tenant_name"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(63))
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"), index=True)
    tags: Mapped[dict[str, str]] = mapped_column(JsonType)
    isolation: Mapped[str] = mapped_column(String(32))
    gpu_count: Mapped[int] = mapped_column(Integer)
    gpu_model: Mapped[str | None] = mapped_column(String(63), nullable=True)
    mig_profile: Mapped[str | None] = mapped_column(String(63), nullable=True)
    share_milli: Mapped[int | None] = mapped_column(Integer, nullable=True)
    gpu_nodes: Mapped[int] = mapped_column(Integer, default=1)  # > 1: a gang over that many nodes
    priority: Mapped[int] = mapped_column(Integer)
    command: Mapped[list[str]] = mapped_column(JsonType)
    status: Mapped[str] = mapped_column(String(32), index=True)
    reason: Mapped[str | None] = mapped_column(String(63), nullable=True)
    reason_details: Mapped[dict[str, Any] | None] = mapped_column(JsonType, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime)
    # False: its MIG slice or share shares a physical GPU with no other tenant (the tenant's
    # profile at submit time)
    co_residency: Mapped[bool] = mapped_column(Boolean, default=True, server_default=true())
    # issue 17: CPU (milli-cores) and memory (MiB) asked besides GPUs; 0: none
    cpu_milli: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    memory_mib: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # issue 17 §3: defragmentation may move it while it runs (it checkpoints itself)
    restartable: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    # issue 17 §4: a gang's {"level": …, "mode": …}; NULL: no topology request
    topology: Mapped[dict[str, str] | None] = mapped_column(JsonType, nullable=True)

    tenant: Mapped[TenantRow] = relationship()
    placement: Mapped[PlacementRow | None] = relationship(
        back_populates="workload", cascade="all, delete-orphan", uselist=False
    )


class PlacementRow(Base):
    """The capacity a workload holds right now; released (deleted) when it stops holding it.
    The history of placements lives in the events."""

    __tablename__ = "placements"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    workload_id: Mapped[int] = mapped_column(
        ForeignKey("workloads.id", ondelete="CASCADE"), unique=True
    )
    node_id: Mapped[int] = mapped_column(ForeignKey("nodes.id"), index=True)
    devices: Mapped[list[dict[str, Any]]] = mapped_column(JsonType)
    placed_at: Mapped[datetime] = mapped_column(UTCDateTime)
    # A gang placement: [{"node": name, "devices": [...]}, ...], the first being node/devices.
    members: Mapped[list[dict[str, Any]] | None] = mapped_column(JsonType, nullable=True)

    workload: Mapped[WorkloadRow] = relationship(back_populates="placement")
    node: Mapped[NodeRow] = relationship()
    # Every node the placement holds capacity on (the gang members' nodes too). A deleted
    # placement's links go with it by the foreign key's ON DELETE CASCADE (SQLite: foreign
    # keys on, store.db), not by the ORM loading them to delete them one statement later.
    nodes: Mapped[list[NodeRow]] = relationship(
        secondary=lambda: placement_nodes, passive_deletes=True
    )


placement_nodes = Table(
    "placement_nodes",
    Base.metadata,
    Column(
        "placement_id",
        Integer,
        ForeignKey("placements.id", ondelete="CASCADE"),
        primary_key=True,
    ),
    Column("node_id", Integer, ForeignKey("nodes.id"), primary_key=True, index=True),
)


class EventRow(Base):
    """Append-only: the migrations install triggers that refuse UPDATE and DELETE."""

    __tablename__ = "events"
    __table_args__ = (
        Index("ix_events_target", "target_type", "target_id"),
        Index("ix_events_action", "action"),
    )
    seq: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=False)
    ts: Mapped[datetime] = mapped_column(UTCDateTime)
    actor: Mapped[str] = mapped_column(String(255))
    action: Mapped[str] = mapped_column(String(63))
    target_type: Mapped[str] = mapped_column(String(32))
    target_id: Mapped[str] = mapped_column(String(255))
    outcome: Mapped[str] = mapped_column(String(16))
    details: Mapped[dict[str, Any]] = mapped_column(JsonType)


class UserRow(Base):
    """A person (local password + TOTP, or federated through OIDC)."""

    __tablename__ = "users"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    username: Mapped[str] = mapped_column(String(63), unique=True)
    source: Mapped[str] = mapped_column(String(16))  # local | oidc | bootstrap
    external_subject: Mapped[str | None] = mapped_column(String(255), nullable=True, unique=True)
    password_hash: Mapped[str | None] = mapped_column(String(255), nullable=True)
    roles: Mapped[list[str]] = mapped_column(JsonType)
    tenants: Mapped[list[str]] = mapped_column(JsonType)
    # KMS ciphertext (service/keys.py seal_secret; AAD users/<id>/totp_secret), never the seed
    totp_secret: Mapped[str | None] = mapped_column(Text, nullable=True)
    totp_enabled: Mapped[bool] = mapped_column(Boolean)
    totp_last_step: Mapped[int | None] = mapped_column(BigId, nullable=True)
    recovery_codes: Mapped[list[str]] = mapped_column(JsonType)  # SHA-256 of unused codes
    failed_logins: Mapped[int] = mapped_column(Integer)
    locked_until: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    disabled: Mapped[bool] = mapped_column(Boolean)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime)


class TokenRow(Base):
    """A bearer credential. Only its SHA-256 is kept; the token is shown once."""

    __tablename__ = "tokens"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    kind: Mapped[str] = mapped_column(String(16))  # api | session | enrollment | agent
    name: Mapped[str] = mapped_column(String(255))
    user_id: Mapped[int | None] = mapped_column(
        ForeignKey("users.id", ondelete="CASCADE"), nullable=True, index=True
    )
    node_name: Mapped[str | None] = mapped_column(String(63), nullable=True)
    roles: Mapped[list[str]] = mapped_column(JsonType)
    tenants: Mapped[list[str]] = mapped_column(JsonType)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    last_used_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    # The credential that minted this one (a session or an API token; None: a login, the
    # bootstrap token, an agent credential). Revoking an API token revokes what it minted.
    parent_id: Mapped[str | None] = mapped_column(String(32), nullable=True, index=True)

    user: Mapped[UserRow | None] = relationship()


class AuthFailureRow(Base):
    """Failed logins counted by what is not a user row: a source address (``addr:…``, the
    progressive delay) or a username no account has (``name:`` + SHA-256, locked exactly as
    an account would be, so a lockout does not tell which usernames exist)."""

    __tablename__ = "auth_failures"
    key: Mapped[str] = mapped_column(String(80), primary_key=True)
    failures: Mapped[int] = mapped_column(Integer)
    last_failure_at: Mapped[datetime] = mapped_column(UTCDateTime, index=True)
    locked_until: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)


class OidcLoginRow(Base):
    """An OIDC authorization request in flight (state → nonce and PKCE verifier). Nonce and
    verifier are KMS ciphertext (AAD ``oidc_logins/<state>/<column>``)."""

    __tablename__ = "oidc_logins"
    state: Mapped[str] = mapped_column(String(64), primary_key=True)
    nonce: Mapped[str] = mapped_column(Text)
    code_verifier: Mapped[str] = mapped_column(Text)
    return_to: Mapped[str | None] = mapped_column(String(255), nullable=True)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime)


class SinkRow(Base):
    """A SIEM export sink (issue 4) and its durable cursor: the last event ``seq`` the receiver
    acknowledged. ``config``'s secret fields (``SECRET_FIELDS``: HEC token, bearer token, key
    file) are KMS ciphertext (AAD ``siem_sinks/<id>/<field>``); the API shows them redacted."""

    __tablename__ = "siem_sinks"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(63), unique=True)
    kind: Mapped[str] = mapped_column(String(32))
    config: Mapped[dict[str, Any]] = mapped_column(JsonType)
    enabled: Mapped[bool] = mapped_column(Boolean)
    cursor: Mapped[int] = mapped_column(BigId)
    consecutive_failures: Mapped[int] = mapped_column(Integer)
    last_error: Mapped[str | None] = mapped_column(Text, nullable=True)
    last_attempt_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    last_success_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime)


class AuditHashRow(Base):
    """The Merkle log: leaf hashes and complete-subtree hashes in append order (issue 4; see
    ``proofplane.store.audit_log`` for the id layout). Written with its events, never updated."""

    __tablename__ = "audit_hashes"
    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=False)
    hash: Mapped[bytes] = mapped_column(LargeBinary(32))


class AuditCheckpointRow(Base):
    """A signed checkpoint (C2SP tlog-checkpoint in a signed note) as it was published."""

    __tablename__ = "audit_checkpoints"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tree_size: Mapped[int] = mapped_column(BigInteger, index=True)
    root_hash: Mapped[bytes] = mapped_column(LargeBinary(32))
    note: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)


class ExecutionJobRow(Base):
    """A workload's job in an execution engine (issue 7): which backend, the engine's job id,
    and the last state the engine reported. One row per dispatch; a workload re-placed after
    ``backend_unavailable`` or an eviction gets a new row."""

    __tablename__ = "execution_jobs"
    __table_args__ = (UniqueConstraint("backend", "job_id"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    workload_id: Mapped[int] = mapped_column(
        ForeignKey("workloads.id", ondelete="CASCADE"), index=True
    )
    backend: Mapped[str] = mapped_column(String(32))
    job_id: Mapped[str] = mapped_column(String(255))
    state: Mapped[str] = mapped_column(String(32), index=True)  # submitted|running|<terminal>
    message: Mapped[str | None] = mapped_column(Text, nullable=True)
    devices: Mapped[dict[str, Any] | None] = mapped_column(JsonType, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime)
    workload: Mapped[WorkloadRow] = relationship()


class NodeAttestationRow(Base):
    """A node's TPM identity (issue 5): the EK it enrolled with, the AK bound to it by
    credential activation, the pending activation challenge (its secret kept only as a hash),
    and what the last accepted quote showed (clock, for monotonicity)."""

    __tablename__ = "node_attestation"
    node_id: Mapped[int] = mapped_column(
        ForeignKey("nodes.id", ondelete="CASCADE"), primary_key=True
    )
    ek_public: Mapped[bytes] = mapped_column(LargeBinary)
    ek_sha256: Mapped[str] = mapped_column(String(64), unique=True)  # one EK, one node
    ek_cert_sha256: Mapped[str | None] = mapped_column(String(64), nullable=True)
    ak_public: Mapped[bytes] = mapped_column(LargeBinary)
    ak_name: Mapped[str] = mapped_column(String(140))
    challenge_sha256: Mapped[str | None] = mapped_column(String(64), nullable=True)
    challenge_expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    bound_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    last_clock: Mapped[dict[str, Any] | None] = mapped_column(JsonType, nullable=True)
    last_passed_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    quarantined: Mapped[bool] = mapped_column(Boolean, default=False)  # by attestation
    # enrolled by the demo's software-key attester: evidence proves nothing about hardware
    simulated: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime)


class AttestationNonceRow(Base):
    """A nonce spent by an attestation round (single use: a nonce met again is a replay).
    Before issue 20 every issued nonce was stored here when issued; now a nonce carries its
    own authenticated issue time (``attest.nonce``) and is stored when its evidence spends it."""

    __tablename__ = "attestation_nonces"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    node_id: Mapped[int] = mapped_column(ForeignKey("nodes.id", ondelete="CASCADE"), index=True)
    nonce: Mapped[str] = mapped_column(String(64), unique=True)  # hex
    issued_at: Mapped[datetime] = mapped_column(UTCDateTime, index=True)  # pruned by it
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime)
    used_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)


class AttestationNonceKeyRow(Base):
    """The key that authenticates the attestation nonces this deployment issues (issue 20,
    ``attest.nonce``), stored only as KMS ciphertext (``secrets`` key, bound to this row). Made
    on first use; every process and replica opens it once."""

    __tablename__ = "attestation_nonce_key"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    key_sealed: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)


class EvidenceRow(Base):
    """Every attestation attempt: the evidence record (replayable offline) and its verdict."""

    __tablename__ = "attestation_evidence"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    node_id: Mapped[int] = mapped_column(ForeignKey("nodes.id", ondelete="CASCADE"), index=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    ok: Mapped[bool] = mapped_column(Boolean)
    reasons: Mapped[list[str]] = mapped_column(JsonType)
    evidence_hash: Mapped[str] = mapped_column(String(64))
    policy_id: Mapped[str] = mapped_column(String(255))
    policy_hash: Mapped[str] = mapped_column(String(64))
    record: Mapped[dict[str, Any]] = mapped_column(JsonType)


class AttestationPolicyRow(Base):
    """The attestation policy of a node class (a node's ``node-class`` label, else
    ``default``). ``enforce``: admission and quarantine release only by passing attestation."""

    __tablename__ = "attestation_policies"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    node_class: Mapped[str] = mapped_column(String(63), unique=True)
    policy: Mapped[dict[str, Any]] = mapped_column(JsonType)
    policy_hash: Mapped[str] = mapped_column(String(64))
    enforce: Mapped[bool] = mapped_column(Boolean)
    updated_by: Mapped[str] = mapped_column(String(255))
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime)


class KmsKeyRow(Base):
    """A named KMS key (issue 13): its purpose, the backend holding its material, and which
    version new ciphertexts and signatures use. Material stays in the backend; each version's
    handle is in ``kms_key_versions``."""

    __tablename__ = "kms_keys"
    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(63), unique=True)
    purpose: Mapped[str] = mapped_column(String(16))
    algorithm: Mapped[str] = mapped_column(String(32))
    backend: Mapped[str] = mapped_column(String(16))
    current_version: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime)
    disabled_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)


class KmsKeyVersionRow(Base):
    """One version of a KMS key: the backend's opaque handle (the local keyring's sealed
    material, an HSM object's label, an OpenBao transit key), the public key of a ``sign``
    version, and when it was made, superseded and destroyed (handle erased)."""

    __tablename__ = "kms_key_versions"
    key_id: Mapped[int] = mapped_column(
        ForeignKey("kms_keys.id", ondelete="CASCADE"), primary_key=True
    )
    version: Mapped[int] = mapped_column(Integer, primary_key=True)
    handle: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    public_key: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    retired_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    destroyed_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)


class PkiCaRow(Base):
    """The agent CA (issue 13): its certificate, and its private key only as KMS ciphertext
    (``secrets`` key, bound to this row)."""

    __tablename__ = "pki_ca"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    cluster_id: Mapped[str] = mapped_column(String(63))
    cert_pem: Mapped[str] = mapped_column(Text)
    key_sealed: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)


class AgentCertRow(Base):
    """A certificate the agent CA issued to a node's agent, and its revocation."""

    __tablename__ = "agent_certificates"
    serial: Mapped[str] = mapped_column(String(40), primary_key=True)  # lowercase hex
    node_name: Mapped[str] = mapped_column(String(63), index=True)
    fingerprint: Mapped[str] = mapped_column(String(64))
    not_before: Mapped[datetime] = mapped_column(UTCDateTime)
    not_after: Mapped[datetime] = mapped_column(UTCDateTime)
    issued_at: Mapped[datetime] = mapped_column(UTCDateTime)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    revoke_reason: Mapped[str | None] = mapped_column(String(200), nullable=True)


class ChangeRequestRow(Base):
    """A typed change to something trust-bearing (issue 12): requested, approved by others,
    applied atomically; ``payload_sha256`` is what approvals are bound to."""

    __tablename__ = "change_requests"
    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    type: Mapped[str] = mapped_column(String(64), index=True)
    state: Mapped[str] = mapped_column(String(16), index=True)
    payload: Mapped[dict[str, Any]] = mapped_column(JsonType)
    payload_sha256: Mapped[str] = mapped_column(String(64))
    reason: Mapped[str] = mapped_column(Text, default="")
    emergency: Mapped[bool] = mapped_column(Boolean, default=False)
    tenant: Mapped[str | None] = mapped_column(String(63), nullable=True)  # its scope, if any
    requested_by: Mapped[str] = mapped_column(String(128))
    requested_at: Mapped[datetime] = mapped_column(UTCDateTime)
    last_edited_by: Mapped[str] = mapped_column(String(128))
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime)
    applied_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    applied_by: Mapped[str | None] = mapped_column(String(128), nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    # emergency changes: the post-implementation review (pending -> done), due by
    review_state: Mapped[str | None] = mapped_column(String(16), nullable=True)
    review_due_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    review_alerted_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)


class ChangeVoteRow(Base):
    """An approval or denial of a change request (or of an emergency change's review), bound
    to the payload hash it saw."""

    __tablename__ = "change_votes"
    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    change_id: Mapped[int] = mapped_column(
        ForeignKey("change_requests.id", ondelete="CASCADE"), index=True
    )
    decision: Mapped[str] = mapped_column(String(16))  # approve | deny | review
    by: Mapped[str] = mapped_column(String(128))
    roles: Mapped[list[str]] = mapped_column(JsonType)  # the voter's roles when voting
    at: Mapped[datetime] = mapped_column(UTCDateTime)
    comment: Mapped[str] = mapped_column(Text, default="")
    payload_sha256: Mapped[str] = mapped_column(String(64))


class ChangeRuleRow(Base):
    """An admin's approval rule for a change type (defaults live in the code)."""

    __tablename__ = "change_rules"
    type: Mapped[str] = mapped_column(String(64), primary_key=True)
    approvals: Mapped[int] = mapped_column(Integer)
    roles: Mapped[list[str]] = mapped_column(JsonType)
    updated_by: Mapped[str] = mapped_column(String(128))
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime)


class IncidentRow(Base):
    """An incident (issue 12): its subject (a node or a tenant), severity, owner, state, the
    post-mortem, and the evidence bundle captured when it was opened."""

    __tablename__ = "incidents"
    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    subject_type: Mapped[str] = mapped_column(String(16))  # node | tenant
    subject: Mapped[str] = mapped_column(String(63), index=True)
    severity: Mapped[str] = mapped_column(String(16))
    state: Mapped[str] = mapped_column(String(16), index=True)
    owner: Mapped[str] = mapped_column(String(128))
    reason: Mapped[str] = mapped_column(Text)
    opened_by: Mapped[str] = mapped_column(String(128))
    opened_at: Mapped[datetime] = mapped_column(UTCDateTime)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime)
    closed_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    postmortem: Mapped[str | None] = mapped_column(Text, nullable=True)
    bundle: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    bundle_sha256: Mapped[str | None] = mapped_column(String(64), nullable=True)


class RetiredEkRow(Base):
    """An endorsement key whose node was decommissioned: it may not enroll again without a new
    approved change (a retired disk or board must not come back quietly)."""

    __tablename__ = "retired_eks"
    ek_sha256: Mapped[str] = mapped_column(String(64), primary_key=True)
    node_name: Mapped[str] = mapped_column(String(63))
    retired_at: Mapped[datetime] = mapped_column(UTCDateTime)
    change_id: Mapped[int | None] = mapped_column(BigId, nullable=True)
    reason: Mapped[str] = mapped_column(Text, default="")


class SegmentRow(Base):
    """A tenant's network segment (issue 14): a VXLAN VNI and an InfiniBand PKey. One per
    tenant (``workload`` NULL), plus one per workload for a tenant whose profile asks for
    ``segment: per-workload``. Released rows stay: a released VNI or PKey cools down
    (``PROOFPLANE_SEGMENT_COOLDOWN_DAYS``) before it is handed out again. At most one active
    segment holds a VNI, and one a PKey (partial unique indexes)."""

    __tablename__ = "network_segments"
    __table_args__ = (
        Index(
            "uq_network_segments_active_vni",
            "vni",
            unique=True,
            sqlite_where=text("state = 'active'"),
            postgresql_where=text("state = 'active'"),
        ),
        Index(
            "uq_network_segments_active_pkey",
            "pkey",
            unique=True,
            sqlite_where=text("state = 'active'"),
            postgresql_where=text("state = 'active'"),
        ),
        Index("ix_network_segments_tenant", "tenant", "state"),
    )
    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    tenant: Mapped[str] = mapped_column(String(63))
    workload: Mapped[str | None] = mapped_column(String(63), nullable=True)
    workload_id: Mapped[int | None] = mapped_column(Integer, nullable=True, index=True)
    vni: Mapped[int] = mapped_column(Integer)
    pkey: Mapped[int] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(16))  # active | released
    manual: Mapped[bool] = mapped_column(Boolean, default=False)
    allocated_at: Mapped[datetime] = mapped_column(UTCDateTime)
    released_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True, index=True)


class EndpointRow(Base):
    """A workload's interface on its segment: a stable overlay IP and MAC, kept while the
    workload lives (it keeps them when it is evicted and placed again), removed when it ends.
    ``member``: the gang member (one endpoint per node of a gang); ``node``: where that member
    runs now (NULL while the workload waits)."""

    __tablename__ = "network_endpoints"
    __table_args__ = (
        UniqueConstraint("workload_id", "member", name="uq_network_endpoints_member"),
        UniqueConstraint("vni", "ip", name="uq_network_endpoints_vni_ip"),
    )
    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    workload_id: Mapped[int] = mapped_column(
        ForeignKey("workloads.id", ondelete="CASCADE"), index=True
    )
    member: Mapped[int] = mapped_column(Integer)
    key: Mapped[str] = mapped_column(String(140))  # the pure core's Endpoint.workload
    tenant: Mapped[str] = mapped_column(String(63))
    vni: Mapped[int] = mapped_column(Integer, index=True)
    ip: Mapped[str] = mapped_column(String(45))
    mac: Mapped[str] = mapped_column(String(17))
    node: Mapped[str | None] = mapped_column(String(63), nullable=True, index=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)


class NodeNetworkRow(Base):
    """A node's underlay (VTEP address, underlay device, HCA port GUIDs; ``simulated`` for the
    demo's made-up ones), the desired network state's generation and hashes, and what its
    agent last reported having applied."""

    __tablename__ = "node_network"
    node_id: Mapped[int] = mapped_column(
        ForeignKey("nodes.id", ondelete="CASCADE"), primary_key=True
    )
    vtep: Mapped[str] = mapped_column(String(45), unique=True)
    underlay_dev: Mapped[str] = mapped_column(String(15))
    hca_guids: Mapped[list[str]] = mapped_column(JsonType)
    simulated: Mapped[bool] = mapped_column(Boolean, default=False)
    source: Mapped[str] = mapped_column(String(16))  # cluster-file | agent | api
    desired_generation: Mapped[int] = mapped_column(BigInteger, default=0)
    desired_sha256: Mapped[str | None] = mapped_column(String(64), nullable=True)
    expected_ruleset_sha256: Mapped[str | None] = mapped_column(String(64), nullable=True)
    # VNI (as text) → the desired generation that added the segment to the node
    segment_since: Mapped[dict[str, int]] = mapped_column(JsonType)
    applied_generation: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    applied_sha256: Mapped[str | None] = mapped_column(String(64), nullable=True)
    ruleset_sha256: Mapped[str | None] = mapped_column(String(64), nullable=True)
    self_check: Mapped[dict[str, Any] | None] = mapped_column(JsonType, nullable=True)
    reported_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    # whether the report differs from the desired state (service.netstate.drift_reasons), kept
    # with every report and every new desired generation; NULL: the agent never reported
    drift: Mapped[bool | None] = mapped_column(Boolean, nullable=True)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime)


# --- telemetry (issue 15) ------------------------------------------------------------------


#: The storage column of each telemetry field (``meter.fields.FIELDS``, in its order): the
#: DCGM name without ``DCGM_FI_``, lower case (``DCGM_FI_DEV_POWER_USAGE`` → ``dev_power_usage``).
#: A sample is one row with one nullable column per field (a field the device did not report
#: is NULL): a new field is a new column (a migration), never a new row per reading.
TELEMETRY_COLUMNS: dict[str, str] = {
    name: name.removeprefix("DCGM_FI_").lower() for name in TELEMETRY_FIELDS
}


def _field_columns() -> list[Column[Any]]:
    return [Column(c, Float, nullable=True) for c in TELEMETRY_COLUMNS.values()]


class TelemetrySeriesRow(Base):
    """One device as one placement holder saw it (``share``: the part of the device it held;
    ``workload``/``tenant`` None: nobody). Samples name their series, so a device's sample
    is its series, its time and its values."""

    __tablename__ = "telemetry_device_series"
    __table_args__ = (
        UniqueConstraint("key", name="uq_telemetry_device_series_key"),
        Index("ix_telemetry_device_series_node", "node"),
        Index("ix_telemetry_device_series_workload", "workload"),
        Index("ix_telemetry_device_series_device", "gpu_uuid", "gi_id"),
    )
    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    key: Mapped[str] = mapped_column(String(400))
    node: Mapped[str] = mapped_column(String(63))
    gpu_uuid: Mapped[str] = mapped_column(String(64))
    gi_id: Mapped[int | None] = mapped_column(Integer, nullable=True)
    profile: Mapped[str | None] = mapped_column(String(32), nullable=True)
    workload: Mapped[str | None] = mapped_column(String(63), nullable=True)
    tenant: Mapped[str | None] = mapped_column(String(63), nullable=True)
    share: Mapped[float] = mapped_column(Float)
    simulated: Mapped[bool] = mapped_column(Boolean)
    # the start (Unix ms) of the newest hour it has samples in: retention drops a series once
    # that hour is past the raw window (no index on the samples' series_id needed)
    seen_ms: Mapped[int] = mapped_column(BigInteger)


#: A raw sample, kept PROOFPLANE_TELEMETRY_RAW_HOURS (``ts``: Unix milliseconds): one row per
#: device series and time, one column per field (``TELEMETRY_COLUMNS``). The key, time first,
#: is the table (SQLite: WITHOUT ROWID): an interval's samples append to the same pages, and
#: every reader asks for a time range. It makes a re-sent sample a no-op (a re-sent one with
#: more fields fills the missing ones).
telemetry_samples = Table(
    "telemetry_samples",
    Base.metadata,
    Column("ts", BigInteger, primary_key=True, autoincrement=False),
    Column("series_id", BigId, primary_key=True, autoincrement=False),
    *_field_columns(),
    sqlite_with_rowid=False,
)

#: The newest sample of each device (``key``: node, gpu_uuid and gi_id: a node's devices sit
#: together), with the holder then when it was the only one: what dashboards, health and
#: /metrics read. A field the newest sample lacks keeps its previous value.
telemetry_device_latest = Table(
    "telemetry_device_latest",
    Base.metadata,
    Column("key", String(160), primary_key=True),
    Column("node", String(63), nullable=False),
    Column("gpu_uuid", String(64), nullable=False),
    Column("gi_id", Integer, nullable=True),
    Column("profile", String(32), nullable=True),
    Column("ts", BigInteger, nullable=False),
    Column("workload", String(63), nullable=True),
    Column("tenant", String(63), nullable=True),
    Column("simulated", Boolean, nullable=False),
    *_field_columns(),
    Index("ix_telemetry_device_latest_node", "node"),
    sqlite_with_rowid=False,
)


class TelemetryHourlyRow(Base):
    """An hourly rollup (``meter.rollup``), kept 400 days."""

    __tablename__ = "telemetry_hourly"
    __table_args__ = (
        Index("ix_telemetry_hourly_hour", "hour"),
        Index("ix_telemetry_hourly_tenant", "tenant", "hour"),
    )
    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    hour: Mapped[datetime] = mapped_column(UTCDateTime)
    node: Mapped[str] = mapped_column(String(63))
    gpu_uuid: Mapped[str] = mapped_column(String(64))
    gi_id: Mapped[int | None] = mapped_column(Integer, nullable=True)
    field: Mapped[str] = mapped_column(String(64))
    workload: Mapped[str | None] = mapped_column(String(63), nullable=True)
    tenant: Mapped[str | None] = mapped_column(String(63), nullable=True)
    count: Mapped[int] = mapped_column(Integer)
    sum: Mapped[float] = mapped_column(Float)
    min: Mapped[float] = mapped_column(Float)
    max: Mapped[float] = mapped_column(Float)
    last: Mapped[float] = mapped_column(Float)
    simulated: Mapped[bool] = mapped_column(Boolean)


class GpuHealthRow(Base):
    """A GPU drained for its health (``meter.health``): no new work goes to it until an
    operator recovers it. Keyed by UUID, so a node's inventory update keeps it."""

    __tablename__ = "gpu_health"
    __table_args__ = (Index("ix_gpu_health_node", "node"),)
    gpu_uuid: Mapped[str] = mapped_column(String(64), primary_key=True)
    node: Mapped[str] = mapped_column(String(63))
    state: Mapped[str] = mapped_column(String(16))  # drained
    cause: Mapped[str] = mapped_column(String(32))
    message: Mapped[str] = mapped_column(Text)
    xid: Mapped[int | None] = mapped_column(Integer, nullable=True)
    device_lost: Mapped[bool] = mapped_column(Boolean)
    since: Mapped[datetime] = mapped_column(UTCDateTime)
