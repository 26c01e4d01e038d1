"""Per-key operation counts in the key inventory (issue 13): encrypt, decrypt and sign are
counted per key in the server process (``Kms.counts``) and shown as the inventory's
``operations``; signing an audit checkpoint counts one ``sign`` on ``audit-checkpoint``."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from proofplane.access import SYSTEM
from proofplane.api.app import create_app
from proofplane.kms.local import LocalBackend
from proofplane.service import audit as audit_svc
from proofplane.service import key_inventory
from proofplane.service import keys as keys_svc
from proofplane.service.access import bootstrap_admin
from proofplane.service.context import Store
from proofplane.store import migrate

ADMIN = "ppt_key-operations-admin-0123456789abcdef"
T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store(f"sqlite:///{tmp_path / 'ops.db'}")
    migrate.upgrade(s.engine)
    s.kms = keys_svc.Kms(LocalBackend.from_file(tmp_path / "master.key", create=True))
    bootstrap_admin(s, ADMIN)
    yield s
    s.dispose()


def _ops(store: Store, name: str) -> dict[str, int]:
    return key_inventory.get_key(store, SYSTEM, name).operations


def test_checkpoint_signing_counts_signs_on_the_audit_key(store: Store, tmp_path: Path) -> None:
    keys = audit_svc.AuditKeys("proofplane/test", key_file=tmp_path / "none.key")
    with store.write(SYSTEM) as tx:
        tx.record("node.heartbeat", "node", "n1")
    assert audit_svc.sign_checkpoint(store, SYSTEM, keys, T0) is not None
    first = _ops(store, keys_svc.AUDIT_KEY).get("sign", 0)
    assert first >= 1
    for i in range(1, 4):  # each new checkpoint is one more signature
        with store.write(SYSTEM) as tx:
            tx.record("node.heartbeat", "node", f"n{i + 1}")
        assert audit_svc.sign_checkpoint(store, SYSTEM, keys, T0 + timedelta(minutes=i))
    assert _ops(store, keys_svc.AUDIT_KEY)["sign"] == first + 3
    # and the API shows it in the inventory
    with TestClient(create_app(store), raise_server_exceptions=False) as client:
        r = client.get(
            f"/api/v1/keys/{keys_svc.AUDIT_KEY}", headers={"Authorization": f"Bearer {ADMIN}"}
        )
    assert r.status_code == 200, r.text
    assert r.json()["operations"]["sign"] >= first + 3


def test_sealing_and_opening_a_secret_count_encrypt_and_decrypt(store: Store) -> None:
    kms = keys_svc.kms_for(store)
    with store.write(SYSTEM) as tx:
        kms.ensure_key(tx, "ops-test", "encrypt")
    before = _ops(store, "ops-test")
    with store.read() as s:
        sealed = kms.encrypt(s, "ops-test", b"seed", b"aad")
        assert kms.decrypt(s, sealed, b"aad") == b"seed"
        assert kms.decrypt(s, sealed, b"aad") == b"seed"
    after = _ops(store, "ops-test")
    assert after.get("encrypt", 0) == before.get("encrypt", 0) + 1
    assert after.get("decrypt", 0) == before.get("decrypt", 0) + 2
    assert "sign" not in after
