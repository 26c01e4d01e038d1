"""Restartable workloads (issue 17, §3): ``workloads.restartable`` (false by default).

A restartable workload checkpoints itself and may be stopped and started again elsewhere:
defragmentation may move it while it runs. Others move only while idle (no job started).

Revision ID: 0020
Revises: 0019
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0020"
down_revision: str | None = "0019"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "workloads",
        sa.Column("restartable", sa.Boolean(), nullable=False, server_default=sa.false()),
    )


def downgrade() -> None:
    # ALTER TABLE … DROP COLUMN in place (SQLite 3.35+), as 0017 does
    op.drop_column("workloads", "restartable")
