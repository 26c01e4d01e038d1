"""The same suite for every KMS backend (issue 13): data-key wrapping bound to its AAD,
Ed25519 signing, and the key inventory's lifecycle (create, rotate with old ciphertexts still
opening, rewrap, disable, destroy) with every refusal a clear error and nothing half-written."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from sqlalchemy import select

from proofplane.access import SYSTEM
from proofplane.errors import ProofplaneError
from proofplane.keys import (
    ENCRYPT,
    SIGN,
    DecryptFailed,
    KeyDisabled,
    KeyExists,
    KeyNotFound,
    WrongPurpose,
    envelope,
)
from proofplane.kms import Backend
from proofplane.service import keys as keys_svc
from proofplane.service.context import Store
from proofplane.store import migrate
from proofplane.store.tables import EventRow

AAD = b"users/1/totp_secret"


@pytest.fixture
def kms_store(tmp_path: Path, backend: Backend) -> Store:
    store = Store(f"sqlite:///{tmp_path / 'kms.db'}")
    migrate.upgrade(store.engine)
    store.kms = keys_svc.Kms(backend)
    return store


def test_wrap_unwrap_is_bound_to_its_aad_and_version(backend: Backend) -> None:
    v1 = backend.generate(ENCRYPT, "t-v1")
    v2 = backend.generate(ENCRYPT, "t-v2")
    dk = os.urandom(32)
    wrapped = backend.wrap(v1, dk, AAD)
    assert dk not in wrapped and backend.unwrap(v1, wrapped, AAD) == dk
    with pytest.raises(DecryptFailed):
        backend.unwrap(v1, wrapped, b"users/2/totp_secret")
    with pytest.raises(DecryptFailed):
        backend.unwrap(v2, wrapped, AAD)
    tampered = bytearray(wrapped)
    tampered[-1] ^= 1
    with pytest.raises(DecryptFailed):
        backend.unwrap(v1, bytes(tampered), AAD)
    backend.check()


def test_ed25519_signatures_verify_with_the_public_key(backend: Backend) -> None:
    s1, s2 = backend.generate(SIGN, "a-v1"), backend.generate(SIGN, "a-v2")
    p1 = backend.public_key(s1)
    assert len(p1) == 32 and p1 != backend.public_key(s2)
    sig = backend.sign(s1, b"checkpoint")
    assert len(sig) == 64
    Ed25519PublicKey.from_public_bytes(p1).verify(sig, b"checkpoint")
    with pytest.raises(Exception):  # noqa: B017 - cryptography's InvalidSignature
        Ed25519PublicKey.from_public_bytes(p1).verify(sig, b"other")


def _encrypt(store: Store, name: str, plain: bytes, aad: bytes = AAD) -> str:
    with store.write(SYSTEM) as tx:
        kms = keys_svc.kms_for(store)
        kms.ensure_key(tx, name, ENCRYPT)
        return kms.encrypt(tx.session, name, plain, aad)


def _decrypt(store: Store, text: str, aad: bytes = AAD) -> bytes:
    with store.read() as session:
        return keys_svc.kms_for(store).decrypt(session, text, aad)


def test_envelope_round_trip_rotation_and_rewrap(kms_store: Store) -> None:
    kms = keys_svc.kms_for(kms_store)
    secret = b"JBSWY3DPEHPK3PXP" * 4
    old = _encrypt(kms_store, "secrets", secret)
    assert old.startswith("ppk1.secrets.1.") and secret.decode() not in old
    assert _decrypt(kms_store, old) == secret
    assert _encrypt(kms_store, "secrets", secret) != old  # a fresh data key each time
    with kms_store.write(SYSTEM) as tx:
        view = kms.rotate_key(tx, "secrets")
    assert view.current_version == 2 and view.versions[0].retired_at is not None
    new = _encrypt(kms_store, "secrets", secret)
    assert new.startswith("ppk1.secrets.2.")
    assert _decrypt(kms_store, old) == secret == _decrypt(kms_store, new)  # old still opens
    with kms_store.read() as session:
        rewrapped = kms.rewrap(session, old, AAD)
        assert rewrapped.startswith("ppk1.secrets.2.") and kms.rewrap(session, new, AAD) == new
    assert _decrypt(kms_store, rewrapped) == secret
    with kms_store.write(SYSTEM) as tx:
        kms.destroy_version(tx, "secrets", 1)
    with pytest.raises(KeyDisabled):
        _decrypt(kms_store, old)  # destroyed: what v1 sealed no longer opens
    assert _decrypt(kms_store, rewrapped) == secret
    with kms_store.read() as session:
        actions = [r.action for r in session.scalars(select(EventRow).order_by(EventRow.seq))]
    assert actions == ["key.create", "key.rotate", "key.destroy"]
    assert kms.counts[("secrets", "decrypt")] >= 4


def test_a_ciphertext_opens_only_for_its_row_and_untampered(kms_store: Store) -> None:
    text = _encrypt(kms_store, "secrets", b"hec-token")
    with pytest.raises(DecryptFailed):
        _decrypt(kms_store, text, b"users/2/totp_secret")
    head, wrapped, sealed = text.rsplit(".", 2)
    for bad in (
        f"{head}.{wrapped}.{sealed[:-2]}AA",
        f"{head}.{wrapped[:-2]}AA.{sealed}",
        text.replace("ppk1.secrets.1.", "ppk1.secrets.7."),
        "ppk1.secrets",
        "plaintext",
        "ppk1.Secrets.1.AA.AA",
    ):
        with pytest.raises(ProofplaneError) as refused:
            _decrypt(kms_store, bad)
        assert refused.value.code in ("decrypt_failed", "key_not_found", "invalid_key_name")


def test_signing_keys_and_lifecycle_refusals(kms_store: Store) -> None:
    kms = keys_svc.kms_for(kms_store)
    with kms_store.write(SYSTEM) as tx:
        kms.create_key(tx, "audit-checkpoint", SIGN)
        with pytest.raises(KeyExists):
            kms.create_key(tx, "audit-checkpoint", SIGN)
    with kms_store.read() as session:
        version, sig = kms.sign(session, "audit-checkpoint", b"note")
        pub = keys_svc.get_key(session, "audit-checkpoint").versions[0].public_key
    assert version == 1 and pub is not None
    Ed25519PublicKey.from_public_bytes(pub).verify(sig, b"note")
    with kms_store.write(SYSTEM) as tx, pytest.raises(WrongPurpose):
        kms.encrypt(tx.session, "audit-checkpoint", b"x", AAD)
    with kms_store.write(SYSTEM) as tx:
        kms.disable_key(tx, "audit-checkpoint")
    with kms_store.read() as session, pytest.raises(KeyDisabled):
        kms.sign(session, "audit-checkpoint", b"note")
    with kms_store.write(SYSTEM) as tx, pytest.raises(KeyDisabled):
        kms.rotate_key(tx, "audit-checkpoint")
    with kms_store.write(SYSTEM) as tx, pytest.raises(KeyNotFound):
        kms.rotate_key(tx, "nope")
    with kms_store.write(SYSTEM) as tx, pytest.raises(ProofplaneError) as bad:
        kms.create_key(tx, "Bad Name", ENCRYPT)
    assert bad.value.code == "invalid_key_name"
    with kms_store.write(SYSTEM) as tx, pytest.raises(WrongPurpose):
        kms.create_key(tx, "k", "hash")
    with kms_store.read() as session:
        assert [k.name for k in keys_svc.list_keys(session)] == ["audit-checkpoint"]


def test_the_envelope_format_is_parsed_strictly() -> None:
    env = envelope.Envelope("secrets", 3, b"w" * 40, b"s" * 40)
    assert envelope.parse(env.text()) == env
    for bad in ("", "ppk1..1.AA.AA", "ppk1.secrets.x.AA.AA", "ppk1.secrets.1.AA.AA.AA"):
        with pytest.raises(DecryptFailed):
            envelope.parse(bad)
