"""Attestation nonces checked without a stored copy (issue 20): ``attestation_nonce_key``.

A nonce now carries its issue time and the node it was issued to, authenticated by this key
(``proofplane.attest.nonce``), so issuing one writes nothing; ``attestation_nonces`` keeps the
nonces that evidence spent. The key is made on first use, sealed under the KMS ``secrets`` key.
Nonces issued before this revision and not yet spent are refused as unknown: the agent asks
for another at its next round. ``attestation_nonces.issued_at`` is indexed: a spent nonce's row
is forgotten once its nonce has expired.

Revision ID: 0021
Revises: 0020
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0021"
down_revision: str | None = "0020"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "attestation_nonce_key",
        sa.Column("id", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("key_sealed", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    # spent nonces are forgotten once they can no longer be presented (by issue time)
    op.create_index("ix_attestation_nonces_issued_at", "attestation_nonces", ["issued_at"])


def downgrade() -> None:
    op.drop_index("ix_attestation_nonces_issued_at", table_name="attestation_nonces")
    op.drop_table("attestation_nonce_key")
