"""``GET /metrics``: the control plane's health and the fleet, in the Prometheus exposition
format (issue 15, §3).

Two kinds of series:

* **instruments** (``service.instruments``): what processes observed as they worked (HTTP
  latency by route template, decision latency, attestation verdicts, KMS operations, alert
  deliveries), summed over the worker processes in multiprocess mode;
* **state**, read when the scrape comes (:class:`StateCollector`), so that every process
  answers the same: the audit log's size and its newest checkpoint's age, workloads by status
  and pending ones by reason, nodes by state, each SIEM sink's lag and failures; the fleet from
  the scheduler's in-memory cache (``SchedulerCache.reading``: caught up from the event stream,
  the same cache placement uses; never a per-request counter): GPUs, shares and MIG slices
  held per tenant and compliance pool, and per pool its nodes, GPUs, free GPUs and MIG slices;
  utilisation, framebuffer and power per tenant over each device's newest reading
  (``telemetry.tenant_latest``, aggregated in the database; refreshed in the background every
  ``TELEMETRY_TTL_S``, the scrape serving what it has), labelled with the DCGM field.

Units are base units (seconds, bytes, watts, ratios 0..1); counters end in ``_total``. Label
values are bounded: tenants and pools are what administrators create (a pool is a set of
certifications some node holds: work that needs an uncertified tag waits and is not a fleet
series), sinks are configured, workload names never appear. Pools beyond ``MAX_POOLS`` are
summed under ``pool="other"``.

The fleet costs one pass over what is held (``meter.capacity.fleet``, each holding's part
remembered between scrapes) while the scheduler is current: tens of milliseconds at 5,000
nodes. A process that has no cached scheduler yet loads
one (a full cluster load, once). A scrape that finds this process's cache held by a
transaction for more than ``FLEET_WAIT_S`` serves the last numbers and says how old they are
(``proofplane_fleet_snapshot_age_seconds``).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.gc_collector import GCCollector
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector
from sqlalchemy import func, select
from sqlalchemy.orm import Session
from sqlalchemy.pool import Pool as DbPool

from proofplane.access import Actor, Permission, authorize
from proofplane.meter import capacity
from proofplane.model import WorkloadStatus
from proofplane.model.tenant import profile_from_json
from proofplane.schedule.engine import Held, Pool
from proofplane.service import instruments, telemetry
from proofplane.service.context import Store
from proofplane.service.scheduling import scheduler_cache
from proofplane.store.tables import (
    AuditCheckpointRow,
    EventRow,
    NodeRow,
    SinkRow,
    TenantRow,
    WorkloadRow,
)

log = logging.getLogger(__name__)

MAX_POOLS = 64  # pools shown by name; the rest are summed under "other"
FLEET_WAIT_S = 0.5  # how long a scrape waits for a transaction holding the scheduler cache
TELEMETRY_TTL_S = 10.0  # per-tenant telemetry older than this is refreshed in the background
TELEMETRY_FRESH_S = 300.0  # a device's newest reading older than this is not "now"
OTHER = "other"

# The DCGM fields /metrics shows per tenant: (field, series, help, unit scale, aggregate)
UTILISATION = "DCGM_FI_PROF_GR_ENGINE_ACTIVE"
TENANT_FIELDS: tuple[tuple[str, str, str, float, str], ...] = (
    (
        UTILISATION,
        "proofplane_tenant_gpu_utilization_ratio",
        "Mean graphics-engine activity (0..1) of the devices a tenant holds, newest samples.",
        1.0,
        "mean",
    ),
    (
        "DCGM_FI_DEV_FB_USED",
        "proofplane_tenant_gpu_framebuffer_used_bytes",
        "Framebuffer memory used on the devices a tenant holds, newest samples.",
        float(1 << 20),  # DCGM reports MiB
        "sum",
    ),
    (
        "DCGM_FI_DEV_POWER_USAGE",
        "proofplane_tenant_gpu_power_watts",
        "Power drawn by the GPUs held by this tenant alone, newest samples.",
        1.0,
        "sum",
    ),
)


def authorize_scrape(actor: Actor) -> None:
    authorize(actor, Permission.METRICS_READ)


# --- per process state -------------------------------------------------------------------------


@dataclass
class _FleetNumbers:
    """The fleet families of one computation, and when (``time.monotonic``) it was made."""

    families: list[Metric]
    at: float
    version: int | None


@dataclass
class _State:
    """What one process keeps between scrapes of one database."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    labels: dict[Pool, str] = field(default_factory=dict)
    memo: capacity.NodeMemo = field(default_factory=dict)
    held_memo: capacity.HeldMemo = field(default_factory=dict)
    fleet: _FleetNumbers | None = None
    telemetry: tuple[float, list[Metric]] | None = None
    refreshing: bool = False


_STATES: weakref.WeakKeyDictionary[DbPool, _State] = weakref.WeakKeyDictionary()
_STATES_LOCK = threading.Lock()


def _state(store: Store) -> _State:
    with _STATES_LOCK:
        state = _STATES.get(store.engine.pool)
        if state is None:
            state = _STATES[store.engine.pool] = _State()
        return state


# --- state read at scrape time ----------------------------------------------------------------


def _gauge(name: str, doc: str, labels: Sequence[str] = ()) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=list(labels))


def control_plane_families(session: Session, now: datetime) -> list[Metric]:
    """The audit log, workloads, nodes and SIEM sinks, from a handful of cheap queries."""
    out: list[Metric] = []
    head = session.scalar(select(func.max(EventRow.seq))) or 0
    g = _gauge("proofplane_audit_log_entries", "Entries (events) in the audit log.")
    g.add_metric([], head)
    out.append(g)
    newest = session.execute(
        select(AuditCheckpointRow.tree_size, AuditCheckpointRow.created_at)
        .order_by(AuditCheckpointRow.tree_size.desc(), AuditCheckpointRow.id.desc())
        .limit(1)
    ).first()
    size = _gauge(
        "proofplane_audit_checkpoint_tree_size", "Entries covered by the newest signed checkpoint."
    )
    unsigned = _gauge(
        "proofplane_audit_unsigned_entries",
        "Entries of the audit log no signed checkpoint covers yet.",
    )
    size.add_metric([], newest[0] if newest else 0)
    unsigned.add_metric([], max(0, head - (newest[0] if newest else 0)))
    out += [size, unsigned]
    if newest is not None:
        age = _gauge(
            "proofplane_audit_checkpoint_age_seconds",
            "Seconds since the newest signed checkpoint was made.",
        )
        age.add_metric([], max(0.0, (now - newest[1]).total_seconds()))
        out.append(age)

    statuses = dict(
        session.execute(select(WorkloadRow.status, func.count()).group_by(WorkloadRow.status)).all()
    )
    wl = _gauge("proofplane_workloads", "Workloads by status.", ["status"])
    for status in WorkloadStatus:
        wl.add_metric([status.value], statuses.get(status.value, 0))
    pending = _gauge(
        "proofplane_workloads_pending",
        "Pending workloads by reason code (schedule.reasons).",
        ["reason"],
    )
    for reason, count in session.execute(
        select(WorkloadRow.reason, func.count())
        .where(WorkloadRow.status == WorkloadStatus.PENDING.value)
        .group_by(WorkloadRow.reason)
        .order_by(WorkloadRow.reason)
    ):
        pending.add_metric([reason or "none"], count)
    out += [wl, pending]

    nodes = _gauge("proofplane_nodes", "Nodes by state.", ["state"])
    for state, count in session.execute(
        select(NodeRow.state, func.count()).group_by(NodeRow.state).order_by(NodeRow.state)
    ):
        nodes.add_metric([state], count)
    out.append(nodes)

    lag = _gauge(
        "proofplane_siem_sink_lag_events", "Audit events a SIEM sink has not received.", ["sink"]
    )
    failures = _gauge(
        "proofplane_siem_sink_consecutive_failures",
        "Delivery passes that failed in a row, per SIEM sink.",
        ["sink"],
    )
    last_ok = _gauge(
        "proofplane_siem_sink_last_success_timestamp_seconds",
        "When a SIEM sink last acknowledged a delivery (Unix time).",
        ["sink"],
    )
    enabled = _gauge("proofplane_siem_sink_enabled", "1 when a SIEM sink is enabled.", ["sink"])
    for name, on, cursor, fails, success in session.execute(
        select(
            SinkRow.name,
            SinkRow.enabled,
            SinkRow.cursor,
            SinkRow.consecutive_failures,
            SinkRow.last_success_at,
        ).order_by(SinkRow.name)
    ):
        lag.add_metric([name], max(0, head - cursor))
        failures.add_metric([name], fails)
        enabled.add_metric([name], 1 if on else 0)
        if success is not None:
            last_ok.add_metric([name], success.timestamp())
    out += [lag, failures, last_ok, enabled]
    return out


def _tenant_pools(session: Session) -> list[dict[str, str]]:
    out = []
    for (profile,) in session.execute(select(TenantRow.profile)):
        try:
            tags = profile_from_json(profile or {}).required_tags
        except (ValueError, TypeError, AttributeError):  # a profile this code cannot read
            continue
        if tags:
            out.append(dict(tags))
    return out


def fleet_families(fleet: capacity.Fleet, pools: Iterable[Pool]) -> list[Metric]:
    """The fleet's series from :func:`meter.capacity.fleet` (pure: the tests compare it with a
    recount from the database)."""
    by_pool = capacity.pool_capacity(fleet.nodes, pools)
    shown = set(sorted(by_pool)[:MAX_POOLS])

    def label(pool: str) -> str:
        return pool if pool in shown else OTHER

    held: dict[tuple[str, str], list[float]] = {}
    for (tenant, pool), h in fleet.holdings.items():
        row = held.setdefault((tenant, label(pool)), [0.0, 0.0, 0.0, 0.0])
        row[0] += h.workloads
        row[1] += h.gpus
        row[2] += h.share_milli / 1000
        row[3] += h.mig_slices
    families: list[GaugeMetricFamily] = [
        _gauge(
            "proofplane_tenant_workloads_placed",
            "Workloads holding capacity, per tenant and compliance pool.",
            ["tenant", "pool"],
        ),
        _gauge(
            "proofplane_tenant_gpus_allocated",
            "Whole GPUs held, per tenant and compliance pool.",
            ["tenant", "pool"],
        ),
        _gauge(
            "proofplane_tenant_gpu_shares_allocated",
            "Fractional GPU shares held, in GPUs, per tenant and compliance pool.",
            ["tenant", "pool"],
        ),
        _gauge(
            "proofplane_tenant_mig_slices_allocated",
            "MIG compute slices held (3g.40gb is 3), per tenant and compliance pool.",
            ["tenant", "pool"],
        ),
    ]
    for key in sorted(held):
        for fam, value in zip(families, held[key], strict=True):
            fam.add_metric(list(key), value)
    pool_rows: dict[str, list[int]] = {}
    for name, pc in by_pool.items():
        totals = pool_rows.setdefault(label(name), [0, 0, 0, 0, 0])
        for i, v in enumerate((pc.nodes, pc.gpus, pc.gpus_idle, pc.mig_slices, pc.mig_slices_free)):
            totals[i] += v
    pool_families: list[GaugeMetricFamily] = [
        _gauge(
            "proofplane_pool_nodes",
            "Admitted nodes certified for a compliance pool (pools overlap: a node serves every "
            "pool its certifications cover; do not sum across pools).",
            ["pool"],
        ),
        _gauge("proofplane_pool_gpus", "GPUs on a pool's admitted nodes.", ["pool"]),
        _gauge(
            "proofplane_pool_gpus_free",
            "GPUs on a pool's admitted nodes that nothing is placed on.",
            ["pool"],
        ),
        _gauge(
            "proofplane_pool_mig_slices",
            "MIG compute slices configured on a pool's admitted nodes.",
            ["pool"],
        ),
        _gauge(
            "proofplane_pool_mig_slices_free",
            "MIG compute slices configured on a pool's admitted nodes that nothing holds.",
            ["pool"],
        ),
    ]
    for pool in sorted(pool_rows):
        for fam, value in zip(pool_families, pool_rows[pool], strict=True):
            fam.add_metric([pool], value)
    return [*families, *pool_families]


def _fleet(store: Store, state: _State, session: Session) -> list[Metric]:
    """The fleet families (see the module docstring)."""
    cache = scheduler_cache(store.engine)
    extra = _tenant_pools(session)
    fresh = False
    for attempt in range(2):
        held: list[Held] | None = None
        with cache.reading(session, wait_s=FLEET_WAIT_S) as scheduler:
            if scheduler is not None:  # copy under the lock, count outside it
                held = list(scheduler.held.values())
                nodes = list(scheduler.nodes())
                version = cache.version
        if held is not None:
            numbers = capacity.fleet(
                nodes, held, labels=state.labels, memo=state.memo, held_memo=state.held_memo
            )
            families = fleet_families(numbers, capacity.pools_of(held, extra))
            state.fleet = _FleetNumbers(families, time.monotonic(), version)
            fresh = True
            break
        if attempt == 0 and cache.scheduler is None:
            cache.install(session)  # this process has never loaded the cluster: once
        else:
            break
    age = _gauge(
        "proofplane_fleet_snapshot_age_seconds",
        "How old the fleet series are (0: computed for this scrape; more: a transaction held "
        "the scheduler and the last numbers were served).",
    )
    if state.fleet is None:
        return [age]
    age.add_metric([], 0.0 if fresh else round(time.monotonic() - state.fleet.at, 3))
    return [*state.fleet.families, age]


# --- telemetry per tenant ------------------------------------------------------------------------


def telemetry_families(rows: Iterable[dict[str, Any]]) -> list[Metric]:
    """Per tenant, from the newest reading of each device (``service.telemetry.tenant_latest``
    rows: ``tenant, field, devices, sum, min, max``): utilisation (the mean over its devices),
    framebuffer used (the sum, in bytes), power (the sum, in watts), each labelled with its DCGM
    field; and how many devices report. Readings no single placement held (tenant None) are
    left out."""
    fields = {f[0]: f for f in TENANT_FIELDS}
    out: dict[str, GaugeMetricFamily] = {
        fname: _gauge(series, f"{doc} (DCGM field {fname})", ["tenant", "dcgm_field"])
        for fname, series, doc, _scale, _how in TENANT_FIELDS
    }
    devices = _gauge(
        "proofplane_tenant_telemetry_devices",
        f"Devices (GPUs, MIG instances, shares) reporting {UTILISATION} per tenant.",
        ["tenant"],
    )
    for row in sorted(rows, key=lambda r: (str(r.get("tenant")), str(r.get("field")))):
        tenant, fname = row.get("tenant"), row.get("field")
        spec = fields.get(fname) if isinstance(fname, str) else None
        if not tenant or spec is None:
            continue
        try:
            n, total = int(row["devices"]), float(row["sum"])
        except (KeyError, TypeError, ValueError):
            continue
        if n <= 0 or total != total:  # none, or NaN
            continue
        _name, _series, _doc, scale, how = spec
        value = (total / n if how == "mean" else total) * scale
        out[spec[0]].add_metric([tenant, spec[0]], value)
        if spec[0] == UTILISATION:
            devices.add_metric([tenant], n)
    return [*out.values(), devices]


def _tenant_telemetry(store: Store) -> list[Metric]:
    since = datetime.now(UTC) - timedelta(seconds=TELEMETRY_FRESH_S)
    try:
        rows = telemetry.tenant_latest(store, fields=[f[0] for f in TENANT_FIELDS], since=since)
    except Exception:  # telemetry is an extra: its failure must not fail the scrape
        log.warning("metrics: reading telemetry failed", exc_info=True)
        rows = []
    return telemetry_families(rows)


def _refresh_telemetry(store: Store, state: _State) -> None:
    try:
        state.telemetry = (time.monotonic(), _tenant_telemetry(store))
    finally:
        state.refreshing = False


def _telemetry(store: Store, state: _State) -> list[Metric]:
    """Per-tenant telemetry: computed on the first scrape, then refreshed in the background
    once ``TELEMETRY_TTL_S`` old while the scrape serves the numbers it has (aggregating every
    device's newest reading is the one query whose cost grows with the fleet: tens of
    milliseconds at 5,000 nodes; readings arrive every 15 s or so anyway). The age is a
    series of its own."""
    now = time.monotonic()
    cached = state.telemetry
    if cached is None:
        _refresh_telemetry(store, state)
        cached = state.telemetry
    elif now - cached[0] >= TELEMETRY_TTL_S and not state.refreshing:
        state.refreshing = True
        threading.Thread(
            target=_refresh_telemetry, args=(store, state), name="metrics-telemetry", daemon=True
        ).start()
    age = _gauge(
        "proofplane_telemetry_snapshot_age_seconds",
        "How old the per-tenant telemetry series are (refreshed in the background).",
    )
    if cached is None:
        return [age]
    age.add_metric([], round(now - cached[0], 3))
    return [*cached[1], age]


# --- the collector and the exposition -----------------------------------------------------------


class StateCollector(Collector):
    """The state series of one store, read at each scrape (see the module docstring)."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def describe(self) -> Iterable[Metric]:
        return []  # registered without a collect at registration time

    def collect(self) -> Iterator[Metric]:
        state = _state(self.store)
        with state.lock:  # one scrape at a time per process
            with self.store.read() as session:
                families = control_plane_families(session, datetime.now(UTC))
                fleet = _fleet(self.store, state, session)
            families += fleet
            families += _telemetry(self.store, state)
        yield from families


class _Instruments(Collector):
    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        return instruments.REGISTRY.collect()


def registry_for(store: Store) -> CollectorRegistry:
    """What a scrape collects: the instruments (every process's, in multiprocess mode; this
    process's and its Python process collectors otherwise) and the state of ``store``."""
    registry = CollectorRegistry()
    path = instruments.multiprocess_dir()
    if path is not None:
        MultiProcessCollector(registry, path=path)
    else:
        registry.register(_Instruments())
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
        GCCollector(registry=registry)
    registry.register(StateCollector(store))
    return registry


def render(store: Store, actor: Actor) -> tuple[bytes, str]:
    """The exposition text (the classic text format, what every Prometheus reads) and its
    content type, ``text/plain; version=0.0.4``."""
    authorize_scrape(actor)
    return generate_latest(registry_for(store)), CONTENT_TYPE_PLAIN_0_0_4
