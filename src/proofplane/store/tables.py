"""SQLAlchemy tables. The schema itself is owned by the Alembic migrations in ``migrations/``;
these classes must match them (``tests/test_migrations.py`` compares the two)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

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
    priority: Mapped[int] = mapped_column(Integer)
    command: Mapped[list[str]] = mapped_column(JsonType)
    status: Mapped[str] = mapped_column(String(32), index=True)
    reason: Mapped[str | None] = mapped_column(String(63), nullable=True)
    reason_details: Mapped[dict[str, Any] | None] = mapped_column(JsonType, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime)

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

    workload: Mapped[WorkloadRow] = relationship(back_populates="placement")
    node: Mapped[NodeRow] = relationship()


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
    totp_secret: Mapped[str | None] = mapped_column(String(64), nullable=True)
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

    user: Mapped[UserRow | None] = relationship()


class OidcLoginRow(Base):
    """An OIDC authorization request in flight (state → nonce and PKCE verifier)."""

    __tablename__ = "oidc_logins"
    state: Mapped[str] = mapped_column(String(64), primary_key=True)
    nonce: Mapped[str] = mapped_column(String(64))
    code_verifier: Mapped[str] = mapped_column(String(128))
    return_to: Mapped[str | None] = mapped_column(String(255), nullable=True)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime)
