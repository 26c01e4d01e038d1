"""Overload is refused, not queued (issue 20, §4): the pure part of the API's admission control.

Every request but the health probes belongs to one *priority level* with its own concurrency
budget, in the way of kube-apiserver's API Priority and Fairness: a node agent's attestation
traffic, the reads (the console, ``GET``), and the writes. A flood of one level cannot take the
slots of another. Inside a level no single client (a bearer token, else an address) holds more
than its *share* of the slots, so one client flooding cannot take the whole level either.

A request that finds no slot may wait a short while (its level's ``max_wait_s``, a fraction
of a second, never seconds) in a small per-level queue; a slot freed while it waits is handed
to the first waiter whose client is under its share. Past that, with the queue full, or when
every slot is taken and the wait it would have is already longer than the level allows, the
request is refused at once: the middleware (:mod:`proofplane.api.middleware_overload`)
answers 429 with ``Retry-After``. The request is counted in flight until its response is
complete.

The expected wait is the place the request would take in the queue times the time a request
of its level holds a slot (a moving average of what the middleware measured, one slow request
counted at most as ``limit * max_wait_s``), over the level's slots: a request that could not
be served within its level's wait is told so at once, instead of after waiting it out.

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
QUEUE_WAIT = "queue_wait"  # the wait for a slot would be longer than the level allows
#: Weight of the newest hold time in a level's moving average.
HOLD_WEIGHT = 0.2
#: A level's longest wait in its queue unless said otherwise.
MAX_WAIT_S = 0.05


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
    one client; at most ``queue`` waiting, ``client_queue`` of them from one client, each for
    at most ``max_wait_s``."""

    limit: int
    client_limit: int
    queue: int
    client_queue: int
    max_wait_s: float = MAX_WAIT_S

    @classmethod
    def of(
        cls,
        limit: int,
        client_share: float,
        queue: int | None = None,
        max_wait_s: float = MAX_WAIT_S,
    ) -> Budget:
        """A level of ``limit`` slots: one client gets ``client_share`` of them (at least one);
        the queue holds ``queue`` (default: half as many as the level, at least one), a client
        ``client_share`` of that (at least one)."""
        if limit < 1:
            raise ValueError("a level needs at least one slot")
        if not 0 < client_share <= 1:
            raise ValueError("a client's share is more than 0 and at most 1")
        if queue is not None and queue < 1:
            raise ValueError("a level's queue holds at least one request")
        if not 0 <= max_wait_s <= 60:
            raise ValueError("a wait in the queue is 0 to 60 seconds")
        client_limit = max(1, min(limit, math.floor(limit * client_share)))
        queue = max(1, limit // 2) if queue is None else queue
        client_queue = max(1, math.floor(queue * client_share))
        return cls(limit, client_limit, queue, client_queue, max_wait_s)


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
    refused: dict[str, int] = field(
        default_factory=lambda: {CLIENT_SHARE: 0, LEVEL_FULL: 0, QUEUE_WAIT: 0}
    )
    peak: int = 0
    hold_s: float | None = None  # moving average of how long a request held a slot


@dataclass(frozen=True, slots=True)
class Refused:
    level: str
    reason: str  # CLIENT_SHARE, LEVEL_FULL or QUEUE_WAIT
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
            full = lv.in_flight >= b.limit  # (else only this client's share is taken)
            if full and self._expected_wait(lv, len(lv.queued) + 1) > b.max_wait_s:
                lv.refused[QUEUE_WAIT] += 1
                return Refused(level, QUEUE_WAIT, b.limit)
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

    def release(self, level: str, client: str, held_s: float | None = None) -> None:
        """A request of ``client`` at ``level`` is done, after holding its slot ``held_s``
        seconds (None: not measured, e.g. a request given up): its slot goes to the first
        waiter whose client is under its share (woken here, outside the lock)."""
        with self._lock:
            lv = self._levels[level]
            if held_s is not None and held_s >= 0:
                # One slow request (a worker's first, an export) counts at most as long as
                # the hold that would keep even the first in the queue waiting past the wait.
                held_s = min(held_s, lv.budget.limit * lv.budget.max_wait_s)
                lv.hold_s = (
                    held_s if lv.hold_s is None else lv.hold_s + HOLD_WEIGHT * (held_s - lv.hold_s)
                )
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
        reason), the most in flight at once, how many clients hold slots now, and the moving
        average of how long a request held a slot (ms; None before the first)."""
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
                    "hold_ms": None if lv.hold_s is None else round(lv.hold_s * 1000, 3),
                }
                for name, lv in self._levels.items()
            }

    # -- under the lock --------------------------------------------------------------------

    def _expected_wait(self, lv: _Level, place: int) -> float:
        """Seconds until the request at ``place`` in the queue (1: first) gets a slot, if slots
        keep freeing at the rate they have been: 0 before any hold time is known."""
        if lv.hold_s is None:
            return 0.0
        return place * lv.hold_s / lv.budget.limit

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
