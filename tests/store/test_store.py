"""The store: migrations, engines, and the single-writer rule under concurrency."""

from __future__ import annotations

import threading

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import func, select

from proofplane.access import Actor, Role
from proofplane.errors import ValidationFailed
from proofplane.model import Gpu, GpuRequest, Node, NodeState, Tenant
from proofplane.service import nodes as nodes_svc
from proofplane.service import tenants as tenants_svc
from proofplane.service import workloads as workloads_svc
from proofplane.service.context import Store
from proofplane.store import migrate
from proofplane.store.db import make_engine, normalize_url
from proofplane.store.tables import Base, EventRow, WorkloadRow


def test_migrations_match_the_tables(store: Store) -> None:
    """The ORM tables and what Alembic built must not drift apart."""
    with store.engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    assert diff == []
    assert migrate.is_current(store.engine)


def test_upgrade_is_idempotent(store: Store) -> None:
    migrate.upgrade(store.engine)
    assert migrate.current_revision(store.engine) == migrate.head_revision()


def test_sqlite_runs_in_wal_mode(tmp_path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'sub' / 'x.db'}")
    with engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
    assert (tmp_path / "sub").is_dir()


@pytest.mark.parametrize(
    "url",
    ["sqlite://", "sqlite:///:memory:", "mysql://root@localhost/x", "not a url at all"],
)
def test_unsupported_database_urls(url: str) -> None:
    with pytest.raises(ValidationFailed) as exc:
        make_engine(url)
    assert exc.value.code == "invalid_database_url"


def test_postgres_url_spellings() -> None:
    assert normalize_url("postgres://u@h/db") == "postgresql+psycopg://u@h/db"
    assert normalize_url("postgresql://u@h/db") == "postgresql+psycopg://u@h/db"
    assert normalize_url("postgresql+psycopg://u@h/db") == "postgresql+psycopg://u@h/db"


def test_concurrent_writers_keep_sequence_gapless_and_capacity_single(store: Store) -> None:
    """Eight clients submit at once for four GPUs: exactly four are placed, no GPU twice, and
    event sequence numbers are 1..n with no gap and no duplicate."""
    admin = Actor("admin", frozenset({Role.ADMIN}))
    tenants_svc.create_tenant(store, admin, Tenant("lab"))
    gpus = tuple(Gpu(i, f"GPU-n1-{i}", "H100-80GB", 0) for i in range(4))
    nodes_svc.register_node(store, admin, Node("n1", "r", "z", gpus=gpus))
    nodes_svc.set_node_state(store, admin, "n1", NodeState.ADMITTED)
    errors: list[BaseException] = []
    barrier = threading.Barrier(8)

    def worker(i: int) -> None:
        try:
            barrier.wait()
            spec = workloads_svc.WorkloadSpec(f"w{i}", "lab", gpus=GpuRequest(count=1))
            workloads_svc.submit_workload(store, Actor(f"user{i}", admin.roles), spec)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    with store.read() as s:
        seqs = list(s.scalars(select(EventRow.seq).order_by(EventRow.seq)))
        rows = list(s.scalars(select(WorkloadRow)))
        placed = [r for r in rows if r.placement is not None]
        used = [d["gpu_index"] for r in placed for d in r.placement.devices]
        assert s.scalar(select(func.count()).select_from(WorkloadRow)) == 8
    assert seqs == list(range(1, len(seqs) + 1))
    assert len(placed) == 4 and sorted(used) == [0, 1, 2, 3]
