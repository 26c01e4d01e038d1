"""The in-process cache of bearer-token checks (issue 20): a hot read does not go to the
database to learn who is calling.

``authenticate`` (sessions.py) keeps, per store, ``token_hash → (actor, expires_at, …)`` for at
most ``ttl`` seconds (``PROOFPLANE_TOKEN_CACHE_SECONDS``, default 2; 0: no cache) and at most
``max_entries`` tokens (least recently used evicted first). What it keeps is only what a
successful check established; a refusal is never cached.

Freshness:

* **In this process, at once.** Every ORM change to a token row (revoked, touched, deleted) or
  to a user row (disabled, roles or tenants changed, password changed, deleted) drops the
  affected entries from every cache of the process, when it is flushed and again when it
  commits (mapper and session events, so no service can forget to). A check that read the
  database before such a change commits does not store its answer (the generation counter).
* **In another process** (another ``serve --workers`` worker, another replica): on
  PostgreSQL the change is pushed (``token_push``: ``NOTIFY`` in the changing transaction, a
  ``LISTEN`` in every process) and the entries it names are dropped milliseconds after it
  commits; an entry the push covers lives ``pushed_ttl`` (5 minutes), so an agent attesting
  every minute reads its token once, not every round. Any other entry (SQLite, or while the
  push is down: losing it empties the cache) lives ``ttl`` seconds: that is the bound there,
  and why it is short.
* **Expiry** is checked against the request's ``now`` on every request, cached or not.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import event
from sqlalchemy.orm import Session, object_session

from proofplane.access import Actor
from proofplane.service.access import token_push
from proofplane.service.access.token_push import PUSHED_TTL_S, Push
from proofplane.service.context import PerStore
from proofplane.store.tables import TokenRow, UserRow

DEFAULT_TTL_S = 2.0
MAX_ENTRIES = 20_000  # 10,000 agents' tokens and the people's
_INFO_KEY = "proofplane_token_cache_invalidate"


@dataclass(slots=True)
class Entry:
    """What a successful check of one token established."""

    actor: Actor
    expires_at: datetime
    last_used_at: datetime | None
    user_id: int | None
    loaded: float  # time.monotonic() when its database read began
    touching: bool = False  # its "last used" is noted for the next batch (``last_used``)

    def used(self, at: datetime) -> None:
        """Its "last used" time ``at`` is stored: due again ``TOUCH_EVERY`` after it."""
        if self.last_used_at is None or at > self.last_used_at:
            self.last_used_at = at
        self.touching = False


class TokenCache:
    """One store's cache: an LRU of bounded size whose entries live ``ttl`` seconds."""

    def __init__(self, ttl: float = DEFAULT_TTL_S, max_entries: int = MAX_ENTRIES) -> None:
        self.ttl = ttl
        self.max_entries = max_entries
        self.generation = 0  # bumped by every invalidation
        # On PostgreSQL, what this process's revocation listener vouches for (token_push):
        # an entry it covers lives ``pushed_ttl`` seconds instead of ``ttl``.
        self.push: Push | None = None
        self.pushed_ttl = PUSHED_TTL_S
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[str, Entry] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> Entry | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or not self._fresh(entry, time.monotonic()):
                if entry is not None:
                    del self._entries[key]
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return entry

    def _fresh(self, entry: Entry, now: float) -> bool:
        age = now - entry.loaded
        if age < self.ttl:
            return True
        push = self.push
        return age < self.pushed_ttl and push is not None and push.covers(entry.loaded, now)

    def put(self, key: str, entry: Entry, generation: int) -> None:
        """Keep ``entry`` unless something was invalidated since ``generation`` was read
        (the check read the database before a change to it committed)."""
        if self.ttl <= 0:
            return
        with self._lock:
            if generation != self.generation:
                return
            self._entries[key] = entry
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def claim_touch(self, entry: Entry) -> bool:
        """Whether this caller is the one to note ``entry``'s "last used" (once, until the
        batch that writes it has stored it: ``Entry.used``)."""
        with self._lock:
            if entry.touching:
                return False
            entry.touching = True
            return True

    def invalidate(self, token_hashes: set[str], user_ids: set[int]) -> None:
        with self._lock:
            self.generation += 1
            for key in token_hashes:
                self._entries.pop(key, None)
            if user_ids:
                for key in [k for k, e in self._entries.items() if e.user_id in user_ids]:
                    del self._entries[key]

    def clear(self) -> None:
        with self._lock:
            self.generation += 1
            self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


def _made(store: Any) -> TokenCache:
    from proofplane.config import token_cache_ttl_s

    cache = TokenCache(token_cache_ttl_s())
    if cache.ttl > 0:
        listener = token_push.start_listener(store, cache.invalidate, cache.clear)
        cache.push = None if listener is None else listener.push
    return cache


# disposing a store forgets its cached checks and its cache
_CACHES: PerStore[TokenCache] = PerStore(TokenCache.clear)


def cache_for(store: Any) -> TokenCache:
    """The token cache of ``store`` (made on first use, TTL from the environment, with its
    revocation listener on PostgreSQL); disposing the store forgets both."""
    return _CACHES.get_or_make(store, _made)


def _invalidate_everywhere(token_hashes: set[str], user_ids: set[int]) -> None:
    for cache in _CACHES.values():
        cache.invalidate(token_hashes, user_ids)


def _changed(target: Any, connection: Any) -> None:
    tokens, users = set(), set()
    if isinstance(target, TokenRow):
        tokens.add(target.token_hash)
    elif target.id is not None:
        users.add(target.id)
    _invalidate_everywhere(tokens, users)
    token_push.notify(connection, tokens, users)  # other processes, once this commits
    session = object_session(target)
    if session is not None:  # again once it commits (a check may have read it meanwhile)
        pending = session.info.setdefault(_INFO_KEY, (set(), set()))
        pending[0].update(tokens)
        pending[1].update(users)


@event.listens_for(TokenRow, "after_update")
@event.listens_for(TokenRow, "after_delete")
@event.listens_for(UserRow, "after_update")
@event.listens_for(UserRow, "after_delete")
def _row_changed(_mapper: Any, connection: Any, target: Any) -> None:
    _changed(target, connection)


@event.listens_for(Session, "after_commit")
def _committed(session: Session) -> None:
    pending = session.info.pop(_INFO_KEY, None)
    if pending is not None:
        _invalidate_everywhere(*pending)


@event.listens_for(Session, "after_rollback")
def _rolled_back(session: Session) -> None:
    session.info.pop(_INFO_KEY, None)
