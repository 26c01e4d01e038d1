"""Checkpoints signed through the KMS (issue 13, part 3): they verify with the published
verifier key; after a rotation old and new checkpoints verify each with its own version's
verifier and ``audit key --all`` lists both with their validity periods; a KMS that cannot sign
fails the round without writing a checkpoint, and /readyz says not ready; a pre-KMS key file's
checkpoints still verify with its (legacy) verifier."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from typer.testing import CliRunner

from live_server import serve
from proofplane.access import SYSTEM
from proofplane.api.app import create_app
from proofplane.audit import note
from proofplane.cli.main import app as cli_app
from proofplane.keys import KmsError, KmsUnavailable
from proofplane.kms.local import LocalBackend
from proofplane.service import audit as audit_svc
from proofplane.service import keys as keys_svc
from proofplane.service.access import bootstrap_admin
from proofplane.service.context import Store
from proofplane.store import audit_log, migrate
from proofplane.store.tables import AuditCheckpointRow
from proofplane.workers.checkpoints import CheckpointWorker

ADMIN = "ppt_checkpoint-kms-admin-token-0123456789"
T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
runner = CliRunner()


class DownBackend(LocalBackend):
    """The local keyring whose signing is unreachable (an HSM or OpenBao down)."""

    down = False

    def sign(self, handle: bytes, message: bytes) -> bytes:
        if self.down:
            raise KmsUnavailable("the HSM does not answer")
        return super().sign(handle, message)

    def check(self) -> None:
        if self.down:
            raise KmsUnavailable("the HSM does not answer")


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store(f"sqlite:///{tmp_path / 'cp.db'}")
    migrate.upgrade(s.engine)
    s.kms = keys_svc.Kms(DownBackend.from_file(tmp_path / "master.key", create=True))
    bootstrap_admin(s, ADMIN)
    yield s
    s.dispose()


def _size(store: Store) -> int:
    with store.read() as s:
        return audit_log.tree_size(s)


def _grow(store: Store, n: int = 1) -> None:
    with store.write(SYSTEM) as tx:
        for i in range(n):
            tx.record("node.heartbeat", "node", f"n{i}")


def test_checkpoints_verify_with_their_versions_verifier_across_a_rotation(
    store: Store, tmp_path: Path
) -> None:
    keys = audit_svc.AuditKeys("proofplane/test", key_file=tmp_path / "none.key")
    _grow(store, 3)
    size = _size(store) + 1  # with the key's key.create
    old = audit_svc.sign_checkpoint(store, SYSTEM, keys, T0)
    assert old is not None
    v1 = note.parse_verifier_key(audit_svc.get_verifier_key(store, keys, SYSTEM))
    assert note.verify_checkpoint(old, v1, "proofplane/test").size == size
    with store.read() as s:  # the verifier is the KMS version's public key
        view = keys_svc.get_key(s, keys_svc.AUDIT_KEY)
    assert view.backend == "local" and v1.public_key == view.versions[0].public_key

    with store.write(SYSTEM, T0 + timedelta(hours=1)) as tx:
        keys_svc.kms_for(store).rotate_key(tx, keys_svc.AUDIT_KEY)
    new = audit_svc.sign_checkpoint(store, SYSTEM, keys, T0 + timedelta(hours=2))
    assert new is not None
    v2 = note.parse_verifier_key(audit_svc.get_verifier_key(store, keys, SYSTEM))
    assert v2.key_id != v1.key_id and v2.name == v1.name
    assert note.verify_checkpoint(new, v2).size == size + 1  # the key.rotate
    assert note.verify_checkpoint(old, v1).size == size  # still, after the rotation
    with pytest.raises(note.NoteError):
        note.verify_checkpoint(new, v1)
    with pytest.raises(note.NoteError):
        note.verify_checkpoint(old, v2)

    listed = audit_svc.list_verifiers(store, keys, SYSTEM)
    assert [(v.version, v.current, v.checkpoints) for v in listed] == [(1, False, 1), (2, True, 1)]
    assert listed[0].valid_until == listed[1].valid_from == T0 + timedelta(hours=1)
    assert listed[1].valid_until is None
    report = audit_svc.verify_log(store, audit_svc.known_verifiers(store, keys), "proofplane/test")
    assert report.ok, report.problems

    # the API and `proofplane audit key --all`
    with serve(store) as url:
        cli = ["--server", url, "--token", ADMIN, "audit"]
        out = runner.invoke(cli_app, [*cli, "key", "--all", "--json"])
        assert out.exit_code == 0, out.output
        published = json.loads(out.stdout)["verifiers"]
        v1_text = note.verifier_for("proofplane/default", v1.public_key).text()
        assert [p["version"] for p in published] == [1, 2]
        assert published[0]["verifier"] == v1_text  # the server's origin is its cluster's
        assert published[0]["valid_until"] and published[1]["valid_until"] is None
        text = runner.invoke(cli_app, [*cli, "key", "--all"])
        assert text.exit_code == 0 and "audit-checkpoint v1" in text.stdout
        assert "now (current)" in text.stdout
        current = runner.invoke(cli_app, [*cli, "key"])
        assert current.stdout.strip() == published[1]["verifier"]


def test_a_kms_outage_fails_the_round_writes_nothing_and_readyz_says_so(
    store: Store, tmp_path: Path
) -> None:
    keys = audit_svc.AuditKeys("proofplane/default", key_file=tmp_path / "none.key")
    backend = store.kms.backend
    _grow(store)
    worker = CheckpointWorker(store, keys, 3600)
    assert worker.tick()  # signs (and creates the key)
    _grow(store)
    backend.down = True
    with store.read() as s:
        before = s.scalar(select(func.count()).select_from(AuditCheckpointRow))
        size = audit_log.tree_size(s)
    assert worker.tick() is False
    assert worker.last_error and "HSM" in worker.last_error
    with store.read() as s:
        assert s.scalar(select(func.count()).select_from(AuditCheckpointRow)) == before
        assert audit_log.tree_size(s) == size  # nothing written at all
    with TestClient(create_app(store), raise_server_exceptions=False) as client:
        r = client.get("/readyz")
        assert r.status_code == 503 and r.json()["error"]["code"] == "kms_unavailable"
        r = client.post("/api/v1/audit/checkpoint", headers={"Authorization": f"Bearer {ADMIN}"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "kms_unavailable"
        backend.down = False
        assert client.get("/readyz").json()["kms"] == "local"
    assert worker.tick() and worker.last_error is None  # the next round signs


def test_the_legacy_key_files_checkpoints_still_verify(store: Store, tmp_path: Path) -> None:
    """A deployment from before the KMS: its checkpoints were signed with the key file."""
    path = tmp_path / "audit-signing.key"
    legacy = audit_svc.load_or_create_signer(path, "proofplane/test")
    _grow(store, 2)
    with store.write(SYSTEM, T0) as tx:  # what the old server wrote
        s = tx.session
        cp = note.Checkpoint("proofplane/test", 2, audit_log.root_at(s, 2))
        old = note.sign_checkpoint(cp, legacy)
        s.add(AuditCheckpointRow(tree_size=2, root_hash=cp.root_hash, note=old, created_at=T0))
    keys = audit_svc.AuditKeys("proofplane/test", key_file=path)
    assert audit_svc.verify_log(store, audit_svc.known_verifiers(store, keys)).ok

    _grow(store)
    switch = T0 + timedelta(days=1)
    new = audit_svc.sign_checkpoint(store, SYSTEM, keys, switch)  # now through the KMS
    assert new is not None
    listed = audit_svc.list_verifiers(store, keys, SYSTEM)
    assert [(v.legacy, v.version, v.checkpoints) for v in listed] == [
        (True, None, 1),
        (False, 1, 1),
    ]
    assert listed[0].key == legacy.verifier and listed[0].valid_until == switch
    verifiers = audit_svc.known_verifiers(store, keys)
    assert note.verify_checkpoint(old, verifiers).size == 2
    assert note.signed_by(old, verifiers) == legacy.verifier
    assert note.verify_checkpoint(new, verifiers).size == _size(store)
    assert audit_svc.verify_log(store, verifiers, "proofplane/test").ok
    assert path.read_text().startswith("PRIVATE+KEY+")  # read, never rewritten


def test_a_note_with_a_signature_that_does_not_match_the_key_is_refused(
    store: Store, tmp_path: Path
) -> None:
    """A backend answering with a wrong signature: refused, nothing stored."""
    keys = audit_svc.AuditKeys("proofplane/test", key_file=tmp_path / "none.key")
    backend: Any = store.kms.backend
    backend.sign = lambda handle, message: bytes(64)
    _grow(store)
    with pytest.raises(KmsError):
        audit_svc.sign_checkpoint(store, SYSTEM, keys, T0)
    with store.read() as s:
        assert s.scalar(select(func.count()).select_from(AuditCheckpointRow)) == 0
