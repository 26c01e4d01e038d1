"""execution jobs

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-24

A workload's job in an execution engine: backend, engine job id, last reported state
(issue 7).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    op.create_table(
        "execution_jobs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("workload_id", sa.Integer(), nullable=False),
        sa.Column("backend", sa.String(length=32), nullable=False),
        sa.Column("job_id", sa.String(length=255), nullable=False),
        sa.Column("state", sa.String(length=32), nullable=False),
        sa.Column("message", sa.Text(), nullable=True),
        sa.Column("devices", JSON, nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(["workload_id"], ["workloads.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("backend", "job_id"),
    )
    op.create_index("ix_execution_jobs_workload_id", "execution_jobs", ["workload_id"])
    op.create_index("ix_execution_jobs_state", "execution_jobs", ["state"])


def downgrade() -> None:
    op.drop_index("ix_execution_jobs_state", table_name="execution_jobs")
    op.drop_index("ix_execution_jobs_workload_id", table_name="execution_jobs")
    op.drop_table("execution_jobs")
