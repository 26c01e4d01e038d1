"""The demo's simulated telemetry: history, diurnal load, one idle workload noticed, one
off-hours spike, one XID error that drains a GPU and moves its work; everything simulated."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from proofplane.access import SYSTEM
from proofplane.demo import telemetry as sim
from proofplane.meter import fields as F
from proofplane.model import WorkloadStatus
from proofplane.service import gpu_health, idle
from proofplane.service import telemetry as tel
from proofplane.service import workloads as wl_svc
from proofplane.service.context import Store


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_demo_telemetry(demo: Store) -> None:  # the demo cluster loaded
    store = demo
    now = datetime.now(UTC)
    t = sim.DemoTelemetry(store, started_at=now)
    rows = t.backfill(now, days=2)
    assert rows["hourly"] > 1000 and rows["raw"] > 1000
    assert idle.get_idle_policy(store, SYSTEM, "research-lab")["idle_policy"]["window_s"] == 180
    drained = []
    ts = now
    for k in range(1, 21):  # five minutes of passes, 15 s apart
        ts = now + timedelta(seconds=15 * k)
        drained += t.run_once(ts)["drained"]
    # one XID error: the GPU is drained, its workload re-placed (compliantly) or waiting
    assert len(drained) == 1 and drained[0]["xid"] == demo_xid()
    assert drained[0]["evicted"] == ["pathology-finetune"]
    assert [d["gpu_uuid"] for d in gpu_health.list_drained(store, SYSTEM)] == [t.xid_sent]
    moved = wl_svc.get_workload(store, SYSTEM, "pathology-finetune")
    assert moved.status is WorkloadStatus.PENDING or all(
        d.gpu_uuid != t.xid_sent for d in moved.placement.devices
    )
    # the idle workload is noticed under its tenant's short policy
    acted = idle.check_idle(store, SYSTEM, ts)
    assert [(a["workload"], a["action"]) for a in acted] == [("llm-pretrain", "notified")]
    # the spike: the tenant's history is low at every hour, the live hour runs flat out
    hist = tel.hourly(store, start=now - timedelta(days=2), end=now - timedelta(hours=1),
                      tenant=sim.SPIKE_TENANT, field=F.GR_ENGINE_ACTIVE)  # fmt: skip
    assert hist and max(r["max"] for r in hist) < 0.2
    live = tel.list_telemetry(store, SYSTEM, tenant=sim.SPIKE_TENANT, field_name=F.GR_ENGINE_ACTIVE,
                              start=now + sim.SPIKE_AFTER, limit=50).items  # fmt: skip
    assert live and min(r["value"] for r in live) > 0.9
    # diurnal: other tenants' history follows the day curve
    busy = tel.hourly(store, start=now - timedelta(days=2), end=now - timedelta(hours=1),
                      tenant="berlin-telco", field=F.GR_ENGINE_ACTIVE)  # fmt: skip
    assert max(r["max"] for r in busy) - min(r["min"] for r in busy) > 0.3
    # everything is marked simulated, and energy is metered for the tenants
    assert all(r["simulated"] for r in tel.list_telemetry(store, SYSTEM, limit=500).items)
    assert all(r["simulated"] for r in hist)
    kwh = tel.energy_kwh(store, start=now - timedelta(days=2), end=ts + timedelta(hours=1))
    assert kwh[("research-lab", "llm-pretrain")] > 0


def demo_xid() -> int:
    return sim.XID


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_the_first_pass_writes_the_history(demo: Store) -> None:
    now = datetime.now(UTC)
    t = sim.DemoTelemetry(demo, started_at=now, backfill_days=1)
    assert t.run_at_start
    out = t.run_once(now)
    assert t.backfilled is not None and t.backfilled["hourly"] > 0 and out["stored"] > 0
    rows = tel.hourly(demo, start=now - timedelta(days=2), end=now, field=F.TOTAL_ENERGY)
    assert rows and all(r["simulated"] for r in rows)
    t.run_once(now + timedelta(seconds=15))  # no second history
    assert t.rounds == 2
