"""Overload is refused, not queued (issue 20, §4): the pure part of the API's admission control.

Every request but the health probes belongs to one *priority level* with its own concurrency
budget, in the way of kube-apiserver's API Priority and Fairness: a node agent's attestation
traffic, the reads (the console, ``GET``), and the writes. A flood of one level cannot take the
slots of another. Inside a level no single client (a bearer token, else an address) holds more
than its *share* of the slots, so one client flooding cannot take the whole level either.

A request that finds no slot may wait a short while (``max_wait_s``, milliseconds, never
seconds) in a small per-level queue; a slot freed while it waits is handed to the first waiter
whose client is under its share. Past that, or with the queue full, the request is refused at
once: the middleware (:mod:`proofplane.api.middleware_overload`) answers 429 with
``Retry-After``. The request is counted in flight until its response is complete.

:class:`Limiter` is plain data under a lock: no event loop, no clock. The middleware may call
it from several event loops in several threads (``up``'s in-process agents run one loop per
request), so waking a waiter is a callback the caller supplies.
"""

from __future__ import annotations

import math
import re
import threading
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

ATTESTATION = "attestation"
READ = "read"
WRITE = "write"
LEVELS = (ATTESTATION, READ, WRITE)

#: Paths no budget applies to: a probe must answer while the server is busy.
EXEMPT = frozenset({"/healthz", "/readyz"})

# What a node agent calls: enroll, activate, nonce, evidence, its channel certificate, and the
# agents' CA and CRL (which it fetches to verify the server and its peers).
_AGENT_POST = re.compile(
    r"/api/v1/nodes/[^/]+/(?:attestation/(?:enroll|activate|nonce|evidence)|agent-certificate)/?"
)
_AGENT_GET = frozenset({"/api/v1/pki/ca", "/api/v1/pki/crl"})
_READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})

#: Why a request was refused (the reply's ``details.reason``).
CLIENT_SHARE = "client_share"  # this client holds its share of the level already
LEVEL_FULL = "level_full"  # every slot taken and the wait queue full, or the wait ran out


def classify(method: str, path: str) -> str | None:
    """The priority level of a request, or None for the exempt health probes."""
    if path in EXEMPT:
        return None
    method = method.upper()
    if method == "POST" and _AGENT_POST.fullmatch(path):
        return ATTESTATION
    if method in _READ_METHODS:
        return ATTESTATION if path.rstrip("/") in _AGENT_GET else READ
    return WRITE


@dataclass(frozen=True, slots=True)
class Budget:
    """One level's budget: ``limit`` requests in flight, at most ``client_limit`` of them from
    one client; at most ``queue`` waiting, ``client_queue`` of them from one client."""

    limit: int
    client_limit: int
    queue: int
    client_queue: int

    @classmethod
    def of(cls, limit: int, client_share: float) -> Budget:
        """A level of ``limit`` slots: one client gets ``client_share`` of them (at least one),
        the queue holds half as many as the level (at least one), a client half of that."""
        if limit < 1:
            raise ValueError("a level needs at least one slot")
        if not 0 < client_share <= 1:
            raise ValueError("a client's share is more than 0 and at most 1")
        client_limit = max(1, min(limit, math.floor(limit * client_share)))
        queue = max(1, limit // 2)
        return cls(limit, client_limit, queue, max(1, math.floor(queue * client_share)))


@dataclass(eq=False, slots=True)
class Ticket:
    """A request waiting for a slot. ``wake`` is called (from whichever thread released the
    slot, under no lock of the limiter's) once the slot is handed over: ``granted``."""

    level: str
    client: str
    wake: Callable[[], None]
    granted: bool = False
    done: bool = False  # granted, or given up


@dataclass(slots=True)
class _Level:
    budget: Budget
    in_flight: int = 0
    clients: dict[str, int] = field(default_factory=dict)  # in flight per client (> 0 only)
    queued: deque[Ticket] = field(default_factory=deque)
    queued_clients: dict[str, int] = field(default_factory=dict)
    admitted: int = 0
    waited: int = 0  # admitted after a wait in the queue
    refused: dict[str, int] = field(default_factory=lambda: {CLIENT_SHARE: 0, LEVEL_FULL: 0})
    peak: int = 0


@dataclass(frozen=True, slots=True)
class Refused:
    level: str
    reason: str  # CLIENT_SHARE or LEVEL_FULL
    limit: int  # the level's slots, or the client's share of them


Admitted = bool  # True: the request holds a slot now


class Limiter:
    """Per-level and per-client in-flight counts, a small wait queue per level, and the
    counters an operator reads (:meth:`snapshot`). Thread-safe."""

    def __init__(self, budgets: Mapping[str, Budget]) -> None:
        missing = [name for name in LEVELS if name not in budgets]
        if missing:
            raise ValueError(f"no budget for {', '.join(missing)}")
        self._levels = {name: _Level(budgets[name]) for name in LEVELS}
        self._lock = threading.Lock()

    def budget(self, level: str) -> Budget:
        return self._levels[level].budget

    @property
    def total(self) -> int:
        """The slots of every level together (what the worker's thread pool must exceed)."""
        return sum(lv.budget.limit for lv in self._levels.values())

    def acquire(
        self, level: str, client: str, wake: Callable[[], None]
    ) -> Admitted | Ticket | Refused:
        """A slot now (True), a place in the queue (a :class:`Ticket`: wait for ``wake``, then
        :meth:`give_up` if it does not come in time), or a refusal."""
        with self._lock:
            lv = self._levels[level]
            b = lv.budget
            held = lv.clients.get(client, 0)
            if lv.in_flight < b.limit and held < b.client_limit:
                self._take(lv, client)
                return True
            if lv.queued_clients.get(client, 0) >= b.client_queue or len(lv.queued) >= b.queue:
                return self._refuse(lv, level, client)
            ticket = Ticket(level, client, wake)
            lv.queued.append(ticket)
            lv.queued_clients[client] = lv.queued_clients.get(client, 0) + 1
            return ticket

    def give_up(self, ticket: Ticket) -> Refused | None:
        """The waiter's time ran out (or it went away): None when the slot was handed over
        meanwhile (it holds it: run the request, then :meth:`release`), else its refusal."""
        with self._lock:
            if ticket.granted:
                return None
            lv = self._levels[ticket.level]
            if not ticket.done:
                ticket.done = True
                lv.queued.remove(ticket)
                self._unqueue(lv, ticket.client)
            return self._refuse(lv, ticket.level, ticket.client)

    def release(self, level: str, client: str) -> None:
        """A request of ``client`` at ``level`` is done: its slot goes to the first waiter whose
        client is under its share (woken here, outside the lock)."""
        with self._lock:
            lv = self._levels[level]
            lv.in_flight -= 1
            left = lv.clients[client] - 1
            if left:
                lv.clients[client] = left
            else:
                del lv.clients[client]
            woken = self._hand_over(lv)
        if woken is not None:
            woken.wake()

    def snapshot(self) -> dict[str, Any]:
        """Per level: slots, in flight, waiting, admitted, admitted after a wait, refused (by
        reason), the most in flight at once, and how many clients hold slots now."""
        with self._lock:
            return {
                name: {
                    "limit": lv.budget.limit,
                    "client_limit": lv.budget.client_limit,
                    "in_flight": lv.in_flight,
                    "peak_in_flight": lv.peak,
                    "queued": len(lv.queued),
                    "clients": len(lv.clients),
                    "admitted": lv.admitted,
                    "admitted_after_wait": lv.waited,
                    "refused": dict(lv.refused),
                }
                for name, lv in self._levels.items()
            }

    # -- under the lock --------------------------------------------------------------------

    def _take(self, lv: _Level, client: str) -> None:
        lv.in_flight += 1
        lv.clients[client] = lv.clients.get(client, 0) + 1
        lv.admitted += 1
        lv.peak = max(lv.peak, lv.in_flight)

    def _unqueue(self, lv: _Level, client: str) -> None:
        left = lv.queued_clients[client] - 1
        if left:
            lv.queued_clients[client] = left
        else:
            del lv.queued_clients[client]

    def _hand_over(self, lv: _Level) -> Ticket | None:
        if lv.in_flight >= lv.budget.limit:
            return None
        for ticket in lv.queued:
            if lv.clients.get(ticket.client, 0) < lv.budget.client_limit:
                lv.queued.remove(ticket)
                self._unqueue(lv, ticket.client)
                ticket.granted = ticket.done = True
                self._take(lv, ticket.client)
                lv.waited += 1
                return ticket
        return None

    def _refuse(self, lv: _Level, level: str, client: str) -> Refused:
        b = lv.budget
        if lv.clients.get(client, 0) >= b.client_limit and b.client_limit < b.limit:
            lv.refused[CLIENT_SHARE] += 1
            return Refused(level, CLIENT_SHARE, b.client_limit)
        lv.refused[LEVEL_FULL] += 1
        return Refused(level, LEVEL_FULL, b.limit)
