"""A token's "last used" time, written in batches (issue 20, §2: reads never take the write path).

A bearer token's ``last_used_at`` is due again five minutes after the time it holds
(``sessions.TOUCH_EVERY``). Each such check used to open a write transaction of its own, under
the one write lock, in the request that noticed it: at 10,000 agents attesting every minute
that is ~33 write transactions a second for a field that is not an audit trail. Now the
request only notes the time here, and one transaction a little later writes every time noted
meanwhile, in one executemany ``UPDATE`` (a Core statement: no mapper event, so the token
cache keeps its entries). The entries that asked then carry the new time.

What can be lost: the times noted in the last ``delay`` seconds before a process dies without
closing its store (``Store.dispose`` and the server's shutdown write them). A write that fails
(the database unavailable) keeps its times for the next try.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

from sqlalchemy import Table, bindparam, or_, update

from proofplane.access import Actor
from proofplane.service.context import PerStore
from proofplane.store.tables import TokenRow

log = logging.getLogger(__name__)

#: Seconds between the first time noted and the transaction that writes it.
FLUSH_AFTER_S = 2.0
#: At this many times waiting, the next note writes them at once.
MAX_WAITING = 2000

Done = Callable[[datetime], None]


class LastUsed:
    """The times noted for one store, and the timer that writes them.

    ``write(times)`` stores ``{token_id: time}`` in one transaction (``for_store`` gives the
    real one); ``done`` callbacks run once their time is stored."""

    def __init__(
        self, write: Callable[[Mapping[str, datetime]], None], delay: float = FLUSH_AFTER_S
    ) -> None:
        self.delay = delay
        self.writes = 0  # transactions written
        self._write = write
        self._waiting: dict[str, tuple[datetime, list[Done]]] = {}
        self._lock = threading.Lock()
        self._flushing = threading.Lock()  # one write at a time: a later one never goes first
        self._timer: threading.Timer | None = None
        self._closed = False

    def note(self, token_id: str, at: datetime, done: Done | None = None) -> None:
        """Record that ``token_id`` was used at ``at``; written within ``delay`` seconds."""
        with self._lock:
            if self._closed:
                return
            self._merge(token_id, at, [] if done is None else [done])
            full = len(self._waiting) >= MAX_WAITING
            if not full:
                self._arm()
        if full:
            self.flush()

    def waiting(self) -> int:
        with self._lock:
            return len(self._waiting)

    def flush(self) -> int:
        """Write what waits now, in one transaction; the number of tokens written."""
        with self._flushing:
            with self._lock:
                batch, self._waiting = self._waiting, {}
                if self._timer is not None:
                    self._timer.cancel()
                    self._timer = None
            if not batch:
                return 0
            try:
                self._write({token: when for token, (when, _) in batch.items()})
            except Exception as exc:  # a lost stamp must not fail a request
                log.warning("last-used times not written (%d tokens, kept): %s", len(batch), exc)
                self._requeue(batch)
                return 0
            self.writes += 1
        for when, callbacks in batch.values():
            for done in callbacks:
                done(when)
        return len(batch)

    def close(self) -> None:
        """Write what waits; later notes to this batch are ignored (a disposed store's:
        ``for_store`` gives such a store a new batch)."""
        self.flush()
        with self._lock:
            self._closed = True
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

    def _fire(self) -> None:
        try:
            self.flush()
        except Exception:  # a timer thread has no caller to tell
            log.exception("last-used flush failed")

    def _requeue(self, batch: dict[str, tuple[datetime, list[Done]]]) -> None:
        with self._lock:
            if self._closed:
                return
            for token, (when, callbacks) in batch.items():
                self._merge(token, when, callbacks)
            self._arm()

    def _merge(self, token_id: str, at: datetime, callbacks: list[Done]) -> None:
        """(Under ``_lock``.) ``token_id`` waits with the later of its times, every caller's
        callback kept."""
        held = self._waiting.get(token_id)
        if held is None:
            self._waiting[token_id] = (at, callbacks)
        else:
            self._waiting[token_id] = (max(at, held[0]), held[1] + callbacks)

    def _arm(self) -> None:
        """(Under ``_lock``.) Start the timer that writes what waits, unless it runs."""
        if self._timer is None:
            self._timer = threading.Timer(self.delay, self._fire)
            self._timer.daemon = True
            self._timer.name = "proofplane-last-used"
            self._timer.start()


_TOKENS: Table = TokenRow.__table__  # type: ignore[assignment]
_SET_LAST_USED = (  # on the table, not the mapped class: an executemany, never ORM bulk mode
    update(_TOKENS)
    .where(
        _TOKENS.c.id == bindparam("tid"),
        or_(_TOKENS.c.last_used_at.is_(None), _TOKENS.c.last_used_at < bindparam("at")),
    )
    .values(last_used_at=bindparam("at"))
)


def _made(store: Any) -> LastUsed:
    ref = weakref.ref(store)

    def write(times: Mapping[str, datetime]) -> None:
        target = ref()
        if target is None:
            return
        with target.write(Actor("system")) as tx:
            tx.session.connection().execute(
                _SET_LAST_USED, [{"tid": token, "at": at} for token, at in sorted(times.items())]
            )

    return LastUsed(write)


# disposing a store writes what waits and retires its batch
_BATCHES: PerStore[LastUsed] = PerStore(LastUsed.close)


def for_store(store: Any) -> LastUsed:
    """The batch of ``store`` (a ``service.context.Store``), made on first use; disposing
    the store writes what waits and retires the batch."""
    return _BATCHES.get_or_make(store, _made)


def flush_for(store: Any) -> None:
    """Write what waits for ``store`` now (a server shutting down: the store may serve again,
    so later notes still count); nothing when it never noted any."""
    batch = _BATCHES.get(store)
    if batch is not None:
        batch.flush()
