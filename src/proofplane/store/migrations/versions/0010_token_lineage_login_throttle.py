"""access: which credential minted a token, and failed logins counted by address and name

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-25

Issue 19, §4. ``tokens.parent_id`` names the session or API token a token was minted with: a
token minted by an API token expires no later than it, and dies with it. ``auth_failures``
counts failed logins by what is not a user row: a source address (the progressive delay that
keeps one address from locking out every account) and a username no account has (locked after
the same count as a real one, so that a 423 does not tell which usernames exist).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("tokens") as batch:
        batch.add_column(sa.Column("parent_id", sa.String(length=32), nullable=True))
        batch.create_index(batch.f("ix_tokens_parent_id"), ["parent_id"], unique=False)
    op.create_table(
        "auth_failures",
        sa.Column("key", sa.String(length=80), nullable=False),
        sa.Column("failures", sa.Integer(), nullable=False),
        sa.Column("last_failure_at", sa.DateTime(), nullable=False),
        sa.Column("locked_until", sa.DateTime(), nullable=True),
        sa.PrimaryKeyConstraint("key"),
    )
    op.create_index(
        op.f("ix_auth_failures_last_failure_at"),
        "auth_failures",
        ["last_failure_at"],
        unique=False,
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_auth_failures_last_failure_at"), table_name="auth_failures")
    op.drop_table("auth_failures")
    with op.batch_alter_table("tokens") as batch:
        batch.drop_index(batch.f("ix_tokens_parent_id"))
        batch.drop_column("parent_id")
