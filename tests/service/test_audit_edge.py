"""The Merkle log's right edge between write transactions (``Store`` / ``Tx.edge_hint``, issue
20): a store's write starts from the edge its last commit left instead of reading it back,
when the log still holds exactly as many leaves; after another writer appended, or after a
rollback, the edge is read (or kept) so that the stored tree still verifies."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import event

from proofplane.access import SYSTEM
from proofplane.service import audit as audit_svc
from proofplane.service.context import Store


class _Boom(Exception):
    pass


def _edge_reads(store: Store) -> Callable[[], int]:
    """How many statements on ``store``'s connections read the stored hashes from here on."""
    seen: list[str] = []
    if store.engine.dialect.name == "sqlite":  # the log's reads run on the DB-API connection

        @event.listens_for(store.engine, "connect")
        def trace(dbapi_connection: Any, _record: Any) -> None:
            dbapi_connection.set_trace_callback(seen.append)

        store.engine.dispose()  # the pool's connections are traced from their start
    else:

        @event.listens_for(store.engine, "before_cursor_execute")
        def counted(_c: Any, _cur: Any, statement: str, *_rest: Any) -> None:
            seen.append(statement)

    def reads() -> int:
        n = sum(s.lstrip().upper().startswith("SELECT") and "audit_hashes" in s for s in seen)
        seen.clear()
        return n

    return reads


def _write(store: Store, target: str) -> None:
    with store.write(SYSTEM) as tx:
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
        assert reads() > 0
        _write(mine, "e")
        assert reads() == 0
        _verifies(mine, 5)
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
    read with a snapshot taken after the lock was granted, not before), and the log verifies."""
    first, second = Store(db_url), Store(db_url)  # two processes' or replicas' stores
    try:
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
            with second.write(SYSTEM) as tx:
                waited["newest"] = tx.newest_seq()  # blocks on the lock until the holder commits
                tx.record("test.wait", "item", "c")
                waited["seq"] = tx.last_seq

        other = threading.Thread(target=waiter)
        other.start()
        other.join(0.3)
        assert other.is_alive()  # it waits for the lock the holder has
        release.set()
        thread.join(10)
        other.join(10)
        assert waited == {"newest": seqs["holder"], "seq": seqs["holder"] + 1}
        report = audit_svc.verify_log(second, [])
        assert report.ok and report.first_bad_index is None, report.problems
        assert report.events == report.tree_size == seqs["holder"] + 1
    finally:
        first.dispose()
        second.dispose()
