"""SQLite writers queue on the writer gate (a thread lock, then a ``flock`` on
``<database>.writer``) instead of polling in SQLite's sleeping busy handler: writes from many
threads and from two processes all commit, the event log stays gap-free, a writer waits while
another process holds the gate and goes the moment it is released. On PostgreSQL the writers of
one process queue on a thread lock, so one of them at a time waits on the advisory lock."""

from __future__ import annotations

import contextlib
import fcntl
import multiprocessing
import os
import stat
import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import func, select, text

from proofplane.access import SYSTEM
from proofplane.errors import Unavailable
from proofplane.service.context import Store
from proofplane.store import db as store_db
from proofplane.store import migrate
from proofplane.store.tables import EventRow


def _store(path: Path) -> Store:
    store = Store(f"sqlite:///{path}")
    migrate.upgrade(store.engine)
    return store


def _write_events(url: str, who: str, count: int) -> None:
    store = Store(url)
    try:
        for i in range(count):
            with store.write(SYSTEM) as tx:
                tx.record("test.gate", "writer", f"{who}-{i}")
    finally:
        store.dispose()


def _a_late_writer_is_unavailable(store: Store) -> None:
    """While this thread holds the write slot, a write from another thread gives up after
    ``BUSY_TIMEOUT_S`` with ``unavailable`` (and writes nothing)."""
    failed: list[BaseException] = []
    with store.write(SYSTEM) as tx:
        tx.record("test.gate", "writer", "holder")

        def write() -> None:
            try:
                with store.write(SYSTEM) as inner:
                    inner.record("test.gate", "writer", "late")
            except Unavailable as exc:
                failed.append(exc)

        t = threading.Thread(target=write)
        t.start()
        t.join(10)
    assert len(failed) == 1 and failed[0].code == "unavailable"


def _seqs(store: Store) -> list[int]:
    with store.read() as session:
        return list(session.scalars(select(EventRow.seq).order_by(EventRow.seq)))


def test_threads_and_processes_all_commit_and_the_log_stays_gap_free(tmp_path: Path) -> None:
    path = tmp_path / "gate.db"
    store = _store(path)
    url = f"sqlite:///{path}"
    with store.read() as session:
        before = session.scalar(select(func.count()).select_from(EventRow)) or 0
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_write_events, args=(url, f"p{k}", 40)) for k in range(2)]
    for p in procs:
        p.start()
    threads = [threading.Thread(target=_write_events, args=(url, f"t{k}", 30)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    seqs = _seqs(store)
    assert len(seqs) == before + 2 * 40 + 4 * 30
    assert seqs == list(range(1, len(seqs) + 1))  # one writer at a time: no gap, no duplicate
    gate = Path(f"{path}.writer")
    assert stat.S_IMODE(gate.stat().st_mode) == 0o600


def _hold_gate(path: str, ready: object, release: object) -> None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    ready.set()  # type: ignore[attr-defined]
    release.wait(30)  # type: ignore[attr-defined]
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


def test_a_writer_waits_for_another_process_and_goes_when_it_lets_go(tmp_path: Path) -> None:
    path = tmp_path / "gate.db"
    store = _store(path)
    ctx = multiprocessing.get_context("spawn")
    ready, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold_gate, args=(f"{path}.writer", ready, release))
    holder.start()
    try:
        assert ready.wait(30)
        done = threading.Event()

        def write() -> None:
            with store.write(SYSTEM) as tx:
                tx.record("test.gate", "writer", "waiting")
            done.set()

        writer = threading.Thread(target=write)
        writer.start()
        assert not done.wait(0.5)  # queued behind the other process
        released = time.monotonic()
        release.set()
        assert done.wait(10)
        assert time.monotonic() - released < 1.0  # woken by the kernel, not a polling sleep
        writer.join(10)
    finally:
        release.set()
        holder.join(30)


def test_a_writer_that_cannot_get_the_slot_in_time_is_unavailable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = _store(tmp_path / "gate.db")
    monkeypatch.setattr(store_db, "BUSY_TIMEOUT_S", 0.2)
    _a_late_writer_is_unavailable(store)
    seqs = _seqs(store)
    assert seqs == list(range(1, len(seqs) + 1))


def test_an_in_memory_sqlite_database_has_no_gate() -> None:
    from sqlalchemy import create_engine

    gate = store_db.writer_gate(create_engine("sqlite://"))
    assert isinstance(gate, contextlib.nullcontext)


_ADVISORY_WAITERS = text(
    "SELECT count(*) FROM pg_locks l JOIN pg_database d ON d.oid = l.database "
    "WHERE l.locktype = 'advisory' AND NOT l.granted AND d.datname = current_database() "
    "AND l.objid = :key"
)


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_on_postgresql_a_process_sends_one_writer_at_a_time_to_the_advisory_lock(
    store: Store,
) -> None:
    """Issue 20: the other writers of the process wait in it (a thread lock), not in
    PostgreSQL holding a pooled connection each; they all commit once the holder has, and the
    log stays gap-free."""
    taken, release = threading.Event(), threading.Event()
    done: list[str] = []

    def holder() -> None:
        with store.write(SYSTEM) as tx:
            tx.record("test.gate", "writer", "holder")
            taken.set()
            release.wait(10)

    def writer(k: int) -> None:
        with store.write(SYSTEM) as tx:
            tx.record("test.gate", "writer", f"w{k}")
        done.append(f"w{k}")

    h = threading.Thread(target=holder)
    h.start()
    assert taken.wait(10)
    writers = [threading.Thread(target=writer, args=(k,)) for k in range(4)]
    for t in writers:
        t.start()
    try:
        time.sleep(0.3)  # long enough for a writer to reach PostgreSQL, were it let through
        with store.engine.connect() as conn:
            waiting = conn.execute(_ADVISORY_WAITERS, {"key": store_db.WRITE_LOCK_KEY}).scalar()
        assert waiting == 0 and done == []  # they wait in the process, and have not written
    finally:
        release.set()
        h.join(10)
        for t in writers:
            t.join(10)
    assert sorted(done) == ["w0", "w1", "w2", "w3"]
    seqs = _seqs(store)
    assert seqs == list(range(1, len(seqs) + 1))


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_on_postgresql_a_writer_that_waits_too_long_in_its_process_is_unavailable(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store_db, "BUSY_TIMEOUT_S", 0.2)
    _a_late_writer_is_unavailable(store)
    from sqlalchemy import event

    with store.write(SYSTEM) as tx:  # the gate is free again, and re-entrant in its holder
        tx.record("test.gate", "writer", "after")

        def hook(_session: object) -> None:  # a write an after_commit hook makes
            with store.write(SYSTEM) as inner:
                inner.record("test.gate", "writer", "after-commit")

        event.listen(tx.session, "after_commit", hook, once=True)
    with store.read() as session:
        ids = list(
            session.scalars(select(EventRow.target_id).where(EventRow.action == "test.gate"))
        )
    assert ids == ["holder", "after", "after-commit"]


def test_a_write_an_after_commit_hook_makes_in_the_same_thread_does_not_wait_for_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sqlalchemy import event

    store = _store(tmp_path / "gate.db")
    monkeypatch.setattr(store_db, "BUSY_TIMEOUT_S", 2)
    started = time.monotonic()
    with store.write(SYSTEM) as tx:
        tx.record("test.gate", "writer", "outer")

        def after(_session: object) -> None:  # like keys' record of a failed backend erase
            with store.write(SYSTEM) as inner:
                inner.record("test.gate", "writer", "after-commit")

        event.listen(tx.session, "after_commit", after, once=True)
    assert time.monotonic() - started < 1.5
    with store.read() as session:
        ids = list(
            session.scalars(select(EventRow.target_id).where(EventRow.action == "test.gate"))
        )
    assert ids == ["outer", "after-commit"]


def test_a_read_waits_while_another_thread_of_the_process_holds_the_write_slot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 20: the slot holder runs alone in its process. A read starting in another thread
    waits until the holder commits, or at most ``READ_YIELD_S`` (5 s here, so that a slow box
    cannot end the wait before the commit); the holder's own reads never wait; with no write
    in progress, or on another database, nothing waits."""
    monkeypatch.setattr(store_db, "READ_YIELD_S", 5.0)
    store = _store(tmp_path / "prio.db")
    taken, release, read_done = threading.Event(), threading.Event(), threading.Event()
    finished: dict[str, float] = {}

    def writer() -> None:
        with store.write(SYSTEM) as tx:
            taken.set()
            t = time.perf_counter()
            with store.read() as session:  # its own read: no wait
                session.scalar(select(func.count()).select_from(EventRow))
            finished["own_read_s"] = time.perf_counter() - t
            release.wait(5)
            tx.record("test.prio", "writer", "w")
            finished["committing"] = time.perf_counter()

    def reader() -> None:
        with store.read() as session:
            session.scalar(select(func.count()).select_from(EventRow))
        finished["read"] = time.perf_counter()
        read_done.set()

    try:
        w = threading.Thread(target=writer)
        w.start()
        assert taken.wait(5)
        r = threading.Thread(target=reader)
        r.start()
        assert not read_done.wait(0.02)  # held back while the slot is held
        release.set()
        w.join(5)
        r.join(5)
        assert finished["read"] >= finished["committing"]
        assert finished["own_read_s"] < 1.0  # it would have waited 5 s for itself
        # no holder: a read goes at once
        t = time.perf_counter()
        store_db.yield_to_writer(store.engine, 5.0)
        assert time.perf_counter() - t < 1.0
        # a holder that keeps the slot longer holds a read back at most the timeout
        release.clear()
        taken.clear()
        read_done.clear()
        w = threading.Thread(target=writer)
        w.start()
        assert taken.wait(5)
        t = time.perf_counter()
        store_db.yield_to_writer(store.engine, 0.1)
        waited = time.perf_counter() - t
        assert 0.09 <= waited < 2.0, waited
        # a read of another database (another file) does not wait for this one's writer
        other = _store(tmp_path / "other.db")
        try:
            with other.write(SYSTEM) as tx:  # it has a gate of its own now
                tx.record("test.prio", "writer", "other")
            t = time.perf_counter()
            store_db.yield_to_writer(other.engine, 5.0)
            assert time.perf_counter() - t < 1.0
        finally:
            other.dispose()
        release.set()
        w.join(5)
    finally:
        release.set()
        store.dispose()
