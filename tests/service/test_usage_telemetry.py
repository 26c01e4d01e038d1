"""The usage report with telemetry (issue 15, §4): metered energy on the workload's lines and
the tenant's total (service.telemetry.energy_kwh, shown, not priced), and the allocated-but-idle
waste view from the hourly rollups of DCGM_FI_PROF_GR_ENGINE_ACTIVE; on SQLite and PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest

from proofplane.access import SYSTEM
from proofplane.hardware.cluster_file import parse_cluster
from proofplane.meter.fields import GR_ENGINE_ACTIVE, TOTAL_ENERGY
from proofplane.meter.samples import Sample
from proofplane.model import GpuRequest
from proofplane.service import telemetry
from proofplane.service import usage as usage_svc
from proofplane.service.cluster import load_cluster
from proofplane.service.workloads import WorkloadSpec, submit_workload
from usage_scenario import ClockStore

T0 = datetime(2021, 6, 1, tzinfo=UTC)
MIN = timedelta(minutes=1)
MJ_PER_KWH = 3.6e9
CLUSTER = """
cluster: usage-telemetry
tenants: [{name: acme}]
nodes:
  - name: n1
    region: r1
    zone: z1
    gpus: [{model: H100-80GB, count: 2}]
"""


@pytest.fixture
def metered(db_url: str) -> Iterator[ClockStore]:
    store = ClockStore(db_url)
    store.clock = T0 - 60 * MIN
    load_cluster(store, SYSTEM, parse_cluster(CLUSTER))
    store.clock = T0
    w = submit_workload(store, SYSTEM, WorkloadSpec("w", "acme", gpus=GpuRequest(count=1)))
    assert w.placement is not None
    uuid = w.placement.devices[0].gpu_uuid
    samples = []
    for k in range(13):  # every 15 minutes for three hours: 0.7 kWh an hour
        ts = T0 + 15 * k * MIN + MIN
        samples.append(Sample("n1", uuid, None, None, TOTAL_ENERGY, ts, k * 0.175 * MJ_PER_KWH))
        busy = 0.01 if ts < T0 + 60 * MIN else 0.8  # idle the first hour
        samples.append(Sample("n1", uuid, None, None, GR_ENGINE_ACTIVE, ts, busy))
    store.clock = T0 + 4 * 60 * MIN
    telemetry.store_samples(store, SYSTEM, "n1", samples, now=store.clock)
    yield store
    store.dispose()


def test_energy_and_waste_in_the_report(metered: ClockStore) -> None:
    end = T0 + 3 * 60 * MIN
    energy = telemetry.energy_kwh(metered, start=T0, end=end)
    held = energy.get(("acme", "w"), 0.0)
    assert held > 0, energy
    report = usage_svc.usage_report(
        metered, SYSTEM, start=T0, end=end, now=datetime.now(UTC), waste=True
    )
    (line,) = report.lines
    assert line.energy_kwh == Decimal(repr(held)).quantize(Decimal("0.001"))
    assert report.tenants[0].energy_kwh == line.energy_kwh
    assert line.gpu_hours == Decimal("3.000000")  # energy is shown beside it, never priced
    assert line.billed_cost == Decimal("7.20")
    assert not any(n.startswith("energy: no metered") for n in report.notes)
    assert report.waste is not None
    (waste,) = report.waste
    assert waste.tenant == "acme" and waste.allocated_device_hours == 3
    assert waste.idle_device_hours == 1  # the first hour stayed below 0.05
    assert Decimal("1.3") < waste.utilisation_adjusted_idle_hours < Decimal("1.5")


def test_energy_in_the_cost_comparison(metered: ClockStore) -> None:
    end = T0 + 3 * 60 * MIN
    result = usage_svc.cost_compare(metered, SYSTEM, start=T0, end=end, now=datetime.now(UTC))
    (row,) = result["skus"]
    assert row["bare_metal"]["power_source"] == "metered"
    assert Decimal(row["measured"]["energy_kwh"]) > 0
    assert row["measured"]["activity_source"] == "metered"
    assert Decimal("0.5") < Decimal(row["measured"]["mean_activity"]) < Decimal("0.6")
