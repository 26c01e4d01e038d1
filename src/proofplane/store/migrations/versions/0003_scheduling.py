"""scheduling

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23

Quotas, gang workloads and the node index of placements (issue 3): per-tenant quota columns
(NULL: no limit), ``workloads.gpu_nodes`` (> 1: a gang), the members of a gang placement, and
``placement_nodes`` listing every node a placement holds capacity on (one row for a plain
placement, one per member for a gang), so that "what runs on node X" finds gang members too.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.add_column(sa.Column("quota_gpus", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("quota_mig_slices", sa.Integer(), nullable=True))
    with op.batch_alter_table("workloads") as batch:
        batch.add_column(
            sa.Column("gpu_nodes", sa.Integer(), nullable=False, server_default=sa.text("1"))
        )
    with op.batch_alter_table("placements") as batch:
        batch.add_column(sa.Column("members", JSON, nullable=True))
    op.create_table(
        "placement_nodes",
        sa.Column("placement_id", sa.Integer(), nullable=False),
        sa.Column("node_id", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(["placement_id"], ["placements.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["node_id"], ["nodes.id"]),
        sa.PrimaryKeyConstraint("placement_id", "node_id"),
    )
    op.create_index("ix_placement_nodes_node_id", "placement_nodes", ["node_id"], unique=False)
    # Placements made before this revision each hold capacity on their one node.
    op.execute(
        "INSERT INTO placement_nodes (placement_id, node_id) SELECT id, node_id FROM placements"
    )


def downgrade() -> None:
    op.drop_index("ix_placement_nodes_node_id", table_name="placement_nodes")
    op.drop_table("placement_nodes")
    with op.batch_alter_table("placements") as batch:
        batch.drop_column("members")
    with op.batch_alter_table("workloads") as batch:
        batch.drop_column("gpu_nodes")
    with op.batch_alter_table("tenants") as batch:
        batch.drop_column("quota_mig_slices")
        batch.drop_column("quota_gpus")
