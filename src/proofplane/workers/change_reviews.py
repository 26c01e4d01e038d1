"""The overdue emergency-review alert: :func:`overdue_reviews` on a timer.

An emergency change applies at once and owes a post-implementation review within
``PROOFPLANE_EMERGENCY_REVIEW_HOURS``; while one is overdue this worker raises
``alert.change_review_overdue`` for it once an hour (naming the runbook that answers it, when
one does), so it reaches the SIEM like any other alert."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime

from proofplane.service.changes import overdue_reviews
from proofplane.service.context import Store
from proofplane.workers.base import Worker, started

log = logging.getLogger(__name__)


def _utcnow() -> datetime:
    return datetime.now(UTC)


class ReviewWorker(Worker):
    """Every ``interval_s``: alert on each overdue emergency review (at most hourly each).
    ``now`` is injectable (tests move time, not the wall clock)."""

    def __init__(
        self, store: Store, *, interval_s: float, now: Callable[[], datetime] = _utcnow
    ) -> None:
        super().__init__("change-reviews", interval_s, run_at_start=True)
        self.store = store
        self.now = now
        self.alerted: list[int] = []  # the change ids each pass alerted on, in order

    def run_once(self) -> list[int]:
        done = overdue_reviews(self.store, self.now())
        self.alerted.extend(done)
        return done

    def on_error(self, exc: Exception) -> None:
        log.exception("the overdue change-review check failed")


@contextmanager
def review_worker(store: Store, interval_s: float | None) -> Iterator[ReviewWorker | None]:
    """The overdue-review checker for the duration of the block (none when ``interval_s`` is
    falsy). A pass that finds nothing due is one read."""
    worker = ReviewWorker(store, interval_s=interval_s) if interval_s else None
    with started(worker) as running:
        yield running
