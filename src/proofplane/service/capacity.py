"""Capacity per compliance pool (issue 15, §10): headroom, the N+1 check and a demand forecast,
for ``proofplane capacity``, ``GET /api/v1/capacity`` and the alert worker.

The numbers come from the scheduler the service places with (its cache, caught up from the
event stream; a copy is made under its lock in milliseconds and worked on outside it, so a
check never holds up placement), and the N+1 check runs the production placement core on that
copy (``meter.capacity.n_plus_one``). The forecast is a straight line through each pool's
daily mean demand (GPU-equivalents held) over the last weeks, metered from the audit log by
``meter.usage`` (``service.usage.meter_log``): the same record the bill comes from.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from fractions import Fraction
from typing import Any

from sqlalchemy import select

from proofplane.access import Actor, Permission, authorize
from proofplane.errors import ProofplaneError, ValidationFailed
from proofplane.meter import capacity as core
from proofplane.meter.usage import gpu_fraction, pool_tags
from proofplane.model import Node, Quota
from proofplane.model.tenant import profile_from_json
from proofplane.schedule.engine import Held, Job, Pool, Scheduler
from proofplane.service.context import Store
from proofplane.service.scheduling import (
    ClusterView,
    job_of,
    scheduler_cache,
    server_scheduler,
)
from proofplane.store.repo import WORKLOAD_LOAD
from proofplane.store.tables import TenantRow, WorkloadRow

DAY = timedelta(days=1)
MAX_WEEKS = 12
CACHE_WAIT_S = 2.0


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A copy of what the scheduler holds: enough to build a private scheduler from."""

    nodes: list[Node]
    held: list[Held]  # in placement order
    quotas: dict[str, Quota]
    tenant_pools: list[dict[str, str]]  # the tenants' required tags

    def scheduler(self) -> Scheduler:
        # the server's scorer and MIG layout rules, so a forecast places as the server would
        return server_scheduler(self.nodes, self.held, self.quotas)


def _tenant_pools(session: Any) -> list[dict[str, str]]:
    out = []
    for (profile,) in session.execute(select(TenantRow.profile)):
        try:
            tags = profile_from_json(profile or {}).required_tags
        except (ValueError, TypeError, AttributeError):
            continue
        if tags:
            out.append(dict(tags))
    return out


def snapshot(store: Store) -> Snapshot:
    """The scheduler's state, copied (from the process's cached scheduler when it can be had,
    else loaded in a read)."""
    cache = scheduler_cache(store.engine)
    with store.read() as session:
        pools = _tenant_pools(session)
        for attempt in range(2):
            with cache.reading(session, wait_s=CACHE_WAIT_S) as s:
                if s is not None:
                    held = sorted(s.held.values(), key=lambda h: s.rank(h.key) or 0)
                    return Snapshot(list(s.nodes()), held, dict(s.quotas), pools)
            if attempt == 0 and cache.scheduler is None:
                cache.install(session)
        loaded = ClusterView(session).scheduler
        held = sorted(loaded.held.values(), key=lambda h: loaded.rank(h.key) or 0)
        return Snapshot(list(loaded.nodes()), held, dict(loaded.quotas), pools)


def _jobs(store: Store, keys: Iterable[Hashable]) -> dict[Hashable, Job]:
    ids = sorted(k for k in keys if isinstance(k, int))
    out: dict[Hashable, Job] = {}
    with store.read() as session:
        for at in range(0, len(ids), 500):
            rows = session.scalars(
                select(WorkloadRow)
                .where(WorkloadRow.id.in_(ids[at : at + 500]))
                .options(*WORKLOAD_LOAD)
            )
            for row in rows:
                out[row.id] = job_of(row)
    return out


def checks(store: Store, snap: Snapshot) -> tuple[list[core.NPlusOne], core.Fleet, list[Pool]]:
    """The N+1 check of every pool on a private scheduler built from ``snap``."""
    scheduler = snap.scheduler()
    numbers = core.fleet(scheduler.nodes(), scheduler.held.values())
    pools = core.pools_of(snap.held, snap.tenant_pools)
    jobs = _jobs(store, core.jobs_needed(scheduler, pools, numbers.nodes))
    return [core.n_plus_one(scheduler, p, jobs, numbers.nodes) for p in pools], numbers, pools


def capacity_checks(store: Store) -> list[core.NPlusOne]:
    """The N+1 check of every pool (the alert worker's)."""
    return checks(store, snapshot(store))[0]


def daily_demand(
    store: Store, now: datetime, weeks: int
) -> tuple[list[datetime], dict[str, list[float]]]:
    """Per pool label, the mean GPU-equivalents held on each of the last ``weeks × 7`` whole
    days (UTC), metered from the audit log; leading days before any demand are dropped."""
    from proofplane.service.usage import meter_log

    end = now.astimezone(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    start = end - weeks * 7 * DAY
    days = [start + i * DAY for i in range(weeks * 7)]
    metered, _models = meter_log(store, start, end, cuts=tuple(days[1:]))
    day_us = Fraction(int(DAY.total_seconds() * 1_000_000))
    per_pool: dict[str, list[Fraction]] = {}
    for (segment, key), units_us in metered.usage.items():
        try:
            weight = gpu_fraction(key.sku, key.kind, key.profile)
        except ProofplaneError:
            continue
        label = core.pool_label(pool_tags(key.pool))
        series = per_pool.setdefault(label, [Fraction(0)] * len(days))
        series[segment] += units_us * weight / day_us
    out: dict[str, list[float]] = {}
    for label, series in per_pool.items():
        values = [float(v) for v in series]
        first = next((i for i, v in enumerate(values) if v > 0), len(values))
        out[label] = values[first:]
    return days, out


def capacity_report(
    store: Store,
    actor: Actor,
    now: datetime,
    *,
    forecast: bool = True,
    weeks: int = 4,
    horizon_days: int = 28,
) -> dict[str, Any]:
    """Per compliance pool: capacity and headroom, what is held, the N+1 check, and (with
    ``forecast``) the demand trend. Fleet-wide figures: ``metrics:read``. The workloads an N+1
    check could not re-place are named only to who reads every tenant's workloads; others
    see how many."""
    authorize(actor, Permission.METRICS_READ)
    if isinstance(weeks, bool) or not isinstance(weeks, int) or not 1 <= weeks <= MAX_WEEKS:
        raise ValidationFailed(f"weeks is 1..{MAX_WEEKS}", code="invalid_weeks")
    names_visible = actor.visible_tenants(Permission.WORKLOADS_READ) is None
    snap = snapshot(store)
    results, numbers, pools = checks(store, snap)
    by_pool = core.pool_capacity(numbers.nodes, pools)
    held: dict[str, dict[str, float]] = {}
    for (_tenant, pool), h in numbers.holdings.items():
        row = held.setdefault(pool, {"workloads": 0, "gpus": 0, "gpu_shares": 0.0,
                                     "mig_slices": 0})  # fmt: skip
        row["workloads"] += h.workloads
        row["gpus"] += h.gpus
        row["gpu_shares"] = round(row["gpu_shares"] + h.share_milli / 1000, 3)
        row["mig_slices"] += h.mig_slices
    demand: dict[str, list[float]] = {}
    if forecast:
        _days, demand = daily_demand(store, now, weeks)
    out = []
    for result in results:
        cap = by_pool[result.pool]
        check = result.to_json()
        if not names_visible:
            check = {**check, "displaced": len(result.displaced),
                     "replaced": len(result.replaced), "victims": len(result.victims),
                     "unplaced": [{"reason": u.reason} for u in result.unplaced]}  # fmt: skip
        entry: dict[str, Any] = {
            **cap.to_json(),
            "headroom": {"gpus": cap.gpus_idle, "mig_slices": cap.mig_slices_free},
            "held": held.get(
                result.pool, {"workloads": 0, "gpus": 0, "gpu_shares": 0.0, "mig_slices": 0}
            ),  # fmt: skip
            "n_plus_one": check,
        }
        if forecast:
            series = demand.get(result.pool, [])
            entry["forecast"] = {
                **core.forecast(series, float(cap.gpus), horizon_days).to_json(),
                "basis": "daily mean GPU-equivalents held (metered from the audit log), against "
                "the GPUs of the pool's admitted nodes (shared with overlapping pools)",
            }
        out.append(entry)
    return {
        "at": now.astimezone(UTC).isoformat(),
        "pools": out,
        "ok": all(r.ok for r in results),
        "nodes": len(numbers.nodes),
    }
