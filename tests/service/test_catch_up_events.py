"""The events a write transaction's caches catch up from (``service.context.events_after``,
issue 20). The scheduler cache and the network cache both follow what another process or
replica wrote since their version; in a write transaction they read those events once between
them (kept by the ``Tx``, its own events added as it writes them), and on PostgreSQL not at
all when the write lock's round trip brought them (``store.db.write_session``). Whatever
serves them, they are the rows a plain read gives."""

from __future__ import annotations

from collections.abc import Callable

from sqlalchemy import select

from dbtest import traced_statements
from proofplane.access import SYSTEM
from proofplane.model import GpuRequest
from proofplane.service import workloads as workloads_svc
from proofplane.service.context import Store, events_after
from proofplane.service.scheduling import scheduler_cache
from proofplane.store.db import LOCKED_EVENTS, LOCKED_EVENTS_MAX
from proofplane.store.tables import EventRow


def _rows(store: Store, after: int) -> list[tuple[int, str, str, str]]:
    with store.read() as session:
        return [
            (r.seq, r.target_type, r.target_id, r.action)
            for r in session.scalars(select(EventRow).where(EventRow.seq > after).order_by("seq"))
        ]


def _event_reads(store: Store) -> Callable[[], int]:
    """How many statements on ``store``'s connections read the events table from here on
    (the write lock's round trip and the inserts left out)."""
    seen = traced_statements(store)

    def reads() -> int:
        n = sum(
            s.lstrip().upper().startswith("SELECT")
            and "FROM events" in s
            and "max(" not in s.lower()
            and "pg_advisory_xact_lock" not in s
            for s in seen
        )
        seen.clear()
        return n

    return reads


def _submit(store: Store, name: str) -> None:
    spec = workloads_svc.WorkloadSpec(name=name, tenant="research-lab", gpus=GpuRequest(count=1))
    workloads_svc.submit_workload(store, SYSTEM, spec)


def test_a_write_serves_the_events_a_read_gives_its_own_included(db_url: str) -> None:
    mine, other = Store(db_url), Store(db_url)
    try:
        with mine.write(SYSTEM) as tx:
            tx.record("test.mine", "test", "m0")
        for i in range(5):
            with other.write(SYSTEM) as tx:
                tx.record_many(
                    [("test.other", "node", f"n{i}", {}), ("test.other", "user", "u", {})]
                )
        with mine.write(SYSTEM, catch_up=True) as tx:
            session = tx.session
            assert events_after(session, 1, 100) == _rows(other, 1)
            assert events_after(session, 4, 100) == _rows(other, 4)  # later than it knows
            assert events_after(session, 1, 3) == _rows(other, 1)[:4]  # cap + 1: too many
            assert events_after(session, 1, 100, upto=6) == _rows(other, 1)[:5]
            tx.record("test.mine", "workload", "w1")
            tx.record_many([("test.mine", "tenant", "t", {})])
            assert events_after(session, 1, 100) == [
                *_rows(other, 1),
                (12, "workload", "w1", "test.mine"),
                (13, "tenant", "t", "test.mine"),
            ]
            assert events_after(session, 0, 100)[0] == (1, "test", "m0", "test.mine")  # read
        assert _rows(mine, 0)[-2:] == [
            (12, "workload", "w1", "test.mine"),
            (13, "tenant", "t", "test.mine"),
        ]
    finally:
        mine.dispose()
        other.dispose()


def test_a_catch_up_after_another_writer_reads_the_events_once_or_not_at_all(
    demo: Store, db_url: str
) -> None:
    """The scheduler cache and the network cache catch up from one read of the events
    (SQLite), or from the rows the write lock brought (PostgreSQL), and stay a fresh load's."""
    reads = _event_reads(demo)  # (on SQLite its pool is new: the caches are loaded again)
    _submit(demo, "own-0")
    cache = scheduler_cache(demo.engine)
    other = Store(db_url)
    try:
        for i in range(3):
            _submit(other, f"other-{i}")
            workloads_svc.cancel_workload(other, SYSTEM, f"other-{i}", tenant="research-lab")
            catch_ups = cache.catch_ups
            reads()
            _submit(demo, f"own-{i + 1}")
            assert cache.catch_ups == catch_ups + 1
            assert reads() == (1 if demo.engine.dialect.name == "sqlite" else 0)
    finally:
        other.dispose()


def test_a_writer_further_behind_than_the_lock_brings_reads_them(demo: Store, db_url: str) -> None:
    """More events since its last commit than the lock's round trip carries: the caches read
    them (once) and still catch up instead of loading the cluster."""
    reads = _event_reads(demo)
    _submit(demo, "own-0")
    cache = scheduler_cache(demo.engine)
    other = Store(db_url)
    try:
        with other.write(SYSTEM) as tx:  # targets placement does not see: caught up, no load
            tx.record_many(
                [("user.update", "user", f"u{i}", {}) for i in range(LOCKED_EVENTS_MAX + 10)]
            )
        reads()
        loads, catch_ups = cache.loads, cache.catch_ups
        _submit(demo, "own-1")
        assert (cache.loads, cache.catch_ups) == (loads, catch_ups + 1)
        assert reads() == 1
    finally:
        other.dispose()


def test_only_a_write_that_asks_brings_the_events_with_the_lock(db_url: str) -> None:
    """A write that places through the caches asks for the other writers' events with the
    lock (``catch_up``: submits and cancels); another (an attestation round) does not pay for
    them. SQLite has no lock round trip: neither brings them."""
    store = Store(db_url)
    try:
        with store.write(SYSTEM) as tx:  # its commit leaves the edge the next writes start from
            tx.record("test.first", "test", "t")
        with store.write(SYSTEM) as tx:
            tx.session.connection()  # begun: the lock taken
            assert LOCKED_EVENTS not in tx.session.info
        with store.write(SYSTEM, catch_up=True) as tx:
            tx.session.connection()
            postgres = store.engine.dialect.name == "postgresql"
            assert (LOCKED_EVENTS in tx.session.info) is postgres
            if postgres:
                assert tx.session.info[LOCKED_EVENTS] == (1, [])  # nothing since its commit
    finally:
        store.dispose()
