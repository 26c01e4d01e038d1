"""The telemetry worker's pass: roll up the hours that ended, apply retention, judge idle
workloads; a failing pass is counted and the loop goes on."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

import pytest

import telemetry_cluster as tc
from proofplane.access import SYSTEM
from proofplane.hardware.cluster_file import gpu_uuid
from proofplane.meter import fields as F
from proofplane.service import telemetry as tel
from proofplane.service.context import Store
from proofplane.workers.base import started
from proofplane.workers.telemetry import TelemetryWorker, telemetry_worker


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_pass_rolls_up_keeps_and_judges(store: Store) -> None:
    tc.load(store)
    now = datetime.now(UTC)
    base = now.replace(minute=0, second=0, microsecond=0) - timedelta(hours=3)
    uuid = gpu_uuid("n2", 0)
    power = [tc.entry(uuid, base + timedelta(minutes=m), {F.POWER_USAGE: 100 + m})
             for m in range(0, 240, 20)]  # fmt: skip
    tel.ingest(store, tc.agent("n2"), "n2", {"samples": power}, now=now)
    later = datetime.now(UTC) + timedelta(minutes=40)
    whole = gpu_uuid("n1", 1)
    quiet = [tc.entry(whole, later - timedelta(minutes=m), {F.GR_ENGINE_ACTIVE: 0.0})
             for m in range(0, 36, 2)]  # fmt: skip
    tel.ingest(store, tc.agent("n1"), "n1", {"samples": quiet}, now=later)
    worker = TelemetryWorker(store, interval_s=60, raw_hours=48)
    worker.passes = 1  # as tick() counts it: the first pass also applies retention
    out = worker.run_once(later)
    assert len(out["rolled_up"]) >= 3 and "deleted" in out
    assert [(a["workload"], a["action"]) for a in out["idle"]] == [("whole", "notified")]
    assert worker.idle_actions == out["idle"]
    stored = tel.list_telemetry(store, SYSTEM, resolution="hour", limit=500).items
    assert {r["hour"] for r in stored} >= {base, base + timedelta(hours=1)}


def test_the_worker_runs_in_the_background_and_survives_a_failing_pass(tmp_path) -> None:
    store = Store(f"sqlite:///{tmp_path / 'missing' / 'x.db'}")  # never migrated: passes fail
    worker = TelemetryWorker(store, interval_s=0.01, idle=False)
    with started(worker):
        deadline = datetime.now(UTC) + timedelta(seconds=5)
        while worker.consecutive_failures < 2 and datetime.now(UTC) < deadline:
            time.sleep(0.01)
    assert worker.consecutive_failures >= 2 and worker.last_error
    with telemetry_worker(store, None) as none:
        assert none is None
    store.dispose()
