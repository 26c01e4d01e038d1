"""Telemetry history for the alert tests: hourly rollups as the telemetry worker stores them,
written straight into ``telemetry_hourly`` (weeks of readings would take minutes to post),
and a judged hour at a chosen clock."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from proofplane.access import SYSTEM
from proofplane.meter.fields import GR_ENGINE_ACTIVE, PCIE_TX_BYTES
from proofplane.service.alerts import SETTLE
from proofplane.service.context import Store
from proofplane.store.tables import TelemetryHourlyRow

# Monday 2026-03-02 03:00 UTC: off-hours under the shipped default business hours
NIGHT = datetime(2026, 3, 2, 3, tzinfo=UTC)
WEEK = timedelta(weeks=1)


def clock_for(hour: datetime) -> datetime:
    """A "now" at which the alert worker judges ``hour`` (the last whole hour, settled)."""
    return hour + timedelta(hours=1) + SETTLE + timedelta(minutes=1)


def rollups(
    store: Store,
    tenant: str,
    hour: datetime,
    *,
    devices: int,
    activity: float,
    transfer_bps: float = 0.0,
    node: str = "n1",
) -> None:
    """One hour of a tenant's devices: ``devices`` rows of graphics activity (a minute's
    readings each), and PCIe throughput when given."""
    rows = []
    for d in range(devices):
        uuid = f"GPU-{tenant}-{d}"
        rows.append(TelemetryHourlyRow(
            hour=hour, node=node, gpu_uuid=uuid, gi_id=None, field=GR_ENGINE_ACTIVE,
            workload=f"w{d}", tenant=tenant, count=60, sum=60 * activity, min=activity,
            max=activity, last=activity, simulated=True))  # fmt: skip
        if transfer_bps:
            rows.append(TelemetryHourlyRow(
                hour=hour, node=node, gpu_uuid=uuid, gi_id=None, field=PCIE_TX_BYTES,
                workload=f"w{d}", tenant=tenant, count=60, sum=60 * transfer_bps,
                min=transfer_bps, max=transfer_bps, last=transfer_bps, simulated=True))  # fmt: skip
    with store.write(SYSTEM) as tx:
        tx.session.add_all(rows)


def usual_nights(store: Store, tenant: str, hour: datetime, weeks: int = 4) -> None:
    """The same hour of the ``weeks`` weeks before ``hour``: one device, barely busy."""
    for k in range(1, weeks + 1):
        rollups(store, tenant, hour - k * WEEK, devices=1, activity=0.05 + 0.01 * (k % 2))
