"""A destroyed key version whose backend material could not be erased after the commit is in
the audit log, not only in the server's log (the embedded keyring; the backends share the
path in service/keys.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import select

from proofplane.access import SYSTEM
from proofplane.kms.local import LocalBackend
from proofplane.model import Outcome
from proofplane.service import keys as keys_svc
from proofplane.service.context import Store
from proofplane.store import migrate
from proofplane.store.tables import EventRow


def test_an_erase_that_fails_after_the_commit_is_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = Store(f"sqlite:///{tmp_path / 'kms.db'}")
    try:
        migrate.upgrade(store.engine)
        backend = LocalBackend.from_file(tmp_path / "master.key", create=True)
        kms = store.kms = keys_svc.Kms(backend)
        with store.write(SYSTEM) as tx:
            kms.create_key(tx, "payroll", "encrypt")
        with store.write(SYSTEM) as tx:
            kms.rotate_key(tx, "payroll")

        def refuse(_handle: bytes) -> None:
            raise OSError("backend-handle-7f3a unreachable")

        monkeypatch.setattr(backend, "destroy", refuse)
        with store.write(SYSTEM) as tx:
            kms.destroy_version(tx, "payroll", 1)
        with store.read() as session:
            rows = list(
                session.scalars(
                    select(EventRow).where(EventRow.action == "key.destroy").order_by(EventRow.seq)
                )
            )
        assert [r.outcome for r in rows] == [Outcome.SUCCESS.value, Outcome.FAILURE.value]
        failed = rows[1].details
        assert failed["stage"] == "backend_erase" and failed["version"] == 1
        assert failed["error"] == "OSError" and "backend-handle" not in str(failed)
    finally:
        store.dispose()
