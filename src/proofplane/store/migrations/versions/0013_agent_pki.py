"""The agent CA and the certificates it issued (issue 13, part 5).

Revision ID: 0013
Revises: 0012
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "pki_ca",
        sa.Column("id", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("cluster_id", sa.String(length=63), nullable=False),
        sa.Column("cert_pem", sa.Text(), nullable=False),
        sa.Column("key_sealed", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_table(
        "agent_certificates",
        sa.Column("serial", sa.String(length=40), nullable=False),
        sa.Column("node_name", sa.String(length=63), nullable=False),
        sa.Column("fingerprint", sa.String(length=64), nullable=False),
        sa.Column("not_before", sa.DateTime(), nullable=False),
        sa.Column("not_after", sa.DateTime(), nullable=False),
        sa.Column("issued_at", sa.DateTime(), nullable=False),
        sa.Column("revoked_at", sa.DateTime(), nullable=True),
        sa.Column("revoke_reason", sa.String(length=200), nullable=True),
        sa.PrimaryKeyConstraint("serial"),
    )
    op.create_index(
        op.f("ix_agent_certificates_node_name"), "agent_certificates", ["node_name"], unique=False
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_agent_certificates_node_name"), table_name="agent_certificates")
    op.drop_table("agent_certificates")
    op.drop_table("pki_ca")
