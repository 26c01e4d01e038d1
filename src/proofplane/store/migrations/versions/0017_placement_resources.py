"""Placement resources (issue 17): CPU and memory that workloads ask for and nodes offer.

``workloads.cpu_milli`` / ``workloads.memory_mib`` (0: none asked) and ``nodes.cpu_milli`` /
``nodes.memory_mib`` (NULL: not tracked, placement never filters on it).

Revision ID: 0017
Revises: 0016
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "workloads", sa.Column("cpu_milli", sa.Integer(), nullable=False, server_default="0")
    )
    op.add_column(
        "workloads", sa.Column("memory_mib", sa.Integer(), nullable=False, server_default="0")
    )
    op.add_column("nodes", sa.Column("cpu_milli", sa.Integer(), nullable=True))
    op.add_column("nodes", sa.Column("memory_mib", sa.Integer(), nullable=True))


def downgrade() -> None:
    # ALTER TABLE … DROP COLUMN in place (SQLite 3.35+), as 0016 does: a batch copy of the
    # table would trip the foreign keys that point at it
    op.drop_column("nodes", "memory_mib")
    op.drop_column("nodes", "cpu_milli")
    op.drop_column("workloads", "memory_mib")
    op.drop_column("workloads", "cpu_milli")
