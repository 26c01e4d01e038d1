"""The unit of work: one transaction per use case, with its events written inside it.

``Store.write`` is the only way service code changes state. It opens a write transaction (the
single-writer lock, see ``store.db``), hands out a ``Tx`` whose ``record`` appends events with
gap-free sequence numbers, and commits state and events together, or neither.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, TypeVar

from sqlalchemy import Dialect, Engine, bindparam, func, insert, select
from sqlalchemy.exc import DataError, IntegrityError, OperationalError
from sqlalchemy.orm import Session

from proofplane.access import Actor
from proofplane.audit.canonical import entry_leaf_hashes, format_ts, stored_details
from proofplane.audit.export.config import SinkPolicy
from proofplane.config import NetworkSettings
from proofplane.errors import Conflict, ProofplaneError, Unavailable, ValidationFailed
from proofplane.model import Outcome
from proofplane.service import instruments
from proofplane.store.audit_log import Appender, sqlite_connection
from proofplane.store.db import (
    LOCKED_EVENTS,
    LOCKED_EVENTS_MAX,
    LOCKED_HASHES,
    LOCKED_HASHES_MAX,
    LOCKED_NEWEST_SEQ,
    make_engine,
    read_session,
    write_session,
    writer_gate,
    yield_to_writer,
)
from proofplane.store.tables import EventRow

if TYPE_CHECKING:
    from proofplane.backends.base import Backend


class NewEvent(NamedTuple):
    """One event for ``Tx.record_many``."""

    action: str
    target_type: str
    target_id: str
    details: dict[str, Any] | None = None
    outcome: Outcome = Outcome.SUCCESS


_EVENT_COLUMNS = (
    "seq", "ts", "actor", "action", "target_type", "target_id", "outcome", "details"
)  # fmt: skip
# SQLite: values bound as prepared (ts as the column's text, details as canonical JSON text)
_SQLITE_INSERT = f"INSERT INTO events ({', '.join(_EVENT_COLUMNS)}) VALUES ({', '.join('?' * 8)})"


#: An event as the caches catch up from it: ``(seq, target_type, target_id, action)``.
EventKey = tuple[int, str, str, str]

_OUTCOMES = {o: o.value for o in Outcome}
_LAST_SEQ = select(func.max(EventRow.__table__.c.seq))
_SQLITE_LAST_SEQ = "SELECT max(seq) FROM events"


class Tx:
    """A write transaction in progress: the session, who acts, and when."""

    backend: Backend | None = None  # the store's execution engine (service/execution.py)
    # the store's network settings (issue 14; None: read from PROOFPLANE_* when needed)
    network_settings: NetworkSettings | None = None

    def __init__(self, session: Session, actor: Actor, now: datetime) -> None:
        self.session = session
        self.actor = actor
        self.now = now
        self._next_seq: int | None = None
        self._audit: Appender | None = None  # the Merkle log's right edge, loaded on first use
        # The edge this process's last commit left (its tree size, its hashes; None: none
        # known): when the log still holds that many leaves, it is the edge, read no more.
        self.edge_hint: tuple[int, list[bytes]] | None = None
        # The newest event before this transaction wrote its first one (None: none written
        # yet): the state a per-store cache must be current at to be reused by this one.
        self.base_seq: int | None = None
        # The newest event in the database as read under the write lock (None: not read yet):
        # only this transaction's own events move it after that (``newest_seq``).
        self._newest: int | None = None
        # Per-transaction state a service keeps (by its own key), and what runs just before
        # the commit (``on_finish``): a service that batches work to the end of the
        # transaction (the network's desired state, issue 14) writes it there, events and all.
        self.extras: dict[str, Any] = {}
        self._finishers: list[Callable[[Tx], None]] = []
        # Every event after a seq, up to the newest (this transaction's own included), as
        # ``(seq, target_type, target_id, action)``: what the per-store caches catch up from
        # (``events_after``), read once for all of them (None: not known yet).
        self._events: tuple[int, list[EventKey]] | None = None
        self._events_taken = False  # whether the lock query's events were looked at

    def record(
        self,
        action: str,
        target_type: str,
        target_id: str,
        *,
        outcome: Outcome = Outcome.SUCCESS,
        details: dict[str, Any] | None = None,
    ) -> EventRow:
        """Append one event to this transaction. The single place events are written.

        The row is inserted at once (visible to this transaction's later queries); the
        returned ``EventRow`` carries its values (details as the database gives them back)
        and is not attached to the session."""
        prepared = self._prepare([NewEvent(action, target_type, target_id, details, outcome)])
        (seq,) = self._write(prepared)
        return EventRow(
            seq=seq,
            ts=self.now,
            actor=self.actor.name,
            action=action,
            target_type=target_type,
            target_id=target_id,
            outcome=outcome.value,
            details=prepared[0][4],
        )

    def record_many(self, events: Iterable[NewEvent | tuple[Any, ...]]) -> list[int]:
        """Append many events at once (one bulk insert, no ORM objects): the same rows,
        entries and Merkle hashes as that many ``record`` calls, in order. Returns their seqs.
        Nothing is written when any event is refused (``ValueError``)."""
        prepared = self._prepare(events)
        return self._write(prepared) if prepared else []

    def _prepare(
        self, events: Iterable[NewEvent | tuple[Any, ...]]
    ) -> list[tuple[str, str, str, str, dict[str, Any], str, str]]:
        # pure and first: a refused event leaves the transaction's log state untouched
        out = []
        success = Outcome.SUCCESS.value
        for e in events:
            if len(e) == 5:
                action, target_type, target_id, details, outcome_enum = e
                outcome = _OUTCOMES.get(outcome_enum)
                if outcome is None:
                    raise ValueError(f"outcome must be an Outcome, not {outcome_enum!r}")
            else:
                action, target_type, target_id, details = NewEvent(*e)[:4]
                outcome = success
            value, stored, text = stored_details(details)
            out.append((action, target_type, target_id, outcome, value, stored, text))
        return out

    def _write(
        self, prepared: list[tuple[str, str, str, str, dict[str, Any], str, str]]
    ) -> list[int]:
        session = self.session
        raw = sqlite_connection(session)
        sqlite = raw is not None
        if self._next_seq is None:
            # The first event flushes the session's pending rows, as the ORM query here once
            # did (its autoflush): a Core read later in the transaction sees them. The read
            # itself is Core (or the DB-API connection): nothing for the ORM to compile.
            session.flush()
            last = self.newest_seq()  # read under this transaction's write lock
            self._next_seq = last + 1
            self.base_seq = last
        if self._audit is None:
            size, hint = self._next_seq - 1, self.edge_hint
            locked = session.info.get(LOCKED_HASHES)
            if hint is not None and hint[0] == size:
                # Under the write lock the log holds ``size`` leaves, as it did when this
                # process committed that edge: nobody appended since (every append moves
                # the newest seq), so the edge is the same and two reads are saved.
                self._audit = Appender(size, hint[1])
            elif (
                hint is not None
                and locked is not None
                and locked[0] == hint[0] < size
                and len(locked[1]) <= LOCKED_HASHES_MAX
            ):
                # Another writer appended since: its hashes came with the write lock, and
                # they extend that edge (each checked against the leaves it stored).
                self._audit = Appender.extended(hint[0], hint[1], locked[1], size)
            else:
                self._audit = Appender.load(session, size)
        ts_db: Any = _sqlite_ts(self.now, session.get_bind().dialect) if sqlite else self.now
        actor = self.actor.name
        first = seq = self._next_seq
        # the entries' leaves first: an entry that is not valid Unicode refuses the batch
        leaves = entry_leaf_hashes(
            format_ts(self.now),
            actor,
            [(first + k, p[0], p[1], p[2], p[3], p[6]) for k, p in enumerate(prepared)],
        )
        rows: list[dict[str, Any]] = []
        params: list[tuple[Any, ...]] = []
        for action, target_type, target_id, outcome, value, stored, _text in prepared:
            row = (seq, ts_db, actor, action, target_type, target_id, outcome)
            if sqlite:
                params.append((*row, stored))  # as a rule the canonical text itself
            else:
                rows.append(dict(zip(_EVENT_COLUMNS, (*row, value), strict=True)))
            seq += 1
        if raw is not None:
            raw.executemany(_SQLITE_INSERT, params)
        else:
            session.execute(insert(EventRow.__table__), rows)
        known = self.known_events()
        if known is not None:  # it stays every event after its start: these are the newest
            known[1].extend((first + k, p[1], p[2], p[0]) for k, p in enumerate(prepared))
        self._next_seq = seq
        self._audit.append_leaves(leaves)
        return list(range(seq - len(leaves), seq))

    def newest_seq(self) -> int:
        """The newest event's ``seq`` in the database: this transaction's last one, or the one
        before it wrote any, read once. It holds the write lock from its first statement and
        every event is written through ``record``/``record_many``, so nothing else moves it
        meanwhile: the scheduler cache's checks, the network cache's and the first event's
        seq share one read instead of each taking its own."""
        if self._next_seq is not None:
            return self._next_seq - 1
        if self._newest is None:
            session = self.session
            raw = sqlite_connection(session)
            if raw is None:
                session.connection()  # begun: the write lock taken, the newest seq with it
            locked = session.info.get(LOCKED_NEWEST_SEQ)  # PostgreSQL's, read with the lock
            self._newest = int(locked) if locked is not None else _read_last_seq(session, raw) or 0
        return self._newest

    def known_events(self) -> tuple[int, list[EventKey]] | None:
        """``(after, events)``: every event after seq ``after`` up to the newest, in seq order,
        as this transaction knows them without reading (None: it knows none). On PostgreSQL the
        lock's round trip brings the events written since this process's last commit
        (``store.db.write_session``); a complete read by ``events_after`` is kept too; the
        transaction's own events are added as it writes them."""
        if not self._events_taken and self._events is None:
            self._events_taken = True
            locked = self.session.info.get(LOCKED_EVENTS)
            # the lock query's rows are all of them unless the limit cut them
            if locked is not None and len(locked[1]) <= LOCKED_EVENTS_MAX:
                self._events = (int(locked[0]), list(locked[1]))
        return self._events

    def audit_edge(self) -> tuple[int, list[bytes]] | None:
        """The Merkle log's right edge after this transaction's events (None: none loaded)."""
        return None if self._audit is None else (self._audit.size, self._audit.range.hashes)

    @property
    def last_seq(self) -> int | None:
        """The newest event this transaction wrote (None: none)."""
        return None if self._next_seq is None else self._next_seq - 1

    def on_finish(self, fn: Callable[[Tx], None]) -> None:
        """Run ``fn(tx)`` once, just before the commit (in the order they were added); it may
        change state and record events, which commit with the rest or not at all."""
        if fn not in self._finishers:
            self._finishers.append(fn)

    def finish(self) -> None:
        """Run the ``on_finish`` work, then write the Merkle log hashes of this transaction's
        events (just before commit)."""
        for fn in self._finishers:
            fn(self)
        if self._audit is not None:
            self._audit.flush(self.session)


def _read_last_seq(session: Session, raw: Any | None) -> int | None:
    """The newest event's seq (None: no event), read on the DB-API connection on SQLite."""
    if raw is not None:
        last: int | None = raw.execute(_SQLITE_LAST_SEQ).fetchone()[0]
        return last
    return session.connection().execute(_LAST_SEQ).scalar()


def _sqlite_ts(now: datetime, dialect: Dialect) -> str:
    """The text the ``events.ts`` column stores for ``now`` on SQLite (the column type's own
    bind processing, so a row written in bulk reads back exactly like one the ORM wrote)."""
    process = EventRow.__table__.c.ts.type._cached_bind_processor(dialect)
    value = process(now) if process else now
    if not isinstance(value, str):
        raise TypeError(f"expected the SQLite text form of a datetime, got {value!r}")
    return value


_TX_INFO = "proofplane.tx"  # a write session's ``Session.info`` key: its ``Tx``

_EVENTS_AFTER = (
    select(
        EventRow.__table__.c.seq,
        EventRow.__table__.c.target_type,
        EventRow.__table__.c.target_id,
        EventRow.__table__.c.action,
    )
    .where(
        EventRow.__table__.c.seq > bindparam("after"),
        EventRow.__table__.c.seq <= bindparam("upto"),
    )
    .order_by(EventRow.__table__.c.seq)
    .limit(bindparam("cap"))
)
_NO_END = 2**62


def events_after(session: Session, after: int, cap: int, upto: int | None = None) -> list[EventKey]:
    """The events with ``after < seq <= upto`` (``upto`` None: up to the newest) as ``(seq,
    target_type, target_id, action)`` in seq order, at most ``cap`` + 1 of them (more than
    ``cap``: the caller has too many to follow). In a write transaction of ``Store.write``
    they come from what it already knows when that covers them (``Tx.known_events``): the
    scheduler cache and the network cache catch up from one read, or from none when the
    write lock's round trip brought them; a complete read to the newest is kept for the next
    caller. Elsewhere they are read."""
    tx = session.info.get(_TX_INFO)
    known = tx.known_events() if isinstance(tx, Tx) else None
    if known is not None and known[0] <= after:
        end = _NO_END if upto is None else upto
        return [e for e in known[1] if after < e[0] <= end][: cap + 1]
    rows: list[EventKey] = [
        (int(seq), target_type, target_id, action)
        for seq, target_type, target_id, action in session.execute(
            _EVENTS_AFTER,
            {"after": after, "upto": _NO_END if upto is None else upto, "cap": cap + 1},
        )
    ]
    if isinstance(tx, Tx) and upto is None and len(rows) <= cap and known is None:
        tx._events = (after, list(rows))  # every event after ``after``: kept
    return rows


def newest_seq(session: Session) -> int:
    """The newest event's ``seq`` that ``session`` sees: ``Tx.newest_seq`` in a write
    transaction of ``Store.write`` (read at most once), else read now."""
    tx = session.info.get(_TX_INFO)
    if isinstance(tx, Tx):
        return tx.newest_seq()
    return session.scalar(_LAST_SEQ) or 0


_JOINED: ContextVar[tuple[Store, Tx] | None] = ContextVar("proofplane_joined_tx", default=None)

_I = TypeVar("_I")
_R = TypeVar("_R")

#: The most writes one group commit carries: a batch holds the write lock for all of them, and
#: the other writers (a console's submit) wait behind it.
GROUP_MAX = 16


class _Pending(Generic[_I, _R]):
    """One caller's write waiting in a group: its actor, time and item, then its outcome."""

    __slots__ = ("actor", "done", "error", "item", "now", "result")

    def __init__(self, actor: Actor, now: datetime | None, item: _I) -> None:
        self.actor, self.now, self.item = actor, now, item
        self.done = False
        self.result: _R | None = None
        self.error: BaseException | None = None


class _Group(Generic[_I, _R]):
    """Group commit of one kind of write (``Store.write_grouped``), leader/follower as a
    database's log writer does it: a caller queues its write; the first one that finds no
    leader becomes it, takes the write lock once for everything queued (up to ``GROUP_MAX``),
    applies each in its turn in one transaction and commits them together; the others wait for
    their outcome. Under load a batch forms while the previous one holds the lock, so the lock,
    the log's right edge, the Merkle hashes and the commit are paid once per batch instead of
    once per write; alone, a write is a batch of one and waits for nobody."""

    def __init__(
        self,
        store: Store,
        apply: Callable[[Tx, _I], _R],
        *,
        catch_up: bool = False,
        apply_many: Callable[[Tx, list[_I]], list[_R]] | None = None,
    ) -> None:
        self.store, self.apply, self.catch_up = store, apply, catch_up
        self.apply_many = apply_many
        self.cv = threading.Condition()
        self.queue: deque[_Pending[_I, _R]] = deque()
        self.leading = False

    def run(self, pending: _Pending[_I, _R]) -> _R:
        with self.cv:
            self.queue.append(pending)
            while not pending.done and self.leading:
                self.cv.wait()
            lead = not pending.done
            self.leading = self.leading or lead
        if lead:
            try:
                while not pending.done:
                    self._commit(None)
                    with self.cv:
                        self.cv.notify_all()  # the batch's callers have their outcome
            finally:
                with self.cv:
                    self.leading = False
                    self.cv.notify_all()  # one of those still queued leads next
        if pending.error is not None:
            raise pending.error
        return pending.result  # type: ignore[return-value]

    def _first(self) -> _Pending[_I, _R]:
        with self.cv:
            return self.queue[0]  # the leader's own write is queued until it is done

    def _take(self) -> list[_Pending[_I, _R]]:
        with self.cv:
            return [self.queue.popleft() for _ in range(min(GROUP_MAX, len(self.queue)))]

    def _runs(self, batch: list[_Pending[_I, _R]]) -> list[list[_Pending[_I, _R]]]:
        """``batch`` in runs that ``apply_many`` may apply at once: consecutive writes of one
        actor at one time (a transaction's events carry its actor's name and its time); each
        write alone without ``apply_many``. One actor: one name, whichever of its credentials
        (tokens, sessions) each write came with, so ``apply_many`` takes anything else of an
        actor (its tenants, for one) from each item, not from ``tx.actor``."""
        runs: list[list[_Pending[_I, _R]]] = []
        for p in batch:
            last = runs[-1][-1] if runs else None
            if (
                self.apply_many is not None
                and last is not None
                and last.actor.name == p.actor.name
                and last.now == p.now
            ):
                runs[-1].append(p)
            else:
                runs.append([p])
        return runs

    def _apply_run(
        self,
        tx: Tx,
        run: list[_Pending[_I, _R]],
        began: datetime,
        results: list[tuple[_Pending[_I, _R], _R | None, BaseException | None]],
    ) -> bool:
        """``apply_many`` for a run of one actor's writes at one time; False when a check
        refused one of them before anything was written (then each is applied alone)."""
        assert self.apply_many is not None
        tx.actor, tx.now = run[0].actor, run[0].now or began
        tx.session.flush()
        seq = tx.last_seq
        try:
            outs = self.apply_many(tx, [p.item for p in run])
        except ProofplaneError as exc:
            if not _refused_untouched(tx, seq, exc):
                raise
            return False
        results.extend((p, out, None) for p, out in zip(run, outs, strict=True))
        return True

    def _commit(self, given: list[_Pending[_I, _R]] | None) -> None:
        """Commit ``given`` in one transaction, or (None) what is queued once the write lock is
        held: the writes that queued while this leader waited for it (another process's or
        replica's transaction, or another group's in this process) join this batch instead of
        the next one, so under contention the lock is taken once for all of them."""
        results: list[tuple[_Pending[_I, _R], _R | None, BaseException | None]] = []
        batch = given or []
        try:
            actor = batch[0].actor if batch else self._first().actor
            with self.store.write(actor, catch_up=self.catch_up) as tx:
                if given is None:
                    tx.session.connection()  # begins the transaction: the lock is held now
                    batch = self._take()
                began = tx.now  # the group's time: what a write without ``now`` takes
                for run in self._runs(batch):
                    if len(run) > 1 and self._apply_run(tx, run, began, results):
                        continue
                    for p in run:  # alone (or one of a run a check refused: each alone)
                        tx.actor, tx.now = p.actor, p.now or began
                        tx.session.flush()  # the writes before it, so its own are told apart
                        seq = tx.last_seq
                        try:
                            results.append((p, self.apply(tx, p.item), None))
                        except ProofplaneError as exc:
                            if not _refused_untouched(tx, seq, exc):
                                raise
                            # refused before it changed anything (a check): the others go on
                            results.append((p, None, exc))
        except Unavailable as exc:  # the lock or the database: the same for every write
            for p in batch or self._take():
                p.error, p.done = copy.copy(exc), True
            return
        except Exception as exc:
            batch = batch or self._take()  # failed before the lock: each alone, as below
            if len(batch) == 1:
                batch[0].error, batch[0].done = exc, True
                return
            # A write failed after it changed something: the batch rolled back, and each is
            # committed alone, so a write fails only for its own reason and the others land.
            for p in batch:
                self._commit([p])
            return
        except BaseException as exc:  # an interpreter exit: nothing committed, nothing retried
            for p in batch:
                p.error, p.done = exc, True
            raise
        for p, out, error in results:
            p.result, p.error, p.done = out, error, True


def _refused_untouched(tx: Tx, seq: int | None, exc: ProofplaneError) -> bool:
    """Whether a grouped write that raised ``exc`` was refused before it changed anything: no
    event of its own (every change writes one, rule 1) and nothing left unflushed. Then the
    transaction holds only the other writes, which may still commit."""
    if isinstance(exc, Unavailable) or tx.last_seq != seq:
        return False
    session = tx.session
    return not (session.new or session.dirty or session.deleted)


class Store:
    """The database a control plane instance works on, and the engine that runs its placed
    workloads (``backend``; None: placements are decisions only, nothing is executed)."""

    # What SIEM sinks may reach (issue 19, §5); None: read from PROOFPLANE_SINK_* when needed.
    sink_policy: SinkPolicy | None = None
    # The KMS sealing its secrets and signing its checkpoints (service/keys.py ``kms_for``);
    # None: built from PROOFPLANE_KMS on first use.
    kms: Any = None
    # The key of its attestation nonces, opened once (service/attestation.py ``nonce_key``).
    nonce_key: bytes | None = None
    # Segment pools and their cool-down (issue 14); None: read from PROOFPLANE_* when needed.
    network: NetworkSettings | None = None

    def __init__(
        self, url: str, engine: Engine | None = None, backend: Backend | None = None
    ) -> None:
        self.url = url
        self.engine = engine or make_engine(url)
        self.backend = backend
        self._groups: dict[Callable[..., Any], _Group[Any, Any]] = {}  # write_grouped's
        self._groups_lock = threading.Lock()
        self._at_dispose: list[Callable[[], None]] = []
        # The audit log's edge this store's last commit left (``Tx.edge_hint``); replaced
        # whole, so a reader sees one commit's pair.
        self._audit_edge: tuple[int, list[bytes]] | None = None

    def at_dispose(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` when the store is disposed, before its connections close (work a
        service batches for it, such as tokens' "last used" times, is written then)."""
        self._at_dispose.append(fn)

    @contextmanager
    def joined(self, tx: Tx) -> Iterator[None]:
        """Inside this block, ``write`` on this store (in this thread or task) joins ``tx``
        instead of opening a transaction: a service function called here commits or rolls
        back with ``tx``. An approved change applies the very function a direct call runs,
        atomically with the change request's own state and events (issue 12)."""
        token = _JOINED.set((self, tx))
        try:
            yield
        finally:
            _JOINED.reset(token)

    def joined_tx(self) -> Tx | None:
        """The transaction ``write`` joins here (``joined``), else None."""
        joined = _JOINED.get()
        return joined[1] if joined is not None and joined[0] is self else None

    def write_grouped(
        self,
        actor: Actor,
        now: datetime | None,
        apply: Callable[[Tx, _I], _R],
        item: _I,
        *,
        catch_up: bool = False,
        apply_many: Callable[[Tx, list[_I]], list[_R]] | None = None,
    ) -> _R:
        """``apply(tx, item)`` in a write transaction, committed together with the other
        callers' writes of the same ``apply`` waiting at the time (group commit, ``_Group``):
        what ``with store.write(actor, now) as tx: return apply(tx, item)`` does, with the
        write lock shared. ``tx.actor`` and ``tx.now`` are this caller's while ``apply`` runs
        (``now`` None: the group's transaction's own time, as ``write`` picks it). A write
        refused before it changed anything (a check's ``ProofplaneError``) fails alone and the
        group commits the rest; one that fails after changing something rolls the group back,
        and each write is then committed alone, so it fails alone. Inside ``joined`` it joins
        that transaction instead. ``catch_up``: as for ``write``. ``apply_many(tx, items)``:
        ``apply`` for several items at once, their results in order, the same rows and events
        as one ``apply`` after the other; the group applies each run of writes of one actor
        at one time through it, and each write alone when it refuses one of them before
        writing anything (both fixed by the first call for ``apply``)."""
        if self.joined_tx() is not None:
            with self.write(actor, now) as tx:
                return apply(tx, item)
        with self._groups_lock:
            group = self._groups.get(apply)
            if group is None:
                group = self._groups[apply] = _Group(
                    self, apply, catch_up=catch_up, apply_many=apply_many
                )
        return group.run(_Pending(actor, now, item))

    @contextmanager
    def write(
        self, actor: Actor, now: datetime | None = None, *, catch_up: bool = False
    ) -> Iterator[Tx]:
        """A write transaction. ``catch_up``: it places work through this store's scheduler
        and network caches, which follow what other processes or replicas wrote since this
        store's last commit: on PostgreSQL those events and the Merkle log's hashes come with
        the write lock's round trip (``store.db.write_session``) instead of being read. Other
        writes (an attestation round) leave it off and read only what they need."""
        joined = self.joined_tx()
        if joined is not None:
            yield joined  # the outer transaction commits (or rolls back) it all
            return
        asked = time.perf_counter()
        with writer_gate(self.engine):
            got = time.perf_counter()
            try:
                yield from self._write(actor, now, catch_up)
            finally:
                instruments.observe_write(got - asked, time.perf_counter() - got)

    def _write(self, actor: Actor, now: datetime | None, catch_up: bool) -> Iterator[Tx]:
        # the events since this store's last commit come with the write lock (PostgreSQL)
        hint = self._audit_edge
        after = hint[0] if catch_up and hint is not None else None
        session = write_session(self.engine, events_after=after)
        try:
            with session.begin():
                tx = Tx(session, actor, now or datetime.now(UTC))
                tx.backend = self.backend
                tx.network_settings = self.network
                tx.edge_hint = self._audit_edge
                session.info[_TX_INFO] = tx
                yield tx
                tx.finish()
            edge = tx.audit_edge()  # committed (a rollback raised past this)
            if edge is not None:
                self._audit_edge = edge
        except IntegrityError as exc:
            # Services check uniqueness first under the writer lock; this is the safety net.
            raise Conflict(
                "the change conflicts with existing data", details=str(exc.orig)
            ) from exc
        except DataError as exc:
            raise _unstorable(exc) from exc
        except OperationalError as exc:
            raise Unavailable("the database is unavailable", details=str(exc.orig)) from exc
        finally:
            session.info.pop(_TX_INFO, None)
            session.close()

    @contextmanager
    def read(self, *, streaming: bool = False) -> Iterator[Session]:
        """A read session (``store.db.read_session``: autocommit on PostgreSQL unless
        ``streaming``, which a ``yield_per`` query needs for its server-side cursor)."""
        yield_to_writer(self.engine)  # this database's write slot, held in this process, first
        session = read_session(self.engine, streaming=streaming)
        try:
            with session.begin():
                yield session
        except DataError as exc:
            raise _unstorable(exc) from exc
        except OperationalError as exc:
            raise Unavailable("the database is unavailable", details=str(exc.orig)) from exc
        finally:
            session.close()

    def dispose(self) -> None:
        hooks, self._at_dispose = self._at_dispose, []
        for fn in hooks:
            try:
                fn()
            except Exception:  # closing goes on; the hook logs what it lost
                logging.getLogger(__name__).exception("store dispose hook failed")
        self.engine.dispose()


_T = TypeVar("_T")


class PerStore(Generic[_T]):
    """One ``_T`` per store (a batch, a cache, a listener), made on first use and held no
    longer than the store. Disposing the store runs ``retire`` on it and forgets it: an engine
    can be used again after ``dispose``, and its next use makes a new one (with a new hook)."""

    def __init__(self, retire: Callable[[_T], None]) -> None:
        self._items: weakref.WeakKeyDictionary[Store, _T] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()
        self._retire = retire

    def get(self, store: Store) -> _T | None:
        with self._lock:
            return self._items.get(store)

    def values(self) -> list[_T]:
        with self._lock:
            return list(self._items.values())

    def get_or_make(self, store: Store, make: Callable[[Store], _T]) -> _T:
        """The store's item, else ``make(store)``'s (called once, under this registry's
        lock)."""
        item = self._items.get(store)
        if item is not None:
            return item
        with self._lock:
            item = self._items.get(store)
            if item is None:
                made = item = self._items[store] = make(store)
                ref = weakref.ref(store)
                store.at_dispose(lambda: self._forget(ref, made))
        return item

    def _forget(self, ref: weakref.ref[Store], item: _T) -> None:
        self._retire(item)
        store = ref()
        with self._lock:
            if store is not None and self._items.get(store) is item:
                del self._items[store]


def _unstorable(exc: DataError) -> ValidationFailed:
    """A value the database refuses (a NUL character, a number out of range): the input's
    fault, so a 422, never a 500."""
    return ValidationFailed(
        "a value in the request cannot be stored or compared (out of range or invalid characters)",
        code="invalid_value",
        details=str(exc.orig).splitlines()[0],
    )
