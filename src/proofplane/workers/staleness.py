"""The server's attestation staleness check: :func:`check_stale` on a timer."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta

from proofplane.access import SYSTEM
from proofplane.service.attestation import check_stale, prune_spent_nonces
from proofplane.service.context import Store
from proofplane.workers.base import Worker, started

log = logging.getLogger(__name__)


class StaleWorker(Worker):
    """A thread that runs :func:`check_stale` every ``interval_s`` with grace ``grace``, then
    :func:`prune_spent_nonces`. A pass that fails is logged and retried at the next tick (the
    nodes it would have quarantined stay stale, so the next pass catches them)."""

    def __init__(self, store: Store, *, interval_s: float, grace: timedelta) -> None:
        super().__init__("attest-stale", interval_s)
        self.store = store
        self.grace = grace
        self.quarantined: list[str] = []  # every node a pass quarantined, in order
        self.nonces_pruned = 0  # spent nonces forgotten

    def run_once(self, now: datetime | None = None) -> list[str]:
        done = check_stale(self.store, SYSTEM, self.grace, now)
        self.quarantined.extend(done)
        # and the spent nonces that can no longer be presented (one read when there are none)
        self.nonces_pruned += prune_spent_nonces(self.store, SYSTEM, now)
        return done

    def on_error(self, exc: Exception) -> None:
        # keep checking; a failed pass never admits anything
        log.exception("attestation staleness check failed")


@contextmanager
def stale_worker(
    store: Store, interval_s: float | None, grace: timedelta
) -> Iterator[StaleWorker | None]:
    """The staleness checker for the duration of the block (none when ``interval_s`` is
    falsy). Without an enforcing attestation policy each pass is a single read."""
    worker = StaleWorker(store, interval_s=interval_s, grace=grace) if interval_s else None
    with started(worker) as running:
        yield running
