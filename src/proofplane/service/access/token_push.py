"""Revocations pushed to every process on PostgreSQL (issue 20): the token cache may keep a
check for minutes, not seconds, without a revocation elsewhere waiting that long.

A change to a token or user row (revoked, logged out, disabled, roles or tenants changed,
deleted) already drops the affected cache entries of its own process (``token_cache``). On
PostgreSQL it also sends ``NOTIFY proofplane_credentials`` with the token hash or user id, in
the same transaction: PostgreSQL delivers it when, and only if, that transaction commits. Every
process keeps one connection that ``LISTEN``\\s on the channel (``Listener``, a daemon thread
per store) and drops the named entries of its caches when a notice arrives, milliseconds after
the commit.

What the cache may assume from it (``Push.covers``): an entry read after the ``LISTEN`` took
effect, while the connection has been up without a break and answered a health check within
``ALIVE_S``, will be dropped by any later change. So such an entry lives ``PUSHED_TTL_S``;
any other the short TTL (``PROOFPLANE_TOKEN_CACHE_SECONDS``, 2 s by default). When the
connection breaks, every cache of the store is emptied (a notice may have been lost) and the
listener connects again, with a growing pause. On SQLite (one host, the workers of one
``serve``) nothing is pushed: the short TTL is the bound there.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from sqlalchemy import Connection, Engine, text

from proofplane.service.context import PerStore

log = logging.getLogger(__name__)

CHANNEL = "proofplane_credentials"
APPLICATION_NAME = "proofplane-token-push"
#: How long an entry covered by the push is kept (expiry is still checked on every request).
PUSHED_TTL_S = 300.0
#: Seconds between the listener's health checks, and how long after the last one that
#: succeeded its push still counts.
HEALTH_S = 1.0
ALIVE_S = 10.0
#: How often the thread looks up from its connection (how soon ``stop`` ends it).
WAKE_S = 0.1
#: The pause before connecting again after a failure doubles up to this.
MAX_PAUSE_S = 30.0

_NOTIFY = text("SELECT pg_notify(:channel, :payload)")


def notify(connection: Connection, token_hashes: set[str], user_ids: set[int]) -> None:
    """Tell every process, once this transaction commits, to drop these entries (PostgreSQL
    only; elsewhere nothing)."""
    if connection.dialect.name != "postgresql" or not (token_hashes or user_ids):
        return
    payload = json.dumps({"t": sorted(token_hashes), "u": sorted(user_ids)})
    connection.execute(_NOTIFY, {"channel": CHANNEL, "payload": payload})


def parse(payload: str) -> tuple[set[str], set[int]] | None:
    """The token hashes and user ids of a notice, or None when it is not one of ours."""
    try:
        data = json.loads(payload)
        tokens = {str(t) for t in data["t"]}
        users = {int(u) for u in data["u"]}
    except (ValueError, KeyError, TypeError):
        return None
    return tokens, users


class Push:
    """What one process's listener vouches for (read by the token cache on every check)."""

    def __init__(self) -> None:
        self.since: float | None = None  # time.monotonic() when the LISTEN took effect
        self.alive_at = 0.0  # when the connection last answered

    def covers(self, loaded: float, now: float) -> bool:
        """Whether a check that started reading at ``loaded`` is dropped by any later change."""
        since = self.since
        return since is not None and loaded >= since and now - self.alive_at < ALIVE_S


class Listener:
    """A daemon thread holding one connection that LISTENs on ``CHANNEL`` for ``engine``'s
    database. ``on_notice(tokens, users)`` drops entries; ``on_lost()`` empties the caches."""

    def __init__(
        self,
        engine: Engine,
        on_notice: Callable[[set[str], set[int]], None],
        on_lost: Callable[[], None],
        owner: Any = None,
    ) -> None:
        self.push = Push()
        self.notices = 0
        self.connects = 0
        self._engine = engine
        self._on_notice = on_notice
        self._on_lost = on_lost
        # The store it serves, weakly: a store dropped without ``dispose`` ends the thread.
        self._owner = None if owner is None else weakref.ref(owner)
        self._stop = threading.Event()
        self._conn: Any = None
        self._thread = threading.Thread(target=self._run, name="proofplane-token-push")
        self._thread.daemon = True

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def wait_listening(self, timeout: float) -> bool:
        """Whether the LISTEN took effect within ``timeout`` seconds (tests, start-up)."""
        deadline = time.monotonic() + timeout
        while self.push.since is None:
            if time.monotonic() > deadline or self._stop.is_set():
                return False
            time.sleep(0.01)
        return True

    def _connect(self) -> Any:
        dialect = self._engine.dialect
        cargs, cparams = dialect.create_connect_args(self._engine.url)
        cparams.setdefault("application_name", APPLICATION_NAME)  # in pg_stat_activity
        conn = dialect.loaded_dbapi.connect(*cargs, **cparams)
        conn.autocommit = True
        conn.execute(f"LISTEN {CHANNEL}")
        return conn

    def _run(self) -> None:
        pause = 0.5
        failures = 0
        while not self._stop.is_set():
            if self._owner is not None and self._owner() is None:
                return
            try:
                self._conn = self._connect()
                self.connects += 1
                self.push.alive_at = self.push.since = time.monotonic()
                failures, pause = 0, 0.5
                self._listen(self._conn)
            except Exception as exc:  # a broken or refused connection: start over
                if not self._stop.is_set():
                    (log.warning if failures == 0 else log.debug)(
                        "token revocation push lost, caches emptied: %s", exc
                    )
                failures += 1
            finally:
                self.push.since = None
                if self._conn is not None:
                    try:
                        self._conn.close()
                    except Exception:  # already broken
                        log.debug("closing the push connection failed", exc_info=True)
                    self._conn = None
                self._on_lost()
            if self._stop.wait(pause):
                break
            pause = min(pause * 2, MAX_PAUSE_S)

    def _listen(self, conn: Any) -> None:
        checked = time.monotonic()
        while not self._stop.is_set():
            for notice in conn.notifies(timeout=WAKE_S):
                got = parse(notice.payload) if notice.channel == CHANNEL else None
                if got is not None:
                    self.notices += 1
                    self._on_notice(*got)
            if time.monotonic() - checked >= HEALTH_S:
                conn.execute("SELECT 1")
                checked = self.push.alive_at = time.monotonic()


# disposing a store stops its listener and forgets it
_LISTENERS: PerStore[Listener] = PerStore(Listener.stop)


def listener_for(store: Any) -> Listener | None:
    """The running listener of ``store`` (a ``service.context.Store``), or None when its
    database cannot push (SQLite)."""
    return _LISTENERS.get(store)


def start_listener(
    store: Any,
    on_notice: Callable[[set[str], set[int]], None],
    on_lost: Callable[[], None],
) -> Listener | None:
    """Start ``store``'s listener if its database is PostgreSQL (once); disposing the store
    stops it and forgets it (a store used again after ``dispose`` starts a new one)."""
    if store.engine.dialect.name != "postgresql":
        return None

    def made(s: Any) -> Listener:
        listener = Listener(s.engine, on_notice, on_lost, s)
        listener.start()
        return listener

    return _LISTENERS.get_or_make(store, made)
