"""The tamper-evident audit log: RFC 9162 Merkle tree over the canonical (RFC 8785) bytes of
every event, stored subtree hashes for O(log n) proofs, and C2SP signed checkpoints.

Pure modules: ``merkle`` (hashing, proofs, verification), ``canonical`` (entry bytes),
``note`` (signed notes, checkpoints, verifier keys), ``bundle`` (offline evidence bundles).
Storage: ``log`` (hash storage and proofs on the database).
"""

from proofplane.audit.canonical import entry_bytes, event_leaf_hash
from proofplane.audit.merkle import (
    consistency_proof,
    inclusion_proof,
    leaf_hash,
    root,
    verify_consistency,
    verify_inclusion,
)

__all__ = [
    "consistency_proof",
    "entry_bytes",
    "event_leaf_hash",
    "inclusion_proof",
    "leaf_hash",
    "root",
    "verify_consistency",
    "verify_inclusion",
]
