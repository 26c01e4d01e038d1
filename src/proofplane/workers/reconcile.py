"""The engine reconciler: :func:`proofplane.service.reconcile.sync` on a timer while the API
server runs."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from proofplane.backends.base import Backend
from proofplane.service.context import Store
from proofplane.service.reconcile import SyncReport, sync
from proofplane.workers.base import Worker, started

log = logging.getLogger("proofplane.execution")


class SyncWorker(Worker):
    """Runs ``sync`` every ``interval_s`` seconds. Engine trouble (``SyncReport.error``) is
    logged as a warning; a pass that raises is logged; either way the next pass retries."""

    def __init__(self, store: Store, backend: Backend, interval_s: float) -> None:
        super().__init__("proofplane-execution-sync", interval_s)
        self.stop_timeout_s = interval_s + 5
        self.store = store
        self.backend = backend

    def run_once(self) -> SyncReport:
        report = sync(self.store, self.backend)
        if report.error:
            log.warning("execution sync: %s", report.error)
        return report

    def on_error(self, exc: Exception) -> None:
        log.exception("execution sync failed")  # keep the loop alive; the next pass retries


@contextmanager
def sync_worker(
    store: Store, backend: Backend, interval_s: float | None
) -> Iterator[SyncWorker | None]:
    """Run ``sync`` every ``interval_s`` seconds in a daemon thread while the context is open
    (the API server's lifespan); None or 0: no thread."""
    worker = SyncWorker(store, backend, interval_s) if interval_s else None
    with started(worker) as running:
        yield running
