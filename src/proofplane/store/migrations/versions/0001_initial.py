"""initial schema

Revision ID: 0001
Revises:
Create Date: 2026-11-23

Timestamps are stored as naive UTC (the ORM converts); JSON is JSONB on PostgreSQL.
The events table is append-only: triggers refuse UPDATE and DELETE on both databases.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")

_SQLITE_TRIGGERS = [
    """CREATE TRIGGER events_no_update BEFORE UPDATE ON events
       BEGIN SELECT RAISE(ABORT, 'events are append-only'); END""",
    """CREATE TRIGGER events_no_delete BEFORE DELETE ON events
       BEGIN SELECT RAISE(ABORT, 'events are append-only'); END""",
]
_POSTGRES_TRIGGERS = [
    """CREATE FUNCTION proofplane_events_append_only() RETURNS trigger AS $$
       BEGIN RAISE EXCEPTION 'events are append-only'; END; $$ LANGUAGE plpgsql""",
    """CREATE TRIGGER events_append_only BEFORE UPDATE OR DELETE ON events
       FOR EACH ROW EXECUTE FUNCTION proofplane_events_append_only()""",
    """CREATE TRIGGER events_no_truncate BEFORE TRUNCATE ON events
       FOR EACH STATEMENT EXECUTE FUNCTION proofplane_events_append_only()""",
]


def upgrade() -> None:
    op.create_table(
        "events",
        sa.Column(
            "seq",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=False,
            nullable=False,
        ),
        sa.Column("ts", sa.DateTime(), nullable=False),
        sa.Column("actor", sa.String(length=255), nullable=False),
        sa.Column("action", sa.String(length=63), nullable=False),
        sa.Column("target_type", sa.String(length=32), nullable=False),
        sa.Column("target_id", sa.String(length=255), nullable=False),
        sa.Column("outcome", sa.String(length=16), nullable=False),
        sa.Column("details", JSON, nullable=False),
        sa.PrimaryKeyConstraint("seq"),
    )
    op.create_index("ix_events_action", "events", ["action"], unique=False)
    op.create_index("ix_events_target", "events", ["target_type", "target_id"], unique=False)
    op.create_table(
        "nodes",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=63), nullable=False),
        sa.Column("region", sa.String(length=63), nullable=False),
        sa.Column("zone", sa.String(length=63), nullable=False),
        sa.Column("rack", sa.String(length=63), nullable=True),
        sa.Column("labels", JSON, nullable=False),
        sa.Column("state", sa.String(length=32), nullable=False),
        sa.Column("state_reason", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("name"),
    )
    op.create_index(op.f("ix_nodes_region"), "nodes", ["region"], unique=False)
    op.create_index(op.f("ix_nodes_state"), "nodes", ["state"], unique=False)
    op.create_index(op.f("ix_nodes_zone"), "nodes", ["zone"], unique=False)
    op.create_table(
        "tenants",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=63), nullable=False),
        sa.Column("description", sa.Text(), nullable=False),
        sa.Column("profile", JSON, nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("name"),
    )
    op.create_table(
        "gpus",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("node_id", sa.Integer(), nullable=False),
        sa.Column("index", sa.Integer(), nullable=False),
        sa.Column("uuid", sa.String(length=64), nullable=False),
        sa.Column("model", sa.String(length=63), nullable=False),
        sa.Column("memory_mb", sa.Integer(), nullable=False),
        sa.Column("mig_enabled", sa.Boolean(), nullable=False),
        sa.Column("mig_instances", JSON, nullable=False),
        sa.Column("vbios_version", sa.String(length=63), nullable=True),
        sa.Column("driver_version", sa.String(length=63), nullable=True),
        sa.ForeignKeyConstraint(["node_id"], ["nodes.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("node_id", "index", name="uq_gpus_node_index"),
        sa.UniqueConstraint("uuid"),
    )
    op.create_table(
        "node_certifications",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("node_id", sa.Integer(), nullable=False),
        sa.Column("key", sa.String(length=63), nullable=False),
        sa.Column("value", sa.String(length=63), nullable=False),
        sa.Column("issued_by", sa.String(length=255), nullable=False),
        sa.Column("issued_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(["node_id"], ["nodes.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("node_id", "key", name="uq_certifications_node_key"),
    )
    op.create_table(
        "workloads",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=63), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("tags", JSON, nullable=False),
        sa.Column("isolation", sa.String(length=32), nullable=False),
        sa.Column("gpu_count", sa.Integer(), nullable=False),
        sa.Column("gpu_model", sa.String(length=63), nullable=True),
        sa.Column("mig_profile", sa.String(length=63), nullable=True),
        sa.Column("share_milli", sa.Integer(), nullable=True),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("command", JSON, nullable=False),
        sa.Column("status", sa.String(length=32), nullable=False),
        sa.Column("reason", sa.String(length=63), nullable=True),
        sa.Column("reason_details", JSON, nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"],
            ["tenants.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("tenant_id", "name", name="uq_workloads_tenant_name"),
    )
    op.create_index(op.f("ix_workloads_status"), "workloads", ["status"], unique=False)
    op.create_index(op.f("ix_workloads_tenant_id"), "workloads", ["tenant_id"], unique=False)
    op.create_table(
        "placements",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("workload_id", sa.Integer(), nullable=False),
        sa.Column("node_id", sa.Integer(), nullable=False),
        sa.Column("devices", JSON, nullable=False),
        sa.Column("placed_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(
            ["node_id"],
            ["nodes.id"],
        ),
        sa.ForeignKeyConstraint(["workload_id"], ["workloads.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("workload_id"),
    )
    op.create_index(op.f("ix_placements_node_id"), "placements", ["node_id"], unique=False)
    dialect = op.get_bind().dialect.name
    for statement in _POSTGRES_TRIGGERS if dialect == "postgresql" else _SQLITE_TRIGGERS:
        op.execute(statement)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP TRIGGER IF EXISTS events_no_truncate ON events")
        op.execute("DROP TRIGGER IF EXISTS events_append_only ON events")
        op.execute("DROP FUNCTION IF EXISTS proofplane_events_append_only()")
    op.drop_index(op.f("ix_placements_node_id"), table_name="placements")
    op.drop_table("placements")
    op.drop_index(op.f("ix_workloads_tenant_id"), table_name="workloads")
    op.drop_index(op.f("ix_workloads_status"), table_name="workloads")
    op.drop_table("workloads")
    op.drop_table("node_certifications")
    op.drop_table("gpus")
    op.drop_table("tenants")
    op.drop_index(op.f("ix_nodes_zone"), table_name="nodes")
    op.drop_index(op.f("ix_nodes_state"), table_name="nodes")
    op.drop_index(op.f("ix_nodes_region"), table_name="nodes")
    op.drop_table("nodes")
    op.drop_index("ix_events_target", table_name="events")
    op.drop_index("ix_events_action", table_name="events")
    op.drop_table("events")
