"""``Store.write_grouped``: writes that wait while one holds the write lock are committed
together in one transaction, each applied as its caller's (actor, time); one refused before it
changed anything fails alone in the group; one that fails after changing something rolls the
group back and each is committed alone; a database that is unavailable fails them all, once
(issue 20)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

import pytest
from sqlalchemy import select

from proofplane.access import SYSTEM, Actor
from proofplane.errors import Unavailable, ValidationFailed
from proofplane.service.context import GROUP_MAX, Store, Tx
from proofplane.store.tables import EventRow

T0 = datetime(2026, 11, 28, 12, tzinfo=UTC)


class Writes:
    """An ``apply`` that records one event per item and notes which transaction applied it; the
    item ``"first"`` holds the lock until the others are queued behind it. ``refuse(item)``: an
    error raised before the item writes anything; ``fail(item)``: one raised after its event."""

    def __init__(
        self,
        store: Store,
        fail: Callable[[str], BaseException | None],
        refuse: Callable[[str], BaseException | None] = lambda _item: None,
    ) -> None:
        self.store, self.fail, self.refuse = store, fail, refuse
        self.transactions: list[tuple[Tx, list[str]]] = []
        self.queued = threading.Event()
        self.started = threading.Event()

    def __call__(self, tx: Tx, item: str) -> str:
        if not self.transactions or self.transactions[-1][0] is not tx:
            self.transactions.append((tx, []))
        self.transactions[-1][1].append(item)
        refused = self.refuse(item)
        if refused is not None:
            raise refused
        tx.record("test.write", "item", item, details={"now": tx.now.isoformat()})
        if item == "first":
            self.started.set()
            assert self.queued.wait(10)
        error = self.fail(item)
        if error is not None:
            raise error
        return f"{item}@{tx.actor.name}"

    def grouped(self, items: list[str]) -> dict[str, Future[str]]:
        """``first`` alone, then ``items`` queued behind it; their futures."""
        pool = ThreadPoolExecutor(len(items) + 1)
        out = {"first": pool.submit(self.send, "first")}
        assert self.started.wait(10)
        out |= {i: pool.submit(self.send, i) for i in items}
        group = self.store._groups[self]
        for _ in range(1000):
            if len(group.queue) == len(items):
                break
            threading.Event().wait(0.01)
        self.queued.set()
        pool.shutdown(wait=True)
        return out

    def send(self, item: str) -> str:
        now = T0 if item == "first" else None
        return self.store.write_grouped(Actor(f"user:{item}"), now, self, item)

    def batches(self) -> list[list[str]]:
        return [items for _tx, items in self.transactions]


def _written(store: Store) -> list[tuple[int, str, str]]:
    with store.read() as session:
        rows = session.execute(
            select(EventRow.seq, EventRow.actor, EventRow.target_id)
            .where(EventRow.action == "test.write")
            .order_by(EventRow.seq)
        )
        return [tuple(r) for r in rows]  # type: ignore[misc]


def test_writes_queued_behind_the_lock_commit_in_one_transaction_each_as_its_caller(
    store: Store,
) -> None:
    writes = Writes(store, lambda _item: None)
    items = [f"w{i}" for i in range(5)]
    got = writes.grouped(items)
    assert {k: f.result() for k, f in got.items()} == {
        k: f"{k}@user:{k}" for k in ["first", *items]
    }
    assert [len(b) for b in writes.batches()] == [1, 5]
    events = _written(store)
    assert sorted(a for _s, a, _t in events) == sorted(f"user:{k}" for k in ["first", *items])
    seqs = [s for s, _a, _t in events]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # gap-free, one after another
    with store.read() as session:
        details = dict(session.execute(select(EventRow.target_id, EventRow.details)).all())
    assert details["first"]["now"] == T0.isoformat()  # a caller's own time is its events'
    # else the group's: the time its transaction began, as a write without a time takes it
    assert len({details[i]["now"] for i in items}) == 1
    assert details["w0"]["now"] > T0.isoformat()


def test_a_group_carries_at_most_group_max_writes(store: Store) -> None:
    writes = Writes(store, lambda _item: None)
    items = [f"w{i}" for i in range(GROUP_MAX + 3)]
    got = writes.grouped(items)
    assert all(f.result() for f in got.values())
    assert [len(b) for b in writes.batches()] == [1, GROUP_MAX, 3]


def test_writes_queued_while_the_leader_waits_for_the_lock_join_its_batch(store: Store) -> None:
    """A leader forms its batch once it holds the write lock, not before it waits for it: the
    writes that queue while another transaction (another group, process or replica) holds the
    lock commit with the leader's write, in one transaction."""
    writes = Writes(store, lambda _item: None)
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with store.write(SYSTEM) as tx:
            tx.session.connection()
            held.set()
            assert release.wait(10)

    pool = ThreadPoolExecutor(6)
    holder = pool.submit(hold)
    assert held.wait(10)
    got = {"lead": pool.submit(writes.send, "lead")}
    group = None
    for _ in range(1000):
        group = store._groups.get(writes)
        if group is not None and group.leading:
            break
        threading.Event().wait(0.01)
    assert group is not None and group.leading  # the leader waits for the lock
    items = [f"w{i}" for i in range(4)]
    got |= {i: pool.submit(writes.send, i) for i in items}
    for _ in range(1000):
        if sum(1 for p in group.queue if p.item in items) == len(items):
            break
        threading.Event().wait(0.01)
    release.set()
    writes.queued.set()
    pool.shutdown(wait=True)
    holder.result()
    assert {k: f.result() for k, f in got.items()} == {k: f"{k}@user:{k}" for k in got}
    assert writes.batches() == [["lead", *items]]  # one transaction for all five
    assert sorted(t for _s, _a, t in _written(store)) == sorted(["lead", *items])


def _only_refused(got: dict[str, Any], refused: str, landed: list[str]) -> None:
    """``refused``'s caller got its own refusal; every other caller (``landed``) its result."""
    with pytest.raises(ValidationFailed, match=f"{refused} is refused"):
        got[refused].result()
    assert {k: f.result() for k, f in got.items() if k != refused} == {
        k: f"{k}@user:{k}" for k in landed
    }


def test_a_write_that_fails_in_a_group_fails_alone_and_the_others_land(store: Store) -> None:
    bad = ValidationFailed("w2 is refused", code="refused")
    writes = Writes(store, lambda item: bad if item == "w2" else None)
    items = [f"w{i}" for i in range(4)]
    got = writes.grouped(items)
    _only_refused(got, "w2", ["first", "w0", "w1", "w3"])
    # the group rolled back at w2, then each was committed (or refused) alone
    assert writes.batches() == [["first"], items[:3], ["w0"], ["w1"], ["w2"], ["w3"]]
    assert sorted(t for _s, _a, t in _written(store)) == ["first", "w0", "w1", "w3"]


def test_a_write_refused_before_it_changed_anything_fails_alone_in_the_group(
    store: Store,
) -> None:
    bad = ValidationFailed("w1 is refused", code="refused")
    writes = Writes(store, lambda _item: None, refuse=lambda item: bad if item == "w1" else None)
    items = [f"w{i}" for i in range(4)]
    got = writes.grouped(items)
    _only_refused(got, "w1", ["first", "w0", "w2", "w3"])
    assert writes.batches() == [["first"], items]  # one transaction, nothing retried
    assert sorted(t for _s, _a, t in _written(store)) == ["first", "w0", "w2", "w3"]


def test_an_unavailable_database_fails_the_whole_group_once(store: Store) -> None:
    writes = Writes(store, lambda item: Unavailable("gone") if item == "w1" else None)
    items = ["w0", "w1", "w2"]
    got = writes.grouped(items)
    for item in items:
        with pytest.raises(Unavailable):
            got[item].result()
    assert got["first"].result() == "first@user:first"
    assert writes.batches() == [["first"], items[:2]]  # not retried alone: each would wait again
    assert [t for _s, _a, t in _written(store)] == ["first"]


def test_a_write_alone_is_its_own_transaction(store: Store) -> None:
    writes = Writes(store, lambda _item: None)
    assert store.write_grouped(SYSTEM, T0, writes, "solo") == f"solo@{SYSTEM.name}"
    assert writes.batches() == [["solo"]]
    with pytest.raises(KeyError):
        store.write_grouped(SYSTEM, T0, lambda _tx, item: {}[item], "missing")


def test_inside_a_joined_transaction_a_grouped_write_joins_it(store: Store) -> None:
    writes = Writes(store, lambda _item: None)
    with (
        pytest.raises(RuntimeError, match="roll back"),
        store.write(SYSTEM, T0) as tx,
        store.joined(tx),
    ):
        assert store.write_grouped(Actor("user:x"), None, writes, "inner") == (
            f"inner@{SYSTEM.name}"  # the joined transaction's actor
        )
        assert writes.transactions[0][0] is tx
        raise RuntimeError("roll back")
    assert _written(store) == []  # it rolled back with the transaction it joined


@pytest.mark.parametrize("error", [Unavailable("no write lock"), RuntimeError("begin failed")])
def test_a_failure_before_the_batch_is_taken_answers_the_queued_writes(
    store: Store, monkeypatch: pytest.MonkeyPatch, error: Exception
) -> None:
    """The leader takes its batch once it holds the lock: when beginning the transaction
    fails, the writes queued are answered with that failure (none waits for ever, none is
    left behind) and the next write commits."""
    writes = Writes(store, lambda _item: None)
    real = Store._write
    failed = []

    def failing(self: Store, actor: Actor, now: datetime | None, catch_up: bool) -> Any:
        if not failed:
            failed.append(actor)
            raise error
        return real(self, actor, now, catch_up)

    monkeypatch.setattr(Store, "_write", failing)
    with pytest.raises(type(error), match=str(error)):
        store.write_grouped(SYSTEM, T0, writes, "doomed")
    assert failed == [SYSTEM] and writes.batches() == []  # nothing was applied
    assert not store._groups[writes].queue and not store._groups[writes].leading
    assert store.write_grouped(SYSTEM, T0, writes, "next") == f"next@{SYSTEM.name}"
    assert [t for _s, _a, t in _written(store)] == ["next"]
