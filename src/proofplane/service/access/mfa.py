"""A user's own second factor: TOTP enrollment, confirmed with a first code.

The seed is stored only as KMS ciphertext bound to its row (``totp_seed``/``seal_totp_seed``):
a ciphertext copied to another user's row does not open, and a KMS that cannot decrypt fails
the operation (nothing is written) rather than letting the server use a seed in the clear."""

from __future__ import annotations

from sqlalchemy import select

from proofplane.access import Actor, Forbidden, totp
from proofplane.access import credentials as cred
from proofplane.errors import Conflict, ValidationFailed
from proofplane.service.access.common import end_sessions
from proofplane.service.context import Store, Tx
from proofplane.service.keys import kms_for, open_secret, seal_secret, secret_aad
from proofplane.store.tables import UserRow

ISSUER = "proofplane"


def totp_aad(row: UserRow) -> bytes:
    return secret_aad(UserRow.__tablename__, row.id, "totp_secret")


def seal_totp_seed(store: Store, tx: Tx, row: UserRow, seed: str) -> str:
    """``seed`` as ``users.totp_secret`` stores it (the ``secrets`` key made on first use)."""
    return seal_secret(kms_for(store), tx, seed, totp_aad(row))


def totp_seed(store: Store, tx: Tx, row: UserRow) -> str:
    """The row's TOTP seed in the clear, for this transaction only. DecryptFailed when the
    stored value is not this row's ciphertext (copied, tampered, or never sealed);
    KmsUnavailable when the KMS cannot be used now."""
    assert row.totp_secret is not None
    return open_secret(kms_for(store), tx.session, row.totp_secret, totp_aad(row))


def _self(tx: Tx, actor: Actor) -> UserRow:
    row = tx.session.scalar(select(UserRow).where(UserRow.username == actor.name))
    if row is None or actor.token_id is None:
        raise Forbidden("only a signed-in user can manage their own MFA")
    return row


def mfa_begin(store: Store, actor: Actor) -> tuple[str, str]:
    """Start (or restart) TOTP enrollment: a new secret and its otpauth:// URI. Not active
    until confirmed with a code from the authenticator."""
    with store.write(actor) as tx:
        row = _self(tx, actor)
        if row.source == "oidc":
            raise Forbidden("federated users authenticate (and do MFA) at their provider")
        if row.totp_enabled:
            raise Conflict("MFA is already enabled for this account", code="mfa_already_enabled")
        seed = totp.new_secret()
        row.totp_secret = seal_totp_seed(store, tx, row, seed)
        row.totp_last_step = None
        row.updated_at = tx.now
        tx.record("mfa.enroll", "user", row.username, details={"stage": "started"})
        return seed, totp.provisioning_uri(seed, row.username, ISSUER)


def mfa_confirm(store: Store, actor: Actor, code: str) -> list[str]:
    """Activate TOTP with a first valid code; returns recovery codes (shown once). Ends the
    enrollment session: the user logs in again with the second factor."""
    with store.write(actor) as tx:
        row = _self(tx, actor)
        if row.totp_enabled:
            raise Conflict("MFA is already enabled for this account", code="mfa_already_enabled")
        if row.totp_secret is None:
            raise Conflict("start enrollment first", code="mfa_not_started")
        step = totp.verify(totp_seed(store, tx, row), code, tx.now.timestamp(), None)
        if step is None:
            raise ValidationFailed("invalid TOTP code", code="invalid_totp")
        codes = cred.new_recovery_codes()
        row.totp_enabled = True
        row.totp_last_step = step
        row.recovery_codes = [cred.recovery_hash(c) for c in codes]
        row.updated_at = tx.now
        tx.record(
            "mfa.enroll",
            "user",
            row.username,
            details={"stage": "confirmed", "recovery_codes": len(codes)},
        )
        end_sessions(tx, row, "mfa enrolled")
        return codes
