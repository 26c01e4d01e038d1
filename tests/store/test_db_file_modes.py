"""The SQLite database holds password hashes, token hashes and sink secrets (issue 19, §6): its
file, WAL and SHM are created 0600 whatever the umask, and a server refuses to start on a
database file other users can read, saying which ``chmod`` to run."""

from __future__ import annotations

import os
import socket
import sqlite3
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from proofplane.access import SYSTEM
from proofplane.cli.main import app as cli
from proofplane.errors import ValidationFailed
from proofplane.service.context import Store
from proofplane.store import migrate
from proofplane.store.db import check_private


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def umask_022() -> Iterator[None]:
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_database_wal_and_shm_are_created_0600_under_umask_022(tmp_path, umask_022):
    db = tmp_path / "data" / "pp.db"
    store = Store(f"sqlite:///{db}")
    try:
        migrate.upgrade(store.engine)
        with store.write(SYSTEM) as tx:
            tx.record("node.register", "node", "n1")
        with store.read() as session:  # a reader holds the WAL and SHM open
            session.connection()
            files = {p.name: mode(p) for p in db.parent.iterdir()}
    finally:
        store.dispose()
    assert {"pp.db", "pp.db-wal", "pp.db-shm"} <= set(files), files
    assert all(m == 0o600 for m in files.values()), {k: oct(v) for k, v in files.items()}


def test_a_leftover_wal_open_to_others_is_made_private(tmp_path, umask_022):
    db = tmp_path / "pp.db"
    Store(f"sqlite:///{db}").dispose()  # created 0600
    wal = Path(f"{db}-wal")
    wal.touch()
    wal.chmod(0o644)
    store = Store(f"sqlite:///{db}")
    try:
        migrate.upgrade(store.engine)
    finally:
        store.dispose()
    if wal.exists():
        assert mode(wal) == 0o600


def world_readable_db(tmp_path: Path) -> Path:
    db = tmp_path / "shared.db"
    sqlite3.connect(db).close()
    db.chmod(0o644)
    return db


def test_a_database_readable_by_others_is_refused_with_the_chmod(tmp_path):
    db = world_readable_db(tmp_path)
    with pytest.raises(ValidationFailed) as info:
        check_private(f"sqlite:///{db}")
    assert info.value.code == "insecure_database_file"
    assert f"chmod 600 {db}" in info.value.message
    assert mode(db) == 0o644  # not silently changed: the operator decides
    db.chmod(0o600)
    check_private(f"sqlite:///{db}")
    check_private(f"sqlite:///{tmp_path / 'not-yet.db'}")  # will be created 0600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_server_refuses_to_start_on_a_database_readable_by_others(tmp_path):
    db = world_readable_db(tmp_path)
    result = CliRunner().invoke(
        cli, ["serve", "--db", f"sqlite:///{db}", "--port", str(free_port())]
    )
    assert result.exit_code == 1, result.output
    assert f"chmod 600 {db}" in result.output
    assert "proofplane serving" not in result.output
    upgrade = CliRunner().invoke(cli, ["db", "upgrade", "--db", f"sqlite:///{db}"])
    assert upgrade.exit_code == 1 and f"chmod 600 {db}" in upgrade.output
