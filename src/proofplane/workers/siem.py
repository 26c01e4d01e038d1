"""The SIEM exporter: an export pass over the enabled sinks every ``interval_s``, each sink
backing off on its own while its receiver fails."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from proofplane.errors import NotFound
from proofplane.service.context import Store
from proofplane.service.sinks import PassResult, RetryPolicy, enabled_sink_names, export_once
from proofplane.workers.base import Worker, started

log = logging.getLogger("proofplane.export")


class ExportWorker(Worker):
    """The exporter in the API server: a thread that runs an export pass at once and then
    every ``interval_s``.

    A sink whose pass failed waits ``interval_s · 2^(failures-1)`` (capped at
    ``max_backoff_s``) before its next pass, so a receiver that is down for ten minutes is
    probed about once a minute and caught up from its cursor as soon as it answers. (That
    backoff is per sink, measured on ``clock``; the loop itself keeps its interval.)
    """

    stop_timeout_s = 30.0

    def __init__(
        self,
        store: Store,
        *,
        interval_s: float = 5.0,
        max_backoff_s: float = 60.0,
        max_batches: int = 20,
        retry: RetryPolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__("siem-export", interval_s, run_at_start=True)
        self.store = store
        self.max_backoff_s = max_backoff_s
        self.max_batches = max_batches
        self.retry = retry or RetryPolicy()
        self.clock = clock
        self._failures: dict[str, int] = {}
        self._next_try: dict[str, float] = {}

    def due(self) -> list[str]:
        """The enabled sinks whose backoff has passed."""
        now = self.clock()
        return [n for n in enabled_sink_names(self.store) if self._next_try.get(n, 0.0) <= now]

    def run_once(self) -> list[PassResult]:
        names = self.due()
        if not names:
            return []
        results = export_once(
            self.store, names=names, retry=self.retry, max_batches=self.max_batches
        )
        now = self.clock()
        for r in results:
            if r.error is None:
                self._failures.pop(r.name, None)
                self._next_try.pop(r.name, None)
            else:
                n = self._failures.get(r.name, 0) + 1
                self._failures[r.name] = n
                wait = min(self.max_backoff_s, self.interval_s * 2 ** (n - 1))
                self._next_try[r.name] = now + wait
        return results

    def on_error(self, exc: Exception) -> None:
        if isinstance(exc, NotFound):
            return  # a sink deleted between listing and export
        log.exception("SIEM export pass failed")


@contextmanager
def export_worker(store: Store, interval_s: float | None) -> Iterator[ExportWorker | None]:
    """The server's exporter for the duration of the block (none when ``interval_s`` is
    falsy)."""
    worker = ExportWorker(store, interval_s=interval_s) if interval_s else None
    with started(worker) as running:
        yield running
