"""attestation: mark identities enrolled by a simulated (software-key) attester

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-23

A node enrolled by the demo's simulated attester (``PROOFPLANE_DEMO_ATTESTER=simulated``) is
marked so that every view of it says so, and so that a server outside demo mode refuses its
evidence (issue 5, "The demo cluster attests too").
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("node_attestation") as batch:
        batch.add_column(
            sa.Column("simulated", sa.Boolean(), nullable=False, server_default=sa.false())
        )


def downgrade() -> None:
    with op.batch_alter_table("node_attestation") as batch:
        batch.drop_column("simulated")
