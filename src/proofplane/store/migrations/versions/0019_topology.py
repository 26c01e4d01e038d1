"""Topology-aware gangs (issue 17 §4): where nodes sit, what gangs ask.

``nodes.topology``: JSON object, topology level → domain (``{"nvlink_domain": "nvl72-3"}``; NULL
or ``{}``: none beyond ``nodes.rack``). ``workloads.topology``: JSON object ``{"level": …,
"mode": "required" | "preferred"}`` of a gang that asks to be packed; NULL: no request.

Revision ID: 0019
Revises: 0018
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0019"
down_revision: str | None = "0018"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    op.add_column("nodes", sa.Column("topology", JSON, nullable=True))
    op.add_column("workloads", sa.Column("topology", JSON, nullable=True))


def downgrade() -> None:
    # ALTER TABLE … DROP COLUMN in place (SQLite 3.35+), as 0016 and 0017 do
    op.drop_column("workloads", "topology")
    op.drop_column("nodes", "topology")
