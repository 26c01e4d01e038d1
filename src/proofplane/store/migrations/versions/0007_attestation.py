"""attestation: node TPM identity, nonces, evidence, policies

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-23

Enrollment (EK, AK bound by credential activation), single-use nonces, every attestation
attempt with its verdict, and the attestation policy per node class (issue 5).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    op.create_table(
        "node_attestation",
        sa.Column("node_id", sa.Integer(), nullable=False),
        sa.Column("ek_public", sa.LargeBinary(), nullable=False),
        sa.Column("ek_sha256", sa.String(length=64), nullable=False),
        sa.Column("ek_cert_sha256", sa.String(length=64), nullable=True),
        sa.Column("ak_public", sa.LargeBinary(), nullable=False),
        sa.Column("ak_name", sa.String(length=140), nullable=False),
        sa.Column("challenge_sha256", sa.String(length=64), nullable=True),
        sa.Column("challenge_expires_at", sa.DateTime(), nullable=True),
        sa.Column("bound_at", sa.DateTime(), nullable=True),
        sa.Column("last_clock", JSON, nullable=True),
        sa.Column("last_passed_at", sa.DateTime(), nullable=True),
        sa.Column("quarantined", sa.Boolean(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(["node_id"], ["nodes.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("node_id"),
        sa.UniqueConstraint("ek_sha256"),
    )
    op.create_table(
        "attestation_nonces",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("node_id", sa.Integer(), nullable=False),
        sa.Column("nonce", sa.String(length=64), nullable=False),
        sa.Column("issued_at", sa.DateTime(), nullable=False),
        sa.Column("expires_at", sa.DateTime(), nullable=False),
        sa.Column("used_at", sa.DateTime(), nullable=True),
        sa.ForeignKeyConstraint(["node_id"], ["nodes.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("nonce"),
    )
    op.create_index("ix_attestation_nonces_node_id", "attestation_nonces", ["node_id"])
    op.create_table(
        "attestation_evidence",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("node_id", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("ok", sa.Boolean(), nullable=False),
        sa.Column("reasons", JSON, nullable=False),
        sa.Column("evidence_hash", sa.String(length=64), nullable=False),
        sa.Column("policy_id", sa.String(length=255), nullable=False),
        sa.Column("policy_hash", sa.String(length=64), nullable=False),
        sa.Column("record", JSON, nullable=False),
        sa.ForeignKeyConstraint(["node_id"], ["nodes.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_attestation_evidence_node_id", "attestation_evidence", ["node_id"])
    op.create_table(
        "attestation_policies",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("node_class", sa.String(length=63), nullable=False),
        sa.Column("policy", JSON, nullable=False),
        sa.Column("policy_hash", sa.String(length=64), nullable=False),
        sa.Column("enforce", sa.Boolean(), nullable=False),
        sa.Column("updated_by", sa.String(length=255), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("node_class"),
    )


def downgrade() -> None:
    op.drop_table("attestation_policies")
    op.drop_index("ix_attestation_evidence_node_id", table_name="attestation_evidence")
    op.drop_table("attestation_evidence")
    op.drop_index("ix_attestation_nonces_node_id", table_name="attestation_nonces")
    op.drop_table("attestation_nonces")
    op.drop_table("node_attestation")
