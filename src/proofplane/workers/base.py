"""One base for the server's background loops: a daemon thread that runs ``run_once`` every
``interval_s`` seconds until stopped.

What each loop used to hand-write is here once: start and a prompt stop (the wait is on an
Event, so ``stop`` never waits out an interval), an optional jitter (so replicas started
together do not tick together), an optional error backoff (a pass that raised waits
``interval_s · 2^(failures-1)``, capped at ``backoff_cap_s``; the first success resets it), and
a few facts a health check or a metric can read: when the last pass succeeded, the last error,
how many passes failed in a row. A pass that raises is reported to ``on_error`` (logged by
default) and never ends the thread.

The defaults change nothing about a loop's timing: no jitter, no backoff, the first pass one
interval after ``start`` (``run_at_start`` runs it at once). ``sleep``, ``random`` and ``clock``
are injectable, and ``run`` runs the loop on the calling thread, so tests are fast and exact.
"""

from __future__ import annotations

import logging
import random as _random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol, TypeVar

log = logging.getLogger(__name__)


class Lease(Protocol):
    """What a worker asks before each pass (``workers.leader.Leadership``)."""

    def held(self) -> bool: ...

    def attach(self) -> None: ...

    def detach(self) -> None: ...


class Worker:
    """A background loop. Subclass and implement :meth:`run_once` (or pass ``target``).

    ``sleep(delay)`` waits up to ``delay`` seconds and returns True when the loop must stop
    (default: the worker's stop Event, so :meth:`stop` ends any wait at once)."""

    #: seconds :meth:`stop` waits for the thread by default
    stop_timeout_s: float = 10.0
    #: a loop that must run once per deployment: :func:`started` gives it its store's lease,
    #: and a pass runs only while this process holds it (``workers.leader``)
    leader_only: bool = True
    #: the lease a pass needs (None: every pass runs)
    leadership: Lease | None = None

    def __init__(
        self,
        name: str,
        interval_s: float,
        *,
        target: Callable[[], object] | None = None,
        jitter: float = 0.0,
        backoff_cap_s: float | None = None,
        run_at_start: bool = False,
        sleep: Callable[[float], bool] | None = None,
        random: Callable[[], float] = _random.random,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be positive")
        if not 0.0 <= jitter < 1.0:
            raise ValueError("jitter must be in [0, 1)")
        if backoff_cap_s is not None and backoff_cap_s < interval_s:
            raise ValueError("backoff_cap_s must be at least interval_s")
        self.name = name
        self.interval_s = interval_s
        self.jitter = jitter
        self.backoff_cap_s = backoff_cap_s
        self.run_at_start = run_at_start
        self._target = target
        self._sleep = sleep
        self._random = random
        self._clock = clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: when (``clock()``, seconds since the epoch by default) the last pass succeeded
        self.last_success_at: float | None = None
        #: the last failed pass's error (None once a pass succeeds)
        self.last_error: str | None = None
        #: passes that raised since the last success
        self.consecutive_failures = 0
        #: passes run, successful or not
        self.passes = 0
        #: passes skipped because another process leads
        self.skipped = 0

    # --- what a subclass provides ------------------------------------------------------------

    def run_once(self) -> Any:
        """One pass of the loop; raising counts as a failure (the loop goes on)."""
        if self._target is None:
            raise NotImplementedError(f"{type(self).__name__} has no run_once")
        return self._target()

    def on_error(self, exc: Exception) -> None:
        """A pass raised ``exc`` (called from within the ``except``): log it."""
        log.exception("background worker %s: pass failed", self.name)

    # --- the loop ----------------------------------------------------------------------------

    def next_delay(self) -> float:
        """Seconds until the next pass: the interval, or the backoff after failures, with
        jitter (a uniform factor in ``[1 - jitter, 1 + jitter]``)."""
        delay = self.interval_s
        if self.backoff_cap_s is not None and self.consecutive_failures > 1:
            growth = 2.0 ** min(self.consecutive_failures - 1, 64)
            delay = min(self.backoff_cap_s, self.interval_s * growth)
        if self.jitter:
            delay *= 1.0 + self.jitter * (2.0 * self._random() - 1.0)
        return delay

    def tick(self) -> bool:
        """Run one pass and keep its facts; whether it succeeded. Never raises an
        ``Exception`` (the loop must outlive any pass). Without the lease (another process
        leads) the pass is skipped, which is no failure."""
        if self.leadership is not None and not self.leadership.held():
            self.skipped += 1
            return True
        self.passes += 1
        try:
            self.run_once()
        except Exception as exc:
            self.consecutive_failures += 1
            self.last_error = str(exc) or type(exc).__name__
            try:
                self.on_error(exc)
            except Exception:  # a broken error hook must not end the loop either
                log.exception("background worker %s: error handler failed", self.name)
            return False
        self.consecutive_failures = 0
        self.last_error = None
        self.last_success_at = self._clock()
        return True

    def run(self) -> None:
        """The loop, on the calling thread, until :meth:`stop` (or ``sleep`` returns True)."""
        self._loop(self._stop)

    def _loop(self, stop: threading.Event) -> None:
        # ``stop`` is this run's own Event: a thread that outlived its stop's timeout never
        # resumes when the worker is started again
        def wait(delay: float) -> bool:
            if self._sleep is not None:
                return self._sleep(delay) or stop.is_set()
            return stop.wait(delay)

        if self.run_at_start and not stop.is_set():
            self.tick()
        while not wait(self.next_delay()):
            self.tick()

    # --- start and stop ----------------------------------------------------------------------

    def start(self) -> None:
        """Run the loop on a daemon thread named after the worker (no-op when running)."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._loop, args=(self._stop,), name=self.name, daemon=True
        )
        self._thread.start()

    def stop(self, timeout_s: float | None = None) -> None:
        """End the loop: a wait ends at once, a pass in progress finishes first (waited for
        up to ``timeout_s``, default ``stop_timeout_s``)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(self.stop_timeout_s if timeout_s is None else timeout_s)

    @property
    def running(self) -> bool:
        """Whether the loop's thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def stopping(self) -> bool:
        """Whether :meth:`stop` was called (a long pass may check it to end early)."""
        return self._stop.is_set()

    def status(self) -> dict[str, Any]:
        """The worker's facts, for a health check or a metric."""
        return {
            "name": self.name,
            "running": self.running,
            "interval_s": self.interval_s,
            "passes": self.passes,
            "last_success_at": self.last_success_at,
            "last_error": self.last_error,
            "consecutive_failures": self.consecutive_failures,
            "skipped": self.skipped,
            "leader": getattr(self.leadership, "leading", None),
        }


W = TypeVar("W", bound=Worker)


@contextmanager
def started(worker: W | None) -> Iterator[W | None]:
    """``worker`` running for the duration of the block, stopped when it ends (None: nothing
    runs, None is yielded): the server's lifespan holds its workers this way."""
    if worker is None:
        yield None
        return
    lease = worker.leadership
    if lease is None and worker.leader_only:
        lease = worker.leadership = _lease_of(worker)
    if lease is not None:
        lease.attach()
        lease.held()  # take the lease now if it is free: a leader is known before any pass
    worker.start()
    try:
        yield worker
    finally:
        worker.stop()
        if lease is not None:
            lease.detach()


def _lease_of(worker: Worker) -> Lease | None:
    """The lease of the database a worker works on (its ``store``), if it has one."""
    from proofplane.service.context import Store
    from proofplane.workers.leader import leadership_for

    store = getattr(worker, "store", None)
    return leadership_for(store) if isinstance(store, Store) else None
