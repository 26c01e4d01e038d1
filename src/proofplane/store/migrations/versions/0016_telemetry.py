"""Telemetry (issue 15): raw samples by series, the newest reading per device and field,
hourly rollups, drained GPUs, and each tenant's idle policy.

Revision ID: 0016
Revises: 0014 (re-pointed to 0015 when the network migration lands)
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    op.create_table(
        "telemetry_series",
        sa.Column("id", BigId, autoincrement=True, nullable=False),
        sa.Column("key", sa.String(length=400), nullable=False),
        sa.Column("node", sa.String(length=63), nullable=False),
        sa.Column("gpu_uuid", sa.String(length=64), nullable=False),
        sa.Column("gi_id", sa.Integer(), nullable=True),
        sa.Column("profile", sa.String(length=32), nullable=True),
        sa.Column("field", sa.String(length=64), nullable=False),
        sa.Column("workload", sa.String(length=63), nullable=True),
        sa.Column("tenant", sa.String(length=63), nullable=True),
        sa.Column("share", sa.Float(), nullable=False),
        sa.Column("simulated", sa.Boolean(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("key", name="uq_telemetry_series_key"),
    )
    op.create_index("ix_telemetry_series_node", "telemetry_series", ["node"])
    op.create_index("ix_telemetry_series_workload", "telemetry_series", ["workload"])
    op.create_index("ix_telemetry_series_device", "telemetry_series", ["gpu_uuid", "field"])
    op.create_table(
        "telemetry_raw",
        sa.Column("series_id", BigId, nullable=False),
        sa.Column("ts", sa.BigInteger(), nullable=False),  # Unix milliseconds
        sa.Column("value", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("series_id", "ts"),
        sqlite_with_rowid=False,  # the key is the table: one B-tree less per reading
    )
    op.create_index("ix_telemetry_raw_ts", "telemetry_raw", ["ts"])
    op.create_table(
        "telemetry_latest",
        sa.Column("key", sa.String(length=200), nullable=False),
        sa.Column("node", sa.String(length=63), nullable=False),
        sa.Column("gpu_uuid", sa.String(length=64), nullable=False),
        sa.Column("gi_id", sa.Integer(), nullable=True),
        sa.Column("profile", sa.String(length=32), nullable=True),
        sa.Column("field", sa.String(length=64), nullable=False),
        sa.Column("ts", sa.BigInteger(), nullable=False),
        sa.Column("value", sa.Float(), nullable=False),
        sa.Column("workload", sa.String(length=63), nullable=True),
        sa.Column("tenant", sa.String(length=63), nullable=True),
        sa.Column("simulated", sa.Boolean(), nullable=False),
        sa.PrimaryKeyConstraint("key"),
    )
    op.create_index("ix_telemetry_latest_node", "telemetry_latest", ["node"])
    op.create_table(
        "telemetry_hourly",
        sa.Column("id", BigId, autoincrement=True, nullable=False),
        sa.Column("hour", sa.DateTime(), nullable=False),
        sa.Column("node", sa.String(length=63), nullable=False),
        sa.Column("gpu_uuid", sa.String(length=64), nullable=False),
        sa.Column("gi_id", sa.Integer(), nullable=True),
        sa.Column("field", sa.String(length=64), nullable=False),
        sa.Column("workload", sa.String(length=63), nullable=True),
        sa.Column("tenant", sa.String(length=63), nullable=True),
        sa.Column("count", sa.Integer(), nullable=False),
        sa.Column("sum", sa.Float(), nullable=False),
        sa.Column("min", sa.Float(), nullable=False),
        sa.Column("max", sa.Float(), nullable=False),
        sa.Column("last", sa.Float(), nullable=False),
        sa.Column("simulated", sa.Boolean(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_telemetry_hourly_hour", "telemetry_hourly", ["hour"])
    op.create_index("ix_telemetry_hourly_tenant", "telemetry_hourly", ["tenant", "hour"])
    op.create_table(
        "gpu_health",
        sa.Column("gpu_uuid", sa.String(length=64), nullable=False),
        sa.Column("node", sa.String(length=63), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("cause", sa.String(length=32), nullable=False),
        sa.Column("message", sa.Text(), nullable=False),
        sa.Column("xid", sa.Integer(), nullable=True),
        sa.Column("device_lost", sa.Boolean(), nullable=False),
        sa.Column("since", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("gpu_uuid"),
    )
    op.create_index("ix_gpu_health_node", "gpu_health", ["node"])
    with op.batch_alter_table("tenants") as batch:
        batch.add_column(sa.Column("idle_policy", JSON, nullable=True))


def downgrade() -> None:
    # ALTER TABLE … DROP COLUMN in place (SQLite 3.35+): a batch copy of tenants would trip
    # the workloads' foreign key (as in 0015)
    op.drop_column("tenants", "idle_policy")
    op.drop_index("ix_gpu_health_node", table_name="gpu_health")
    op.drop_table("gpu_health")
    op.drop_index("ix_telemetry_hourly_tenant", table_name="telemetry_hourly")
    op.drop_index("ix_telemetry_hourly_hour", table_name="telemetry_hourly")
    op.drop_table("telemetry_hourly")
    op.drop_index("ix_telemetry_latest_node", table_name="telemetry_latest")
    op.drop_table("telemetry_latest")
    op.drop_index("ix_telemetry_raw_ts", table_name="telemetry_raw")
    op.drop_table("telemetry_raw")
    op.drop_index("ix_telemetry_series_device", table_name="telemetry_series")
    op.drop_index("ix_telemetry_series_workload", table_name="telemetry_series")
    op.drop_index("ix_telemetry_series_node", table_name="telemetry_series")
    op.drop_table("telemetry_series")
