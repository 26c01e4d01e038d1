"""Network segmentation (issue 14): tenant segments (VNI + PKey, with their release times for
the cool-down), workload endpoints (stable overlay IP and MAC), node underlay facts with the
desired and applied network state; deleted tenants keep their row (``deleted_at``).

Tenants that exist before this revision get their segment when they first need one (their
next placed workload), through the service, so that the allocation is an audited event like
any other.

Revision ID: 0015
Revises: 0014
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")
ACTIVE = sa.text("state = 'active'")


def upgrade() -> None:
    op.add_column("tenants", sa.Column("deleted_at", sa.DateTime(), nullable=True))
    op.create_table(
        "network_segments",
        sa.Column("id", BigId, autoincrement=True, nullable=False),
        sa.Column("tenant", sa.String(length=63), nullable=False),
        sa.Column("workload", sa.String(length=63), nullable=True),
        sa.Column("workload_id", sa.Integer(), nullable=True),
        sa.Column("vni", sa.Integer(), nullable=False),
        sa.Column("pkey", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("manual", sa.Boolean(), nullable=False),
        sa.Column("allocated_at", sa.DateTime(), nullable=False),
        sa.Column("released_at", sa.DateTime(), nullable=True),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index(
        "uq_network_segments_active_vni",
        "network_segments",
        ["vni"],
        unique=True,
        sqlite_where=ACTIVE,
        postgresql_where=ACTIVE,
    )
    op.create_index(
        "uq_network_segments_active_pkey",
        "network_segments",
        ["pkey"],
        unique=True,
        sqlite_where=ACTIVE,
        postgresql_where=ACTIVE,
    )
    op.create_index("ix_network_segments_tenant", "network_segments", ["tenant", "state"])
    op.create_index(
        op.f("ix_network_segments_workload_id"), "network_segments", ["workload_id"], unique=False
    )
    op.create_index(
        op.f("ix_network_segments_released_at"), "network_segments", ["released_at"], unique=False
    )
    op.create_table(
        "network_endpoints",
        sa.Column("id", BigId, autoincrement=True, nullable=False),
        sa.Column("workload_id", sa.Integer(), nullable=False),
        sa.Column("member", sa.Integer(), nullable=False),
        sa.Column("key", sa.String(length=140), nullable=False),
        sa.Column("tenant", sa.String(length=63), nullable=False),
        sa.Column("vni", sa.Integer(), nullable=False),
        sa.Column("ip", sa.String(length=45), nullable=False),
        sa.Column("mac", sa.String(length=17), nullable=False),
        sa.Column("node", sa.String(length=63), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(["workload_id"], ["workloads.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("workload_id", "member", name="uq_network_endpoints_member"),
        sa.UniqueConstraint("vni", "ip", name="uq_network_endpoints_vni_ip"),
    )
    op.create_index(
        op.f("ix_network_endpoints_workload_id"), "network_endpoints", ["workload_id"], unique=False
    )
    op.create_index(op.f("ix_network_endpoints_vni"), "network_endpoints", ["vni"], unique=False)
    op.create_index(op.f("ix_network_endpoints_node"), "network_endpoints", ["node"], unique=False)
    op.create_table(
        "node_network",
        sa.Column("node_id", sa.Integer(), nullable=False),
        sa.Column("vtep", sa.String(length=45), nullable=False),
        sa.Column("underlay_dev", sa.String(length=15), nullable=False),
        sa.Column("hca_guids", JSON, nullable=False),
        sa.Column("simulated", sa.Boolean(), nullable=False),
        sa.Column("source", sa.String(length=16), nullable=False),
        sa.Column("desired_generation", sa.BigInteger(), nullable=False),
        sa.Column("desired_sha256", sa.String(length=64), nullable=True),
        sa.Column("expected_ruleset_sha256", sa.String(length=64), nullable=True),
        sa.Column("segment_since", JSON, nullable=False),
        sa.Column("applied_generation", sa.BigInteger(), nullable=True),
        sa.Column("applied_sha256", sa.String(length=64), nullable=True),
        sa.Column("ruleset_sha256", sa.String(length=64), nullable=True),
        sa.Column("self_check", JSON, nullable=True),
        sa.Column("reported_at", sa.DateTime(), nullable=True),
        sa.Column("drift", sa.Boolean(), nullable=True),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(["node_id"], ["nodes.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("node_id"),
        sa.UniqueConstraint("vtep"),
    )


def downgrade() -> None:
    op.drop_table("node_network")
    op.drop_index(op.f("ix_network_endpoints_node"), table_name="network_endpoints")
    op.drop_index(op.f("ix_network_endpoints_vni"), table_name="network_endpoints")
    op.drop_index(op.f("ix_network_endpoints_workload_id"), table_name="network_endpoints")
    op.drop_table("network_endpoints")
    op.drop_index(op.f("ix_network_segments_released_at"), table_name="network_segments")
    op.drop_index(op.f("ix_network_segments_workload_id"), table_name="network_segments")
    op.drop_index("ix_network_segments_tenant", table_name="network_segments")
    op.drop_index("uq_network_segments_active_pkey", table_name="network_segments")
    op.drop_index("uq_network_segments_active_vni", table_name="network_segments")
    op.drop_table("network_segments")
    # ALTER TABLE … DROP COLUMN in place (SQLite 3.35+): a batch copy of tenants would trip
    # the workloads' foreign key
    op.drop_column("tenants", "deleted_at")
