"""Telemetry (issue 15): ingesting the agents' GPU samples, keeping them (raw for
PROOFPLANE_TELEMETRY_RAW_HOURS, hourly rollups for 400 days), and the read functions the
metering, alerting and capacity code uses.

Read functions (for M2/M3; no actor: callers authorize):

* ``hourly(store, *, start, end, tenant=None, field=None) -> list[dict]``: one dict per
  (hour, node, gpu_uuid, gi_id, field, workload, tenant) with ``count, sum, min, max, last``
  and ``simulated``; hours in [start, end). Counters (energy, ECC, PCIe/NVLink bytes): ``sum``
  is the increase attributed to that placement in that hour.
* ``latest(store, *, node=None) -> list[dict]``: the newest sample per device and field
  (``node, gpu_uuid, gi_id, profile, field, ts, value, workload, tenant, simulated``).
* ``energy_kwh(store, *, start, end) -> dict[(tenant, workload), float]``: metered energy per
  placement holder in [start, end); (None, None) holds energy no placement held.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from proofplane.service.context import Store


def hourly(
    store: Store,
    *,
    start: datetime,
    end: datetime,
    tenant: str | None = None,
    field: str | None = None,
) -> list[dict[str, Any]]:
    """Hourly rollups with ``hour`` in [start, end), oldest first."""
    return []


def latest(store: Store, *, node: str | None = None) -> list[dict[str, Any]]:
    """The newest sample per (node, gpu_uuid, gi_id, field)."""
    return []


def energy_kwh(
    store: Store, *, start: datetime, end: datetime
) -> dict[tuple[str | None, str | None], float]:
    """Energy (kWh) per (tenant, workload) over [start, end)."""
    return {}
