"""KMS key inventory: named keys and their versions (issue 13).

Revision ID: 0011
Revises: 0010
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "kms_keys",
        sa.Column("id", BigId, autoincrement=True, nullable=False),
        sa.Column("name", sa.String(length=63), nullable=False),
        sa.Column("purpose", sa.String(length=16), nullable=False),
        sa.Column("algorithm", sa.String(length=32), nullable=False),
        sa.Column("backend", sa.String(length=16), nullable=False),
        sa.Column("current_version", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.Column("disabled_at", sa.DateTime(), nullable=True),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("name"),
    )
    op.create_table(
        "kms_key_versions",
        sa.Column("key_id", BigId, nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("handle", sa.LargeBinary(), nullable=True),
        sa.Column("public_key", sa.LargeBinary(), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("retired_at", sa.DateTime(), nullable=True),
        sa.Column("destroyed_at", sa.DateTime(), nullable=True),
        sa.ForeignKeyConstraint(["key_id"], ["kms_keys.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("key_id", "version"),
    )


def downgrade() -> None:
    op.drop_table("kms_key_versions")
    op.drop_table("kms_keys")
