"""audit log

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23

Merkle log storage and signed checkpoints (issue 4). ``audit_hashes`` holds every leaf and
complete-subtree hash in append order; ``audit_checkpoints`` the signed checkpoints. Events
recorded before this revision are hashed into the log here, in event order.
"""

from collections.abc import Sequence
from datetime import UTC
from types import SimpleNamespace

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "audit_hashes",
        sa.Column("id", BigId, autoincrement=False, nullable=False),
        sa.Column("hash", sa.LargeBinary(length=32), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_table(
        "audit_checkpoints",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("tree_size", sa.BigInteger(), nullable=False),
        sa.Column("root_hash", sa.LargeBinary(length=32), nullable=False),
        sa.Column("note", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index(
        op.f("ix_audit_checkpoints_tree_size"), "audit_checkpoints", ["tree_size"], unique=False
    )
    _backfill()


def _backfill() -> None:
    """Hash the events that already exist (a log upgraded in place keeps its history)."""
    from proofplane.audit.canonical import event_leaf_hash
    from proofplane.store.audit_log import Appender

    conn = op.get_bind()
    events = sa.table(
        "events",
        sa.column("seq"),
        sa.column("ts"),
        sa.column("actor"),
        sa.column("action"),
        sa.column("target_type"),
        sa.column("target_id"),
        sa.column("outcome"),
        sa.column("details", sa.JSON()),
    )
    appender = Appender(0, [], [])
    for row in conn.execute(sa.select(events).order_by(events.c.seq)):
        if row.seq != appender.size + 1:
            raise RuntimeError(f"events are not gap-free: expected seq {appender.size + 1}")
        ts = row.ts if row.ts.tzinfo else row.ts.replace(tzinfo=UTC)
        event = SimpleNamespace(**{**row._mapping, "ts": ts})
        appender.append_leaf(event_leaf_hash(event))
        if len(appender.pending) >= 10_000:
            appender.flush(conn)
    appender.flush(conn)


def downgrade() -> None:
    op.drop_index(op.f("ix_audit_checkpoints_tree_size"), table_name="audit_checkpoints")
    op.drop_table("audit_checkpoints")
    op.drop_table("audit_hashes")
