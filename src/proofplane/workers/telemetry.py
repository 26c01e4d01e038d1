"""The server's telemetry loop (issue 15): each pass rolls up the hours that ended
(``service.telemetry.rollup_hours``), applies retention (raw readings older than
PROOFPLANE_TELEMETRY_RAW_HOURS, rollups older than 400 days; every ``retention_every`` passes)
and judges idle workloads under their tenants' policies (``service.idle.check_idle``). It runs
in the process holding the leader lease, like every background loop."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

from proofplane.access import SYSTEM
from proofplane.service.context import Store
from proofplane.service.idle import check_idle
from proofplane.service.telemetry import RAW_HOURS, apply_retention, rollup_hours
from proofplane.workers.base import Worker, started

log = logging.getLogger(__name__)


class TelemetryWorker(Worker):
    def __init__(
        self,
        store: Store,
        *,
        interval_s: float,
        raw_hours: float = RAW_HOURS,
        idle: bool = True,
        retention_every: int = 10,
    ) -> None:
        super().__init__("telemetry", interval_s, backoff_cap_s=max(interval_s, 600.0))
        self.store = store
        self.raw_hours = raw_hours
        self.idle = idle
        self.retention_every = max(1, retention_every)
        self.idle_actions: list[dict[str, Any]] = []  # what idle passes did, newest last

    def run_once(self, now: datetime | None = None) -> dict[str, Any]:
        now = now or datetime.now(UTC)
        out: dict[str, Any] = {"rolled_up": rollup_hours(self.store, SYSTEM, now)}
        if self.passes % self.retention_every == 1 or self.retention_every == 1:
            out["deleted"] = apply_retention(self.store, SYSTEM, now, raw_hours=self.raw_hours)
        if self.idle:
            acted = check_idle(self.store, SYSTEM, now)
            self.idle_actions = (self.idle_actions + acted)[-1000:]
            out["idle"] = acted
        return out

    def on_error(self, exc: Exception) -> None:
        log.exception("telemetry pass (rollup, retention, idle) failed")


@contextmanager
def telemetry_worker(
    store: Store, interval_s: float | None, raw_hours: float = RAW_HOURS
) -> Iterator[TelemetryWorker | None]:
    """The telemetry loop for the duration of the block (none when ``interval_s`` is falsy)."""
    worker = (
        TelemetryWorker(store, interval_s=interval_s, raw_hours=raw_hours) if interval_s else None
    )
    with started(worker) as running:
        yield running
