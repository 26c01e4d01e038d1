"""workloads: co_residency, resolved from the tenant's compliance profile at submit

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-23

A workload whose tenant profile refuses co-residency keeps its MIG slice or GPU share on a
physical GPU no other tenant uses (issue 3, isolation level ``mig``: "another tenant may hold
other slices of the same GPU only if both profiles allow co-residency"). Existing workloads
allow it, as every profile did before.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("workloads") as batch:
        batch.add_column(
            sa.Column("co_residency", sa.Boolean(), nullable=False, server_default=sa.true())
        )


def downgrade() -> None:
    with op.batch_alter_table("workloads") as batch:
        batch.drop_column("co_residency")
