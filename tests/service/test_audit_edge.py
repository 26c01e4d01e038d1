"""The Merkle log's right edge between write transactions (``Store`` / ``Tx.edge_hint``, issue
20): a store's write starts from the edge its last commit left instead of reading it back,
when the log still holds exactly as many leaves; after another writer appended, the edge is
read (SQLite) or extended by the hashes that came with the write lock (PostgreSQL, each
checked against its leaves), and after a rollback it is kept, so that the stored tree still
verifies."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import func, select, update

from dbtest import traced_statements
from proofplane.access import SYSTEM
from proofplane.service import audit as audit_svc
from proofplane.service.context import Store, events_after
from proofplane.store.audit_log import LogCorrupted, node_id
from proofplane.store.db import LOCKED_HASHES_MAX
from proofplane.store.tables import AuditHashRow, EventRow


class _Boom(Exception):
    pass


def _edge_reads(store: Store) -> Callable[[], int]:
    """How many statements on ``store``'s connections read the stored hashes from here on (the
    write lock's own round trip, which on PostgreSQL brings another writer's, left out)."""
    seen = traced_statements(store)

    def reads() -> int:
        n = sum(
            s.lstrip().upper().startswith("SELECT")
            and "audit_hashes" in s
            and "pg_advisory_xact_lock" not in s
            for s in seen
        )
        seen.clear()
        return n

    return reads


def _write(store: Store, target: str, *, catch_up: bool = True) -> None:
    """One event; ``catch_up`` as a placing write asks (on PostgreSQL the other writers'
    events and hashes come with the lock)."""
    with store.write(SYSTEM, catch_up=catch_up) as tx:
        tx.record("test.edge", "test", target)


def _verifies(store: Store, events: int) -> None:
    report = audit_svc.verify_log(store, [])
    assert report.ok and report.first_bad_index is None, report.problems
    assert report.events == report.tree_size == events


def test_a_stores_next_write_starts_from_the_edge_it_committed(store: Store) -> None:
    reads = _edge_reads(store)
    _write(store, "first")
    assert reads() > 0  # nothing known yet: the edge is read
    for i in range(5):  # sizes 1..5: edges of one, two and three subtrees
        _write(store, f"next-{i}")
        assert reads() == 0
    _verifies(store, 6)


def test_another_writer_appending_makes_the_edge_read_again(db_url: str) -> None:
    mine, other = Store(db_url), Store(db_url)  # two processes, as far as the caches go
    try:
        reads = _edge_reads(mine)
        _write(mine, "a")
        _write(mine, "b")
        reads()
        _write(other, "c")  # the log grew past the edge ``mine`` holds
        _write(mine, "d")
        if mine.engine.dialect.name == "sqlite":
            assert reads() > 0
        else:  # the other writer's hashes came with the lock and extended the edge
            assert reads() == 0
        _write(other, "c2")
        _write(mine, "d2", catch_up=False)  # a write that does not ask reads it, either way
        assert reads() > 0
        _write(mine, "e")
        assert reads() == 0
        _verifies(mine, 7)
    finally:
        mine.dispose()
        other.dispose()


def test_a_rolled_back_write_leaves_the_committed_edge(store: Store) -> None:
    _write(store, "kept")
    reads = _edge_reads(store)
    with pytest.raises(_Boom), store.write(SYSTEM) as tx:
        tx.record("test.edge", "test", "rolled-back")
        raise _Boom
    _write(store, "after")  # the edge of "kept", not of the rolled-back leaf
    assert reads() == 0
    _verifies(store, 2)


def test_the_newest_seq_is_read_once_the_write_lock_is_granted(db_url: str) -> None:
    """A write that waited for the lock numbers its events after those the holder committed
    meanwhile (on PostgreSQL the lock and the newest seq are one round trip: the seq must be
    read with a snapshot taken after the lock was granted, not before), knows the holder's
    events (which come in the same round trip, with its Merkle hashes), and the log verifies."""
    first, second = Store(db_url), Store(db_url)  # two processes' or replicas' stores
    try:
        _write(second, "before")  # its edge and version known: the lock brings what follows
        held, release = threading.Event(), threading.Event()
        seqs: dict[str, int] = {}

        def holder() -> None:
            with first.write(SYSTEM) as tx:
                tx.record("test.hold", "item", "a")
                held.set()
                assert release.wait(10)
                tx.record("test.hold", "item", "b")
                seqs["holder"] = tx.last_seq or 0

        thread = threading.Thread(target=holder)
        thread.start()
        assert held.wait(10)
        waited: dict[str, Any] = {}

        def waiter() -> None:
            with second.write(SYSTEM, catch_up=True) as tx:
                waited["newest"] = tx.newest_seq()  # blocks on the lock until the holder commits
                waited["known"] = events_after(tx.session, 1, 10)
                tx.record("test.wait", "item", "c")
                waited["seq"] = tx.last_seq

        other = threading.Thread(target=waiter)
        other.start()
        other.join(0.3)
        assert other.is_alive()  # it waits for the lock the holder has
        release.set()
        thread.join(10)
        other.join(10)
        assert seqs["holder"] == 3
        assert waited == {
            "newest": 3,
            "seq": 4,
            "known": [(2, "item", "a", "test.hold"), (3, "item", "b", "test.hold")],
        }
        report = audit_svc.verify_log(second, [])
        assert report.ok and report.first_bad_index is None, report.problems
        assert report.events == report.tree_size == seqs["holder"] + 1
    finally:
        first.dispose()
        second.dispose()


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)  # the lock's round trip
def test_an_edge_extended_by_another_writers_hashes_checks_them(db_url: str) -> None:
    """PostgreSQL: the hashes another writer appended, which come with the write lock, extend
    this store's edge only when they are those of the leaves it stored and nothing more: a
    damaged hash or one too many refuses the write (nothing of it stays), as reading the
    edge refuses it."""
    mine, other = Store(db_url), Store(db_url)
    try:
        _write(mine, "a")
        for i in range(3):  # leaves 2..4 by the other writer: leaf and subtree hashes
            _write(other, f"o{i}")
        _write(mine, "b")  # extended by them
        _verifies(mine, 5)
        for i in range(2):
            _write(other, f"p{i}")
        # leaves 5 and 6 by the other writer; leaf 5 completed the subtree of leaves 4..5:
        # its stored hash damaged
        with mine.engine.begin() as conn:
            conn.execute(
                update(AuditHashRow)
                .where(AuditHashRow.id == node_id(1, 2))
                .values(hash=b"\x00" * 32)
            )
        with pytest.raises(LogCorrupted, match="not those of its leaves"):
            _write(mine, "refused")
        with mine.read() as session:
            assert session.scalar(select(func.count()).select_from(EventRow)) == 7
    finally:
        mine.dispose()
        other.dispose()


def test_an_edge_behind_by_more_than_the_lock_brings_is_read(db_url: str) -> None:
    """A store further behind than the lock query's hashes (``LOCKED_HASHES_MAX``) reads the
    edge as before, and the log verifies."""
    mine, other = Store(db_url), Store(db_url)
    try:
        _write(mine, "a")
        with other.write(SYSTEM) as tx:
            tx.record_many(
                [("test.edge", "test", f"bulk-{i}", {}) for i in range(LOCKED_HASHES_MAX)]
            )
        reads = _edge_reads(mine)
        _write(mine, "b")
        assert reads() > 0
        _verifies(mine, LOCKED_HASHES_MAX + 2)
    finally:
        mine.dispose()
        other.dispose()
