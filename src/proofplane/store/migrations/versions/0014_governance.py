"""Governance (issue 12): change requests, their votes and approval rules; incidents; retired
endorsement keys.

Revision ID: 0014
Revises: 0013
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    op.create_table(
        "change_requests",
        sa.Column("id", BigId, autoincrement=True, nullable=False),
        sa.Column("type", sa.String(length=64), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("payload", JSON, nullable=False),
        sa.Column("payload_sha256", sa.String(length=64), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("emergency", sa.Boolean(), nullable=False),
        sa.Column("tenant", sa.String(length=63), nullable=True),
        sa.Column("requested_by", sa.String(length=128), nullable=False),
        sa.Column("requested_at", sa.DateTime(), nullable=False),
        sa.Column("last_edited_by", sa.String(length=128), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.Column("expires_at", sa.DateTime(), nullable=False),
        sa.Column("applied_at", sa.DateTime(), nullable=True),
        sa.Column("applied_by", sa.String(length=128), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("review_state", sa.String(length=16), nullable=True),
        sa.Column("review_due_at", sa.DateTime(), nullable=True),
        sa.Column("review_alerted_at", sa.DateTime(), nullable=True),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index(op.f("ix_change_requests_type"), "change_requests", ["type"], unique=False)
    op.create_index(op.f("ix_change_requests_state"), "change_requests", ["state"], unique=False)
    op.create_table(
        "change_votes",
        sa.Column("id", BigId, autoincrement=True, nullable=False),
        sa.Column("change_id", BigId, nullable=False),
        sa.Column("decision", sa.String(length=16), nullable=False),
        sa.Column("by", sa.String(length=128), nullable=False),
        sa.Column("roles", JSON, nullable=False),
        sa.Column("at", sa.DateTime(), nullable=False),
        sa.Column("comment", sa.Text(), nullable=False),
        sa.Column("payload_sha256", sa.String(length=64), nullable=False),
        sa.ForeignKeyConstraint(["change_id"], ["change_requests.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index(op.f("ix_change_votes_change_id"), "change_votes", ["change_id"], unique=False)
    op.create_table(
        "change_rules",
        sa.Column("type", sa.String(length=64), nullable=False),
        sa.Column("approvals", sa.Integer(), nullable=False),
        sa.Column("roles", JSON, nullable=False),
        sa.Column("updated_by", sa.String(length=128), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("type"),
    )
    op.create_table(
        "incidents",
        sa.Column("id", BigId, autoincrement=True, nullable=False),
        sa.Column("subject_type", sa.String(length=16), nullable=False),
        sa.Column("subject", sa.String(length=63), nullable=False),
        sa.Column("severity", sa.String(length=16), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("owner", sa.String(length=128), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("opened_by", sa.String(length=128), nullable=False),
        sa.Column("opened_at", sa.DateTime(), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.Column("closed_at", sa.DateTime(), nullable=True),
        sa.Column("postmortem", sa.Text(), nullable=True),
        sa.Column("bundle", sa.LargeBinary(), nullable=True),
        sa.Column("bundle_sha256", sa.String(length=64), nullable=True),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index(op.f("ix_incidents_subject"), "incidents", ["subject"], unique=False)
    op.create_index(op.f("ix_incidents_state"), "incidents", ["state"], unique=False)
    op.create_table(
        "retired_eks",
        sa.Column("ek_sha256", sa.String(length=64), nullable=False),
        sa.Column("node_name", sa.String(length=63), nullable=False),
        sa.Column("retired_at", sa.DateTime(), nullable=False),
        sa.Column("change_id", BigId, nullable=True),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("ek_sha256"),
    )


def downgrade() -> None:
    op.drop_table("retired_eks")
    op.drop_index(op.f("ix_incidents_state"), table_name="incidents")
    op.drop_index(op.f("ix_incidents_subject"), table_name="incidents")
    op.drop_table("incidents")
    op.drop_table("change_rules")
    op.drop_index(op.f("ix_change_votes_change_id"), table_name="change_votes")
    op.drop_table("change_votes")
    op.drop_index(op.f("ix_change_requests_state"), table_name="change_requests")
    op.drop_index(op.f("ix_change_requests_type"), table_name="change_requests")
    op.drop_table("change_requests")
