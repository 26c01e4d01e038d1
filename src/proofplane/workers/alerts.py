"""The alert worker (issue 15, §8): every ``interval_s``, evaluate the rules that are due,
record what starts and ends (``alert.<rule>``, ``alert.resolve``), and deliver to Alertmanager
and webhooks (``service.alerts``). Once per deployment: it runs in the process holding the
leader lease (``workers.leader``); a new leader rebuilds what it needs from the log."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime

import httpx

from proofplane.config import AlertSettings
from proofplane.meter.anomaly import AlertRules
from proofplane.service import alerts as svc
from proofplane.service.context import Store
from proofplane.workers.base import Worker, started

log = logging.getLogger("proofplane.alerts")


def _utcnow() -> datetime:
    return datetime.now(UTC)


class AlertWorker(Worker):
    """A pass at once and then every ``settings.interval_s``; a pass that fails (the database
    away) is logged and the next one starts over from the log. ``now`` and the HTTP ``client``
    are injectable (tests move time, not the wall clock)."""

    def __init__(
        self,
        store: Store,
        settings: AlertSettings,
        rules: AlertRules,
        *,
        cluster: str = "default",
        attest_grace_s: float = 900.0,
        now: Callable[[], datetime] = _utcnow,
        client: httpx.Client | None = None,
    ) -> None:
        super().__init__("alerts", settings.interval_s, run_at_start=True,
                         backoff_cap_s=max(settings.interval_s, 600.0))  # fmt: skip
        self.store = store
        self.settings = settings
        self.rules = rules
        self.cluster = cluster
        self.attest_grace_s = attest_grace_s
        self.now = now
        self.client = client
        self.state = svc.AlertState()
        self.last: svc.PassResult | None = None

    def run_once(self) -> svc.PassResult:
        with self.state.lock:
            now = self.now()
            result = svc.evaluate(self.store, self.state, self.rules, now,
                                  attest_grace_s=self.attest_grace_s)  # fmt: skip
            result.delivered = svc.deliver(
                self.state, self.settings, now, cluster=self.cluster, client=self.client
            )
            self.last = result
            return result

    def on_error(self, exc: Exception) -> None:
        log.exception("alert pass failed")
        self.state = svc.AlertState()  # start over from the log next time


@contextmanager
def alert_worker(
    store: Store,
    settings: AlertSettings | None,
    *,
    cluster: str = "default",
    attest_grace_s: float = 900.0,
) -> Iterator[AlertWorker | None]:
    """The alert worker for the duration of the block (none without settings or with a zero
    interval). The rules file is read first: a mistake in it stops the server at start."""
    worker = None
    if settings is not None and settings.interval_s:
        rules = svc.load_rules(settings.rules_file)
        worker = AlertWorker(store, settings, rules, cluster=cluster,
                             attest_grace_s=attest_grace_s)  # fmt: skip
    with started(worker) as running:
        yield running
